"""What the ONNX and OpenVINO files share (`keras_vit.export.runtime_files`), tested on each runtime alike: a model
of any size in one file at each size, a tower's embedding, a file that disagrees with Keras not written, and a
missing runtime named by its extra. Each runtime's own behaviour: tests/export/test_onnx.py, test_openvino.py."""

import os

import numpy as np
import pytest

import keras_vit
from keras_vit.cli import export as export_cli
from keras_vit.export import onnx_file, openvino_file, runtime_files
from tests.testing import TINY_VIT, needs, save_checkpoint, tiny_model, vit_checkpoint


def run_onnx(path, images: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def run_openvino(path, images: np.ndarray) -> np.ndarray:
    import openvino

    return openvino.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(images)[0]


# format: (export function, report reader, file name, runner, mismatch error, runtime's name in messages, module)
RUNTIMES = {
    "onnx": (onnx_file.export_onnx, onnx_file.read_report, onnx_file.ONNX_FILE, run_onnx, onnx_file.OnnxMismatchError,
             "ONNX Runtime", "onnxruntime"),
    "openvino": (openvino_file.export_openvino, openvino_file.read_report, openvino_file.XML_FILE, run_openvino,
                 openvino_file.OpenVinoMismatchError, "OpenVINO", "openvino"),
}
FORMATS = [pytest.param("onnx"), pytest.param("openvino", marks=needs("openvino", "OpenVINO's runtime, "
                                                                                  "keras_vit[openvino]"))]


def pixels(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 255, shape).astype("float32")


@pytest.mark.parametrize("file_format", FORMATS)
def test_any_size_file_takes_each_size_and_a_tower_its_embedding(tmp_path, file_format):
    """A checkpoint built for any size (`--any-size`): height and width are dynamic in the file, and each size
    gives the Keras model's logits; an image tower (`include_top=False`) gives its pooled embedding."""
    export, read_report, file_name, run, *_ = RUNTIMES[file_format]
    checkpoint = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(TINY_VIT, seed=3))
    base = tmp_path / "any"
    assert export_cli.main(["--weights", checkpoint, "--any-size", "--format", file_format, "--out", str(base)]) == 0
    report = read_report(base / "1")
    assert report["input_shape"] == [None, None, None, 3] and report["any_size_stride"] == TINY_VIT["patch_size"]
    assert report["checked_shapes"][-1] == [4, 48, 40, 3]  # two strides taller, one wider than its 32 x 32
    model = keras_vit.VisionTransformer(weights=checkpoint, input_shape=(None, None, 3), classes=10)
    for shape in ((2, 32, 32, 3), (1, 24, 56, 3)):
        images = pixels(shape, seed=2)
        np.testing.assert_allclose(run(base / "1" / file_name, images), model(images), atol=1e-5, rtol=0)

    tower = keras_vit.VisionTransformer(weights=checkpoint, include_top=False, pooling="token")
    path = export(tower, tmp_path / "tower")
    images = pixels((2, 32, 32, 3), seed=3)
    embedding = run(path / file_name, images)
    assert embedding.shape == (2, TINY_VIT["hidden_dim"])
    np.testing.assert_allclose(embedding, tower(images), atol=1e-5, rtol=0)


@pytest.mark.parametrize("file_format", FORMATS)
def test_a_file_that_disagrees_is_not_written(tmp_path, file_format):
    export, _, _, _, mismatch, runtime, _ = RUNTIMES[file_format]
    base = tmp_path / file_format
    with pytest.raises(mismatch, match=rf"^{runtime}'s outputs are .* over max_relative_diff=-1: version 1 was not "
                                       r"written"):
        export(tiny_model("plain"), base, max_relative_diff=-1)
    assert os.listdir(base) == []  # no version, no partial folder


@pytest.mark.parametrize("file_format", RUNTIMES)  # the runtime need not be installed
def test_without_its_runtime_one_line_names_the_extra(tmp_path, monkeypatch, file_format):
    export, *_, module = RUNTIMES[file_format]
    monkeypatch.setattr(runtime_files.importlib.util, "find_spec",
                        lambda name, *args: None if name == module else object())
    expected = rf'needs {module}, which is not installed: pip install "keras_vit\[{file_format}\]"'
    with pytest.raises(ImportError, match=expected):
        export(tiny_model("plain"), tmp_path / file_format)
    assert not (tmp_path / file_format).exists()
