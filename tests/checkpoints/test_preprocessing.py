"""A checkpoint's own preprocessing: read from `preprocessor_config.json` (transformers) or timm's `config.json`
beside the weights, used by the model's `preprocessing` layer, kept by `.keras` files, and baked into the
SavedModel's resize, crop and normalization. The processor files below are shaped like those of the named hub
repositories (their keys and values as published); the weights are tiny random ones."""

import io
import json
import math
import re
import warnings

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

import keras
import keras_vit
from keras_vit import image_io
from keras_vit.checkpoints.reader import read_checkpoint
from tests.testing import hf_state_dict, save_safetensors, timm_state_dict

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
PROCESSORS = {  # repository: (preprocessor_config.json, expected fields, the size it produces)
    "openai/clip-vit-base-patch32": (
        {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
         "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
         "resample": 3, "size": 224},
        dict(resize_mode="shortest_edge", crop_fraction=1.0, resize_size=224, interpolation="bicubic",
             crop_offset="floor"), (224, 224)),
    "facebook/dinov2-base": (
        {"crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
         "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": IMAGENET_MEAN,
         "image_processor_type": "BitImageProcessor", "image_std": IMAGENET_STD, "resample": 3,
         "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 256}},
        dict(resize_mode="shortest_edge", crop_fraction=0.875, resize_size=256, interpolation="bicubic",
             crop_offset="floor"), (224, 224)),
    "google/siglip-base-patch16-224": (
        {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
         "image_processor_type": "SiglipImageProcessor", "image_std": [0.5, 0.5, 0.5], "processor_class":
         "SiglipProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
         "size": {"height": 224, "width": 224}},
        dict(resize_mode="squash", crop_fraction=1.0, resize_size=224, interpolation="bicubic", crop_offset="floor"),
        (224, 224)),
    "google/vit-base-patch16-224": (
        {"do_normalize": True, "do_resize": True, "feature_extractor_type": "ViTFeatureExtractor",
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "size": 224},
        dict(resize_mode="squash", crop_fraction=1.0, resize_size=224, interpolation="bilinear", crop_offset="floor"),
        (224, 224)),
    "facebook/deit-base-distilled-patch16-224": (
        {"crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
         "feature_extractor_type": "DeiTFeatureExtractor", "image_mean": IMAGENET_MEAN,
         "image_std": IMAGENET_STD, "resample": 3, "size": 256},
        dict(resize_mode="squash", crop_fraction=0.875, resize_size=256, interpolation="bicubic",
             crop_offset="floor"), (224, 224)),
}
TIMM_AUGREG = {"architecture": "vit_base_patch16_224", "num_classes": 21843, "pretrained_cfg": {
    "tag": "augreg_in21k", "input_size": [3, 224, 224], "fixed_input_size": True, "interpolation": "bicubic",
    "crop_pct": 0.9, "crop_mode": "center", "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5],
    "num_classes": 21843, "first_conv": "patch_embed.proj", "classifier": "head"}}
HF_CONFIG = {"num_attention_heads": 3, "layer_norm_eps": 1e-12, "hidden_act": "gelu"}


def save_pretrained(folder, processor=None, config=HF_CONFIG, timm=False):
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(timm_state_dict() if timm else hf_state_dict(), folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if processor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return folder


def build(weights, **kwargs):
    kwargs = {"input_shape": (32, 32, 3), "classes": 10, "classifier_activation": None, **kwargs}
    return keras_vit.VisionTransformer(weights=str(weights), **kwargs)


@pytest.mark.parametrize("repo", sorted(PROCESSORS))
def test_processor_configs_of_the_family_are_read(tmp_path, repo):
    processor, expected, size = PROCESSORS[repo]
    file = read_checkpoint(save_pretrained(tmp_path / "model", processor))
    assert file.preprocessing == {"image_mean": tuple(processor["image_mean"]),
                                  "image_std": tuple(processor["image_std"]), **expected}
    assert file.declared_size == file.input_size == size
    assert file.preprocessing_source.endswith("preprocessor_config.json")


def test_timm_pretrained_cfg_is_read_and_the_processor_file_wins_over_it(tmp_path):
    folder = save_pretrained(tmp_path / "timm", config=TIMM_AUGREG, timm=True)
    file = read_checkpoint(folder)
    assert file.preprocessing == dict(image_mean=(0.5,) * 3, image_std=(0.5,) * 3, resize_mode="shortest_edge",
                                      crop_fraction=0.9, resize_size=None, interpolation="bicubic",
                                      crop_offset="round")
    assert file.declared_size == (224, 224)  # pretrained_cfg's input_size
    assert file.preprocessing_source.endswith("config.json")
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSORS["google/siglip-base-patch16-224"][0]))
    assert read_checkpoint(folder).preprocessing["crop_fraction"] == 1.0  # transformers' processor, not timm's 0.9


def test_no_declared_preprocessing_keeps_the_original_normalization(tmp_path):
    model = build(save_pretrained(tmp_path / "bare"))
    assert read_checkpoint(tmp_path / "bare").preprocessing is None
    assert model.preprocessing_config == keras_vit.PreprocessingConfig(
        image_mean=(0.5,) * 3, image_std=(0.5,) * 3, resize_mode="squash", crop_fraction=1.0, resize_size=None,
        interpolation="bilinear", crop_offset="floor")
    layer = model.get_layer("preprocessing")
    assert (layer.scale, layer.offset) == (1 / 127.5, -1.0)  # the original's x / 127.5 - 1, as before


@pytest.mark.parametrize("edit, match", [
    (dict(image_processor_type="BeitImageProcessor"), "unknown image processor type 'BeitImageProcessor'"),
    (dict(resample=4), r"resample=4 is not a resampling keras_vit reproduces.*3 \(bicubic\)"),
    (dict(image_std=[0.2, 0.0, 0.2]), "every standard deviation must be positive"),
    (dict(image_std=[0.2, float("nan"), 0.2]), r"image_std=\[0.2, nan, 0.2\]; every value must be a finite number"),
    (dict(image_mean=[0.5, float("inf"), 0.5]), r"image_mean=\[0.5, inf, 0.5\]; every value must be a finite"),
    (dict(size={"shortest_edge": 0}), r"size\['shortest_edge'\]=0; expected a positive integer"),
    (dict(crop_size=224.5), r"crop_size=224.5; expected a positive integer"),
    (dict(image_mean=[0.5, 0.5]), "expected 3 numbers, one per RGB channel"),
    (dict(size={"longest_edge": 256}), "size=.*is not a size keras_vit reproduces"),
    (dict(crop_size={"height": 300, "width": 300}), "crop_size 300 is larger than the resize size 256"),
    (dict(rescale_factor=1.0), "rescale_factor=1.0"),
])
def test_bad_processor_files_are_clear_errors_and_nothing_is_built(tmp_path, edit, match):
    processor = {**PROCESSORS["facebook/dinov2-base"][0], **edit}
    folder = save_pretrained(tmp_path / "bad", processor)
    with pytest.raises(ValueError, match=match) as error:
        build(folder)
    assert "preprocessor_config.json" in str(error.value)


def test_an_unknown_processor_does_not_block_the_weights(tmp_path):
    processor = {**PROCESSORS["facebook/dinov2-base"][0], "image_processor_type": "NewFamilyImageProcessorFast"}
    folder = save_pretrained(tmp_path / "new", processor)
    reference = build(save_pretrained(tmp_path / "known", PROCESSORS["facebook/dinov2-base"][0]),
                      include_preprocessing=False)
    with pytest.warns(UserWarning, match=r"unknown image processor type .*The weights load without it; the model's "
                                         r"image_mean and image_std stay the defaults"):
        model = build(folder, include_preprocessing=False)  # the weights alone: no processor needed
    inputs = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype("float32")
    np.testing.assert_array_equal(model.predict_on_batch(inputs), reference.predict_on_batch(inputs))
    with pytest.raises(ValueError, match=r"unknown image processor type 'NewFamilyImageProcessorFast'.*"
                                         r"include_preprocessing=False.*image_mean=\(0.5, 0.5, 0.5\)"):
        build(folder)
    given = build(folder, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    assert given.preprocessing_config.image_mean == tuple(IMAGENET_MEAN)


def test_bad_timm_configs_are_clear_errors(tmp_path):
    for edit, match in ((dict(crop_mode="border"), "crop_mode='border'"), (dict(interpolation="random"),
                                                                          "interpolation='random'")):
        config = {**TIMM_AUGREG, "pretrained_cfg": {**TIMM_AUGREG["pretrained_cfg"], **edit}}
        folder = save_pretrained(tmp_path / edit.popitem()[0], config=config, timm=True)
        assert re.search(match, read_checkpoint(folder).preprocessing_problem)
        with pytest.raises(ValueError, match=match):
            build(folder)
    (tmp_path / "broken").mkdir()
    save_safetensors(hf_state_dict(), tmp_path / "broken" / "model.safetensors")
    (tmp_path / "broken" / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="Could not read .*preprocessor_config.json"):
        build(tmp_path / "broken", num_heads=3)


def test_the_model_normalizes_with_the_checkpoints_mean_and_std(tmp_path):
    folder = save_pretrained(tmp_path / "dinov2", PROCESSORS["facebook/dinov2-base"][0])
    pixels = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    model = build(folder)
    assert model.preprocessing_config.image_mean == tuple(IMAGENET_MEAN)
    assert model.preprocessing_config.crop_fraction == 0.875
    normalized = (pixels / 255.0 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    inner = keras.Model(model.input, model.get_layer("preprocessing").output)
    np.testing.assert_allclose(np.asarray(inner(pixels)), normalized, rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(keras_vit.preprocess_input(pixels, model.preprocessing_config)), normalized,
                               rtol=0, atol=2e-6)
    unnormalized = build(folder, include_preprocessing=False)
    np.testing.assert_allclose(np.asarray(model(pixels)), np.asarray(unnormalized(normalized.astype("float32"))),
                               rtol=0, atol=2e-5)
    path = str(tmp_path / "dinov2.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    assert reloaded.vit_config == model.vit_config
    assert reloaded.preprocessing_config == model.preprocessing_config
    np.testing.assert_array_equal(np.asarray(reloaded(pixels)), np.asarray(model(pixels)))
    with pytest.raises(TypeError, match="takes a model's `preprocessing_config`.*Received: ViTConfig"):
        keras_vit.preprocess_input(pixels, model.vit_config)


def test_a_choice_against_the_file_is_used_and_said_in_one_line(tmp_path):
    folder = save_pretrained(tmp_path / "clip", PROCESSORS["openai/clip-vit-base-patch32"][0])
    with pytest.warns(UserWarning) as caught:
        model = build(folder, image_mean=(0.5, 0.5, 0.5))
    messages = [str(warning.message) for warning in caught if "overrides" in str(warning.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert messages[0].startswith("keras_vit: image_mean=(0.5, 0.5, 0.5) overrides the checkpoint's image_mean="
                                  "(0.48145466, 0.4578275, 0.40821073) (")
    assert model.preprocessing_config.image_mean == (0.5, 0.5, 0.5)
    assert model.preprocessing_config.image_std == tuple(CLIP_STD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(folder, image_std=CLIP_STD)  # the file's own value: no warning


def test_bad_input_options_are_clear_errors():
    for options, match in ((dict(resize_mode="longest"), "Unknown resize_mode 'longest'"),
                           (dict(interpolation="cubic"), "Unknown interpolation 'cubic'"),
                           (dict(crop_fraction=1.2), r"crop_fraction must be in \(0, 1\]"),
                           (dict(image_std=(1, 0, 1)), "Every image_std must be positive")):
        with pytest.raises(ValueError, match=match):
            keras_vit.ViTTi16(weights=None, **options)


# --- the resize and crop, against PIL (which transformers and timm resize with) ---


def photograph():
    from sklearn.datasets import load_sample_image

    return load_sample_image("china.jpg")  # 427 x 640, a real photograph


def pil_transform(image, size, short_side=None, square=None, crop=None, resample=Image.BICUBIC):
    """transformers' processor steps in PIL: resize (shortest edge, int() of the long side; or a square), centre
    crop with offsets (resized - crop) // 2."""
    height, width = image.shape[:2]
    if short_side:
        new = (short_side, int(short_side * width / height)) if height <= width else \
            (int(short_side * height / width), short_side)
    else:
        new = (square, square)
    resized = np.asarray(Image.fromarray(image).resize((new[1], new[0]), resample), np.float64)
    crop = crop or size
    top, left = (new[0] - crop) // 2, (new[1] - crop) // 2
    return resized[top:top + crop, left:left + crop]


@pytest.mark.parametrize("case", ["clip", "dinov2", "deit", "vit"])
def test_fit_to_model_matches_pils_resize_and_crop(case):
    image = photograph()
    size = 224
    if case == "clip":
        fields, expected = dict(resize_mode="shortest_edge", interpolation="bicubic"), pil_transform(
            image, size, short_side=224)
    elif case == "dinov2":
        fields, expected = dict(resize_mode="shortest_edge", crop_fraction=0.875, interpolation="bicubic"), \
            pil_transform(image, size, short_side=256)
    elif case == "deit":
        fields, expected = dict(resize_mode="squash", crop_fraction=0.875, interpolation="bicubic"), \
            pil_transform(image, size, square=256)
    else:
        fields, expected = dict(), pil_transform(image, size, square=224, resample=Image.BILINEAR)
    fitted = image_io.fit_to_model(tf.constant(image[None]), (size, size), **fields)[0].numpy()
    difference = np.abs(fitted - expected)
    # PIL rounds each resized pixel to uint8 (up to 0.5) and its kernels are tabulated in fixed point.
    assert difference.mean() < 0.6 and np.percentile(difference, 99) < 2.5, (difference.mean(), difference.max())
    assert np.corrcoef(fitted.ravel(), expected.ravel())[0, 1] > 0.999


def test_crop_offsets_follow_transformers_and_torchvision():
    wide = np.arange(5 * 8, dtype="float32").reshape(1, 5, 8, 1).repeat(3, -1)  # a margin of 3: 1.5 each side
    for offset, left in (("floor", 1), ("round", 2)):  # (8 - 5) // 2 as transformers; round(1.5) as torchvision
        out = image_io.fit_to_model(wide, (5, 5), resize_mode="shortest_edge", crop_offset=offset).numpy()
        np.testing.assert_array_equal(out[0, :, :, 0], wide[0, :, left:left + 5, 0])


def test_jpeg_decodes_as_pil_decodes_it():
    photo = photograph()
    for quality, crop in ((95, photo), (75, photo[:301, 17:400]), (50, photo[100:, :333])):
        data = tf.io.encode_jpeg(np.ascontiguousarray(crop), quality=quality).numpy()
        np.testing.assert_array_equal(image_io.decode_rgb(tf.constant(data)).numpy(),
                                      np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_fit_to_model_passes_an_image_at_the_model_size_unchanged():
    image = np.random.default_rng(0).uniform(0, 255, (1, 32, 32, 3)).astype("float32")
    for fields in (dict(), dict(interpolation="bicubic"), dict(resize_mode="shortest_edge", interpolation="bicubic")):
        np.testing.assert_allclose(image_io.fit_to_model(image, (32, 32), **fields).numpy(), image, atol=1e-4)
    assert math.floor(224 / 0.875) == 256


# --- the SavedModel serves the checkpoint's transform ---


@pytest.mark.slow
def test_saved_model_bytes_signature_serves_the_checkpoints_transform(tmp_path):
    from keras_vit.export import saved_model
    from tests.testing import TF1Server

    processor = {**PROCESSORS["facebook/dinov2-base"][0], "size": {"shortest_edge": 36},
                 "crop_size": {"height": 32, "width": 32}}
    model = build(save_pretrained(tmp_path / "dinov2", processor))
    assert model.preprocessing_config.crop_fraction == 32 / 36
    path = saved_model.export_saved_model(model, tmp_path / "served", version=1)
    metadata = saved_model.read_metadata(path)
    assert metadata["preprocessing"]["image_mean"] == IMAGENET_MEAN
    image = photograph()[:200, :300]
    jpeg = tf.io.encode_jpeg(image, quality=95).numpy()
    decoded = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))  # PIL's decode, as transformers reads files
    outputs = TF1Server(path).predict("serving_bytes", {"image_bytes": np.array([jpeg])})
    # The Keras model on PIL's shortest-edge-36 bicubic resize and centre crop of the same decoded pixels.
    expected = np.asarray(model(pil_transform(decoded, 32, short_side=36)[None].astype("float32")))
    np.testing.assert_allclose(outputs["logits"], expected, rtol=0, atol=0.05 * np.abs(expected).max())
    fitted = image_io.fit_to_model(decoded[None], (32, 32), resize_mode="shortest_edge", crop_fraction=32 / 36,
                                   interpolation="bicubic")
    np.testing.assert_allclose(outputs["logits"], np.asarray(model(fitted)), rtol=0, atol=1e-5)
