"""What the ONNX and OpenVINO files share (`keras_vit.export.runtime_files`), tested on each runtime alike: a model
of any size in one file at each size, a tower's embedding, a file that disagrees with Keras not written, the int8
file (`--precision int8`) checked on photographs and refused past `--max-top1-drop`, and a missing runtime named by
its extra. Each runtime's own behaviour: tests/export/test_onnx.py, test_openvino.py."""

import dataclasses
import os
import shutil
from typing import Callable

import numpy as np
import pytest

import keras_vit
from keras_vit.cli import export as export_cli
from keras_vit.export import data, model_io, onnx_file, openvino_file, precision, runtime_files
from tests.testing import TINY_VIT, needs, save_checkpoint, tiny_model, vit_checkpoint


def run_onnx(path, images: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def run_openvino(path, images: np.ndarray) -> np.ndarray:
    import openvino

    return openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(images)[0]


def onnx_is_int8(path) -> bool:
    """Integer matmuls on int8 weights: ONNX Runtime's dynamic quantization."""
    import onnx

    graph = onnx.load(str(path)).graph
    return ({"DynamicQuantizeLinear", "MatMulInteger"} <= {node.op_type for node in graph.node}
            and any(tensor.data_type == onnx.TensorProto.INT8 for tensor in graph.initializer))


def openvino_is_int8(path) -> bool:
    """The int8 points NNCF inserts before the matmuls."""
    import openvino

    return [op.get_type_name() for op in openvino.Core().read_model(str(path)).get_ops()].count("FakeQuantize") >= 4


def onnx_int8_weights(path) -> list[np.ndarray]:
    """The file's int8 weights."""
    import onnx
    from onnx import numpy_helper

    return [numpy_helper.to_array(tensor) for tensor in onnx.load(str(path)).graph.initializer
            if tensor.data_type == onnx.TensorProto.INT8]


def openvino_int8_weights(path) -> list[np.ndarray]:
    """The file's int8 weights (NNCF stores a quantized matmul's weights as int8 constants)."""
    import openvino

    return [op.get_data() for op in openvino.Core().read_model(str(path)).get_ops()
            if op.get_type_name() == "Constant" and op.get_element_type().get_type_name() == "i8"]


def assert_7_bit(weights: list[np.ndarray]) -> None:
    """Every int8 weight within [-64, 64], which no CPU's 8-bit dot product saturates on (without VNNI, two uint8 x
    int8 products sum into 16 bits: 2 x 255 x 127 overflows 32767, 2 x 255 x 64 does not)."""
    assert weights and all(np.abs(weight.astype(np.int32)).max() <= 64 for weight in weights), \
        sorted({int(np.abs(weight.astype(np.int32)).max()) for weight in weights})


@dataclasses.dataclass(frozen=True)
class Runtime:
    export: Callable
    read_report: Callable
    files: tuple[str, ...]  # the model's files, the one a runtime opens first
    run: Callable
    mismatch: type
    name: str  # in the messages
    module: str  # the module whose absence is named
    int8_method: str  # in the printed line
    is_int8: Callable
    int8_weights: Callable
    module_file: object  # export.onnx_file or export.openvino_file


RUNTIMES = {
    "onnx": Runtime(onnx_file.export_onnx, onnx_file.read_report, (onnx_file.ONNX_FILE,), run_onnx,
                    onnx_file.OnnxMismatchError, "ONNX", "onnxruntime", "ONNX Runtime's dynamic quantization",
                    onnx_is_int8, onnx_int8_weights, onnx_file),
    "openvino": Runtime(openvino_file.export_openvino, openvino_file.read_report, (openvino_file.XML_FILE, "model.bin"),
                        run_openvino, openvino_file.OpenVinoMismatchError, "OpenVINO", "openvino", "NNCF",
                        openvino_is_int8, openvino_int8_weights, openvino_file),
}
FORMATS = [pytest.param("onnx"), pytest.param("openvino", marks=needs("openvino", "OpenVINO's runtime, "
                                                                                  "keras_vit[openvino]"))]


def pixels(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, shape).astype("float32")


@pytest.mark.parametrize("file_format", FORMATS)
def test_any_size_file_takes_each_size_and_a_tower_its_embedding(tmp_path, file_format):
    """A checkpoint built for any size (`--any-size`): height and width are dynamic in the file, and each size
    gives the Keras model's logits; an image tower (`include_top=False`) gives its pooled embedding."""
    runtime = RUNTIMES[file_format]
    checkpoint = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(TINY_VIT, seed=3))
    base = tmp_path / "any"
    assert export_cli.main(["--weights", checkpoint, "--any-size", "--format", file_format, "--out", str(base)]) == 0
    report = runtime.read_report(base / "1")
    assert report["input_shape"] == [None, None, None, 3] and report["any_size_stride"] == TINY_VIT["patch_size"]
    assert report["checked_shapes"][-1] == [4, 48, 40, 3]  # two strides taller, one wider than its 32 x 32
    model = keras_vit.VisionTransformer(weights=checkpoint, input_shape=(None, None, 3), classes=10)
    for shape in ((2, 32, 32, 3), (1, 24, 56, 3)):
        images = pixels(shape, seed=2)
        np.testing.assert_allclose(runtime.run(base / "1" / runtime.files[0], images), model(images), atol=1e-5,
                                   rtol=0)

    tower = keras_vit.VisionTransformer(weights=checkpoint, include_top=False, pooling="token")
    path = runtime.export(tower, tmp_path / "tower")
    images = pixels((2, 32, 32, 3), seed=3)
    embedding = runtime.run(path / runtime.files[0], images)
    assert embedding.shape == (2, TINY_VIT["hidden_dim"])
    np.testing.assert_allclose(embedding, tower(images), atol=1e-5, rtol=0)


@pytest.mark.parametrize("file_format", FORMATS)
def test_a_file_that_disagrees_is_not_written(tmp_path, file_format):
    runtime = RUNTIMES[file_format]
    base = tmp_path / file_format
    with pytest.raises(runtime.mismatch, match=rf"^{runtime.name}.*'s outputs are .* over max_relative_diff=-1: "
                                               r"version 1 was not written"):
        runtime.export(tiny_model("plain"), base, max_relative_diff=-1)
    assert os.listdir(base) == []  # no version, no partial folder


@pytest.mark.parametrize("file_format", FORMATS)
def test_int8_file_is_checked_on_photographs(tmp_path, capsys, file_format):
    """--precision int8: the float32 file is checked against Keras, then quantized by the runtime's own tool and
    checked on crops of real photographs; the report's top-1 agreement is the file's own, recomputed here in the
    batches of 16 it was checked in (ONNX Runtime's int8 scale of the activations is each batch's)."""
    runtime = RUNTIMES[file_format]
    model = tiny_model("plain")
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    base = tmp_path / file_format
    assert export_cli.main(["--model", str(model_file), "--format", file_format, "--precision", "int8",
                            "--out", str(base)]) == 0
    printed = capsys.readouterr().out
    report = runtime.read_report(base / "1")
    assert (report["precision"], report["quantization"]) == ("int8", runtime.module_file.INT8_METHOD)
    assert report["float32_check"]["max_relative_diff"] <= runtime_files.MAX_RELATIVE_DIFF
    assert runtime.is_int8(base / "1" / runtime.files[0])
    assert_7_bit(runtime.int8_weights(base / "1" / runtime.files[0]))
    assert sorted(os.listdir(base / "1")) == sorted([*runtime.files, runtime.module_file.REPORT_FILE])
    check = report["int8_check"]
    photos = data.photos((32, 32), count=precision.CHECK_PHOTOS)
    ours = np.concatenate([runtime.run(base / "1" / runtime.files[0], photos[start:start + 16])
                           for start in range(0, len(photos), 16)])
    expected = np.asarray(model(photos))
    assert check["images"] == precision.CHECK_PHOTOS and not check["refused"]
    assert check["top1_agreement"] == np.mean(ours.argmax(-1) == expected.argmax(-1)) >= 0.9
    assert 0 < np.abs(ours - expected).max() < 0.1  # quantized: close, not float32-equal
    calibrated = ", calibrated on 128 photo crops" if file_format == "openvino" else ""  # ONNX's dynamic: none
    assert report.get("calibration_images", "128 photo crops") == "128 photo crops"
    assert (f"in float32; int8 ({runtime.int8_method}{calibrated}) against Keras on {precision.CHECK_PHOTOS} "
            f"photographs: top-1 agreement {100 * check['top1_agreement']:.1f}%") in printed, printed


@pytest.mark.parametrize("file_format", FORMATS)
def test_an_int8_towers_file_is_held_to_no_top1(tmp_path, file_format):
    """A tower's output is an embedding, whose largest entry is no class: its int8 file is reported by the least
    cosine with Keras' embeddings, not refused on a top-1 of them (which would refuse good files at random)."""
    runtime = RUNTIMES[file_format]
    tower = keras_vit.VisionTransformer(weights=save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(TINY_VIT, seed=3)),
                                        include_top=False, pooling="token")
    check = runtime.read_report(runtime.export(tower, tmp_path / file_format, precision="int8"))["int8_check"]
    assert "top1_agreement" not in check and not check["refused"] and check["images"] == precision.CHECK_PHOTOS
    assert 0.9 < check["min_cosine"] < 1


def test_agreement_reads_top1_of_a_classifier_only():
    reference = np.array([[1.0, 0.0, 0.9], [0.2, 1.0, 0.0]])
    swapped = reference[:, [2, 1, 0]]  # the first row's top-1 moves; both stay close in cosine
    as_classifier = precision.agreement(reference, swapped, max_top1_drop=1)
    assert (as_classifier["top1_agreement"], as_classifier["top1_drop"], as_classifier["refused"]) == (0.5, 50.0, True)
    as_embedding = precision.agreement(reference, swapped, max_top1_drop=1, classifier=False)
    assert "top1_agreement" not in as_embedding and not as_embedding["refused"]
    assert as_embedding["min_cosine"] == pytest.approx(1 / 1.04)  # the second row: 1 / (1 + 0.2 ** 2)


@pytest.mark.parametrize("file_format", FORMATS)
def test_an_int8_file_that_loses_top1_is_not_written(tmp_path, monkeypatch, file_format):
    """An int8 file whose top-1 disagrees with Keras past --max-top1-drop (here: another model's file stands for a
    quantization gone wrong) is refused, nothing written; an unknown precision is named."""
    runtime = RUNTIMES[file_format]
    other = runtime.export(tiny_model("plain", seed=7), tmp_path / "other")

    def other_model(*args):  # replaced, not rewritten, as quantize_in_place does (OpenVINO maps its weights)
        folder = os.path.dirname(next(arg for arg in args if isinstance(arg, str)))
        for name in runtime.files:
            shutil.copyfile(other / name, os.path.join(folder, "new_" + name))
            os.replace(os.path.join(folder, "new_" + name), os.path.join(folder, name))

    monkeypatch.setattr(runtime.module_file, "quantize_in_place", other_model)
    base = tmp_path / file_format
    with pytest.raises(precision.Top1DropError, match=rf"^The int8 {runtime.name} file's top-1 disagrees with "
                       r"float32 on [0-9.]+ points of 128 photographs, over max_top1_drop=1, so nothing was written"):
        runtime.export(tiny_model("plain"), base, precision="int8")
    assert os.listdir(base) == []
    with pytest.raises(ValueError, match=rf"Unknown {runtime.name} precision 'int4'. Expected one of "
                                         rf"{', '.join(runtime.module_file.PRECISIONS)}\."):
        runtime.export(tiny_model("plain"), base, precision="int4")


@pytest.mark.parametrize("file_format", RUNTIMES)  # the runtime need not be installed
def test_without_its_runtime_one_line_names_the_extra(tmp_path, monkeypatch, file_format):
    runtime = RUNTIMES[file_format]
    monkeypatch.setattr(runtime_files.importlib.util, "find_spec",
                        lambda name, *args: None if name == runtime.module else object())
    expected = rf'needs {runtime.module}, which is not installed: pip install "keras_vit\[{file_format}\]"'
    with pytest.raises(ImportError, match=expected):
        runtime.export(tiny_model("plain"), tmp_path / file_format)
    assert not (tmp_path / file_format).exists()


def write_jpegs(folder, images: np.ndarray) -> None:
    import tensorflow as tf

    folder.mkdir()
    for i, image in enumerate(images):
        (folder / f"{i:02d}.jpg").write_bytes(tf.io.encode_jpeg(image.astype("uint8"), quality=95).numpy())


CALIBRATED = [pytest.param("onnx", "int8_static"),
              pytest.param("openvino", "int8", marks=needs("openvino", "OpenVINO's runtime, keras_vit[openvino]"))]


@pytest.mark.parametrize("file_format, int8", CALIBRATED)
def test_int8_file_is_calibrated_on_the_given_images(tmp_path, capsys, monkeypatch, file_format, int8):
    """--calibration-images DIR: the int8 file's scales are calibrated on those images (fitted to the model's size
    as `export.data.directory` fits them), said in the report and the printed line, and checked as every int8 file
    is; ONNX's static file holds QDQ pairs around int8 weights."""
    runtime = RUNTIMES[file_format]
    model = tiny_model("plain")
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    write_jpegs(tmp_path / "mine", data.photos((48, 40), count=6, seed=4))
    seen = []
    calibrate = runtime.module_file.quantize_static_in_place if file_format == "onnx" else \
        runtime.module_file.quantize_in_place
    monkeypatch.setattr(runtime.module_file, calibrate.__name__,
                        lambda *args: seen.append(args[-1]) or calibrate(*args))
    base = tmp_path / file_format
    assert export_cli.main(["--model", str(model_file), "--format", file_format, "--precision", int8,
                            "--calibration-images", str(tmp_path / "mine"), "--out", str(base)]) == 0
    (images,) = seen
    fitted = data.directory(tmp_path / "mine", (32, 32), model_io.preprocessing_config(model).resize_arguments)
    np.testing.assert_array_equal(images, fitted)
    report = runtime.read_report(base / "1")
    assert (report["precision"], report["calibration_images"]) == (int8, "6 given images")
    check = report["int8_check"]
    assert check["top1_agreement"] >= 0.9 and not check["refused"]
    assert f"calibrated on 6 given images) against Keras on {precision.CHECK_PHOTOS} photographs" in \
        capsys.readouterr().out
    if file_format == "onnx":
        import onnx

        graph = onnx.load(str(base / "1" / onnx_file.ONNX_FILE)).graph
        assert {"QuantizeLinear", "DequantizeLinear"} <= {node.op_type for node in graph.node}
        # Only the weights of onnx_file.STATIC_INT8_OPS are int8 (those of LayerNorm and the biases stay float32).
        int8_weights = {tensor.name for tensor in graph.initializer if tensor.data_type == onnx.TensorProto.INT8}
        weights_of = {output: set(node.input) & int8_weights for node in graph.node
                      if node.op_type == "DequantizeLinear" for output in node.output}
        takers = {node.op_type for node in graph.node for name in node.input if weights_of.get(name)}
        assert "MatMul" in takers and takers <= set(onnx_file.STATIC_INT8_OPS), takers
        assert any(tensor.data_type == onnx.TensorProto.INT8 for tensor in graph.initializer)
        assert report["quantization"] == onnx_file.INT8_METHODS["int8_static"]
    assert_7_bit(RUNTIMES[file_format].int8_weights(base / "1" / RUNTIMES[file_format].files[0]))
    photos = data.photos((32, 32), count=precision.CHECK_PHOTOS)
    ours = np.concatenate([runtime.run(base / "1" / runtime.files[0], photos[start:start + 16])
                           for start in range(0, len(photos), 16)])
    assert check["top1_agreement"] == np.mean(ours.argmax(-1) == np.asarray(model(photos)).argmax(-1))


def test_calibration_images_of_another_size_or_flag_are_refused(tmp_path, capsys):
    model = tiny_model("plain")
    with pytest.raises(ValueError, match=r"^Expected calibration images of shape \(N, 32, 32, 3\), N >= 1, pixels in "
                                         r"\[0, 255\] at the model's size\. Received shape \(2, 16, 16, 3\)\.$"):
        onnx_file.export_onnx(model, tmp_path / "onnx", precision="int8_static",
                              calibration_images=np.zeros((2, 16, 16, 3), "float32"))
    assert not (tmp_path / "onnx").exists()
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    with pytest.raises(SystemExit) as stop:
        export_cli.main(["--model", str(model_file), "--format", "onnx", "--precision", "int8",
                         "--calibration-images", str(tmp_path), "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert ("--calibration-images calibrates --format onnx --precision int8_static and --format openvino --precision "
            "int8; --format onnx --precision int8 is not calibrated (drop the flag).") in capsys.readouterr().err
