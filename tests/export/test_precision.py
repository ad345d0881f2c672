"""bfloat16 SavedModels (`keras-vit-export --precision`): the model rebuilt in bfloat16, checked against float32
before anything is written, served with float32 inputs and outputs."""

import os

import numpy as np
import pytest
import tensorflow as tf

import keras
from keras_vit.cli import export as export_cli
from keras_vit.export import data, model_io, precision, saved_model
from tests.testing import TF1Server, tiny_model

SIZE = (32, 32)


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    return np.round(data.photos(SIZE, count=16, seed=2))


@pytest.mark.parametrize("flags, expected", [
    ({"avx512_bf16", "avx512f"}, ("bfloat16", "auto: this CPU has AVX512-BF16")),
    ({"amx_bf16", "amx_tile", "avx512_bf16"}, ("bfloat16", "auto: this CPU has AMX-BF16 and AVX512-BF16")),
    ({"avx2", "fma", "avx512f"}, ("float32", "auto: this CPU has no native bfloat16 (no AVX512-BF16 or AMX)")),
    (set(), ("float32", "auto: this CPU has no native bfloat16 (no AVX512-BF16 or AMX)")),
])
def test_auto_is_bfloat16_only_where_the_cpu_computes_it_natively(monkeypatch, flags, expected):
    monkeypatch.setattr(precision.kernels, "cpu_flags", lambda: frozenset(flags))
    assert precision.resolve("auto") == expected
    assert precision.resolve("float32") == ("float32", "asked for")
    assert precision.resolve("bfloat16") == ("bfloat16", "asked for")
    with pytest.raises(ValueError, match=r"Unknown precision 'float16'. Expected one of float32, bfloat16, auto."):
        precision.resolve("float16")


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
def test_the_bfloat16_model_computes_in_bfloat16_but_its_pixels_and_outputs(kind, photos):
    model = tiny_model(kind, seed=3, include_preprocessing=True)
    twin = precision.bfloat16_model(model)
    dtypes = {layer.name: (layer.compute_dtype, {weight.dtype for weight in layer.weights}) for layer in twin.layers}
    assert dtypes["preprocessing"][0] == "float32"
    assert dtypes["head"] == ("float32", {"float32"}) and dtypes["predictions"][0] == "float32"
    assert dtypes["encoderblock_0"] == ("bfloat16", {"bfloat16"})
    assert dtypes["embedding"] == ("bfloat16", {"bfloat16"})
    assert twin.vit_config == model.vit_config and twin.preprocessing_config == model.preprocessing_config
    # Its weights are the float32 model's, rounded to bfloat16 (8 significant bits: within 2^-8 relative).
    for ours, theirs in zip(twin.weights, model.weights):
        theirs = keras.ops.convert_to_numpy(theirs)
        np.testing.assert_allclose(keras.ops.convert_to_numpy(keras.ops.cast(ours, "float32")), theirs,
                                   rtol=2 ** -8, atol=0)
    expected, got = model(photos, training=False), twin(photos, training=False)
    assert got.dtype == "float32"
    difference = np.abs(np.asarray(got) - np.asarray(expected)).max() / np.abs(np.asarray(expected)).max()
    assert 1e-5 < difference < 0.05, difference  # bfloat16, not float32 rounding, and close
    report = precision.check(model, twin, photos)  # with the pixel normalization of each, as served
    assert report["images"] == 16 and report["top1_agreement"] >= 14 / 16, report
    assert report["refused"] == (report["top1_drop"] > precision.DEFAULT_MAX_TOP1_DROP)
    assert report["min_cosine"] > 0.999 and 1e-5 < report["max_relative_diff"] < 0.05, report


def test_cli_writes_a_bfloat16_saved_model_that_serves_float32_as_the_float32_one(tmp_path, photos, capsys):
    model = tiny_model("plain", seed=4)
    model.save(tmp_path / "tiny.keras")
    for name in ("float32", "bfloat16"):
        assert export_cli.main(["--model", str(tmp_path / "tiny.keras"), "--out", str(tmp_path / name),
                                "--precision", name, "--signatures", "embed"]) == 0
    printed = capsys.readouterr().out
    assert "float32, asked for)." in printed
    assert "bfloat16, asked for; against float32 on 128 photographs: top-1 agreement" in printed
    metadata = saved_model.read_metadata(tmp_path / "bfloat16" / "1")
    assert (metadata["precision"], metadata["precision_chosen"]) == ("bfloat16", "asked for")
    assert metadata["precision_check"]["images"] == precision.CHECK_PHOTOS and not metadata["precision_check"][
        "refused"]
    assert saved_model.read_metadata(tmp_path / "float32" / "1")["precision_check"] is None

    served = {name: TF1Server(tmp_path / name / "1") for name in ("float32", "bfloat16")}
    outputs = {name: server.predict("serving_default", {"images": photos}) for name, server in served.items()}
    embeddings = {name: server.predict("embed", {"image_bytes": np.array([
        tf.io.encode_png(photo.astype(np.uint8)).numpy() for photo in photos[:4]])})["embedding"]
        for name, server in served.items()}
    for key in ("logits", "probabilities", "scores"):
        assert outputs["bfloat16"][key].dtype == np.float32
    assert embeddings["bfloat16"].dtype == np.float32
    logits = {name: values["logits"] for name, values in outputs.items()}
    np.testing.assert_allclose(logits["float32"], model_io.logits_model(model).predict(photos, verbose=0),
                               atol=1e-5, rtol=0)
    difference = np.abs(logits["bfloat16"] - logits["float32"]).max() / np.abs(logits["float32"]).max()
    assert 1e-5 < difference < 0.05, difference
    cosine = np.sum(embeddings["bfloat16"] * embeddings["float32"], -1) / (
        np.linalg.norm(embeddings["bfloat16"], axis=-1) * np.linalg.norm(embeddings["float32"], axis=-1))
    assert cosine.min() > 0.999, cosine
    # The variables are stored in bfloat16: the SavedModel's variables are about half the float32 one's.
    sizes = {name: sum(path.stat().st_size for path in (tmp_path / name / "1" / "variables").iterdir())
             for name in ("float32", "bfloat16")}
    assert sizes["bfloat16"] < 0.6 * sizes["float32"], sizes


def test_only_a_functional_model_is_rebuilt_in_bfloat16():
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    for model in (Subclassed(), "model.keras"):
        with pytest.raises(ValueError, match=r"Expected a functional keras.Model \(a keras_vit builder's model\)"):
            precision.bfloat16_model(model)


def test_a_bfloat16_model_that_disagrees_with_float32_is_refused_and_nothing_is_written(tmp_path, photos,
                                                                                           monkeypatch):
    model = tiny_model("plain", seed=5)
    swapped = tiny_model("plain", seed=6)  # another model: its top-1 differs on most photographs
    monkeypatch.setattr(precision, "bfloat16_model", lambda model: swapped)
    with pytest.raises(precision.Top1DropError, match=r"The bfloat16 model's top-1 disagrees with float32 on "
                       r"[0-9.]+ points of 16 photographs, over max_top1_drop=1, so nothing was written: export in "
                       r"float32 \(--precision float32\), or allow more \(--max-top1-drop\)"):
        saved_model.export_saved_model(model, tmp_path / "served", precision="bfloat16", check_images=photos)
    assert not (tmp_path / "served").exists()
    with pytest.raises(ValueError, match=r"Expected max_top1_drop >= 0 \(points of top-1\). Received -1"):
        precision.check(model, swapped, photos, max_top1_drop=-1)


def test_cli_refuses_precision_where_it_does_not_apply(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        export_cli.main(["--variant", "Ti/16", "--out", str(tmp_path), "--format", "onnx", "--precision",
                         "bfloat16"])
    assert stop.value.code == 2
    assert ("--precision bfloat16 applies to --format saved_model; --format onnx writes float32, int8 or int8_static."
            in capsys.readouterr().err)
    with pytest.raises(SystemExit) as stop:
        export_cli.main(["--variant", "Ti/16", "--out", str(tmp_path), "--precision", "int8"])
    assert stop.value.code == 2
    assert ("--precision int8 applies to --format onnx and --format openvino; --format saved_model writes float32, "
            "bfloat16 or auto."
            in capsys.readouterr().err)
    assert not os.listdir(tmp_path)
    from keras_vit.export import onnx_file, openvino_file

    assert export_cli.FORMAT_PRECISIONS == {"saved_model": precision.PRECISIONS, "onnx": onnx_file.PRECISIONS,
                                            "openvino": openvino_file.PRECISIONS}
    assert sorted(export_cli.PRECISIONS) == sorted(set(sum(export_cli.FORMAT_PRECISIONS.values(), ())))
    assert export_cli.DEFAULT_MAX_TOP1_DROP == precision.DEFAULT_MAX_TOP1_DROP
