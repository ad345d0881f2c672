"""The model class of keras_vit: `ViTModel`, a functional `keras.Model` that carries its `ViTConfig` and whose
`fit` / `evaluate` / `predict` steps may use the machine's CPU kernels (`CpuKernelSteps`), with LoRA and Keras'
quantization fitted to ViT blocks. The builders (`keras_vit.models`) return one.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import warnings
from typing import Any, Sequence

import keras

from keras_vit import _keras_internals, kernels
from keras_vit import layers as vit_layers
from keras_vit import resnet
from keras_vit.head_rows import head_rows_model
from keras_vit.variants import PREPROCESSING_FIELDS, PreprocessingConfig, ViTConfig


LORA_NAMES = ("query", "key", "value", "attention_output", "Dense_0", "Dense_1", "Dense_gate")
LORA_TARGETS = ("query", "value")


def _block_projections(block: vit_layers.TransformerBlock) -> dict[str, keras.layers.Layer]:
    attention, mlp = block.attention, block.mlp
    projections = zip(LORA_NAMES, (attention.query_dense, attention.key_dense, attention.value_dense,
                                   attention.output_dense, mlp.dense_0, mlp.dense_1, mlp.dense_gate))
    return {name: projection for name, projection in projections if projection is not None}  # a gate if gated


class CpuKernelSteps:
    """Mixin for a `keras.Model`: its `fit` / `evaluate` / `predict` steps may use the machine's
    CPU kernels (`keras_vit.kernels.cpu_kernels`), and TensorFlow traces each step once; nothing else changes."""

    # The steps' signatures differ by backend (JAX passes its state too): pass them on as they come.
    def train_step(self, *args, **kwargs):
        with kernels.cpu_kernels(not self.jit_compile, training=True):  # XLA compiles the whole step: portable ops
            return super().train_step(*args, **kwargs)

    def test_step(self, *args, **kwargs):
        with kernels.cpu_kernels(not self.jit_compile):
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args, **kwargs):
        with kernels.cpu_kernels(not self.jit_compile):
            return super().predict_step(*args, **kwargs)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        """Keras' TensorFlow trainer, building the optimizer's and metrics' state before the first trace: TensorFlow
        traces `fit`'s and `evaluate`'s steps once, not twice (`keras_vit._keras_internals.symbolic_build`)."""
        _keras_internals.symbolic_build(self, super()._maybe_symbolic_build, iterator, data_batch)


class _HeadRows:
    """A `ViTModel`'s `head_rows_model`, made once, held by the model in a plain object: Keras neither tracks it as a
    sublayer nor saves it. (In a module-level `WeakKeyDictionary` a twin that is the model itself kept its key, and
    with it every model ever predicted with, alive.)"""

    __slots__ = ("model",)

    def __init__(self, model: keras.Model):
        self.model = model


@keras.saving.register_keras_serializable(package="keras_vit")
class ViTModel(CpuKernelSteps, keras.Model):
    """A functional `keras.Model` (`ViTModel(inputs, outputs)`) whose `fit` / `evaluate` /
    `predict` steps may use the machine's CPU kernels (`keras_vit.kernels`).

    The builders return one. Everything else is `keras.Model`: its `__call__`, exports and
    your own `tf.function`s compute with the portable ops. Wrap a keras_vit backbone in
    `ViTModel` rather than `keras.Model` (e.g. to add a head) to keep those kernels; with
    `keras.Model` the wrapper is just as correct, on the portable ops.
    """

    _head_rows: _HeadRows | None = None  # the twin `predict` runs, made by the first `make_predict_function`

    def __init__(self, *args, vit_config: ViTConfig | None = None,
                 preprocessing_config: PreprocessingConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.vit_config = vit_config
        self.preprocessing_config = preprocessing_config

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self.vit_config is not None:
            config["vit_config"] = self.vit_config.to_dict()
        if self.preprocessing_config is not None:
            config["preprocessing_config"] = self.preprocessing_config.to_dict()
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> ViTModel:
        config = dict(config)
        forward, preprocessing = _split_saved_configs(config.pop("vit_config", None),
                                                      config.pop("preprocessing_config", None))
        model = super().from_config(config, custom_objects=custom_objects)
        model.vit_config = ViTConfig.from_dict(forward) if forward is not None else None
        model.preprocessing_config = PreprocessingConfig.from_dict(preprocessing) if preprocessing is not None \
            else None
        return model

    def make_predict_function(self, force=False):
        """Keras' predict function, whose steps run `keras_vit.head_rows_model(self)`, made here (eagerly: Keras
        traces the steps after this)."""
        if self._head_rows is None:
            self._head_rows = _HeadRows(head_rows_model(self))
        return super().make_predict_function(force)

    def predict_step(self, *args, **kwargs):
        """Keras' predict step computed by `keras_vit.head_rows_model(self)`: the same outputs, with the last
        encoder block computing only the token rows they read (7% fewer FLOPs for ViT-B/16's class token)."""
        twin = self._head_rows.model if self._head_rows is not None else self
        if twin is self:
            return super().predict_step(*args, **kwargs)
        with kernels.cpu_kernels(not self.jit_compile):
            if keras.backend.backend() == "jax":  # a stateless step: (state, data) -> (outputs, non-trainables)
                return _stateless_predict(self, twin, *args)
            x, _, _ = keras.utils.unpack_x_y_sample_weight(args[0])
            return twin(x, training=False)

    def enable_lora(self, rank: int, target_names: Sequence[str] = LORA_TARGETS) -> None:
        """Low-rank adaptation (Hu et al. 2021) of the encoder, as keras-hub's `Backbone.enable_lora`.

        Every weight is frozen except, in each encoder block, the projections named in `target_names`
        (of `query`, `key`, `value`, `attention_output`, `Dense_0`, `Dense_1`, and `Dense_gate` in a gated MLP),
        which Keras' `enable_lora(rank)` gives a trainable rank-`rank` update of their frozen kernel (their bias
        stays trainable, as in Keras). Defaults to the attention's query and value.
        """
        unknown = set(target_names) - set(LORA_NAMES)
        if unknown:
            raise ValueError(f"Unknown LoRA targets {sorted(unknown)}. Expected some of {LORA_NAMES}.")
        for layer in self.layers:
            if not isinstance(layer, vit_layers.TransformerBlock):
                layer.trainable = False
                continue
            layer.norm_attention.trainable = layer.norm_mlp.trainable = False
            for name, projection in _block_projections(layer).items():
                if name in target_names:
                    projection.enable_lora(rank)
                else:
                    projection.trainable = False

    def quantize(self, mode: str, **kwargs) -> None:
        """Keras' `Model.quantize(mode)`: the encoder's projections and the head get `mode`'s weights and matmuls.

        The patch embedding (a hybrid's ResNet too), the LayerNorms, the class and register tokens and the
        position embeddings stay float: Keras has no quantized form of them. Keras warns once for each such layer
        class; for the layers keras_vit builds (`FLOAT_LAYERS`) that warning is left out, a layer of your own
        still gets it. Python's garbage collector runs once, at the end (`one_garbage_collection`).
        """
        with warnings.catch_warnings(), one_garbage_collection():
            warnings.filterwarnings("ignore", _FLOAT_LAYER_NOTICE, UserWarning)
            super().quantize(mode, **kwargs)

    def export(self, filepath, format: str = "tf_saved_model", verbose=None, input_signature=None, **kwargs):
        """Keras' `Model.export`. For `format="onnx"` or `"openvino"` without an `input_signature`, this model's
        inputs are the signature (`input_signature(self)`: the batch dynamic, and height and width for a model of
        any size): Keras' exporters for those formats refuse a model that Keras never saw called, and `predict`
        here runs `keras_vit.head_rows_model(self)`, not the model itself."""
        if input_signature is None and format in ("onnx", "openvino"):
            input_signature = model_input_signature(self)
        return super().export(filepath, format=format, verbose=verbose, input_signature=input_signature, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """`keras.Model.load_weights` (Keras files); says to use `keras_vit.load_weights` for checkpoints."""
        if os.fspath(filepath).endswith((".npz", ".safetensors")):
            raise ValueError(f"Model.load_weights reads Keras weights files (.weights.h5), not the original "
                             f"checkpoint {os.fspath(filepath)!r}: use `keras_vit.load_weights(model, path)`, which "
                             "maps its keys and resizes position embeddings.")
        return super().load_weights(filepath, *args, **kwargs)


def model_input_signature(model: keras.Model) -> list:
    """The `input_signature` of `keras.Model.export` for a functional `model`: one `keras.InputSpec` per input, of
    its shape (None dimensions stay dynamic), dtype and name; a list of them for a model of several inputs."""
    specs = [keras.InputSpec(shape=tuple(tensor.shape), dtype=tensor.dtype, name=tensor.name)
             for tensor in model.inputs]
    return specs if len(specs) == 1 else [specs]


class _DeferredCollections:
    """`gc.collect` deferred in the threads inside `one_garbage_collection`, and real everywhere else."""

    def __init__(self):
        self.lock = threading.Lock()
        self.scopes = 0  # open scopes, in every thread: the wrapper is installed while there is one
        self.real_collect = gc.collect
        self.thread = threading.local()  # .depth: the scopes open in this thread

    def collect(self, generation: int = 2) -> int:
        if getattr(self.thread, "depth", 0):
            return 0  # collected once when this thread's outermost scope closes
        return self.real_collect(generation)

    @contextlib.contextmanager
    def scope(self):
        with self.lock:
            if self.scopes == 0:
                self.real_collect = gc.collect
                gc.collect = self.collect
            self.scopes += 1
        self.thread.depth = getattr(self.thread, "depth", 0) + 1
        try:
            yield
        finally:
            self.thread.depth -= 1
            with self.lock:
                self.scopes -= 1
                if self.scopes == 0:
                    gc.collect = self.real_collect
            if self.thread.depth == 0:
                self.real_collect()


_DEFERRED = _DeferredCollections()


def one_garbage_collection():
    """A context in which this thread's `gc.collect()` calls do nothing; one collection runs as it closes.

    Keras' `Layer.__delattr__` runs a full `gc.collect()` for each variable a layer deletes, and quantizing a
    projection deletes its float kernel: 73 collections for a ViT-B/16, about 0.2 s each in a process with
    TensorFlow loaded (its `quantize` took 18.6-19.5 s with them, under 1 s with one). Only the thread that opened
    the context is affected: `gc.collect` is the real one in every other thread, also while it is open.
    """
    return _DEFERRED.scope()


def _unquantizable(module) -> set[str]:
    """The names of `module`'s layer classes that have no `quantize` of their own (Keras' base one refuses)."""
    return {name for name, value in vars(module).items() if isinstance(value, type)
            and issubclass(value, keras.layers.Layer) and value.quantize is keras.layers.Layer.quantize}


# The layer classes of keras_vit's models that Keras cannot quantize, which stay float: keras_vit's own, and the
# Keras layers its builders use.
FLOAT_LAYERS = frozenset(_unquantizable(vit_layers) | _unquantizable(resnet) | {
    layer.__name__ for layer in (keras.layers.InputLayer, keras.layers.Rescaling, keras.layers.Dropout,
                                 keras.layers.Identity, keras.layers.Activation, keras.layers.ReLU,
                                 keras.layers.LayerNormalization, keras.layers.GroupNormalization,
                                 keras.layers.MaxPooling2D)})
# Keras' warning for each of them (keras.Model.quantize).
_FLOAT_LAYER_NOTICE = rf"Layer ({'|'.join(sorted(FLOAT_LAYERS))}) does not have a `quantize` method implemented"


def _split_saved_configs(forward: dict | None, preprocessing: dict | None) -> tuple[dict | None, dict | None]:
    """The saved `vit_config` and `preprocessing_config` of a `.keras` file. Files of 0.1 have neither; those of 0.2
    keep the input fields (`PREPROCESSING_FIELDS`) in `vit_config`: they move to the preprocessing."""
    if forward is None or preprocessing is not None:
        return forward, preprocessing
    inputs = {name: forward[name] for name in PREPROCESSING_FIELDS if name in forward}
    forward = {name: value for name, value in forward.items() if name not in PREPROCESSING_FIELDS}
    return forward, (inputs or None)


def _stateless_predict(model: keras.Model, twin: keras.Model, state, data):
    """JAX's `predict_step(state, data)` with `twin`, whose variables are the model's (in another order)."""
    trainable, non_trainable = state
    value_of = {id(variable): value for variable, value in zip(
        model.trainable_variables + model.non_trainable_variables, [*trainable, *non_trainable])}
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    outputs, updated = twin.stateless_call([value_of[id(v)] for v in twin.trainable_variables],
                                           [value_of[id(v)] for v in twin.non_trainable_variables], x, training=False)
    updated = dict(zip(map(id, twin.non_trainable_variables), updated))
    return outputs, [updated.get(id(variable), value) for variable, value in zip(model.non_trainable_variables,
                                                                                  non_trainable)]
