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
from tests.testing import needs, tiny_model

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
    assert refused.value.code == 2, error
    assert "--precision bfloat16 applies to --format saved_model; --format openvino writes float32 or int8." in error
    assert sorted(os.listdir(base)) == ["1"]
