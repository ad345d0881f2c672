"""keras_vit.kernels: the CPU-specific kernels compute what the portable ops compute, are chosen
from what the machine supports, fall back when an internal is missing, and stay out of exports."""

import collections
import logging
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_vit
from keras_vit import _tf_internals, kernels
from keras_vit.kernels import machine, tf_ops
from keras_vit import layers as vit_layers
from tests.testing import TINY_VIT, graph_op_types, randomize

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AMX = AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}


@pytest.fixture(autouse=True)
def _fresh_choice():
    """Each test detects and probes the machine anew (some force what it finds)."""
    kernels.detect.cache_clear()
    kernels.machine_choice.cache_clear()
    yield
    kernels.detect.cache_clear()
    kernels.machine_choice.cache_clear()


@pytest.fixture
def block_and_tokens():
    block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, name="encoderblock_0")
    tokens = np.random.default_rng(0).normal(size=(3, 9, 32)).astype("float32")
    block(tokens)
    randomize(block)  # non-zero biases so every term is checked
    return block, tokens


def _output_and_gradients(block, x):
    """The block's training output and the gradients of a non-linear loss of it."""
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = block(x, training=True)
        loss = tf.reduce_sum(y * tf.cos(y))
    return y, tape.gradient(loss, [x] + [w.value for w in block.trainable_weights])


def _assert_same(result, reference):
    """Outputs equal to 1e-5, gradients to 1e-4."""
    (y, grads), (y_ref, grads_ref) = result, reference
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)


def _traced(function, cpu_kernels: bool):
    """`function` as a tf.function traced inside (or outside) the `cpu_kernels` scope."""
    def traced(x):
        with kernels.cpu_kernels(cpu_kernels):
            return function(x)
    return tf.function(traced)


def _op_types(function, x) -> set[str]:
    return graph_op_types(function.get_concrete_function(x).graph.as_graph_def())


def _force(monkeypatch, choice: kernels.KernelChoice):
    monkeypatch.setattr(machine, "machine_choice", lambda: choice)


# --- the choice, from the machine's capabilities ---


@pytest.mark.parametrize("flags, norm_dtypes, conv", [
    (AVX2, {"float32"}, False),                 # AMD EPYC: no bfloat16 LayerNorm, no AMX
    (AVX512, {"float32", "bfloat16"}, False),   # AVX-512 without bfloat16 hardware
    (AMX, {"float32", "bfloat16"}, True),       # Sapphire Rapids
])
def test_choice_follows_the_cpu(flags, norm_dtypes, conv):
    choice = kernels.choose(kernels.Capabilities(flags, onednn=True, onednn_layer_norm_op=True))
    assert choice.onednn_layer_norm == norm_dtypes
    assert choice.bfloat16_conv_projections is conv
    assert choice.xla_elementwise
    assert not choice.xla_encoder_blocks  # TensorFlow on oneDNN keeps its fused oneDNN kernels
    assert not choice.onednn_batch_matmul  # and rewrites its batched matmuls to oneDNN's itself
    assert not choice.xla_inference_gelu  # and fuses the GELU into the matmul before it


def test_without_onednn_only_the_xla_loops_remain():
    """TF_ENABLE_ONEDNN_OPTS=0, or TensorFlow's default on AVX2-only CPUs."""
    choice = kernels.choose(kernels.Capabilities(AMX, onednn=False, onednn_layer_norm_op=True))
    assert choice == kernels.KernelChoice(xla_elementwise=True, xla_encoder_blocks=True, xla_inference_gelu=True)
    choice = kernels.choose(kernels.Capabilities(AVX2, onednn=False, onednn_batch_matmul_op=True))
    assert choice == kernels.KernelChoice(xla_elementwise=True, onednn_batch_matmul=True, xla_encoder_blocks=True,
                                          xla_inference_gelu=True)


@pytest.mark.parametrize("capabilities", [
    kernels.Capabilities(AMX, onednn=True, onednn_layer_norm_op=True, accelerator=True),  # a GPU in sight
    kernels.Capabilities(frozenset(), onednn=True, onednn_layer_norm_op=True),  # flags unreadable (not Linux)
])
def test_an_accelerator_or_an_unknown_cpu_mean_portable(capabilities):
    assert kernels.choose(capabilities) == kernels.PORTABLE


def test_layer_norm_op_missing_keeps_the_rest():
    choice = kernels.choose(kernels.Capabilities(AMX, onednn=True, onednn_layer_norm_op=False))
    assert choice.onednn_layer_norm == frozenset() and choice.bfloat16_conv_projections


def test_environment_switch_forces_portable(monkeypatch):
    monkeypatch.setenv(kernels.ENV_SWITCH, "portable")
    assert kernels.machine_choice() == kernels.PORTABLE


def test_this_machine_never_gets_a_kernel_its_cpu_lacks():
    choice, capabilities = kernels.machine_choice(), kernels.detect()
    if "bfloat16" in choice.onednn_layer_norm:
        assert capabilities.avx512
    if choice.bfloat16_conv_projections:
        assert capabilities.amx


# --- each kernel computes what the portable ops compute ---


def test_machine_kernels_match_the_portable_path_forward_and_gradients(block_and_tokens):
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    step = lambda x: _output_and_gradients(block, x)  # noqa: E731
    fast, portable = _traced(step, True), _traced(step, False)
    fast_ops, portable_ops = _op_types(fast, x), _op_types(portable, x)
    if "float32" in kernels.machine_choice().onednn_layer_norm:
        assert tf_ops.ONEDNN_LAYER_NORM in fast_ops
    if kernels.machine_choice().onednn_batch_matmul:
        assert tf_ops.ONEDNN_BATCH_MATMUL in fast_ops
    assert not any(op.startswith("_Mkl") for op in portable_ops)
    _assert_same(fast(x), portable(x))


@pytest.mark.parametrize("choice", [
    kernels.KernelChoice(onednn_layer_norm=frozenset({"float32"})),
    kernels.KernelChoice(xla_elementwise=True),
    kernels.KernelChoice(xla_elementwise=True, xla_inference_gelu=True),
    kernels.KernelChoice(onednn_batch_matmul=True),
])
def test_each_kernel_alone_matches_the_portable_path(monkeypatch, block_and_tokens, choice):
    if choice.onednn_layer_norm and not kernels.detect().onednn_layer_norm_op:
        pytest.skip("this TensorFlow build has no oneDNN LayerNorm op")
    if choice.onednn_batch_matmul and not kernels.detect().onednn_batch_matmul_op:
        pytest.skip("this TensorFlow build has no oneDNN batched matmul op")
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    step = lambda x: _output_and_gradients(block, x)  # noqa: E731
    portable = _traced(step, False)(x)
    _force(monkeypatch, choice)
    _assert_same(_traced(step, True)(x), portable)


def test_onednn_layer_norm_takes_the_4d_query_and_key_norms(monkeypatch):
    """qk_norm normalizes (batch, heads, tokens, head_dim) tensors; oneDNN's op alone takes 2-D or 3-D ones."""
    if not kernels.detect().onednn_layer_norm_op:
        pytest.skip("this TensorFlow build has no oneDNN LayerNorm op")
    block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, qk_norm=True)
    x = tf.constant(np.random.default_rng(1).normal(size=(3, 9, 32)).astype("float32"))
    block(x)
    randomize(block)
    step = lambda x: _output_and_gradients(block, x)  # noqa: E731
    portable = _traced(step, False)(x)
    _force(monkeypatch, kernels.KernelChoice(onednn_layer_norm=frozenset({"float32"})))
    _assert_same(_traced(step, True)(x), portable)


def _xla_functions(function, x) -> list[str]:
    """Names of the functions XLA must compile in `function`'s graph."""
    graph_def = function.get_concrete_function(x).graph.as_graph_def()
    return [f.signature.name for f in graph_def.library.function
            if f.attr["_XlaMustCompile"].b]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 5])
def test_xla_encoder_blocks_match_the_portable_inference(monkeypatch, batch):
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classes=3, classifier_activation=None)
    randomize(model)
    x = np.random.default_rng(batch).uniform(0, 255, (batch, 16, 16, 3)).astype("float32")
    _force(monkeypatch, kernels.PORTABLE)
    portable = model.predict(x, verbose=0)
    _force(monkeypatch, kernels.KernelChoice(xla_encoder_blocks=True))
    model.predict_function = None  # traced again, with the XLA blocks
    fast = model.predict(x, verbose=0)
    np.testing.assert_allclose(fast, portable, rtol=1e-5, atol=1e-5)
    assert np.abs(portable).max() > 0.1  # the logits are not near zero
    inference = _traced(lambda x: model(x, training=False), True)
    assert len(_xla_functions(inference, tf.constant(x))) == 1  # both blocks call the same compiled function
    assert not _xla_functions(_traced(lambda x: model(x, training=False), False), tf.constant(x))
    twin = keras_vit.head_rows_model(model)  # what predict runs: the last block with output_tokens=1, compiled too
    twin_inference = _traced(lambda x: twin(x, training=False), True)
    assert len(_xla_functions(twin_inference, tf.constant(x))) == 2  # the full blocks' function, the last block's
    np.testing.assert_allclose(twin_inference(tf.constant(x)), portable, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_xla_encoder_blocks_take_the_rotary_tables_and_the_naflex_mask_as_inputs(monkeypatch):
    """Blocks called with tensors compile too, the tensors inputs of the compiled function: DINOv3's rotary tables
    (RESULTS.md run AT: its blocks ran uncompiled) and NaFlex's attention mask, the same outputs as the portable
    inference. An any-size model's tables have no known shape: its blocks run as they are."""
    from keras_vit import naflex
    from tests.data.make_family_files import FOLDER, NAFLEX

    rotary = dict(TINY_VIT, position_embedding="none", rope="dinov3", num_register_tokens=2, layer_scale_init=0.5)
    model = keras_vit.VisionTransformer(**rotary, input_shape=(16, 24, 3), classes=3, classifier_activation=None)
    randomize(model)
    x = np.random.default_rng(3).uniform(0, 255, (2, 16, 24, 3)).astype("float32")
    tower = naflex.NaFlexViT(weights=os.path.join(FOLDER, NAFLEX))
    rng = np.random.default_rng(4)
    pictures = [rng.uniform(0, 255, (*size, 3)).astype("uint8") for size in ((40, 90), (70, 30))]
    patches = naflex.naflex_inputs(pictures, 8, 64)
    _force(monkeypatch, kernels.PORTABLE)
    portable, portable_tower = model.predict(x, verbose=0), tower(patches)
    _force(monkeypatch, kernels.KernelChoice(xla_encoder_blocks=True))
    model.predict_function = None  # traced again, with the XLA blocks
    np.testing.assert_allclose(model.predict(x, verbose=0), portable, rtol=1e-5, atol=1e-5)
    assert np.abs(portable).max() > 0.1
    with kernels.cpu_kernels(True):  # as Keras' steps of a ViTModel enter it
        compiled_tower = tower(patches, training=False)
    for name in ("embedding", "tokens"):
        np.testing.assert_allclose(compiled_tower[name], portable_tower[name], rtol=1e-5, atol=1e-5)
    assert len(_xla_functions(_traced(lambda x: model(x, training=False), True), tf.constant(x))) == 1
    tower_inference = _traced(lambda inputs: tower(inputs, training=False)["embedding"], True)
    assert _xla_functions(tower_inference, {key: tf.constant(value) for key, value in patches.items()})
    any_size = keras_vit.VisionTransformer(**rotary, input_shape=(None, None, 3), classes=3)
    assert not _xla_functions(_traced(lambda x: any_size(x, training=False), True), tf.TensorSpec((2, None, None, 3)))


@pytest.mark.slow
def test_xla_encoder_blocks_only_for_small_known_batches(monkeypatch):
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classes=3)
    _force(monkeypatch, kernels.KernelChoice(xla_encoder_blocks=True))
    inference = _traced(lambda x: model(x, training=False), True)
    tokens = 5  # a 2x2 grid and the class token
    small = kernels.XLA_BLOCK_MAX_ROWS // tokens
    assert _xla_functions(inference, tf.TensorSpec((small, 16, 16, 3)))
    assert not _xla_functions(inference, tf.TensorSpec((small + 1, 16, 16, 3)))
    assert not _xla_functions(inference, tf.TensorSpec((None, 16, 16, 3)))


def test_xla_encoder_blocks_are_float32_inference_only(monkeypatch, block_and_tokens):
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    _force(monkeypatch, kernels.KernelChoice(xla_encoder_blocks=True))
    assert _xla_functions(_traced(lambda x: block(x, training=False), True), x)
    assert not _xla_functions(_traced(lambda x: block(x, training=True), True), x)
    assert not _xla_functions(_traced(lambda x: block(x, return_attention_scores=True)[0], True), x)
    bf16_block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, dtype="mixed_bfloat16")
    bf16_block.build((None, 9, 32))
    assert not _xla_functions(_traced(lambda x: bf16_block(x, training=False), True), x)


def test_one_template_per_block_config_and_changed_variables_refused(monkeypatch, block_and_tokens):
    """The compiled calls at two batch sizes, with and without `output_tokens`, equal the portable call and build
    one template between them; a block whose variables are not its config's (quantized, LoRA) is refused."""
    block, tokens = block_and_tokens
    monkeypatch.setattr(tf_ops, "_templates", {})
    monkeypatch.setattr(tf_ops, "_compiled_layer_calls", {})
    built = []
    build_template = tf_ops._template
    monkeypatch.setattr(tf_ops, "_template", lambda *args: built.append(args[1]) or build_template(*args))
    _force(monkeypatch, kernels.PORTABLE)
    for x in (tokens, tokens[:1]):
        for sizes in ({}, {"output_tokens": 1}):
            compiled = tf_ops.compiled_inference_call(block, tf.constant(x), **sizes)
            np.testing.assert_allclose(compiled, block(x, training=False, **sizes), rtol=1e-5, atol=1e-5)
    assert built == [(None, 9, 32)]
    for change in (lambda layer: layer.quantize("int8"), lambda layer: layer.enable_lora(2)):
        changed = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64)
        changed.build((None, 9, 32))
        change(changed.mlp.dense_0)
        assert tf_ops.compiled_inference_call(changed, tf.constant(tokens)) is None


def test_a_first_trace_that_probes_and_makes_a_template_is_the_only_trace(monkeypatch, block_and_tokens):
    """TensorFlow traces a `tf.function` again when its first trace made variables. The probes' layer and the
    compiled blocks' templates are made in the first trace of a Keras step, eagerly and unseen by it: one trace."""
    block, tokens = block_and_tokens
    monkeypatch.setattr(tf_ops, "_templates", {})
    monkeypatch.setattr(tf_ops, "_compiled_layer_calls", {})
    monkeypatch.setattr(machine, "choose", lambda capabilities: kernels.KernelChoice(xla_encoder_blocks=True))
    inference, x = _traced(lambda x: block(x, training=False), True), tf.constant(tokens)
    for _ in range(2):
        np.testing.assert_allclose(inference(x), block(x, training=False), rtol=1e-5, atol=1e-5)
    assert kernels.machine_choice().xla_encoder_blocks  # probed in the first trace, and passed
    assert len(tf_ops._templates) == 2  # the probe's layer's and the block's, both made in the first trace
    assert inference.experimental_get_tracing_count() == 1
    assert _xla_functions(inference, x)


def test_a_later_trace_probes_and_makes_a_template_too(monkeypatch, block_and_tokens):
    """After a first trace that made variables (as Keras' first trace of a step makes its metrics' and optimizer's
    where no strategy is in scope), `tf.function` allows none in a later trace, `tf.init_scope()` included. The
    probes' layer and a block's template first needed in a later trace are made all the same: `evaluate` then
    `test_on_batch` of a fresh model failed with "tf.function only supports singleton tf.Variables created on the
    first call", and a probe run there failed and turned its kernel off."""
    block, tokens = block_and_tokens
    monkeypatch.setattr(tf_ops, "_templates", {})
    monkeypatch.setattr(tf_ops, "_compiled_layer_calls", {})
    monkeypatch.setattr(machine, "choose", lambda capabilities: kernels.KernelChoice(xla_encoder_blocks=True))
    x = tf.constant(tokens)
    expected = block(x, training=False)

    def step(first_inputs, later):
        """A tf.function whose first trace (on `first_inputs`) makes a variable and whose later traces run `later`."""
        made = []

        def call(x):
            if x.shape[0] != first_inputs.shape[0]:
                return later(x)
            if not made:  # TensorFlow traces a first call that made variables twice
                made.append(tf.Variable(2.0))
            return x * made[0]
        function = _traced(call, True)
        function(first_inputs)
        return function

    probing = step(x[:1], lambda x: block(x, training=False))  # the first trace uses no kernel
    np.testing.assert_allclose(probing(x), expected, rtol=1e-5, atol=1e-5)
    assert kernels.machine_choice().xla_encoder_blocks  # probed in the 2nd trace, and passed
    assert _xla_functions(probing, x)

    monkeypatch.setattr(tf_ops, "_templates", {})
    monkeypatch.setattr(tf_ops, "_compiled_layer_calls", {})
    too_many_rows = -(-kernels.XLA_BLOCK_MAX_ROWS // tokens.shape[1]) + 1  # for a compiled block
    inference = step(tf.tile(x, (too_many_rows, 1, 1))[:too_many_rows], lambda x: block(x, training=False))
    assert not tf_ops._templates
    np.testing.assert_allclose(inference(x), expected, rtol=1e-5, atol=1e-5)  # the template, in the 2nd trace
    assert len(tf_ops._templates) == 1 and _xla_functions(inference, x)


def test_bfloat16_projections_as_convolutions_match_the_matmuls(monkeypatch, block_and_tokens):
    """The AMX choice, forced: it runs (emulated) on any CPU, so the maths is checked everywhere."""
    monkeypatch.setattr(kernels, "CONV_PROJECTION_MIN_ROWS", 27)  # the fixture's 3 x 9 tokens
    block = vit_layers.TransformerBlock(num_heads=4, mlp_dim=64, dtype="mixed_bfloat16")
    block.build((None, 9, 32))
    block.set_weights(block_and_tokens[0].get_weights())
    x = tf.constant(block_and_tokens[1])
    inference = lambda x: block(x, training=False)  # noqa: E731
    portable = _traced(inference, False)
    _force(monkeypatch, kernels.KernelChoice(bfloat16_conv_projections=True))
    fast = _traced(inference, True)
    assert "Conv2D" in _op_types(fast, x) and "Conv2D" not in _op_types(portable, x)
    fast, portable = np.asarray(fast(x), "float32"), np.asarray(portable(x), "float32")
    # Both round to bfloat16 (8 significant bits); only the summation order differs: 2 ulps. The residual
    # adds round the branch outputs (magnitude up to ~2, ulp 2^-7) before adding, so near-cancelling sums
    # differ by up to one ulp of the branch: 2^-6 absolute.
    np.testing.assert_allclose(fast, portable, rtol=2 ** -6, atol=2 ** -6)
    assert np.abs(fast - portable).mean() < 2 ** -8


def test_bfloat16_projections_are_convolutions_only_for_enough_rows(monkeypatch):
    """The convolution reorders its weights at every call: a few rows take the matmul, statically where the rows
    are known when traced, at run time (one `If`) where they are not; the numbers are the matmul's either way."""
    monkeypatch.setattr(kernels, "CONV_PROJECTION_MIN_ROWS", 10)
    _force(monkeypatch, kernels.KernelChoice(bfloat16_conv_projections=True))
    rng = np.random.default_rng(0)
    kernel = tf.constant(rng.normal(size=(8, 4)), tf.bfloat16)
    bias = tf.constant(rng.normal(size=(4,)), tf.bfloat16)
    dense = _traced(lambda x: kernels.dense(x, kernel, bias), True)
    few, many = (tf.constant(rng.normal(size=(rows, 8)), tf.bfloat16) for rows in (9, 12))
    assert "Conv2D" not in _op_types(dense, few) and "MatMul" in _op_types(dense, few)
    assert "Conv2D" in _op_types(dense, many) and "MatMul" not in _op_types(dense, many)
    any_rows = dense.get_concrete_function(tf.TensorSpec((None, 8), tf.bfloat16))
    assert {"Conv2D", "MatMul"} <= graph_op_types(any_rows.graph.as_graph_def())
    assert {"If", "StatelessIf"} & graph_op_types(any_rows.graph.as_graph_def())
    for x in (few, many):
        expected = np.asarray(tf.cast(x, tf.float32) @ tf.cast(kernel, tf.float32) + tf.cast(bias, tf.float32))
        for out in (dense(x), any_rows(x)):
            np.testing.assert_allclose(np.asarray(tf.cast(out, tf.float32)), expected, rtol=2 ** -6, atol=2 ** -5)


# --- fallbacks when an internal is missing or a kernel fails ---


def _raise_unavailable(*args, **kwargs):
    raise _tf_internals.Unavailable("forced by the test")


@pytest.mark.parametrize("internal", ["onednn_enabled", "op_registered"])
def test_missing_detection_internal_means_portable(monkeypatch, internal, caplog):
    monkeypatch.setattr(_tf_internals, internal, _raise_unavailable)
    with caplog.at_level(logging.INFO, logger="keras_vit"):
        choice = kernels.machine_choice()
    assert not choice.onednn_layer_norm and not choice.bfloat16_conv_projections
    assert "forced by the test" in caplog.text


def test_failing_op_creation_fails_the_probe_and_outputs_stay_right(monkeypatch, block_and_tokens, caplog):
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    step = lambda x: _output_and_gradients(block, x)  # noqa: E731
    portable = _traced(step, False)(x)
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, onednn=True, onednn_layer_norm_op=True))
    monkeypatch.setattr(_tf_internals, "create_op", _raise_unavailable)
    with caplog.at_level(logging.INFO, logger="keras_vit"):
        assert kernels.machine_choice().onednn_layer_norm == frozenset()
        fast = _traced(step, True)
        _assert_same(fast(x), portable)
    assert tf_ops.ONEDNN_LAYER_NORM not in _op_types(fast, x)
    assert "oneDNN LayerNorm float32 unavailable" in caplog.text


def test_wrong_kernel_result_fails_the_probe(monkeypatch):
    if not kernels.detect().onednn_layer_norm_op:
        pytest.skip("this TensorFlow build has no oneDNN LayerNorm op")
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, onednn=True, onednn_layer_norm_op=True))
    assert "float32" in kernels.machine_choice().onednn_layer_norm  # the probe passes with the right maths
    kernels.machine_choice.cache_clear()
    monkeypatch.setattr(tf_ops, "portable_layer_norm", lambda x, gamma, beta, epsilon: x)
    assert "float32" not in kernels.machine_choice().onednn_layer_norm


def test_failing_xla_probe_turns_the_elementwise_kernels_off(monkeypatch):
    monkeypatch.setattr(machine, "_probe_xla", _raise_unavailable)
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, onednn=False))  # would have the GELU
    choice = kernels.machine_choice()
    assert not choice.xla_elementwise and not choice.xla_inference_gelu


def test_inference_gelu_is_an_xla_loop_only_where_tensorflow_cannot_fuse_it(monkeypatch):
    mlp = keras_vit.layers.MlpBlock(16)
    mlp.build((2, 5, 8))
    for weight in mlp.weights:
        weight.assign(np.random.default_rng(len(weight.shape)).normal(0, 1, weight.shape))
    x = tf.constant(np.random.default_rng(0).normal(0, 2, (2, 5, 8)).astype("float32"))
    portable = mlp(x).numpy()
    _force(monkeypatch, kernels.KernelChoice(xla_elementwise=True))  # TensorFlow on oneDNN
    assert not _xla_functions(_traced(lambda x: mlp(x), True), x)
    _force(monkeypatch, kernels.KernelChoice(xla_elementwise=True, xla_inference_gelu=True))  # on Eigen
    inference = _traced(lambda x: mlp(x), True)
    assert len(_xla_functions(inference, x)) == 1
    np.testing.assert_allclose(inference(x).numpy(), portable, rtol=1e-5, atol=1e-5)
    assert np.abs(portable).max() > 1  # not near zero


def test_gelu_served_on_eigen_is_the_tanh_gelu_in_six_ops():
    x = np.linspace(-12, 12, 4001).astype("float32")
    x64 = x.astype("float64")
    reference = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))  # Flax's nn.gelu

    def mlp_gelu(x):
        return kernels.gelu(x, approximate=True)

    default, eigen = tf.function(mlp_gelu), tf.function(lambda x: _served_on("eigen", mlp_gelu, x))
    tanh_ops, sigmoid_ops = (_op_types(function, tf.constant(x)) for function in (default, eigen))
    assert "Tanh" in tanh_ops and "Sigmoid" not in tanh_ops
    assert "Sigmoid" in sigmoid_ops and "Tanh" not in sigmoid_ops
    elementwise = {"Mul", "AddV2", "Square", "Sigmoid", "Tanh", "Pow", "Cast"}
    traced = eigen.get_concrete_function(tf.constant(x)).graph.as_graph_def().node
    assert sum(node.op in elementwise for node in traced) == 6
    np.testing.assert_allclose(eigen(x).numpy(), reference, rtol=0, atol=2e-6)
    np.testing.assert_allclose(default(x).numpy(), reference, rtol=0, atol=2e-6)
    assert kernels.scope.serving_kernels() == "onednn"  # restored after the scope
    with pytest.raises(ValueError, match=r"Unknown serving kernels 'mkl'. Expected one of \('onednn', 'eigen'\)"):
        with kernels.served_on("mkl"):
            pass


def test_attention_served_on_eigen_runs_head_by_head_with_the_same_outputs():
    """Traced for Eigen serving, attention is one batched matmul per head (over the images only) and no
    transposes; self- and cross-attention outputs equal a NumPy reference, as the default graph's do."""
    layer = keras_vit.layers.MultiHeadDotProductAttention(num_heads=3)
    rng = np.random.default_rng(0)
    x, context = (rng.normal(size=shape).astype("float32") for shape in ((2, 7, 12), (2, 4, 12)))
    layer(x, context=context)
    randomize(layer, seed=1, scale=0.5)
    project = lambda dense, t: np.einsum("btd,dnh->btnh", t, dense.kernel.numpy()) + dense.bias.numpy()  # noqa: E731

    def reference(x, context):
        q, k, v = (project(dense, t) for dense, t in ((layer.query_dense, x), (layer.key_dense, context),
                                                     (layer.value_dense, context)))
        logits = np.einsum("bqnh,bknh->bnqk", q.astype("float64"), k) / np.sqrt(q.shape[-1])
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        attended = np.einsum("bnqk,bknh->bqnh", weights / weights.sum(-1, keepdims=True), v)
        return np.einsum("bqnh,nhd->bqd", attended, layer.output_dense.kernel.numpy()) + layer.output_dense.bias.numpy()

    attend = lambda x, context: layer(x, context=context)  # noqa: E731
    default = tf.function(attend)
    eigen = tf.function(lambda x, context: _served_on("eigen", lambda x: attend(x, context), x))
    for function in (default, eigen):
        for keys in (x, context):
            np.testing.assert_allclose(function(x, keys).numpy(), reference(x, keys), rtol=0, atol=1e-5)
    counts = [collections.Counter(node.op for node in function.get_concrete_function(x, x).graph.as_graph_def().node)
              for function in (default, eigen)]
    assert (counts[0]["BatchMatMulV2"], counts[0]["Transpose"]) == (2, 4)
    assert (counts[1]["BatchMatMulV2"], counts[1]["Transpose"], counts[1]["Softmax"]) == (2 * 3, 0, 3)
    assert kernels.attention_kernel().fused(training=False) is False  # outside the scope: the explicit path


def _served_on(serving_kernels: str, function, x):
    with kernels.served_on(serving_kernels):
        return function(x)


def test_failing_batch_matmul_op_fails_its_probe_and_outputs_stay_right(monkeypatch, block_and_tokens, caplog):
    block, tokens = block_and_tokens
    x = tf.constant(tokens)
    step = lambda x: _output_and_gradients(block, x)  # noqa: E731
    portable = _traced(step, False)(x)
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, onednn_batch_matmul_op=True))
    monkeypatch.setattr(_tf_internals, "create_op", _raise_unavailable)
    with caplog.at_level(logging.INFO, logger="keras_vit"):
        assert not kernels.machine_choice().onednn_batch_matmul
        fast = _traced(step, True)
        _assert_same(fast(x), portable)
    assert tf_ops.ONEDNN_BATCH_MATMUL not in _op_types(fast, x)
    assert "oneDNN batched matmul unavailable on this machine" in caplog.text


def test_failing_or_wrong_xla_block_probe_turns_the_blocks_off(monkeypatch, caplog):
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, onednn=False))
    assert kernels.machine_choice().xla_encoder_blocks  # the probe passes with the right maths
    kernels.machine_choice.cache_clear()
    monkeypatch.setattr(machine, "_probe_xla_blocks", _raise_unavailable)
    with caplog.at_level(logging.INFO, logger="keras_vit"):
        choice = kernels.machine_choice()
    assert not choice.xla_encoder_blocks and choice.xla_elementwise
    assert "XLA encoder blocks unavailable on this machine" in caplog.text
    monkeypatch.undo()
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, onednn=False))
    kernels.machine_choice.cache_clear()
    monkeypatch.setattr(tf_ops, "compiled_inference_call", lambda layer, x, **sizes: x)  # a wrong compiled result
    assert not kernels.machine_choice().xla_encoder_blocks


def test_internals_work_on_this_tensorflow():
    """Fails when a TensorFlow release moves an internal (the kernels would silently turn off)."""
    assert _tf_internals.op_registered("MatMul") and not _tf_internals.op_registered("NoSuchOp")
    assert isinstance(_tf_internals.onednn_enabled(), bool)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.constant([1.0, -2.0])
        y = _tf_internals.create_op("Relu", [x], tf.float32, {"T": tf.float32}, name="relu")
    assert y.op.type == "Relu"
    with graph.as_default():  # bool attributes
        product = _tf_internals.create_op("MatMul", [tf.ones((2, 3)), tf.ones((4, 3))], tf.float32,
                                          {"T": tf.float32, "transpose_b": True}, name="matmul")
    assert product.shape == (2, 4)


# --- where the scope is entered: Keras steps of a ViTModel, never exports ---


@pytest.mark.slow
def test_fit_evaluate_predict_enter_the_scope_and_jit_compile_does_not(monkeypatch):
    """Every kernel choice made in a step sees the machine's kernels (not the symbolic forward with which Keras
    builds the metrics before the first step: it computes nothing)."""
    seen, stepping = [], []
    original = kernels.active
    monkeypatch.setattr(kernels, "active",
                        lambda: (stepping and seen.append(original() is not kernels.PORTABLE)) or original())
    _force(monkeypatch, kernels.KernelChoice(xla_elementwise=True))
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classes=2)
    for name in ("train_step", "test_step", "predict_step"):
        def step(*args, _step=getattr(model, name), **kwargs):
            stepping.append(True)
            try:
                return _step(*args, **kwargs)
            finally:
                stepping.pop()
        setattr(model, name, step)
    x, y = np.ones((4, 16, 16, 3), "float32"), np.eye(2)[[0, 1, 0, 1]]
    model.compile("sgd", "categorical_crossentropy")
    for run in (lambda: model.fit(x, y, verbose=0), lambda: model.evaluate(x, y, verbose=0),
                lambda: model.predict(x, verbose=0)):
        seen.clear()
        run()
        assert seen and all(seen), seen
    model.compile("sgd", "categorical_crossentropy", steps_per_execution=2)
    seen.clear()
    model.predict(np.ones((8, 16, 16, 3), "float32"), batch_size=2, verbose=0)
    assert seen and all(seen), seen
    model.compile("sgd", "categorical_crossentropy", jit_compile=True)  # XLA compiles the whole step
    seen.clear()
    model.fit(x, y, verbose=0)
    assert seen and not any(seen), seen


@pytest.mark.slow
def test_calls_and_exports_get_portable_ops(monkeypatch, tmp_path):
    _force(monkeypatch, kernels.KernelChoice(onednn_layer_norm=frozenset({"float32"}), xla_elementwise=True,
                                             onednn_batch_matmul=True, xla_encoder_blocks=True))
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(16, 16, 3), classes=2)
    x = tf.ones((2, 16, 16, 3))
    assert not any(op.startswith("_Mkl") for op in _op_types(tf.function(model), x))
    assert not _xla_functions(tf.function(model), x)
    model.export(str(tmp_path / "export"), verbose=False)
    saved = tf.saved_model.load(str(tmp_path / "export"))
    np.testing.assert_allclose(saved.serve(x), model(x), atol=1e-6)


# --- mixed_bfloat16 on every CPU ---


@pytest.mark.slow
def test_mixed_bfloat16_predict_and_fit_run_on_this_cpu_and_match_float32():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=4, classifier_activation=None)
    randomize(model, scale=0.1)
    x = np.random.default_rng(1).uniform(0, 255, (6, 32, 32, 3)).astype("float32")
    logits = model.predict(x, verbose=0)
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, np.arange(6) % 4, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    keras.mixed_precision.set_global_policy("float32")
    reference = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=4,
                                            classifier_activation=None)
    randomize(reference, scale=0.1)
    np.testing.assert_allclose(logits, reference.predict(x, verbose=0), atol=0.05, rtol=0.05)


def test_emulated_bfloat16_is_said_once(monkeypatch):
    monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AVX2, True, True))
    monkeypatch.setattr(machine, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            vit_layers.TransformerBlock(2, 8, dtype="mixed_bfloat16").build((None, 3, 8))
        assert [str(w.message) for w in caught].count(
            "keras_vit: this CPU has no native bfloat16 (no AVX512-BF16 or AMX): bfloat16 is emulated and float32 "
            "is faster here. mixed_bfloat16 still computes correctly.") == 1
        monkeypatch.setattr(machine, "detect", lambda: kernels.Capabilities(AMX, True, True))
        monkeypatch.setattr(machine, "_warned", set())
        caught.clear()
        vit_layers.TransformerBlock(2, 8, dtype="mixed_bfloat16").build((None, 3, 8))
    assert not any("bfloat16" in str(w.message) for w in caught)
