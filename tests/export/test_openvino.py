"""OpenVINO files: `keras-vit-export --format openvino` writes `OUT/<version>/model.xml` and `model.bin` with the
preprocessing inside, a dynamic batch (and height and width for a model of any size), checked with OpenVINO's CPU
plugin in float32 against Keras before it is written, whole or not at all; the CPU's default precision (bfloat16
where the CPU has it) is measured and reported beside it."""

import os

import numpy as np
import pytest

import keras_vit
from keras_vit.cli import export as export_cli
from keras_vit.export import openvino_file, runtime_files
from tests.testing import TINY_VIT, needs, save_checkpoint, tiny_model, vit_checkpoint

pytestmark = needs("openvino", "OpenVINO's runtime, keras_vit[openvino]")


def pixels(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, shape).astype("float32")


def run(path, images: np.ndarray, hint: str = "f32") -> np.ndarray:
    import openvino

    compiled = openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": hint})
    return compiled(images)[0]


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_cli_writes_versions_checked_against_keras_and_never_overwrites(tmp_path, capsys, kind):
    model = tiny_model(kind)
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    base = tmp_path / "openvino"
    assert export_cli.main(["--model", str(model_file), "--format", "openvino", "--out", str(base)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"Wrote OpenVINO file {base / '1' / 'model.xml'}: input image [None, 32, 32, 3]; "
                              "OpenVINO "), printed
    assert sorted(os.listdir(base / "1")) == ["keras_vit_openvino.json", "model.bin", "model.xml"]
    report = openvino_file.read_report(base / "1")
    assert report["input_shape"] == [None, 32, 32, 3] and report["image_size"] == [32, 32]
    assert report["checked_shapes"] == [[4, 32, 32, 3], [1, 32, 32, 3]] and report["any_size_stride"] is None
    assert report["max_relative_diff"] <= runtime_files.MAX_RELATIVE_DIFF and report["latency_ms_median_batch_1"] > 0
    assert report["cpu_default_precision"] in ("f32", "bf16", "f16") and report["cpu_default_max_relative_diff"] < 0.05
    assert report["cpu_default_latency_ms_median_batch_1"] > 0
    images = pixels((3, 32, 32, 3), seed=1)  # [0, 255] pixels: the preprocessing is in the file
    expected = np.asarray(model(images))
    np.testing.assert_allclose(run(base / "1" / "model.xml", images), expected, atol=1e-5, rtol=0)
    if "avx512_bf16" in keras_vit.kernels.cpu_flags() or "amx_bf16" in keras_vit.kernels.cpu_flags():
        assert report["cpu_default_precision"] == "bf16"  # OpenVINO's default on such CPUs: not float32
        assert report["cpu_default_max_relative_diff"] > 1e-5

    before = (base / "1" / "model.xml").read_bytes()
    with pytest.raises(SystemExit) as refused:
        export_cli.main(["--model", str(model_file), "--format", "openvino", "--out", str(base), "--version", "1"])
    error = capsys.readouterr().err
    assert refused.value.code == 1 and error.startswith("keras-vit-export: error: Version directory "), error
    assert (base / "1" / "model.xml").read_bytes() == before
    with pytest.raises(SystemExit) as refused:
        export_cli.main(["--model", str(model_file), "--format", "openvino", "--out", str(base), "--precision",
                         "bfloat16"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and "--precision bfloat16 applies to SavedModels; --format openvino" in error
    assert sorted(os.listdir(base)) == ["1"]


def test_any_size_file_takes_each_size_and_a_tower_its_embedding(tmp_path):
    checkpoint = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(TINY_VIT, seed=3))
    base = tmp_path / "any"
    assert export_cli.main(["--weights", checkpoint, "--any-size", "--format", "openvino", "--out", str(base)]) == 0
    report = openvino_file.read_report(base / "1")
    assert report["input_shape"] == [None, None, None, 3] and report["any_size_stride"] == TINY_VIT["patch_size"]
    assert report["checked_shapes"][-1] == [4, 48, 40, 3]
    model = keras_vit.VisionTransformer(weights=checkpoint, input_shape=(None, None, 3), classes=10)
    for shape in ((2, 32, 32, 3), (1, 24, 56, 3)):
        images = pixels(shape, seed=2)
        np.testing.assert_allclose(run(base / "1" / "model.xml", images), model(images), atol=1e-5, rtol=0)

    tower = keras_vit.VisionTransformer(weights=checkpoint, include_top=False, pooling="token")
    path = openvino_file.export_openvino(tower, tmp_path / "tower")
    images = pixels((2, 32, 32, 3), seed=3)
    embedding = run(path / "model.xml", images)
    assert embedding.shape == (2, TINY_VIT["hidden_dim"])
    np.testing.assert_allclose(embedding, tower(images), atol=1e-5, rtol=0)


def test_a_file_that_disagrees_is_not_written(tmp_path):
    base = tmp_path / "openvino"
    with pytest.raises(openvino_file.OpenVinoMismatchError,
                       match=r"OpenVINO's outputs are .* over max_relative_diff=-1: version 1 was not written"):
        openvino_file.export_openvino(tiny_model("plain"), base, max_relative_diff=-1)
    assert os.listdir(base) == []  # no version, no partial folder


def test_without_openvino_one_line_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime_files.importlib.util, "find_spec",
                        lambda name, *args: None if name == "openvino" else object())
    expected = r'needs openvino, which is not installed: pip install "keras_vit\[openvino\]"'
    with pytest.raises(ImportError, match=expected):
        openvino_file.export_openvino(tiny_model("plain"), tmp_path / "openvino")
    assert not (tmp_path / "openvino").exists()
