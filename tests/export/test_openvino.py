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


def test_int8_file_is_nncfs_quantization_checked_on_photographs(tmp_path, capsys):
    """--precision int8: the float32 file is checked against Keras, then quantized by NNCF (int8 matmuls, calibrated
    on photo crops) and checked on other crops of real photographs; the report's top-1 agreement is the file's own,
    recomputed here."""
    import openvino

    from keras_vit.export import data, precision

    model = tiny_model("plain")
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    base = tmp_path / "openvino"
    assert export_cli.main(["--model", str(model_file), "--format", "openvino", "--precision", "int8",
                            "--out", str(base)]) == 0
    printed = capsys.readouterr().out
    report = openvino_file.read_report(base / "1")
    assert (report["precision"], report["quantization"]) == ("int8", openvino_file.INT8_METHOD)
    assert report["float32_check"]["max_relative_diff"] <= runtime_files.MAX_RELATIVE_DIFF
    assert sorted(os.listdir(base / "1")) == ["keras_vit_openvino.json", "model.bin", "model.xml"]
    ops = [op.get_type_name() for op in openvino.Core().read_model(str(base / "1" / "model.xml")).get_ops()]
    assert ops.count("FakeQuantize") >= 4  # the int8 points NNCF inserted before the matmuls
    check = report["int8_check"]
    photos = data.photos((32, 32), count=precision.CHECK_PHOTOS)
    ours = np.concatenate([run(base / "1" / "model.xml", photos[start:start + 16])
                           for start in range(0, len(photos), 16)])
    expected = np.asarray(model(photos))
    assert check["images"] == precision.CHECK_PHOTOS and not check["refused"]
    assert check["top1_agreement"] == np.mean(ours.argmax(-1) == expected.argmax(-1)) >= 0.9
    assert 0 < np.abs(ours - expected).max() < 0.1  # quantized: close, not float32-equal
    assert (f"in float32; int8 (NNCF) against Keras on {precision.CHECK_PHOTOS} photographs: top-1 agreement "
            f"{100 * check['top1_agreement']:.1f}%") in printed, printed


def test_an_int8_file_that_loses_top1_is_not_written(tmp_path, monkeypatch):
    """An int8 file whose top-1 disagrees with Keras past --max-top1-drop (here: another model's file stands for a
    quantization gone wrong) is refused, nothing written."""
    import shutil

    from keras_vit.export import precision

    other = openvino_file.export_openvino(tiny_model("plain", seed=7), tmp_path / "other")

    def other_model(core, path, model):  # replaced, not rewritten, as quantize_in_place does (a mapped file)
        for name in ("model.xml", "model.bin"):
            shutil.copyfile(other / name, os.path.join(os.path.dirname(path), "new_" + name))
            os.replace(os.path.join(os.path.dirname(path), "new_" + name), os.path.join(os.path.dirname(path), name))

    monkeypatch.setattr(openvino_file, "quantize_in_place", other_model)
    base = tmp_path / "openvino"
    with pytest.raises(precision.Top1DropError, match=r"^The int8 OpenVINO file's top-1 disagrees with float32 on "
                       r"[0-9.]+ points of 128 photographs, over max_top1_drop=1, so nothing was written"):
        openvino_file.export_openvino(tiny_model("plain"), base, precision="int8")
    assert os.listdir(base) == []
    with pytest.raises(ValueError, match=r"Unknown OpenVINO precision 'int4'. Expected one of float32, int8."):
        openvino_file.export_openvino(tiny_model("plain"), base, precision="int4")
