"""ONNX files: Keras' own `Model.export(format="onnx")` of a keras_vit model after `predict` (it refused such a model
as "never called"), and `keras-vit-export --format onnx`: `OUT/<version>/model.onnx` with the preprocessing inside,
a dynamic batch, checked with ONNX Runtime against Keras before it is written, whole or not at all. What ONNX files
share with OpenVINO's (any size, a tower, a file that disagrees, the int8 form, a missing runtime):
tests/export/test_runtime_files.py."""

import os

import numpy as np
import onnxruntime
import pytest

from keras_vit.cli import export as export_cli
from keras_vit.export import onnx_file
from tests.testing import randomize, tiny_model


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


def test_an_exact_gelu_model_is_written_with_erf_and_matches_keras(tmp_path):
    """timm's and Hugging Face's families use the exact GELU. TensorFlow writes it with Erfc, which ONNX does not have
    (ONNX Runtime refused every such file: "No Op registered for Erfc"); the file computes it with Erf, within
    float32 rounding of the Keras model, and the Keras model itself keeps TensorFlow's GELU."""
    import keras
    import onnx
    import keras_vit

    model = keras_vit.VisionTransformer(patch_size=8, hidden_dim=32, mlp_dim=64, num_heads=2, num_layers=2,
                                       input_shape=(32, 32, 3), classes=5, weights=None, gelu_approximate=False)
    randomize(model, seed=3)
    path = onnx_file.export_onnx(model, tmp_path / "onnx") / onnx_file.ONNX_FILE
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "Erf" in ops and "Erfc" not in ops, ops
    images = pixels((3, 32, 32, 3), seed=2)
    expected = np.asarray(model(images, training=False))
    assert np.ptp(expected) > 0.1  # not a flat output
    np.testing.assert_allclose(run(path, images), expected, atol=1e-5, rtol=0)
    x = keras.ops.convert_to_tensor(np.linspace(-4, 4, 9, dtype="float32"))
    np.testing.assert_allclose(keras_vit.kernels.gelu(x, approximate=False),
                               keras.activations.gelu(x, approximate=False), atol=0, rtol=0)  # outside the scope
    with keras_vit.kernels.scope.for_onnx():
        np.testing.assert_allclose(keras_vit.kernels.gelu(x, approximate=False),
                                   keras.activations.gelu(x, approximate=False), atol=1e-6, rtol=0)


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
