"""The `keras-vit-tflite` report's op coverage (ops outside XNNPACK) and its int8 top-1 limit, on a tiny ViT
(2 blocks, width 16, 16 px)."""

import collections
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter, OpResolverType

import keras
import keras_vit
from ai_edge_litert import schema_py_generated as schema

from keras_vit import _tf_internals, datasets
from keras_vit.cli import tflite as tflite_cli
from keras_vit.export import data, litert_file, model_io, precision, tflite, tflite_conversion
from tests.testing import TINY_VIT, made_once, randomize

SIZE = (16, 16)
COUNTS = dict(calibration_count=20, evaluation_count=40)


def tiny_model(head_scale: float = 1.0) -> keras.Model:
    """A tiny classifier with random weights; a small `head_scale` brings its probabilities within int8's step
    (1/256) of each other, so full int8 loses the top-1 class of most images."""
    model = keras_vit.VisionTransformer(**dict(TINY_VIT, hidden_dim=16, mlp_dim=32, num_heads=2),
                                        input_shape=(*SIZE, 3), classes=10, weights=None, name="tiny")
    randomize(model, 0, scale=0.3)  # The head is zeros at init: every image would be class 0.
    for weight in model.get_layer("head").weights:
        weight.assign(weight * head_scale)
    return model


def fragile_model() -> keras.Model:
    return tiny_model(head_scale=1e-3)


def partial_files(out_dir) -> list:
    return [path.name for path in out_dir.iterdir() if path.name.startswith(".")]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """(model, output directory, Top1DropError) of float32 and int8 on the digits with a limit of 0 points."""
    model, out = fragile_model(), tmp_path_factory.mktemp("refused")
    with pytest.raises(tflite.Top1DropError) as error:
        tflite.export_tflite(model, out, dataset="digits", modes=("float32", "int8"), max_top1_drop=0, **COUNTS)
    return model, out, error.value


def analyzer_ops(path, capsys) -> list[str]:
    """Op names of a `.tflite` file as TensorFlow's model analyzer prints them (it reads the flatbuffer)."""
    capsys.readouterr()
    tf.lite.experimental.Analyzer.analyze(model_path=str(path))
    return re.findall(r"^\s+Op#\d+ (\w+)\(", capsys.readouterr().out, re.M)


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_op_coverage_agrees_with_the_flatbuffer(refused, capsys):
    _, out, _ = refused
    path = out / "tiny_float32.tflite"
    (result,) = [r for r in json.loads((out / "report.json").read_text())["modes"] if r["mode"] == "float32"]
    ops = collections.Counter(analyzer_ops(path, capsys))
    assert result["ops_total"] == sum(ops.values()) > 50
    outside = result["ops_outside_delegate"]
    assert all(0 < count <= ops[name] for name, count in outside.items()), (outside, ops)
    assert "FULLY_CONNECTED" not in outside and 1 <= result["delegate_partitions"] <= sum(outside.values()) + 1
    # Without the default delegate, the same count finds every op outside and no partition.
    bare = Interpreter(model_path=str(path),
                       experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    bare.allocate_tensors()
    assert tflite.outside_delegates(bare) == (dict(ops), 0)
    listed = ", ".join(f"{name} {count}" for name, count in outside.items())
    assert (f"| {sum(outside.values())} of {result['ops_total']}{f' ({listed})' if listed else ''}; "
            f"{result['delegate_partitions']} partitions |") in (out / "report.md").read_text()
    # The class token is sliced without a shrink-axis mask (`kernels.token_row` in a LiteRT trace): XNNPACK runs
    # every op of the file.
    assert outside == {} and result["delegate_partitions"] == 1


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
@pytest.mark.parametrize("how", ["missing", "raises"])
def test_op_coverage_unknown_without_the_private_listing(how, tmp_path, monkeypatch):
    if how == "missing":
        monkeypatch.delattr(Interpreter, "_get_ops_details")
    else:
        monkeypatch.setattr(Interpreter, "_get_ops_details", lambda self: 1 / 0)
    report = tflite.export_tflite(tiny_model(), tmp_path, dataset="photos", modes=("float32",), **COUNTS)
    (result,) = report["modes"]
    assert result["ops_outside_delegate"] is None and result["delegate_partitions"] is None
    assert result["ops_total"] > 50 and result["non_builtin_ops"] == [] and result["passed"]
    assert f"| unknown (of {result['ops_total']}) |" in (tmp_path / "report.md").read_text()
    assert (result["gpu_delegate_pitfalls"], result["gpu_delegate_problems"]) == ({}, [])
    assert ("float32 for LiteRT's GPU delegate: every op on its list, no known pitfall; TensorFlow's GPU analyzer: "
            "compatible (a check of the file") in (tmp_path / "report.md").read_text()
    result["gpu_delegate_pitfalls"] = {"rank_over_4": 2}  # as a file of another converter would say
    assert "Not for LiteRT's GPU delegate as it is: float32 has tensors of rank 5 or more: refused by the GPU " \
        "delegate (LiteRT issue 2540): 2; TensorFlow's GPU analyzer: compatible (a check of the file" in \
        tflite.markdown_report(report)


def test_gpu_check_lists_ops_off_the_delegates_list_and_sizes_known_only_at_run_time(tmp_path):
    """An op off `GPU_DELEGATE_OPS` (ARG_MAX) is counted and named, and so is an op on it with attributes the
    delegate does not take (a STRIDED_SLICE with a shrink-axis mask); a tensor whose height is known only at run
    time is a pitfall; a plain Dense file has none."""
    flat = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
    plain = tflite.convert(flat, tmp_path / "dense.tflite", "float32", pixel_input=False)
    assert (litert_file.gpu_delegate_pitfalls(plain), litert_file.gpu_delegate_problems(plain)) == ({}, [])
    assert litert_file.gpu_analyzer_verdict(plain) == "compatible"
    inputs = keras.Input((4, 4, 3))
    scores = keras.layers.Dense(2)(keras.layers.Flatten()(inputs))
    argmax = keras.Model(inputs, keras.layers.Lambda(lambda x: tf.argmax(x, axis=-1))(scores))
    path = tflite.convert(argmax, tmp_path / "argmax.tflite", "float32", pixel_input=False)
    assert litert_file.gpu_delegate_pitfalls(path) == {"not_gpu_ops": 1}
    assert litert_file.gpu_delegate_problems(path) == ["ARG_MAX: not on the GPU delegate's list"]
    # TensorFlow 2.21's analyzer said "compatible" of this file (and of GATHER_ND and TOPK_V2 ones): its verdict is
    # reported beside keras_vit's check, which is what decides.
    verdict = litert_file.gpu_analyzer_verdict(path)
    assert verdict == "compatible" or verdict.startswith("GPU COMPATIBILITY WARNING"), verdict
    rows = keras.Input((5, 4, 3))
    first = keras.Model(rows, keras.layers.Lambda(lambda x: x[:, 0])(rows))  # a class token, as Keras slices it
    path = tflite.convert(first, tmp_path / "first.tflite", "float32", pixel_input=False)
    assert litert_file.gpu_delegate_pitfalls(path) == {"gpu_op_attributes": 1}
    assert litert_file.gpu_delegate_problems(path) == ["STRIDED_SLICE: shrink_axis mask"]
    any_height = keras.Sequential([keras.Input((None, 4, 3)), keras.layers.Dense(2)])
    path = tflite.convert(any_height, tmp_path / "any_height.tflite", "float32", pixel_input=False)
    assert litert_file.gpu_delegate_pitfalls(path)["dynamic_shape"] >= 2  # its input and output at least


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_gpu_analyzer_verdict_is_unknown_without_tensorflows_analyzer(how, tmp_path, monkeypatch):
    """`tf.lite.experimental.Analyzer` is experimental: gone or failing, the verdict is None and the report says
    the analyzer was not available."""
    flat = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
    path = tflite.convert(flat, tmp_path / "dense.tflite", "float32", pixel_input=False)
    if how == "missing":
        monkeypatch.delattr(tf.lite.experimental, "Analyzer")
    else:
        monkeypatch.setattr(tf.lite.experimental.Analyzer, "analyze", lambda **kwargs: 1 / 0)
    assert litert_file.gpu_analyzer_verdict(path) is None
    result = {"mode": "float16", **tflite._gpu_check(path)}
    assert result["gpu_analyzer"] is None and result["gpu_delegate_pitfalls"] == {}
    assert tflite._gpu_text(result) == (
        "float16 for LiteRT's GPU delegate: every op on its list, no known pitfall; TensorFlow's GPU analyzer was not "
        "available (a check of the file, not a run on a GPU).")


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_int8_over_the_limit_is_refused_and_not_written(refused):
    model, out, error = refused
    message = str(error)
    # The one refusal of every export (the bfloat16 SavedModel, the int8 ONNX / OpenVINO / LiteRT files).
    assert type(error) is precision.Top1DropError and isinstance(error, ValueError)
    report = json.loads((out / "report.json").read_text())
    assert report == error.report
    results = {r["mode"]: r for r in report["modes"]}
    int8 = results["int8"]
    assert int8["refused"] and not int8["passed"] and int8["file"] is None and int8["top1_drop"] > 10
    assert not (out / "tiny_int8.tflite").exists() and partial_files(out) == []
    assert results["float32"]["file"] == "tiny_float32.tflite" and (out / "tiny_float32.tflite").exists()
    layers = int8["sensitive_layers"]
    assert len(layers) == tflite_conversion.SENSITIVE_LAYERS
    assert layers[0]["rmse_over_scale"] >= layers[-1]["rmse_over_scale"] > 0
    assert "\n" not in message and message.startswith("Refused int8: top-1 drop of ")
    assert f"{int8['top1_drop']:.2f} points" in message and "over max_top1_drop=0" in message
    assert f"{layers[0]['tensor']} ({layers[0]['op']}, " in message
    assert "| int8 |" in (out / "report.md").read_text() and "REFUSED, not written" in (out / "report.md").read_text()


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_digits_report_top1_accuracy(refused):
    model, out, error = refused
    report = error.report
    _, evaluation = tflite.split_indices(len(datasets.digits("all")[1]), **COUNTS)
    labels = datasets.digits("all")[1][evaluation]
    results = {r["mode"]: r for r in report["modes"]}
    keras_top1 = model.predict(datasets.resize(datasets.digits("all")[0][evaluation], SIZE), verbose=0).argmax(-1)
    assert report["keras_top1_accuracy"] == pytest.approx(np.mean(keras_top1 == labels))
    assert results["float32"]["top1_agreement"] == 1.0
    assert results["float32"]["top1_accuracy"] == report["keras_top1_accuracy"]
    assert 0 <= results["int8"]["top1_accuracy"] <= 1
    assert "The Keras model's top-1 accuracy on these images is" in (out / "report.md").read_text()


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_int8_within_the_limit_is_written(tmp_path, monkeypatch):
    """Both modes are converted from one SavedModel, and the files are what each mode converted alone is."""
    model, sources = tiny_model(), []
    from_saved_model = tf.lite.TFLiteConverter.from_saved_model
    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_saved_model",
                        lambda path, *args: sources.append(path) or from_saved_model(path, *args))
    report = tflite.export_tflite(model, tmp_path, dataset="photos", modes=("dynamic_int8", "int8"),
                                  max_top1_drop=100, **COUNTS)
    assert len(sources) == 2 and len(set(sources)) == 1  # one temporary SavedModel, removed after
    assert not os.path.exists(sources[0])
    for result in report["modes"]:
        assert not result["refused"] and result["sensitive_layers"] is None and result["passed"]
        assert (tmp_path / result["file"]).stat().st_size == result["size_bytes"]
    alone = tflite.convert(model, tmp_path / "alone.bin", "dynamic_int8")
    assert alone.read_bytes() == (tmp_path / report["modes"][0]["file"]).read_bytes()
    (tmp_path / "alone.bin").unlink()
    assert report["thresholds"]["max_top1_drop"] == 100 and report["keras_top1_accuracy"] is None
    assert partial_files(tmp_path) == []
    with pytest.raises(ValueError, match="Expected labels only with images"):
        tflite.export_tflite(tiny_model(), tmp_path, dataset="photos", labels=np.zeros(300, int))


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_a_towers_files_are_reported_by_cosine_and_never_refused_on_a_top1(tmp_path):
    """A tower's output is an embedding: its largest entry is no class, so its int8 files are not refused on a top-1
    of it (hf_dinov3_swiglu_112's dynamic int8 file was, on 1.33 points) but reported by the least cosine with Keras'
    embeddings; the digits' labels give no accuracy."""
    tower = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), include_top=False, pooling="token")
    randomize(tower)
    report = tflite.export_tflite(tower, tmp_path, dataset="digits", modes=("float32", "dynamic_int8"), **COUNTS)
    assert report["keras_top1_accuracy"] is None
    for result in report["modes"]:
        assert (result["top1_agreement"], result["top1_drop"], result["reference_classes_predicted"]) == (
            None, None, None)
        assert not result["refused"] and result["passed"] and (tmp_path / result["file"]).exists()
        assert 0.9 < result["min_cosine"] <= 1 + 1e-6
    markdown = tflite.markdown_report(report)
    assert "The model is a tower (its output an embedding, no classes)" in markdown
    assert "| n/a (least cosine " in markdown and "a tower: reported, not judged" in markdown


def test_debugger_failure_still_refuses(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("no\nranking")

    monkeypatch.setattr(tflite, "sensitive_layers", broken)
    (tmp_path / "tiny_int8.tflite").write_bytes(b"an older export")  # The folder must not contradict its report.
    with pytest.raises(tflite.Top1DropError, match=r"^Refused int8: .* most sensitive layers .*: "
                                                   r"unknown \(ValueError: no ranking\)\.$") as error:
        tflite.export_tflite(fragile_model(), tmp_path, dataset="photos", modes=("int8",), max_top1_drop=0,
                             **COUNTS)
    (result,) = error.value.report["modes"]
    assert result["sensitive_layers"] is None and result["sensitive_layers_error"] == "ValueError: no ranking"
    assert (tmp_path / "report.json").exists() and not (tmp_path / "tiny_int8.tflite").exists()


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_cli_refusal_is_one_line_and_exits_nonzero(tmp_path, capsys):
    model_file = tmp_path / "tiny.keras"
    fragile_model().save(model_file)
    out = tmp_path / "tflite"
    with pytest.raises(SystemExit) as done:
        tflite_cli.main(["--model", str(model_file), "--out", str(out), "--modes", "int8", "--max-top1-drop", "0"])
    message = str(done.value.code)
    assert "\n" not in message and message.startswith("keras-vit-tflite: Refused int8: top-1 drop of ")
    assert "max_top1_drop=0" in message and "most sensitive layers" in message
    assert "| int8 |" in capsys.readouterr().out and not (out / "tiny_int8.tflite").exists()


def test_limit_validated_and_spelled_once(capsys):
    assert tflite_cli.DEFAULT_MAX_TOP1_DROP == tflite.DEFAULT_MAX_TOP1_DROP
    with pytest.raises(SystemExit):
        tflite_cli.main(["--variant", "Ti/16", "--out", "unused", "--max-top1-drop", "-1"])
    assert "--max-top1-drop takes points >= 0. Received: -1.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"Expected max_top1_drop >= 0 \(points of top-1\)\. Received nan\."):
        tflite.export_tflite(tiny_model(), "unused", max_top1_drop=float("nan"))


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_mixed_int8_runs_its_matmuls_in_int8_and_every_op_on_xnnpack(tmp_path):
    model = tiny_model()
    report = tflite.export_tflite(model, tmp_path, dataset="digits", modes=("float32", "mixed_int8"), **COUNTS)
    results = {r["mode"]: r for r in report["modes"]}
    mixed = results["mixed_int8"]
    path = tmp_path / mixed["file"]
    ops = litert_file.ops(path)
    # Every matmul takes int8 activations and weights; the ops between them (LayerNorm, softmax, GELU, the
    # attention products) stay float32, with no int8 input.
    matmuls = [op for op in ops if op.name == "FULLY_CONNECTED"]
    assert len(matmuls) == 2 * 6 + 2  # 6 per block (q, k, v, out, 2 MLP), the patch embedding and the head
    assert all(op.input_dtypes[:2] == ["int8", "int8"] for op in matmuls), matmuls
    for op in ops:
        if op.name not in ("FULLY_CONNECTED", "QUANTIZE", "DEQUANTIZE", "RESHAPE", "TRANSPOSE"):
            assert "int8" not in op.input_dtypes, op
    assert {"SOFTMAX", "GELU", "BATCH_MATMUL", "RSQRT"} <= {op.name for op in ops if "float32" in op.input_dtypes}
    # Nothing more outside XNNPACK than in the float32 file.
    assert mixed["ops_outside_delegate"] == results["float32"]["ops_outside_delegate"]
    assert mixed["delegate_partitions"] == results["float32"]["delegate_partitions"]
    classifier = tflite.LiteRTClassifier(path)
    assert [d["dtype"] for d in (classifier.input, classifier.output)] == [np.float32, np.float32]
    # Close to the Keras model, and far closer than full int8 would need to be refused.
    _, evaluation = tflite.split_indices(len(datasets.digits("all")[1]), **COUNTS)
    images = datasets.resize(datasets.digits("all")[0][evaluation], SIZE)
    outputs = np.stack([classifier(image) for image in images])
    np.testing.assert_allclose(outputs, model.predict(images, verbose=0), atol=0.05)
    assert mixed["top1_drop"] <= tflite.DEFAULT_MAX_TOP1_DROP and mixed["passed"]
    assert "mixed_int8 runs FULLY_CONNECTED, CONV_2D, DEPTHWISE_CONV_2D in int8" in (tmp_path / "report.md").read_text()


def test_without_a_quantization_debugger_mixed_int8_is_left_out_or_refused(tmp_path, monkeypatch):
    """`mixed_int8` is made by the quantization debugger's selective quantization (`tf.lite.experimental`)."""
    assert tflite.available_modes() == tflite.ALL_MODES
    monkeypatch.delattr(tf.lite.experimental, "QuantizationDebugger")
    assert tflite.available_modes() == ("float32", "float16", "dynamic_int8", "int8", "int8_cpu")
    with pytest.raises(ValueError, match=rf"TensorFlow {tf.__version__} cannot write \['mixed_int8'\]: mixed_int8 "
                                         r"needs tf.lite.experimental.QuantizationDebugger\."):
        tflite.export_tflite(tiny_model(), tmp_path, modes=("float32", "mixed_int8"))
    # By default the other modes are written, with a warning (here the images are refused right after it).
    with pytest.warns(UserWarning, match="Writing float32, float16, dynamic_int8, int8, int8_cpu: mixed_int8 needs"), \
            pytest.raises(ValueError, match="Expected images of shape"):
        tflite.export_tflite(tiny_model(), tmp_path, images=np.zeros((4, 8, 8, 3)))
    calibration = np.zeros((2, *SIZE, 3), np.float32)
    with pytest.raises(RuntimeError, match=r"mixed_int8 needs tf.lite.experimental.QuantizationDebugger, which "
                                           rf"TensorFlow {tf.__version__} lacks\. Write dynamic_int8, int8 or "
                                           r"int8_cpu instead\."):
        tflite.convert(tiny_model(), tmp_path / "x.tflite", "mixed_int8", calibration)
    assert list(tmp_path.iterdir()) == []
    # A refused mode's diagnosis says why it has none.
    needs_debugger = "Naming the sensitive layers needs tf.lite.experimental.QuantizationDebugger"
    with pytest.raises(RuntimeError, match=needs_debugger):
        tflite.sensitive_layers(tiny_model(), calibration)


def graph_of(flatbuffer: bytes):
    """(op names, the main subgraph) of a `.tflite` flatbuffer, as objects."""
    model = schema.ModelT.InitFromPackedBuf(flatbuffer, 0)
    codes = [max(code.builtinCode, code.deprecatedBuiltinCode) for code in model.operatorCodes]
    graph = model.subgraphs[0]
    return [tflite_conversion._BUILTIN_NAMES[codes[op.opcodeIndex]] for op in graph.operators], graph


def quantization_of(flatbuffer: bytes) -> tuple[list[str], list]:
    """(op names, (tensor name, type, scales, zero points) of every tensor) of a `.tflite` flatbuffer."""
    names, graph = graph_of(flatbuffer)
    tensors = [(t.name, t.type, *((None, None) if t.quantization is None or t.quantization.scale is None else
                                  (list(t.quantization.scale), list(t.quantization.zeroPoint)))) for t in graph.tensors]
    return names, tensors


def ranges_of(flatbuffer: bytes) -> dict[int, tuple[float, float]]:
    """{tensor index: (min, max)} of the tensors of a calibrated `.tflite` flatbuffer that have a recorded range."""
    _, graph = graph_of(flatbuffer)
    return {index: (float(t.quantization.min[0]), float(t.quantization.max[0]))
            for index, t in enumerate(graph.tensors) if t.quantization is not None and t.quantization.min is not None}


def int8_halves(model, calibration) -> tuple[bytes, bytes]:
    """(the calibrated float model, the plain `convert()` full-int8 model) of `model`."""
    options = tflite_conversion.converter_options("int8", calibration)
    with tflite_conversion._converter(model, options) as converter:
        calibrated = _tf_internals.calibrated_tflite(converter)
    with tflite_conversion._converter(model, options) as converter:
        return calibrated, converter.convert()


@pytest.fixture(scope="module")
def int8_of_tiny(tmp_path_factory):
    """`tiny_model()` and its int8 conversions on the first 20 digits, made once for the tests that read them:
    (model, calibration, its int8 file by `tflite.convert`, and `int8_halves`: calibrated, plain)."""
    model, calibration = tiny_model(), data.digits(SIZE)[:20]

    def make(folder):
        tflite.convert(model, folder / "int8.tflite", "int8", calibration)
        for name, content in zip(("calibrated.tflite", "plain.tflite"), int8_halves(model, calibration)):
            (folder / name).write_bytes(content)
    folder = made_once(tmp_path_factory, "int8_of_tiny", make)
    return (model, calibration, folder / "int8.tflite", (folder / "calibrated.tflite").read_bytes(),
            (folder / "plain.tflite").read_bytes())


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_full_int8_runs_every_attention_product_and_layer_norm_on_xnnpack(int8_of_tiny):
    model, calibration, path, calibrated, _ = int8_of_tiny
    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    outside, _ = tflite.outside_delegates(interpreter)
    # The interpreter's own int8 BATCH_MATMUL (right operand off zero point 0) and SQUARED_DIFFERENCE (a
    # LayerNorm written with a square of the centred input) are each about 10x slower than XNNPACK's kernels.
    assert "BATCH_MATMUL" not in outside and "SQUARED_DIFFERENCE" not in outside, outside
    assert litert_file.float_ops(path) == []  # every op integer (Keras' own LayerNormalization left a float NEG)
    names, graph = graph_of(path.read_bytes())
    right = [graph.tensors[op.inputs[1]] for name, op in zip(names, graph.operators) if name == "BATCH_MATMUL"]
    assert len(right) == 2 * 2  # q k^T and A V in each of the 2 blocks
    # Each right operand's scale is the symmetric range of its calibrated one: the larger end / 127.
    calibrated_names, calibrated_graph = graph_of(calibrated)
    ranges = {t.name: (t.quantization.min[0], t.quantization.max[0]) for t in calibrated_graph.tensors
              if t.quantization is not None and t.quantization.min is not None}
    for tensor in right:
        low, high = ranges[tensor.name]
        assert list(tensor.quantization.zeroPoint) == [0], tensor.name
        np.testing.assert_allclose(tensor.quantization.scale, [max(-low * 127 / 128, high) / 127], rtol=1e-5)
    classifier = tflite.LiteRTClassifier(path)
    assert [d["dtype"] for d in (classifier.input, classifier.output)] == [np.uint8, np.uint8]


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_int8_cpu_is_int8_with_softmax_and_gelu_in_float32_on_xnnpack(tmp_path, int8_of_tiny):
    model, calibration, int8, _, _ = int8_of_tiny
    path = tflite.convert(model, tmp_path / "int8_cpu.tflite", "int8_cpu", calibration)
    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    outside, _ = tflite.outside_delegates(interpreter)
    assert not {"SOFTMAX", "GELU", "BATCH_MATMUL", "DEQUANTIZE"} & set(outside), outside
    assert litert_file.float_ops(path) == ["GELU", "SOFTMAX"]
    names, graph = graph_of(path.read_bytes())
    int8_names, _ = graph_of(int8.read_bytes())
    # The int8 file's ops, and one DEQUANTIZE and one QUANTIZE around each softmax and GELU of the 2 blocks and
    # around the head's softmax.
    assert collections.Counter(names) - collections.Counter(int8_names) == {"DEQUANTIZE": 5, "QUANTIZE": 5}
    for name, op in zip(names, graph.operators):
        if name in ("SOFTMAX", "GELU"):
            assert graph.tensors[op.inputs[0]].type == graph.tensors[op.outputs[0]].type == schema.TensorType.FLOAT32
        elif name not in ("DEQUANTIZE", "QUANTIZE"):  # every other op int8 (or uint8 at the ends), as in int8
            assert {graph.tensors[index].type for index in op.inputs if index >= 0} <= {
                schema.TensorType.INT8, schema.TensorType.UINT8, schema.TensorType.INT32}, name
    # K and V on symmetric ranges, as in int8.
    right = [graph.tensors[op.inputs[1]] for name, op in zip(names, graph.operators) if name == "BATCH_MATMUL"]
    assert len(right) == 4 and all(list(tensor.quantization.zeroPoint) == [0] for tensor in right)
    classifier = tflite.LiteRTClassifier(path)
    assert [d["dtype"] for d in (classifier.input, classifier.output)] == [np.uint8, np.uint8]
    # Its probabilities agree with the Keras model's at least as closely as int8's, within int8's step (1/256).
    images = data.digits(SIZE)[20:60]
    reference = model_io.with_pixel_input(model).predict(images, verbose=0)
    errors = {}
    for mode, file in (("int8", int8), ("int8_cpu", path)):
        run = tflite.LiteRTClassifier(file)
        errors[mode] = np.abs(np.stack([run(image) for image in images]) - reference).max()
    assert errors["int8_cpu"] <= errors["int8"] + 1 / 256, errors


@pytest.mark.slow  # runs the quantization debugger twice
def test_int8_cpu_sensitive_layers_rank_only_what_it_quantizes():
    model, calibration = tiny_model(), data.digits(SIZE)[:20]
    ranked = {mode: {layer["op"] for layer in tflite.sensitive_layers(model, calibration, count=1000, mode=mode)}
              for mode in ("int8", "int8_cpu")}
    assert {"SOFTMAX", "GELU"} <= ranked["int8"]
    assert ranked["int8_cpu"] == ranked["int8"] - {"SOFTMAX", "GELU"}


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
def test_full_int8_in_two_halves_is_convert_but_for_the_symmetric_ranges(int8_of_tiny):
    _, _, _, calibrated, plain = int8_of_tiny
    halves = _tf_internals.quantize_calibrated(calibrated, tf.uint8, tf.uint8)
    assert quantization_of(halves) == quantization_of(plain)
    widened = tflite_conversion.symmetric_matmul_operands(calibrated)
    before, after = ranges_of(calibrated), ranges_of(widened)
    names, graph = graph_of(calibrated)
    same_scale = [op for name, op in zip(names, graph.operators) if name in tflite_conversion.SAME_SCALE_OPS]
    right = {op.inputs[1] for name, op in zip(names, graph.operators) if name == "BATCH_MATMUL"}
    # Through the same-scale ops: each operand, the RESHAPE / TRANSPOSE it came from, and their projection.
    tied = right | {op.inputs[0] for op in same_scale if set(op.outputs) & right}
    changed = {index for index in before if after[index] != before[index]}
    assert tied <= changed <= right | {index for op in same_scale for index in (*op.inputs, *op.outputs)}
    for index in changed:
        (low, high), (new_low, new_high) = before[index], after[index]
        np.testing.assert_allclose(new_high, max(-low * 127 / 128, high), rtol=1e-6)
        np.testing.assert_allclose(new_low, -new_high * 128 / 127, rtol=1e-6)
        assert new_low <= low and high <= new_high
    assert ranges_of(tflite_conversion.symmetric_matmul_operands(widened)) == after  # widened once, it stays


@pytest.mark.slow  # converts and runs LiteRT files (3 to 12 s)
@pytest.mark.parametrize("mode, what", [("int8", "attention products"),
                                        ("int8_cpu", "attention products and SOFTMAX, GELU \\(int8 here\\)")],
                         ids=["int8", "int8_cpu"])
def test_full_int8_without_the_converter_internals_is_plain_convert(tmp_path, monkeypatch, mode, what, int8_of_tiny):
    def unavailable(converter):
        raise _tf_internals.Unavailable("forced by the test")

    model, calibration, _, _, plain = int8_of_tiny
    monkeypatch.setattr(_tf_internals, "calibrated_tflite", unavailable)
    with pytest.warns(UserWarning, match=rf"Writing {mode} by TFLiteConverter\.convert\(\): forced by the test\. "
                                         rf"Its {what} will run outside XNNPACK, several times slower\."):
        path = tflite.convert(model, tmp_path / f"{mode}.tflite", mode, calibration)
    assert quantization_of(path.read_bytes()) == quantization_of(plain)
    interpreter = Interpreter(model_path=str(path))
    interpreter.allocate_tensors()
    assert "BATCH_MATMUL" in tflite.outside_delegates(interpreter)[0]


def test_files_are_converted_from_the_head_rows_twin(tmp_path):
    """The last block of a `.tflite` file computes its MLP on the class token's row alone (`head_rows_model`), the
    first block on all 5 tokens; the outputs are the Keras model's."""
    model = tiny_model()
    path = tflite.convert(model, tmp_path / "float32.tflite", "float32")
    names, graph = graph_of(path.read_bytes())
    mlp_rows = [int(np.prod(graph.tensors[op.outputs[0]].shape[:-1])) for name, op in zip(names, graph.operators)
                if name == "FULLY_CONNECTED" and graph.tensors[op.outputs[0]].shape[-1] == 32]  # tiny_model's mlp_dim
    assert mlp_rows == [5, 1], mlp_rows
    images = data.digits(SIZE)[:4]
    classifier = tflite.LiteRTClassifier(path)
    np.testing.assert_allclose(np.stack([classifier(image) for image in images]),
                               model_io.with_pixel_input(model).predict(images, verbose=0), atol=1e-5)

    # The float files are traced for LiteRT's GPU delegate: no BATCH_MATMUL with a transpose flag (which it ignores),
    # no tensor of rank 5 or more (which it refuses); the int8 modes' form keeps q k^T's adj_y. Counted here through
    # flatbuffers' object API, and by `gpu_delegate_pitfalls`.
    def pitfalls(names, graph):
        transposed = [op for name, op in zip(names, graph.operators)
                      if name == "BATCH_MATMUL" and (op.builtinOptions.adjX or op.builtinOptions.adjY)]
        wide = {t for op in graph.operators for t in (*op.inputs, *op.outputs)
                if t >= 0 and len(graph.tensors[t].shape) > 4}
        return len(transposed), len(wide)

    assert pitfalls(names, graph) == (0, 0) and litert_file.gpu_delegate_pitfalls(path) == {}
    assert litert_file.gpu_delegate_problems(path) == []  # the class token too: no STRIDED_SLICE shrink-axis mask
    assert names.count("BATCH_MATMUL") == 2 * TINY_VIT["num_layers"]
    with tflite_conversion.conversion_source(model, gpu_delegate=False) as source:
        int8_form = tflite.convert(model, tmp_path / "int8_form.tflite", "float32", source=source)
    assert pitfalls(*graph_of(int8_form.read_bytes())) == (TINY_VIT["num_layers"], 0)
    assert litert_file.gpu_delegate_pitfalls(int8_form) == {"transposed_batch_matmul": TINY_VIT["num_layers"]}
    assert litert_file.gpu_delegate_problems(int8_form) == ["BATCH_MATMUL: adj_x / adj_y"]
    np.testing.assert_allclose(np.stack([tflite.LiteRTClassifier(int8_form)(image) for image in images]),
                               np.stack([classifier(image) for image in images]), atol=1e-6)
    dense = keras.Sequential([keras.Input((4, 4, 3)), keras.layers.Flatten(), keras.layers.Dense(2)])
    plain = tflite.convert(dense, tmp_path / "dense.tflite", "float32", pixel_input=False)
    assert litert_file.gpu_delegate_pitfalls(plain) == {}


@pytest.mark.slow  # converts a tiny hybrid (about 5 s)
def test_a_hybrids_float_file_has_no_tensor_of_rank_5_and_keeps_its_outputs(tmp_path):
    """The hybrid's GroupNorm is traced with rank-4 tensors for the GPU delegate (Keras' layer makes rank-5 ones,
    which the delegate refuses): its float32 file has none of the pitfalls and computes the Keras model's numbers."""
    from tests.testing import TINY_HYBRID
    model = keras_vit.VisionTransformer(weights=None, input_shape=(32, 32, 3), classes=10, classifier_activation=None,
                                        **TINY_HYBRID)
    randomize(model, seed=2)
    path = tflite.convert(model, tmp_path / "hybrid.tflite", "float32")
    assert litert_file.gpu_delegate_pitfalls(path) == {}
    images = data.photos((32, 32), count=3)
    classifier = tflite.LiteRTClassifier(path)
    expected = model_io.with_pixel_input(model).predict(images, verbose=0)
    assert np.ptp(expected) > 0.5  # logits, not a flat output
    np.testing.assert_allclose(np.stack([classifier(image) for image in images]), expected, atol=1e-5)
