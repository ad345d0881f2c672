"""The served SigLIP 2 NaFlex SavedModel (`keras-vit-export --weights <NaFlex folder> --max-num-patches N`,
export/naflex_serving.py): from the JPEG bytes of tests/data/families/hf_siglip2_naflex_p8's five pictures (1:3 to
16:5) through TF1's loader, as TF Serving loads it, against transformers' `pooler_output` of PIL's pixels."""

import os

import numpy as np
import pytest
import tensorflow as tf

from keras_vit import image_io, naflex
from keras_vit.cli import export as export_cli
from keras_vit.export import naflex_serving, saved_model
from tests import images as odd
from tests.data.make_family_files import FOLDER, NAFLEX, NAFLEX_BUDGETS, NAFLEX_SHAPES, TIMM_NAFLEX
from tests.testing import TF1Server

CASE = os.path.join(FOLDER, NAFLEX)
PATCH = 8
MAX_BATCH = 5


def jpeg(index: int) -> bytes:
    with open(os.path.join(CASE, f"naflex_{index}.jpg"), "rb") as file:
        return file.read()


def one_minus_cos(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(1.0 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def reference() -> dict:
    with np.load(os.path.join(CASE, "reference.npz")) as arrays:
        return dict(arrays)


class Exports(dict):
    """budget -> (TF1Server, version folder), each exported (about 11 s on 2 cores) when first asked for:
    `keras-vit-export --max-num-patches <budget> --signatures features`, budget 37 with --l2-normalize."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, budget: int):
        out = self.folder / str(budget)
        flags = ["--l2-normalize"] if budget == 37 else []
        assert export_cli.main(["--weights", CASE, "--out", str(out), "--max-num-patches", str(budget),
                                "--max-batch", str(MAX_BATCH), "--signatures", "features", *flags]) == 0
        self[budget] = (TF1Server(out / "1"), out / "1")
        return self[budget]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Exports:
    return Exports(tmp_path_factory.mktemp("naflex"))


def request(*indices: int) -> dict:
    return {"image_bytes": np.array([jpeg(index) for index in indices], dtype=object)}


def test_size_rule_equals_the_numpy_rule_on_many_sizes():
    """`naflex_image_size` in graph ops (float64 binary search, elementwise) = `keras_vit.naflex.naflex_image_size`
    on 3,000 random (height, width, budget) triples and the edge cases, at patch 8 and 16."""
    rng = np.random.default_rng(0)
    heights = np.concatenate([rng.integers(1, 6000, 2900), [1, 1, 8, 16, 7, 4000, 1, 255, 256, 16 * 37, 8, 9]])
    widths = np.concatenate([rng.integers(1, 6000, 2900), [1, 4000, 8, 16, 9, 1, 1, 256, 255, 16 * 5, 8, 9]])
    budgets = np.concatenate([rng.choice([1, 2, 3, 16, 37, 64, 100, 256, 729, 1024, 4096], 2900),
                              [1, 256, 1, 4, 64, 37, 256, 256, 256, 37, 2, 2]])
    for patch in (8, 16):
        graph = tf.function(lambda h, w, b: image_io.naflex_image_size(h, w, patch, b))
        ours = graph(tf.constant(heights), tf.constant(widths), tf.constant(budgets)).numpy()
        expected = np.array([naflex.naflex_image_size(int(h), int(w), patch, int(b))
                             for h, w, b in zip(heights, widths, budgets)])
        mismatched = np.flatnonzero((ours != expected).any(axis=1))
        assert mismatched.size == 0, [(heights[i], widths[i], budgets[i], ours[i], expected[i])
                                      for i in mismatched[:5]]
        assert ((expected[:, 0] // patch) * (expected[:, 1] // patch) <= budgets).all()


@pytest.mark.parametrize("budget", NAFLEX_BUDGETS)
def test_in_graph_pixels_are_pils_within_one_level(reference, budget):
    """Decoded, resized (aspect ratio kept) and patchified in the graph: the grids and masks of transformers'
    processor exactly, its PIL pixels within one level."""
    inputs = tf.function(lambda data: naflex_serving.decode(data, PATCH, budget))(request(*range(5))["image_bytes"])
    for index in range(len(NAFLEX_SHAPES)):
        suffix = f"_{index}_{budget}"
        np.testing.assert_array_equal(inputs["spatial_shapes"][index], reference["spatial_shapes" + suffix])
        np.testing.assert_array_equal(inputs["patch_mask"][index], reference["pixel_attention_mask" + suffix])
        difference = np.abs(inputs["patches"][index].numpy() - reference["raw" + suffix])
        # One level, and float32's rounding past it (PIL rounds its 22-bit fixed-point sums: 1.0000076 measured).
        assert difference.max() <= 1.0 + 1e-4, (suffix, difference.max())


@pytest.mark.parametrize("budget", NAFLEX_BUDGETS)
def test_served_embedding_matches_transformers_from_jpeg_bytes(served, reference, budget):
    """Each picture alone through `embed` and `serving_default`: 1 - cos against transformers' `pooler_output` (of
    PIL's pixels) within 1e-6 (measured: 8.7e-8 at worst), the image's tokens (`last_hidden_state`) within 1e-5
    (3.8e-6), the `features` grids the processor's. The issue asks 1e-4, but this random tower's embedding moves
    little with its input: another picture's is 1e-4 to 1.6e-3 away, a squashed one's (aspect ratio not kept)
    2e-6 to 1.1e-4."""
    server, _ = served[budget]
    for index in range(len(NAFLEX_SHAPES)):
        expected = reference[f"pooler_output_{index}_{budget}"]
        for name in ("embed", "serving_default"):
            embedding = server.predict(name, request(index))["embedding"]
            assert embedding.shape == (1, expected.shape[-1])
            assert one_minus_cos(embedding[0], expected) <= 1e-6, (name, index)
        grids = server.predict("features", request(index))
        valid = int(reference[f"pixel_attention_mask_{index}_{budget}"].sum())
        tokens = reference[f"last_hidden_state_{index}_{budget}"][:valid]
        assert one_minus_cos(grids["tokens"][0, :valid], tokens) <= 1e-5, index
        np.testing.assert_array_equal(grids["spatial_shapes"][0], reference[f"spatial_shapes_{index}_{budget}"])
        np.testing.assert_array_equal(grids["patch_mask"][0], reference[f"pixel_attention_mask_{index}_{budget}"])
        assert grids["tokens"].shape == (1, budget, expected.shape[-1])
    if budget == 37:  # exported with --l2-normalize
        np.testing.assert_allclose(np.linalg.norm(server.predict("embed", request(0, 3))["embedding"], axis=1), 1.0,
                                   atol=1e-6)


@pytest.mark.parametrize("budget", [64, 256])
def test_a_batch_of_all_five_equals_each_alone(served, budget):
    """Five aspect ratios in one request: each embedding and each image's tokens as that image alone."""
    server, _ = served[budget]
    together = server.predict("embed", request(*range(5)))["embedding"]
    tokens = server.predict("features", request(*range(5)))
    for index in range(len(NAFLEX_SHAPES)):
        assert one_minus_cos(together[index], server.predict("embed", request(index))["embedding"][0]) <= 1e-6
        alone = server.predict("features", request(index))
        valid = int(alone["patch_mask"].sum())
        assert one_minus_cos(tokens["tokens"][index, :valid], alone["tokens"][0, :valid]) <= 1e-6


def test_bad_requests_fail_as_on_serving_bytes(served):
    """Not an image, empty, a header claiming too many pixels, too many images: serving_bytes' errors, on every
    signature."""
    server, _ = served[64]
    unsupported = r"Unsupported or corrupt image \(\d+ bytes\)"
    over = r"30000x30000 pixels \(900000000 pixels\) is over the limit of max_pixels=40000000"
    cases = [([b"definitely not an image"], unsupported), ([b""], r"Empty image: 0 bytes"),
             ([odd.jpeg_claiming(30_000, 30_000)], over),
             ([jpeg(0)] * (MAX_BATCH + 1), rf"Request of {MAX_BATCH + 1} images is over the limit of "
                                           rf"max_batch={MAX_BATCH}")]
    for name in naflex_serving.signature_names(["features"]):
        for data, pattern in cases:
            with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
                server.predict(name, {"image_bytes": np.array(data, dtype=object)})


def test_metadata_records_the_budget_and_signatures(served):
    for budget in NAFLEX_BUDGETS:
        metadata = saved_model.read_metadata(served[budget][1])
        assert (metadata["model"], metadata["max_num_patches"], metadata["patch_size"]) == ("naflex", budget, PATCH)
        assert (metadata["max_pixels"], metadata["max_batch"]) == (40_000_000, MAX_BATCH)
        assert metadata["signatures"] == ["serving_default", "serving_bytes", "embed", "features"]
        assert metadata["l2_normalize"] == (budget == 37)
        assert (served[budget][1] / saved_model.WARMUP_FILE).is_file()


def test_the_command_reads_a_naflex_folder_once(tmp_path, capsys, monkeypatch):
    """keras-vit-export tells a NaFlex folder by its config.json and builds its model from what it read: config.json
    and the processor read once each, the safetensors header once, for the whole command (the SavedModel writer
    stubbed: it reads no file; the flags' refusals come after the read too)."""
    from keras_vit.checkpoints import config_files, safetensors_file

    counts, built = {}, []
    for module, name in ((safetensors_file, "read_header"), (config_files, "read_json")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, name=name, **kwargs: (
            counts.__setitem__(name, counts.get(name, 0) + 1), real(*args, **kwargs))[1])
    monkeypatch.setattr(naflex_serving, "export_naflex_saved_model",
                        lambda model, out, **options: built.append((model, options)) or tmp_path / "x" / "1")
    assert export_cli.main(["--weights", CASE, "--out", str(tmp_path / "x")]) == 0
    assert "Wrote SavedModel" in capsys.readouterr().out
    assert counts == {"read_header": 1, "read_json": 2}
    (model, options), = built
    assert model.name == "naflex_vit" and options["max_num_patches"] == 64  # the processor's budget
    with pytest.raises(SystemExit):
        export_cli.main(["--weights", CASE, "--out", str(tmp_path / "x"), "--top-k", "3"])
    assert "--top-k needs --class-embeddings" in capsys.readouterr().err


def test_flags_of_image_models_are_refused_by_name(tmp_path, capsys):
    """Each writes nothing; --max-num-patches is refused for an image model."""
    for flags, flag in ((["--image-size", "64"], "--image-size"), (["--pooling", "avg"], "--pooling"),
                        (["--signatures", "explain"], "--signatures explain"), (["--feature-blocks", "2"],
                                                                                 "--feature-blocks"),
                        (["--format", "onnx"], "--format onnx"), (["--format", "openvino"], "--format openvino"),
                        (["--precision", "bfloat16"], "--precision bfloat16"), (["--any-size"], "--any-size")):
        with pytest.raises(SystemExit) as stopped:
            export_cli.main(["--weights", CASE, "--out", str(tmp_path / "x"), *flags])
        assert stopped.value.code == 2
        assert f"{flag} does not apply to SigLIP 2 NaFlex weights" in capsys.readouterr().err
    names = tmp_path.parent / f"{tmp_path.name}_names.txt"
    names.write_text("a\nb\n")
    for flags, flag in ((["--top-k", "3"], "--top-k"), (["--class-names", str(names)], "--class-names"),
                        (["--logit-scale", "10"], "--logit-scale"), (["--logit-bias", "-1"], "--logit-bias")):
        with pytest.raises(SystemExit) as stopped:  # the zero-shot head's flags, without its class embeddings
            export_cli.main(["--weights", CASE, "--out", str(tmp_path / "x"), *flags])
        assert stopped.value.code == 2
        assert f"{flag} needs --class-embeddings" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_cli.main(["--weights", os.path.join(FOLDER, "hf_siglip_256"), "--out", str(tmp_path / "x"),
                         "--max-num-patches", "64"])
    assert "--max-num-patches is the patch budget of SigLIP 2 NaFlex weights" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="`max_num_patches` must be a positive int"):
        naflex_serving.naflex_archive(naflex.NaFlexViT(weights=CASE), 0)


def test_zero_shot_classifier_scores_the_served_embedding(served, tmp_path, capsys):
    """--class-embeddings: serving_default and serving_bytes give softmax(logit_scale * cos(embedding, class) +
    logit_bias) of what `embed` serves, its top-k classes and their names; each image of a mixed batch as alone."""
    plain, _ = served[64]
    width = plain.predict("embed", request(0))["embedding"].shape[-1]
    classes = np.random.default_rng(3).normal(size=(7, width)).astype("float32")
    np.save(tmp_path / "classes.npy", classes)
    (tmp_path / "names.txt").write_text("".join(f"class {i}\n" for i in range(7)))
    out = tmp_path / "zero_shot"
    assert export_cli.main(["--weights", CASE, "--out", str(out), "--max-batch", str(MAX_BATCH),
                            "--class-embeddings", str(tmp_path / "classes.npy"), "--class-names",
                            str(tmp_path / "names.txt"), "--logit-scale", "10", "--logit-bias", "-2",
                            "--top-k", "3"]) == 0
    assert "serving_default a zero-shot classifier of 7 classes" in capsys.readouterr().out
    server = TF1Server(out / "1")
    embedding = server.predict("embed", request(*range(5)))["embedding"].astype(np.float64)
    np.testing.assert_allclose(embedding, plain.predict("embed", request(*range(5)))["embedding"], atol=1e-6)
    unit = lambda rows: rows / np.linalg.norm(rows, axis=-1, keepdims=True)  # noqa: E731
    logits = 10 * unit(embedding) @ unit(classes.astype(np.float64)).T - 2
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    top3 = np.argsort(-probabilities, axis=-1)[:, :3]
    for name in ("serving_default", "serving_bytes"):
        served_out = server.predict(name, request(*range(5)))
        np.testing.assert_allclose(served_out["logits"], logits, atol=1e-4)
        np.testing.assert_allclose(served_out["probabilities"], probabilities, atol=1e-5)
        np.testing.assert_array_equal(served_out["classes"], top3)
        np.testing.assert_allclose(served_out["scores"], np.take_along_axis(probabilities, top3, -1), atol=1e-5)
        assert [[name.decode() for name in row] for row in served_out["class_names"]] == [
            [f"class {i}" for i in row] for row in top3]
    for index in range(5):
        alone = server.predict("serving_default", request(index))["logits"][0]
        np.testing.assert_allclose(alone, server.predict("serving_default", request(*range(5)))["logits"][index],
                                   atol=1e-5)
    metadata = saved_model.read_metadata(out / "1")
    assert metadata["zero_shot"] == {"classes": 7, "logit_scale": 10.0, "logit_bias": -2.0, "top_k": 3,
                                     "class_names": True}
    assert saved_model.read_metadata(served[64][1])["zero_shot"] is None


def test_zero_shot_inputs_are_checked_before_anything_is_traced():
    model = naflex.NaFlexViT(weights=CASE)
    width = model.output["embedding"].shape[-1]
    with pytest.raises(ValueError, match=rf"class_embeddings must be \(classes, {width}\) to match the embedding "
                                         r"of model 'naflex_vit'\. Received shape: \(3, 5\)"):
        naflex_serving.naflex_archive(model, 64, class_embeddings=np.ones((3, 5)))
    with pytest.raises(ValueError, match=r"rows \[1\] are zero vectors"):
        naflex_serving.naflex_archive(model, 64, class_embeddings=np.eye(2, width) * [[1], [0]])
    with pytest.raises(ValueError, match=r"Expected 2 class names \(one per model class\)\. Received 3\."):
        naflex_serving.naflex_archive(model, 64, class_embeddings=np.eye(2, width), class_names=["a", "b", "c"])
    with pytest.raises(ValueError, match="class_names name the classes of class_embeddings"):
        naflex_serving.naflex_archive(model, 64, class_names=["a"])


def test_a_timm_naflexvit_file_is_refused_by_name(tmp_path, capsys):
    """timm resizes a NaFlexVit's images with its own transform (its size search, bicubic), not transformers'
    Siglip2ImageProcessor rule that the SavedModel applies: the command says so and writes nothing."""
    with pytest.raises(SystemExit) as stopped:
        export_cli.main(["--weights", os.path.join(FOLDER, TIMM_NAFLEX), "--out", str(tmp_path / "served")])
    assert stopped.value.code == 2
    assert "is a timm NaFlexVit, whose images timm resizes with its own NaFlex transform" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
