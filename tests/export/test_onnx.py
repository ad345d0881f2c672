"""ONNX files: Keras' own `Model.export(format="onnx")` of a keras_vit model after `predict` (it refused such a model
as "never called"), and `keras-vit-export --format onnx`: `OUT/<version>/model.onnx` with the preprocessing inside,
a dynamic batch (and height and width for a model of any size), checked with ONNX Runtime against Keras before it
is written, whole or not at all."""

import os

import numpy as np
import onnxruntime
import pytest

import keras_vit
from keras_vit.cli import export as export_cli
from keras_vit.export import onnx_file, runtime_files
from tests.testing import TINY_VIT, save_checkpoint, tiny_model, vit_checkpoint


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


def test_any_size_file_takes_each_size_and_a_tower_its_embedding(tmp_path):
    """A checkpoint built for any size (`--any-size`): height and width are dynamic in the file, and each size
    gives the Keras model's logits; an image tower (`include_top=False`) gives its pooled embedding."""
    checkpoint = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(TINY_VIT, seed=3))
    base = tmp_path / "any"
    assert export_cli.main(["--weights", checkpoint, "--any-size", "--format", "onnx", "--out", str(base)]) == 0
    report = onnx_file.read_report(base / "1")
    assert report["input_shape"] == [None, None, None, 3] and report["any_size_stride"] == TINY_VIT["patch_size"]
    assert report["checked_shapes"][-1] == [4, 48, 40, 3]  # two strides taller, one wider than its 32 x 32
    model = keras_vit.VisionTransformer(weights=checkpoint, input_shape=(None, None, 3), classes=10)
    for shape in ((2, 32, 32, 3), (1, 24, 56, 3)):
        images = pixels(shape, seed=2)
        np.testing.assert_allclose(run(base / "1" / "model.onnx", images), model(images), atol=1e-5, rtol=0)

    tower = keras_vit.VisionTransformer(weights=checkpoint, include_top=False, pooling="token")
    path = onnx_file.export_onnx(tower, tmp_path / "tower")
    images = pixels((2, 32, 32, 3), seed=3)
    embedding = run(path / "model.onnx", images)
    assert embedding.shape == (2, TINY_VIT["hidden_dim"])
    np.testing.assert_allclose(embedding, tower(images), atol=1e-5, rtol=0)


def test_a_file_that_disagrees_is_not_written(tmp_path):
    base = tmp_path / "onnx"
    with pytest.raises(onnx_file.OnnxMismatchError, match=r"over max_relative_diff=-1: version 1 was not written"):
        onnx_file.export_onnx(tiny_model("plain"), base, max_relative_diff=-1)
    assert os.listdir(base) == []  # no version, no partial folder


def test_without_onnx_runtime_one_line_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime_files.importlib.util, "find_spec",
                        lambda name, *args: None if name == "onnxruntime" else object())
    expected = r'needs onnxruntime, which is not installed: pip install "keras_vit\[onnx\]"'
    with pytest.raises(ImportError, match=expected):
        onnx_file.export_onnx(tiny_model("plain"), tmp_path / "onnx")
    assert not (tmp_path / "onnx").exists()
