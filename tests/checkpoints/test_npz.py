"""Pretrained-weights tests: registry, `.npz` loading, resampling, converter, download.

Checkpoints are written in the released layout and the reference is a NumPy forward pass
written from the equations that runs on the `.npz` arrays directly, with its own order-1 zoom,
independent of the loader (tests/reference.py; the checkpoint writers are in tests/testing.py).
"""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import scipy.ndimage

import keras_vit
import keras_vit.model_files
import keras_vit.convert
from keras_vit.checkpoints import loader, registry
from keras_vit.cli import convert
from tests.reference import vit_logits
from tests.testing import (REPO, TINY_HYBRID, TINY_VIT, big_vision_names, save_checkpoint, save_safetensors,
                           timm_state_dict, vit_checkpoint)

# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def images(height, width, batch=2, seed=1):
    return np.random.default_rng(seed).uniform(0, 255, (batch, height, width, 3)).astype("float32")


def build(weights=None, size=(32, 32), arch=TINY_VIT, **kwargs):
    kwargs.setdefault("classes", 10)
    return keras_vit.VisionTransformer(**arch, weights=weights, input_shape=(*size, 3),
                                       classifier_activation=None, **kwargs)


def logits(model, x):
    return np.asarray(model(x, training=False))


def snapshot(model):
    return [np.array(w.numpy()) for w in model.weights]


@pytest.fixture(scope="module")
def vit_file(tmp_path_factory):
    """A '224-style' tiny checkpoint: 32 px at patch 8, a 4x4 grid, 10 classes."""
    arrays = vit_checkpoint(grid=4)
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "vit.npz", arrays), arrays


@pytest.fixture(scope="module")
def hybrid_file(tmp_path_factory):
    arrays = vit_checkpoint(TINY_HYBRID, grid=4, seed=3)
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "hybrid.npz", arrays), arrays


# ---------------------------------------------------------------------------------------
# Position-embedding resampling
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new", [((4, 4), (6, 6)), ((4, 4), (3, 7)), ((7, 7), (2, 9)), ((3, 5), (8, 4)),
                                      ((4, 4), (1, 3))])
@pytest.mark.parametrize("prefix", [0, 1])
def test_resample_matches_scipy_zoom(old, new, prefix):
    rng = np.random.default_rng(0)
    posemb = rng.standard_normal((1, prefix + old[0] * old[1], 5)).astype("float32")
    out = keras_vit.resample_position_embedding(posemb, new, old_grid=old, num_prefix_tokens=prefix)
    grid = posemb[0, prefix:].reshape(*old, 5)
    expected = scipy.ndimage.zoom(grid, (new[0] / old[0], new[1] / old[1], 1), order=1)
    assert out.shape == (1, prefix + new[0] * new[1], 5) and out.dtype == np.float32
    np.testing.assert_array_equal(out[:, :prefix], posemb[:, :prefix])
    np.testing.assert_allclose(out[0, prefix:], expected.reshape(-1, 5), atol=1e-6)


def test_resample_infers_square_grid_and_rejects_others():
    posemb = np.arange(2 * 17, dtype="float32").reshape(1, 17, 2)
    np.testing.assert_array_equal(keras_vit.resample_position_embedding(posemb, 4), posemb)
    with pytest.raises(ValueError, match="not a square"):
        keras_vit.resample_position_embedding(posemb[:, :16], 5)


# ---------------------------------------------------------------------------------------
# Loading released-layout checkpoints against the NumPy reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [(32, 32), (48, 48), (32, 56)], ids=["native", "larger", "rectangular"])
def test_vit_matches_reference(vit_file, size):
    path, arrays = vit_file
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build(path, size)
    x = images(*size)
    np.testing.assert_allclose(logits(model, x), vit_logits(arrays, x), atol=1e-4, rtol=0)
    resized = [str(w.message) for w in caught if "position embedding" in str(w.message)]
    rows, columns = size[0] // 8, size[1] // 8
    assert resized == ([] if size == (32, 32) else
                       [f"keras_vit: position embedding 'Transformer/posembed_input/pos_embedding' resampled from "
                        f"17 to {1 + rows * columns} tokens ({rows}x{columns} grid), as the original loader does."])


def test_gap_checkpoint_matches_reference(tmp_path):
    arrays = vit_checkpoint(classifier="gap", seed=5)
    model = build(save_checkpoint(tmp_path / "gap.npz", arrays), classifier="gap")
    x = images(32, 32)
    np.testing.assert_allclose(logits(model, x), vit_logits(arrays, x), atol=1e-4, rtol=0)


@pytest.mark.parametrize("size", [(32, 32), (48, 48)], ids=["native", "larger"])
def test_hybrid_matches_reference(hybrid_file, size):
    path, arrays = hybrid_file
    assert arrays["block2/unit1/gn_proj/scale"].shape == (1, 1, 1, 512)
    model = build(path, size, arch=TINY_HYBRID)
    x = images(*size, batch=1)
    np.testing.assert_allclose(logits(model, x), vit_logits(arrays, x, TINY_HYBRID["resnet_stages"]), atol=1e-4, rtol=0)


def test_big_vision_naming_loads_the_same(vit_file, tmp_path):
    path, arrays = vit_file
    renamed = big_vision_names(arrays)
    assert "params/Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel" in renamed
    x = images(32, 32)
    np.testing.assert_array_equal(logits(build(save_checkpoint(tmp_path / "bv.npz", renamed)), x),
                                  logits(build(path), x))


# ---------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i21k_file(tmp_path_factory):
    """ImageNet-21k style: pre_logits of width D, a zeroed 21843-way head."""
    arrays = vit_checkpoint(classes=21843, representation_size=48, zero_head=True, seed=7)
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "i21k.npz", arrays), arrays


def test_i21k_head_and_pre_logits_loaded_with_zero_head_warning(i21k_file):
    path, arrays = i21k_file
    with pytest.warns(UserWarning, match="is all zeros"):
        model = build(path, classes=21843)  # representation_size inferred from the checkpoint
    np.testing.assert_array_equal(model.get_layer("pre_logits").kernel.numpy(), arrays["pre_logits/kernel"])
    assert not np.any(logits(model, images(32, 32)))


def test_other_classes_with_a_head_is_an_error_as_in_keras_applications(i21k_file):
    path, _ = i21k_file
    with pytest.raises(ValueError, match=r"has a 21843-class head, but the model was asked for include_top=True "
                                         r"and classes=5.*include_top=False"):
        build(path, classes=5)


@pytest.mark.parametrize("weights", ["imagenet", "imagenet21k"])
def test_registered_weights_with_other_classes_fail_before_any_download(monkeypatch, weights):
    def no_download(*args, **kwargs):
        raise AssertionError("nothing may be downloaded for a call that is an error")

    monkeypatch.setattr(registry, "fetch", no_download)
    monkeypatch.setattr(keras_vit.models.keras.utils, "get_file", no_download)
    expected = 1000 if weights == "imagenet" else 21843
    with pytest.raises(ValueError, match=rf"weights='{weights}' has a {expected}-class head, but the model was "
                                         r"asked for include_top=True and classes=10"):
        keras_vit.ViTB16(weights=weights, classes=10)
    with pytest.raises(ValueError, match=rf"has a {expected}-class head"):
        keras_vit.ViTB16(classes=10)  if weights == "imagenet" else keras_vit.ViTB16(weights=weights)


def test_backbone_drops_the_top_layers_silently(i21k_file):
    path, arrays = i21k_file
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backbone = build(path, include_top=False, pooling="token")
    assert {"pre_logits", "head"}.isdisjoint(layer.name for layer in backbone.layers)
    np.testing.assert_array_equal(backbone.get_layer("embedding").kernel.numpy(), arrays["embedding/kernel"])


def test_load_weights_into_another_head_warns_and_keeps_a_zero_head(i21k_file):
    path, arrays = i21k_file
    model = build(classes=5)
    with pytest.warns(UserWarning) as caught:
        keras_vit.load_weights(model, path)
    messages = " ".join(str(w.message) for w in caught)
    assert "head/kernel" in messages and "pre_logits/kernel" in messages  # kept at init / not used
    assert not np.any(model.get_layer("head").kernel.numpy())
    kept = build(classes=5, representation_size=48)
    with pytest.warns(UserWarning, match="head/kernel"):
        keras_vit.load_weights(kept, path)
    np.testing.assert_array_equal(kept.get_layer("pre_logits").kernel.numpy(), arrays["pre_logits/kernel"])


def test_loaded_head_requires_the_checkpoints_pre_logits(i21k_file):
    model = build(classes=21843)  # head fits the checkpoint's, but no pre_logits layer
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"unexpected key 'pre_logits/kernel' \(48, 48\)"):
        keras_vit.load_weights(model, i21k_file[0])
    for old, new in zip(before, snapshot(model)):
        np.testing.assert_array_equal(old, new)


def test_include_top_false_skips_head(vit_file):
    path, arrays = vit_file
    model = build(path, include_top=False, pooling="token")
    assert "head" not in [layer.name for layer in model.layers]
    np.testing.assert_array_equal(model.get_layer("cls").cls.numpy(), arrays["cls"])


# ---------------------------------------------------------------------------------------
# Errors: ValueError, model untouched
# ---------------------------------------------------------------------------------------


def _broken(kind, tmp_path, vit_file):
    path, arrays = vit_file
    target = tmp_path / f"{kind}.npz"
    if kind == "truncated":
        data = open(path, "rb").read()
        target.write_bytes(data[: len(data) // 2])
    elif kind == "not_npz":
        target.write_text("this is not a checkpoint\n")
    elif kind == "missing_key":
        missing = "Transformer/encoderblock_1/LayerNorm_2/bias"
        save_checkpoint(target, {k: v for k, v in arrays.items() if k != missing})
    elif kind == "unexpected_key":
        save_checkpoint(target, {**arrays, "Transformer/encoderblock_0/extra/kernel": np.zeros((2, 2), "float32")})
    elif kind == "wrong_variant":
        save_checkpoint(target, vit_checkpoint(dict(TINY_VIT, hidden_dim=64, mlp_dim=128, num_heads=4, num_layers=3)))
    elif kind == "wrong_mlp":
        save_checkpoint(target, vit_checkpoint(dict(TINY_VIT, mlp_dim=80)))
    return str(target)


@pytest.mark.parametrize("kind, message", [
    ("truncated", r"Could not read .*truncated\.npz.* as an \.npz checkpoint"),
    ("not_npz", r"Could not read .*not_npz\.npz.* as an \.npz checkpoint"),
    ("missing_key", r"missing key for model weight 'encoderblock_1/LayerNorm_2/beta' \(expected shape \(48,\)\)"),
    ("unexpected_key", r"unexpected key 'Transformer/encoderblock_0/extra/kernel' \(2, 2\)"),
    ("wrong_variant", r"checkpoint: hidden size 64, 3 encoder blocks; model: hidden size 48, 2 encoder blocks"
                      r"(.|\n)*shape mismatch for key 'embedding/kernel' -> 'embedding/kernel': "
                      r"expected \(8, 8, 3, 48\), found \(8, 8, 3, 64\)"),
    ("wrong_mlp", r"shape mismatch for key 'Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel' -> "
                  r"'encoderblock_0/MlpBlock_3/Dense_0/kernel': expected \(48, 96\), found \(48, 80\)"),
])
def test_bad_checkpoint_raises_and_leaves_model_untouched(kind, message, tmp_path, vit_file):
    model = build()
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        keras_vit.load_weights(model, _broken(kind, tmp_path, vit_file))
    for old, new in zip(before, snapshot(model)):
        np.testing.assert_array_equal(old, new)


def test_wrong_variant_reports_unexpected_blocks(tmp_path, vit_file):
    with pytest.raises(ValueError, match=r"unexpected key 'Transformer/encoderblock_2/LayerNorm_0/scale'"):
        keras_vit.load_weights(build(), _broken("wrong_variant", tmp_path, vit_file))


# ---------------------------------------------------------------------------------------
# Registry and resolution (no download)
# ---------------------------------------------------------------------------------------


def test_registry_entries_are_consistent():
    keys = [(e.variant, e.tag, e.image_size) for e in registry.REGISTRY]
    assert len(keys) == len(set(keys))
    for entry in registry.REGISTRY:
        assert entry.variant in keras_vit.VARIANTS
        assert entry.url.startswith("https://storage.googleapis.com/vit_models/") and entry.url.endswith(".npz")
        hidden = keras_vit.VARIANTS[entry.variant]["hidden_dim"]
        assert entry.representation_size == (hidden if entry.tag == "imagenet21k" else None)
        assert entry.classes == (21843 if entry.tag.endswith("imagenet21k") else 1000)
    assert {e.tag for e in keras_vit.list_weights("ViT-B_16")} == {
        "imagenet21k", "imagenet21k+imagenet2012", "augreg-imagenet21k", "augreg-imagenet21k+imagenet2012"}


@pytest.mark.parametrize("variant, weights, size, filename", [
    ("B/16", "imagenet", 224, "ViT-B_16-224.npz"),
    ("B/16", "imagenet", 384, "ViT-B_16.npz"),
    ("B/16", "imagenet", 256, "ViT-B_16.npz"),
    ("B/16", "imagenet21k+imagenet2012", 224, "ViT-B_16-224.npz"),
    ("Ti/16", "imagenet", 224, "Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0--imagenet2012-steps_20k-"
                               "lr_0.03-res_224.npz"),
    ("R50+B/16", "imagenet", 224, "R50+ViT-B_16.npz"),
    ("L/32", "imagenet21k", 224, "ViT-L_32.npz"),
])
def test_resolve_picks_checkpoint(variant, weights, size, filename):
    source = loader.resolve(weights, variant=variant, image_size=(size, size), include_top=False, classes=1000)
    assert source.checkpoint.filename == filename


def test_resolve_infers_representation_size_only_when_head_is_loaded():
    def rep(**kwargs):
        return loader.resolve("imagenet21k", variant="B/16", image_size=(224, 224), **kwargs).representation_size
    assert rep(include_top=True, classes=21843) == 768
    assert rep(include_top=False, classes=21843) is None
    assert rep(include_top=False, classes=1000) is None


@pytest.mark.parametrize("variant, weights, message", [
    ("H/14", "imagenet", r"Unknown weights 'imagenet' for variant 'H/14'.*\['imagenet21k'\]"),
    ("B/16", "jft300m", r"Unknown weights 'jft300m' for variant 'B/16'"),
    (None, "imagenet", r"registered weights names need a `variant`"),
])
def test_resolve_rejects_unknown_weights(variant, weights, message):
    with pytest.raises(ValueError, match=message):
        loader.resolve(weights, variant=variant, image_size=(224, 224), include_top=True, classes=1000)


# ---------------------------------------------------------------------------------------
# Download (no network: a file:// URL) and the .weights.h5 converter
# ---------------------------------------------------------------------------------------


def test_registered_name_downloads_once_into_cache(vit_file, tmp_path, monkeypatch):
    path, _ = vit_file
    source = tmp_path / "server" / "Tiny_8-test.npz"
    source.parent.mkdir()
    source.write_bytes(open(path, "rb").read())
    entry = registry.Checkpoint("Ti/16", "test-tag", source.as_uri(), 10, 32)
    monkeypatch.setattr(registry, "REGISTRY", (entry,))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "keras_home"))
    cached = tmp_path / "keras_home" / "models" / "Tiny_8-test.npz"

    model = keras_vit.VisionTransformer("Ti/16", **TINY_VIT, weights="test-tag", input_shape=(32, 32, 3),
                                        classes=10, classifier_activation=None)
    assert cached.read_bytes() == source.read_bytes()
    mtime = cached.stat().st_mtime_ns
    source.unlink()  # a second build must use the cache
    again = keras_vit.VisionTransformer("Ti/16", **TINY_VIT, weights="test-tag", input_shape=(32, 32, 3),
                                        classes=10, classifier_activation=None)
    assert cached.stat().st_mtime_ns == mtime
    x = images(32, 32)
    np.testing.assert_array_equal(logits(again, x), logits(model, x))
    np.testing.assert_array_equal(logits(model, x), logits(build(path), x))


@pytest.mark.parametrize("checkpoint, args, arch, size", [
    ("vit", ["--image-size", "48"], TINY_VIT, (48, 48)),
    ("hybrid", [], TINY_HYBRID, (32, 32)),
])
def test_converter_round_trip(checkpoint, args, arch, size, vit_file, hybrid_file, tmp_path, capsys):
    path = {"vit": vit_file, "hybrid": hybrid_file}[checkpoint][0]
    out = str(tmp_path / "model.weights.h5")
    assert convert.main([path, out, *args]) == 0
    assert "max abs difference 0 (" in capsys.readouterr().out
    x = images(*size, batch=1)
    np.testing.assert_array_equal(logits(build(out, size, arch=arch), x), logits(build(path, size, arch=arch), x))


@pytest.mark.slow
def test_converter_with_registered_variant(tmp_path, capsys):
    arrays = vit_checkpoint(dict(patch_size=16, hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12), grid=2,
                            classes=1000)
    path = save_checkpoint(tmp_path / "ti16.npz", arrays)
    out = str(tmp_path / "ti16.weights.h5")
    assert convert.main([path, out, "--variant", "Ti/16", "--image-size", "48"]) == 0
    assert "max abs difference 0 (" in capsys.readouterr().out
    x = images(48, 48, batch=1)
    np.testing.assert_allclose(logits(keras_vit.ViTTi16(weights=out, input_shape=(48, 48, 3),
                                                         classifier_activation=None), x),
                               vit_logits(arrays, x), atol=1e-4, rtol=0)


def test_converter_writes_an_npz_as_a_keras_model(vit_file, tmp_path):
    path, arrays = vit_file
    model, difference = keras_vit.convert.convert_checkpoint(path, str(tmp_path / "vit.keras"))
    assert difference == 0
    x = images(32, 32)
    written = keras.saving.load_model(tmp_path / "vit.keras")
    np.testing.assert_allclose(logits(written, x), vit_logits(arrays, x), atol=1e-4, rtol=0)


def test_converter_of_a_headless_checkpoint_writes_a_backbone(vit_file, tmp_path):
    arrays = {key: value for key, value in vit_file[1].items() if not key.startswith("head/")}
    path = save_checkpoint(tmp_path / "headless.npz", arrays)
    out = str(tmp_path / "backbone.weights.h5")
    model, difference = keras_vit.convert.convert_checkpoint(path, out)
    assert difference == 0 and model.output.shape == (None, TINY_VIT["hidden_dim"])
    backbone = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), include_top=False, pooling="token",
                                           weights=out)
    x = images(32, 32)
    np.testing.assert_array_equal(np.asarray(backbone(x)), np.asarray(model(x)))
    with pytest.raises(ValueError, match="has no classification head"):
        build(path)


@pytest.mark.slow
def test_tools_build_a_variant_with_the_head_of_its_weights(tmp_path):
    """`load_or_build` (the commands' --variant/--weights) takes the checkpoint's classes unless told."""
    arrays = vit_checkpoint(dict(patch_size=16, hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12), grid=2,
                            classes=7)
    path = save_checkpoint(tmp_path / "ti16_7.npz", arrays)
    model = keras_vit.model_files.load_or_build(variant="Ti/16", weights=path, input_shape=(32, 32, 3))
    assert model.output.shape == (None, 7)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), arrays["head/kernel"])
    assert keras_vit.model_files.load_or_build(variant="Ti/16", input_shape=(32, 32, 3)).output.shape == (None, 1000)
    with pytest.raises(ValueError, match="has a 7-class head"):
        keras_vit.model_files.load_or_build(variant="Ti/16", weights=path, input_shape=(32, 32, 3), classes=10)


def test_converter_rejects_wrong_variant(vit_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        convert.main([vit_file[0], str(tmp_path / "x.weights.h5"), "--variant", "Ti/16"])
    assert exited.value.code == 1 and not (tmp_path / "x.weights.h5").exists()
    error = capsys.readouterr().err
    assert error.startswith("keras-vit-convert: error: ") and "Traceback" not in error
    assert "checkpoint: hidden size 48, 2 encoder blocks; model: hidden size 192, 12 encoder blocks" in error


@pytest.mark.slow
def test_converter_help():
    result = subprocess.run([sys.executable, "-m", "keras_vit.cli.convert", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0
    assert "--variant" in result.stdout and "--image-size" in result.stdout


# ---------------------------------------------------------------------------------------
# ImageNet helpers
# ---------------------------------------------------------------------------------------


def test_decode_predictions():
    index = json.load(open(keras_vit.imagenet.CLASS_INDEX_PATH))
    wnids = [index[str(i)][0] for i in range(1000)]
    assert len(index) == 1000 and wnids == sorted(set(wnids))
    preds = np.zeros((2, 1000), "float32")
    preds[0, [1, 2]] = [0.7, 0.2]
    preds[1, 0] = 1.0
    decoded = keras_vit.decode_predictions(preds, top=2)
    assert decoded[0] == [("n01443537", "goldfish", pytest.approx(0.7)),
                          ("n01484850", "great_white_shark", pytest.approx(0.2))]
    assert decoded[1][0] == ("n01440764", "tench", 1.0)
    with pytest.raises(ValueError, match=r"shape \(samples, 1000\). Received shape: \(2, 10\)"):
        keras_vit.decode_predictions(np.zeros((2, 10)))


def test_preprocess_input_matches_built_in_preprocessing(vit_file):
    x = images(32, 32)
    # To one float32 ulp: XLA on a GPU divides by multiplying with the reciprocal (127.5 -> -6e-8 on an H100).
    np.testing.assert_allclose(np.asarray(keras_vit.preprocess_input(np.array([0.0, 127.5, 255.0]))), [-1, 0, 1],
                               rtol=0, atol=np.finfo(np.float32).eps)
    raw = build(vit_file[0])
    scaled = build(vit_file[0], include_preprocessing=False)
    np.testing.assert_allclose(logits(scaled, keras_vit.preprocess_input(x)), logits(raw, x), atol=1e-5)


def test_architecture_comes_from_the_file(vit_file, hybrid_file, tmp_path):
    """`VisionTransformer(weights=file)` without architecture arguments builds what the keys determine."""
    for (path, _), arch in ((vit_file, TINY_VIT), (hybrid_file, TINY_HYBRID)):
        from_file = keras_vit.VisionTransformer(weights=path, input_shape=(32, 32, 3), classes=10,
                                                classifier_activation=None)
        explicit = build(path, arch=arch)
        x = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
        np.testing.assert_array_equal(logits(from_file, x), logits(explicit, x))
        assert from_file.count_params() == explicit.count_params()
    timm_file = save_safetensors(timm_state_dict(), tmp_path / "tiny_timm.safetensors")
    with pytest.raises(ValueError, match=r"heads is not stored in the weights: give the variant \(or the number"):
        keras_vit.VisionTransformer(weights=timm_file, input_shape=(32, 32, 3), classes=10)


def test_a_head_twice_the_width_reads_the_token_and_patch_mean_unless_pre_logits_come_between():
    """The classifier a file's shapes show: a head on 2 D inputs after a class token is `"token_gap"` (DINOv2's
    classifiers); the same head width after a pre-logits layer of 2 D is the class token's (`"token"`)."""
    from keras_vit.checkpoints.architecture import read_architecture
    hidden = TINY_VIT["hidden_dim"]
    shapes = {key: value.shape for key, value in vit_checkpoint(representation_size=2 * hidden).items()}
    assert read_architecture(shapes, num_heads=3)["classifier"] == "token"
    del shapes["pre_logits/kernel"], shapes["pre_logits/bias"]
    assert read_architecture(shapes, num_heads=3)["classifier"] == "token_gap"
