"""ONNX files: Keras' own `Model.export(format="onnx")` of a keras_vit model after `predict` (it refused such a model
as "never called"), and `keras-vit-export --format onnx`: `OUT/<version>/model.onnx` with the preprocessing inside,
a dynamic batch, checked with ONNX Runtime against Keras before it is written, whole or not at all; its int8 form
(`--precision int8`) checked on photographs. What ONNX files share with OpenVINO's (any size, a tower, a file that
disagrees, a missing runtime): tests/export/test_runtime_files.py."""

import os

import numpy as np
import onnxruntime
import pytest

from keras_vit.cli import export as export_cli
from keras_vit.export import data, onnx_file, precision
from tests.testing import tiny_model


def pixels(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, shape).astype("float32")


def run(path, images: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (given,) = session.get_inputs()
    return session.run(None, {given.name: images})[0]


def test_keras_export_to_onnx_after_predict(tmp_path):
    """`predict` runs the model's head-rows twin, so Keras never saw the model called; its ONNX exporter refused
    it. `ViTModel.export` gives the model's input signature: the file takes any batch and matches `predict`."""
    model = tiny_model("plain")
    expected = model.predict(pixels((5, 32, 32, 3)), verbose=0)
    model.export(str(tmp_path / "model.onnx"), format="onnx", verbose=False)
    for count in (5, 1):
        np.testing.assert_allclose(run(tmp_path / "model.onnx", pixels((5, 32, 32, 3))[:count]), expected[:count],
                                   atol=1e-5, rtol=0)
    assert model.input_shape == (None, 32, 32, 3)  # the signature is the model's own, not a traced batch


def test_cli_writes_versions_checked_against_keras_and_never_overwrites(tmp_path, capsys):
    model = tiny_model("plain")
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    base = tmp_path / "onnx"
    assert export_cli.main(["--model", str(model_file), "--format", "onnx", "--out", str(base)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"Wrote ONNX file {base / '1' / 'model.onnx'}: input image [None, 32, 32, 3]"), printed
    assert sorted(os.listdir(base / "1")) == sorted([onnx_file.ONNX_FILE, onnx_file.REPORT_FILE])
    report = onnx_file.read_report(base / "1")
    assert report["input_shape"] == [None, 32, 32, 3] and report["image_size"] == [32, 32]
    assert report["checked_shapes"] == [[4, 32, 32, 3], [1, 32, 32, 3]] and report["any_size_stride"] is None
    assert report["max_relative_diff"] <= onnx_file.MAX_RELATIVE_DIFF and report["latency_ms_median_batch_1"] > 0
    assert report["preprocessing"]["image_mean"] == [0.5, 0.5, 0.5]
    images = pixels((3, 32, 32, 3), seed=1)  # [0, 255] pixels: the preprocessing is in the file
    np.testing.assert_allclose(run(base / "1" / "model.onnx", images), model(images), atol=1e-5, rtol=0)

    before = (base / "1" / "model.onnx").read_bytes()
    with pytest.raises(SystemExit) as refused:
        export_cli.main(["--model", str(model_file), "--format", "onnx", "--out", str(base), "--version", "1"])
    error = capsys.readouterr().err
    assert refused.value.code == 1 and error.startswith("keras-vit-export: error: Version directory "), error
    assert (base / "1" / "model.onnx").read_bytes() == before
    with pytest.raises(SystemExit) as refused:
        export_cli.main(["--model", str(model_file), "--format", "onnx", "--out", str(base), "--signatures", "embed"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "--signatures shapes the SavedModel's serving signatures" in error, error
    with pytest.raises(SystemExit) as refused:  # it would be ignored: the file holds the model's own outputs
        export_cli.main(["--model", str(model_file), "--format", "onnx", "--out", str(base), "--embedding", "head"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "--embedding head shapes the SavedModel's serving signatures" in error, error
    assert sorted(os.listdir(base)) == ["1"]


def test_int8_file_is_onnx_runtimes_dynamic_quantization_checked_on_photographs(tmp_path, capsys):
    """--precision int8: the float32 file is checked against Keras, then quantized by ONNX Runtime (integer matmuls,
    int8 weights) and checked on real photographs; the report's top-1 agreement is the file's own, recomputed here."""
    import onnx

    model = tiny_model("plain")
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    base = tmp_path / "onnx"
    assert export_cli.main(["--model", str(model_file), "--format", "onnx", "--precision", "int8",
                            "--out", str(base)]) == 0
    printed = capsys.readouterr().out
    report = onnx_file.read_report(base / "1")
    assert (report["precision"], report["quantization"]) == ("int8", onnx_file.INT8_METHOD)
    assert report["float32_check"]["max_relative_diff"] <= onnx_file.MAX_RELATIVE_DIFF
    graph = onnx.load(str(base / "1" / onnx_file.ONNX_FILE)).graph
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {node.op_type for node in graph.node}
    assert any(tensor.data_type == onnx.TensorProto.INT8 for tensor in graph.initializer)
    check = report["int8_check"]
    photos = data.photos((32, 32), count=precision.CHECK_PHOTOS)
    # In batches of 16, as checked: the activations' int8 scale is each batch's, so an image's outputs depend on
    # the other images of its batch.
    ours = np.concatenate([run(base / "1" / onnx_file.ONNX_FILE, photos[start:start + 16])
                           for start in range(0, len(photos), 16)])
    expected = np.asarray(model(photos))
    assert check["images"] == precision.CHECK_PHOTOS and not check["refused"]
    assert check["top1_agreement"] == np.mean(ours.argmax(-1) == expected.argmax(-1)) >= 0.9
    assert 0 < np.abs(ours - expected).max() < 0.1  # quantized: close, not float32-equal
    assert (f"in float32; int8 (ONNX Runtime's dynamic quantization) against Keras on {precision.CHECK_PHOTOS} "
            f"photographs: top-1 agreement {100 * check['top1_agreement']:.1f}%") in printed, printed


def test_an_int8_file_that_loses_top1_is_not_written(tmp_path, monkeypatch):
    """An int8 file whose top-1 disagrees with Keras past --max-top1-drop (here: another model's file stands for a
    quantization gone wrong) is refused, nothing written."""
    import shutil

    other = onnx_file.export_onnx(tiny_model("plain", seed=7), tmp_path / "other") / onnx_file.ONNX_FILE
    monkeypatch.setattr(onnx_file, "quantize_in_place", lambda path: shutil.copyfile(other, path))
    base = tmp_path / "onnx"
    with pytest.raises(precision.Top1DropError, match=r"^The int8 ONNX file's top-1 disagrees with float32 on "
                       r"[0-9.]+ points of 128 photographs, over max_top1_drop=1, so nothing was written"):
        onnx_file.export_onnx(tiny_model("plain"), base, precision="int8")
    assert os.listdir(base) == []
    with pytest.raises(ValueError, match=r"Unknown ONNX precision 'int4'. Expected one of float32, int8."):
        onnx_file.export_onnx(tiny_model("plain"), base, precision="int4")
