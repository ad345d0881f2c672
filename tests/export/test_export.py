"""Exports of tiny keras_vit classifiers, each checked against the Keras model.

SavedModels are reloaded as TF Serving would (TF1 loader, tag `serve`) and with
`tf.saved_model.load` in a fresh process that never imports keras_vit.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
from ai_edge_litert.interpreter import Interpreter

import keras
import keras_vit
from keras_vit import image_io
from keras_vit.cli import export as export_cli
from keras_vit.export import data, export_all, model_io, saved_model, serving, tflite
from tests.testing import TINY_CLASSIFIERS, TF1Server, graph_op_types, made_once, tiny_model

SIZE = (32, 32)
CLASS_NAMES = [f"class_{i}" for i in range(10)]


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    """Real photo crops as whole-number pixels (exactly representable in PNG), float32."""
    return np.round(data.photos(SIZE, count=6, seed=1))


@pytest.fixture(scope="module", params=sorted(TINY_CLASSIFIERS))
def exported(request, tmp_path_factory):
    """(model, version directory) for each architecture."""
    model = tiny_model(request.param)
    base = made_once(tmp_path_factory, f"serving_{request.param}",
                     lambda folder: saved_model.export_saved_model(model, folder, version=1, class_names=CLASS_NAMES))
    return model, base / "1"


def keras_outputs(model: keras.Model, images: np.ndarray) -> dict[str, np.ndarray]:
    return {"probabilities": model.predict(images, verbose=0),
            "logits": model_io.logits_model(model).predict(images, verbose=0)}


def encode(images: np.ndarray, encoder) -> np.ndarray:
    return np.array([encoder(image.astype(np.uint8)).numpy() for image in images], dtype=object)


def assert_matches_keras(outputs: dict, expected: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    np.testing.assert_allclose(outputs["logits"], expected["logits"], atol=atol, rtol=0)
    np.testing.assert_allclose(outputs["probabilities"], expected["probabilities"], atol=atol, rtol=0)
    top5 = np.argsort(-expected["probabilities"], axis=-1)[:, :5]
    np.testing.assert_array_equal(outputs["classes"], top5)
    np.testing.assert_allclose(outputs["scores"], np.take_along_axis(expected["probabilities"], top5, -1),
                               atol=atol, rtol=0)
    np.testing.assert_array_equal(outputs["class_names"].astype(str), np.array(CLASS_NAMES)[top5])


SUBPROCESS_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf

    path, inputs_file, outputs_file = sys.argv[1:]
    inputs = np.load(inputs_file, allow_pickle=True)
    loaded = tf.saved_model.load(path)
    results = {}
    for name in ("model_size", "other_size"):
        out = loaded.signatures["serving_default"](images=tf.constant(inputs[name]))
        results.update({f"{name}/{key}": value.numpy() for key, value in out.items()})
    for name in ("png", "jpeg"):
        out = loaded.signatures["serving_bytes"](image_bytes=tf.constant(list(inputs[name])))
        results.update({f"{name}/{key}": value.numpy() for key, value in out.items()})
    assert "keras_vit" not in sys.modules, "loading the SavedModel imported keras_vit"
    np.savez(outputs_file, **results)
""")


@pytest.mark.slow
def test_tf2_load_without_keras_vit_matches_keras(exported, images, tmp_path):
    model, path = exported
    other_size = np.round(data.photos((48, 40), count=3, seed=2))
    inputs_file, outputs_file = tmp_path / "inputs.npz", tmp_path / "outputs.npz"
    np.savez(inputs_file, model_size=images, other_size=other_size, png=encode(images, tf.io.encode_png),
             jpeg=encode(images, lambda image: tf.io.encode_jpeg(image, quality=95)))
    subprocess.run([sys.executable, "-c", SUBPROCESS_SCRIPT, str(path), str(inputs_file), str(outputs_file)],
                   check=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    results = np.load(outputs_file, allow_pickle=True)
    outputs = {name: {key.split("/")[1]: results[key] for key in results.files if key.startswith(name + "/")}
               for name in ("model_size", "other_size", "png", "jpeg")}
    expected = keras_outputs(model, images)
    assert_matches_keras(outputs["model_size"], expected)
    assert_matches_keras(outputs["png"], expected)
    resized = image_io.fit_to_model(other_size, SIZE).numpy()
    assert_matches_keras(outputs["other_size"], keras_outputs(model, resized))
    np.testing.assert_array_equal(outputs["jpeg"]["classes"][:, 0], expected["probabilities"].argmax(-1))


@pytest.mark.slow
def test_tf1_serve_tag_matches_keras_and_survives_corrupt_bytes(exported, images):
    model, path = exported
    server = TF1Server(path)
    assert {"serving_default", serving.BYTES_SIGNATURE} <= set(server.signatures)
    expected = keras_outputs(model, images)
    assert_matches_keras(server.predict("serving_default", {serving.IMAGES_KEY: images}), expected)
    png = encode(images, tf.io.encode_png)
    with pytest.raises(tf.errors.InvalidArgumentError):
        server.predict(serving.BYTES_SIGNATURE, {serving.BYTES_KEY: np.array([png[0], b"\x89PNG not really"],
                                                                              dtype=object)})
    assert_matches_keras(server.predict(serving.BYTES_SIGNATURE, {serving.BYTES_KEY: png}), expected)
    jpeg = encode(images, lambda image: tf.io.encode_jpeg(image, quality=95))
    jpeg_outputs = server.predict(serving.BYTES_SIGNATURE, {serving.BYTES_KEY: jpeg})
    np.testing.assert_array_equal(jpeg_outputs["classes"][:, 0], expected["probabilities"].argmax(-1))


def test_saved_model_holds_only_portable_ops(exported):
    """No oneDNN-only (`_Mkl*`) or XLA ops: the fast CPU kernels stay inside Keras' own steps."""
    from tensorflow.core.protobuf import saved_model_pb2
    _, path = exported
    proto = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes())
    op_types = graph_op_types(proto.meta_graphs[0].graph_def)
    assert "BatchMatMulV2" in op_types or "MatMul" in op_types  # the model's graph is in there
    assert not {t for t in op_types if t.startswith("_") or "Xla" in t}, op_types


def test_saved_model_keeps_each_variable_once_without_walking_the_keras_model(tmp_path, monkeypatch):
    """The SavedModel's `variables` lists hold the model's variables, each once though two views of it are served,
    and its checkpoint their values once (they were stored twice before: a ViT-B/16's variables were 661 MiB);
    `ExportArchive.track` (which traces each Keras model once more, looking for lookup tables) is not called."""
    def refuse(self, resource):
        raise AssertionError("ExportArchive.track was called")

    monkeypatch.setattr(keras.export.ExportArchive, "track", refuse)
    model = tiny_model("plain")
    path = saved_model.export_saved_model(model, tmp_path, signatures=("embed",))
    loaded = tf.saved_model.load(str(path))
    def names(variables) -> list[str]:
        return sorted(variable.name.removesuffix(":0") for variable in variables)

    assert names(loaded.variables) == sorted(variable.path for variable in model.variables)
    assert len(loaded.trainable_variables) == len(model.trainable_variables)
    assert len(loaded.non_trainable_variables) == len(model.non_trainable_variables)
    own = {variable.path: keras.ops.convert_to_numpy(variable) for variable in model.variables}
    for saved in loaded.variables:
        np.testing.assert_array_equal(saved.numpy(), own[saved.name.removesuffix(":0")])
    # ...and the checkpoint stores each value once (a Keras variable and its tf.Variable are two trackables).
    stored = tf.train.load_checkpoint(str(path / "variables" / "variables")).get_variable_to_shape_map()
    assert sum(int(np.prod(shape)) for key, shape in stored.items() if key.startswith("variables/")) == \
        model.count_params() and len(stored) == len(model.variables) + 1  # + the object graph


def test_export_for_eigen_serves_the_same_outputs_through_six_gelu_ops(tmp_path, images):
    """`--serving-kernels eigen`: the tanh GELU as x sigmoid(2u) on every signature, outputs as Keras'."""
    from tensorflow.core.protobuf import saved_model_pb2
    model = tiny_model("plain")
    with pytest.raises(ValueError, match="Unknown serving kernels 'avx2'"):
        saved_model.export_saved_model(model, tmp_path / "bad", serving_kernels="avx2")
    assert not (tmp_path / "bad").exists()
    model_file = tmp_path / "tiny.keras"
    model.save(model_file)
    assert export_cli.main(["--model", str(model_file), "--out", str(tmp_path / "eigen"), "--serving-kernels",
                            "eigen", "--class-names", str(_class_names_file(tmp_path))]) == 0
    path = tmp_path / "eigen" / "1"
    proto = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes())
    op_types = graph_op_types(proto.meta_graphs[0].graph_def)
    assert "Sigmoid" in op_types and "Tanh" not in op_types, op_types
    assert json.loads((path / saved_model.METADATA_FILE).read_text())["serving_kernels"] == "eigen"
    server = TF1Server(path)
    expected = keras_outputs(model, images)
    assert_matches_keras(server.predict("serving_default", {serving.IMAGES_KEY: images}), expected)
    assert_matches_keras(server.predict(serving.BYTES_SIGNATURE, {serving.BYTES_KEY: encode(images, tf.io.encode_png)}),
                         expected)


def _while_loops(path) -> int:
    from tensorflow.core.protobuf import saved_model_pb2
    graph = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes()).meta_graphs[0].graph_def
    return sum(node.op in ("While", "StatelessWhile") for function in graph.library.function
               for node in function.node_def)


def test_eigen_export_runs_image_groups_with_the_same_outputs(tmp_path, images, monkeypatch):
    """The eigen export runs a request's images in groups (`serving.image_group_size`, forced here to 2 by a
    smaller byte budget), one after another: every signature gives the numbers of the export that runs them all
    at once, for requests of 5 images (groups of 2, 2 and 1), of one image and of none."""
    model = tiny_model("plain")
    widest = model_io.widest_activation_per_image(model)
    assert widest == (4 * 4 + 1) * 96  # 17 tokens x mlp_dim, over 3 heads x 17^2 attention weights
    registers, pooled = (tiny_model("plain", **overrides) for overrides in (
        {"num_register_tokens": 4}, {"classifier": "gap"}))
    assert model_io.widest_activation_per_image(registers) == (4 * 4 + 5) * 96  # class token and 4 registers
    assert model_io.widest_activation_per_image(pooled) == 4 * 4 * 96  # patches only
    assert model_io.widest_activation_per_image(tiny_model("hybrid")) == 16 * 16 * 64  # the ResNet root's output
    assert model_io.widest_activation_per_image(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])) is None
    assert serving.image_group_size(model, serving.DEFAULT_MAX_BATCH) is None  # a tiny model's request fits
    signatures = ("embed", "features", "explain")
    bytes_request = {serving.BYTES_KEY: encode(images[:5], tf.io.encode_png)}
    whole = saved_model.export_saved_model(model, tmp_path / "whole", serving_kernels="eigen", signatures=signatures,
                                           class_names=CLASS_NAMES)
    monkeypatch.setattr(serving, "EIGEN_GROUP_BYTES", 2 * 4 * widest + 3)
    assert serving.image_group_size(model, serving.DEFAULT_MAX_BATCH) == 2
    assert serving.image_group_size(model, max_batch=2) is None  # no group smaller than the largest request
    assert serving.image_group_size(model, serving.DEFAULT_MAX_BATCH, "onednn") is None
    grouped = saved_model.export_saved_model(model, tmp_path / "grouped", serving_kernels="eigen",
                                             signatures=signatures, class_names=CLASS_NAMES)
    # One loop per signature (5) in the grouped export; each takes encoded images through a map_fn. oneDNN's export
    # never groups: `serving_archive` asks `image_group_size` (None for "onednn", above).
    assert _while_loops(grouped) - _while_loops(whole) == 5
    assert [saved_model.read_metadata(path)["image_group"] for path in (whole, grouped)] == [None, 2]
    expected, whole, grouped = keras_outputs(model, images[:5]), TF1Server(whole), TF1Server(grouped)
    for count in (5, 1, 0):
        request = {serving.IMAGES_KEY: images[:count]}
        assert_matches_keras(grouped.predict("serving_default", request),
                             {name: value[:count] for name, value in expected.items()})
    assert_matches_keras(grouped.predict(serving.BYTES_SIGNATURE, bytes_request), expected)
    for signature in signatures:
        outputs, reference = grouped.predict(signature, bytes_request), whole.predict(signature, bytes_request)
        assert sorted(outputs) == sorted(reference)
        for name, value in reference.items():
            np.testing.assert_allclose(outputs[name], value, atol=1e-5, rtol=0, err_msg=f"{signature}/{name}")
            assert value.shape[0] == 5


def _class_names_file(folder) -> str:
    path = folder / "class_names.txt"
    path.write_text("\n".join(CLASS_NAMES) + "\n")
    return str(path)


def test_corrupt_bytes_then_good_request_in_tf2_loaded_model(exported, images):
    _, path = exported
    serve_bytes = tf.saved_model.load(str(path)).signatures[serving.BYTES_SIGNATURE]
    with pytest.raises(tf.errors.InvalidArgumentError):
        serve_bytes(image_bytes=tf.constant([b"definitely not an image"]))
    good = serve_bytes(image_bytes=tf.constant(list(encode(images[:2], tf.io.encode_png))))
    assert good["probabilities"].shape == (2, 10)


def read_warmup_requests(saved_model_dir) -> list:
    """The PredictRequests of a SavedModel's warmup file, parsed with TF Serving's own protos."""
    from tensorflow_serving.apis import prediction_log_pb2

    path = os.path.join(saved_model_dir, saved_model.WARMUP_FILE)
    return [prediction_log_pb2.PredictionLog.FromString(record.numpy()).predict_log.request
            for record in tf.data.TFRecordDataset(path)]


def test_prediction_log_is_the_bytes_tf_serving_protos_write():
    from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

    for signature, key, value in saved_model.warmup_requests((40, 24), "vit"):
        request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name="vit", signature_name=signature))
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
        expected = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
        assert saved_model.prediction_log("vit", signature, key, value) == expected.SerializeToString()
    long_name = "m" * 300  # A length over 127 takes a two-byte varint.
    request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name=long_name, signature_name="s"))
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.zeros((1, 70, 3), np.float32)))
    expected = prediction_log_pb2.PredictionLog(predict_log=prediction_log_pb2.PredictLog(request=request))
    assert saved_model.prediction_log(long_name, "s", "x", np.zeros((1, 70, 3), np.float32)) == \
        expected.SerializeToString()


def test_warmup_requests_replay(exported):
    _, path = exported
    requests = read_warmup_requests(path)
    assert sorted(r.model_spec.signature_name for r in requests) == ["serving_bytes", "serving_bytes",
                                                                     "serving_default"]
    server = TF1Server(path)
    for request in requests:
        inputs = {key: tf.make_ndarray(proto) for key, proto in request.inputs.items()}
        outputs = server.predict(request.model_spec.signature_name, inputs)
        assert outputs["probabilities"].shape == (1, 10)
        np.testing.assert_allclose(outputs["probabilities"].sum(-1), 1.0, atol=1e-5)


@pytest.mark.slow
def test_crash_mid_export_leaves_no_version_and_keeps_the_old_one(tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing")

    monkeypatch.setattr(saved_model, "write_warmup_requests", crash)
    model = tiny_model("plain")
    with pytest.raises(RuntimeError, match="simulated crash"):
        saved_model.export_saved_model(model, tmp_path, version=3)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "marker").write_text("old")
    with pytest.raises(RuntimeError, match="simulated crash"):
        saved_model.export_saved_model(model, tmp_path, version=3, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["3"] and (tmp_path / "3" / "marker").exists()


@pytest.mark.slow
def test_cli_versions_never_overwrite_unless_asked(tmp_path, capsys):
    model_file = tmp_path / "tiny.keras"
    tiny_model("plain").save(model_file)
    base = tmp_path / "serving"
    assert export_cli.main(["--model", str(model_file), "--out", str(base)]) == 0
    assert sorted(p.name for p in base.iterdir()) == ["1"]
    marker = base / "1" / "marker"
    marker.write_text("old")
    with pytest.raises(SystemExit) as refused:
        export_cli.main(["--model", str(model_file), "--out", str(base), "--version", "1"])
    error = capsys.readouterr().err
    assert refused.value.code == 1 and error.startswith("keras-vit-export: error: Version directory "), error
    assert "already exists" in error, error
    assert marker.exists()
    export_cli.main(["--model", str(model_file), "--out", str(base), "--version", "1", "--overwrite"])
    assert sorted(p.name for p in base.iterdir()) == ["1"] and not marker.exists()
    assert saved_model.next_version(base) == 2


def test_rejects_models_without_logits():
    with pytest.raises(ValueError, match="softmax"):
        serving.serving_archive(tiny_model("plain", classifier_activation="sigmoid"))
    headless = tiny_model("plain", include_top=False, pooling="token")
    with pytest.raises(ValueError, match="has no classification `head`"):
        model_io.logits_model(headless)  # the TFLite classifier export
    with pytest.raises(ValueError, match="class_names need a classifier"):
        serving.serving_archive(headless, class_names=["a"])  # a tower serves its embedding, without names


def test_model_without_preprocessing_takes_pixels(images):
    raw = tiny_model("plain", include_preprocessing=False)
    pixels = model_io.pixel_logits_model(raw).predict(images, verbose=0)
    np.testing.assert_allclose(pixels, model_io.logits_model(raw).predict(images / 127.5 - 1, verbose=0),
                               atol=1e-5)


def trained_digits_model() -> keras.Model:
    """The tiny plain ViT trained briefly on sklearn digits (about 95% training accuracy), so top-1 means something."""
    from sklearn.datasets import load_digits

    keras.utils.set_random_seed(0)
    model = keras_vit.VisionTransformer(**TINY_CLASSIFIERS["plain"], name="tiny_digits")
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy")
    model.fit(data.digits(SIZE), load_digits().target, epochs=12, batch_size=64, verbose=0)
    return model


def check_tflite_report(report: dict, out_dir) -> dict[str, dict]:
    """Checks what every report must satisfy; returns its results by mode."""
    results = {r["mode"]: r for r in report["modes"]}
    assert sorted(results) == sorted(tflite.ALL_MODES)
    for mode, result in results.items():
        assert result["non_builtin_ops"] == [], mode
        assert (out_dir / result["file"]).stat().st_size == result["size_bytes"]
        assert sum(result["ops_outside_delegate"].values()) < result["ops_total"], mode  # XNNPACK runs most
    assert not [path for path in out_dir.iterdir() if path.name.endswith(".partial")]
    assert results["float32"]["max_abs_diff"] <= 1e-4
    assert results["float16"]["max_abs_diff"] <= 1e-2
    assert results["float32"]["passed"] and results["float16"]["passed"]
    assert json.loads((out_dir / "report.json").read_text()) == report
    assert "| int8 |" in (out_dir / "report.md").read_text()
    return results


@pytest.mark.slow
def test_tflite_float32_file_matches_keras(tmp_path, images):
    model = tiny_model("plain")
    report = tflite.export_tflite(model, tmp_path, images=images, modes=("float32",), calibration_count=0)
    (result,) = report["modes"]
    assert report["images"] == {"source": "given", "yours": True}
    latency = result["latency_ms_median_by_threads"]
    assert sorted(latency) == ["1", "2"] and all(value > 0 for value in latency.values())
    assert latency["1"] == result["latency_ms_median"]
    assert "| latency, 1 thread (ms) | latency, 2 threads (ms) |" in (tmp_path / "report.md").read_text()
    assert "embedded" not in (tmp_path / "report.md").read_text()
    assert result["non_builtin_ops"] == [] and result["images"] == len(images)
    assert result["max_abs_diff"] <= 1e-4 and result["passed"]
    interpreter = Interpreter(model_path=str(tmp_path / result["file"]))
    interpreter.allocate_tensors()
    (given,), (output,) = interpreter.get_input_details(), interpreter.get_output_details()
    outputs = []
    for image in images:
        interpreter.set_tensor(given["index"], image[np.newaxis].astype("float32"))
        interpreter.invoke()
        outputs.append(interpreter.get_tensor(output["index"])[0])
    np.testing.assert_allclose(np.stack(outputs), model.predict(images, verbose=0), atol=1e-4)


@pytest.mark.slow
def test_tflite_trained_model_meets_every_threshold(tmp_path):
    # Full int8 of this 2-block model disagrees with Keras on 4 to 6 of the 400 held-out digits depending on how the
    # graph splits q, k and v, and the trained model itself depends on the thread count (reduction order): trained
    # with one intra-op thread, its int8 top-1 was 1.25 points under Keras' (92.25% vs 93.5%). Both full-int8 modes
    # are held to 2 points of Keras' top-1, the limit given here; the other int8 modes to the default limit.
    report = tflite.export_tflite(trained_digits_model(), tmp_path, dataset="digits", max_top1_drop=2.0)
    results = check_tflite_report(report, tmp_path)
    assert report["images"] == {"source": "digits", "yours": False}
    markdown = (tmp_path / "report.md").read_text()
    assert "These checks ran on the embedded `digits` images, not on images of your model's domain" in markdown
    assert results["int8"]["reference_classes_predicted"] == 10  # Agreement is not trivial.
    for mode in ("int8", "int8_cpu"):
        assert results[mode]["top1_accuracy"] >= report["keras_top1_accuracy"] - 0.02, mode
        assert results[mode]["top1_accuracy"] > 0.8, mode
    for mode in ("dynamic_int8", "mixed_int8"):
        assert results[mode]["top1_drop"] <= tflite.DEFAULT_MAX_TOP1_DROP, mode
    assert report["keras_top1_accuracy"] > 0.8
    assert results["mixed_int8"]["top1_accuracy"] > 0.8
    assert results["mixed_int8"]["ops_outside_delegate"] == results["float32"]["ops_outside_delegate"]
    assert all(result["passed"] for result in results.values())


@pytest.mark.slow
def test_export_all_hybrid_builtin_only_and_float_thresholds(tmp_path):
    # Random weights: the int8 agreement is reported, not judged (a limit of 100 points); 40 images check the float
    # files' differences and that every mode runs.
    report = export_all(tiny_model("hybrid"), tmp_path, dataset="photos", max_top1_drop=100, serving_kernels="eigen",
                        calibration_count=20, evaluation_count=40)
    assert report["saved_model"] == str(tmp_path / "saved_model" / "1")
    assert saved_model.read_metadata(report["saved_model"])["serving_kernels"] == "eigen"
    assert len(read_warmup_requests(report["saved_model"])) == 3
    assert report["tflite_markdown"] == (tmp_path / "tflite" / "report.md").read_text()
    results = check_tflite_report(report["tflite"], tmp_path / "tflite")
    assert 0.0 <= results["int8"]["top1_agreement"] <= 1.0  # Random weights: reported, not judged.
