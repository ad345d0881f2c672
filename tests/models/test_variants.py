"""`ViTConfig`: one frozen config for the architecture, the family options and the numerics; every option is a
keyword of the builders; a misspelled one fails before anything is built; a weights file is read once."""

import json
import os
import re

import keras
import numpy as np
import pytest

import keras_vit
from keras_vit import models, variants
from keras_vit.checkpoints import config_files, loader, reader, safetensors_file
from tests.testing import REPO, TINY_VIT, hf_state_dict, save_checkpoint, save_safetensors, vit_checkpoint


def test_decode_variant_returns_a_config_that_reads_like_the_table_row():
    config = keras_vit.decode_variant("ViT-B_16")
    assert isinstance(config, keras_vit.ViTConfig) and config == keras_vit.decode_variant("B/16")
    assert (config.hidden_dim, config["num_heads"], config.get("resnet_stages")) == (768, 12, None)
    assert {name: config[name] for name in variants.VARIANTS["B/16"]} == variants.VARIANTS["B/16"]
    assert keras_vit.decode_variant("R50+B/16").stride == 16 and keras_vit.decode_variant("B/32").stride == 32
    assert dict(config) == {name: getattr(config, name) for name in variants.OPTIONS}


def test_config_round_trips_through_json():
    config = keras_vit.decode_variant("R50+B/16").replace(qk_norm=True, num_register_tokens=4,
                                                          layer_norm_epsilon=1e-5, activation="quick_gelu")
    assert keras_vit.ViTConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(dataclasses_error()):
        config.qk_norm = False  # frozen


def dataclasses_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("call", [
    lambda: keras_vit.ViTB16(qk_nrom=True),
    lambda: keras_vit.VisionTransformer("B/16", qk_nrom=True),
    lambda: keras_vit.decode_variant("B/16").replace(qk_nrom=True),
    lambda: keras_vit.ViTConfig.from_dict(dict(keras_vit.decode_variant("B/16"), qk_nrom=True)),
])
def test_misspelled_option_names_the_closest_and_every_valid_one_before_building(call, monkeypatch):
    monkeypatch.setattr(models, "_forward", lambda *a, **k: pytest.fail("built a model"))
    monkeypatch.setattr(loader, "resolve", lambda *a, **k: pytest.fail("resolved weights (a download)"))
    with pytest.raises(TypeError) as error:
        call()
    message = str(error.value)
    assert "unknown option 'qk_nrom'. Did you mean 'qk_norm'?" in message
    assert "Valid options: patch_size, hidden_dim," in message and all(name in message for name in variants.OPTIONS)


def test_unknown_option_without_a_close_match_lists_the_valid_ones():
    with pytest.raises(TypeError, match=r"ViTTi16 got an unknown option 'zzz'\. Valid options: patch_size"):
        keras_vit.ViTTi16(weights=None, zzz=1)


@pytest.mark.parametrize("change, match", [
    (dict(classifier="avg"), r"Unknown classifier 'avg'.*classifier='gap'"),
    (dict(position_embedding="alibi"), r"Unknown position_embedding 'alibi'"),
    (dict(rope="dinov3", hidden_dim=40, num_heads=4), r"rope='dinov3' needs a head size .* divisible by 4"),
    (dict(rope="rope"), r"rope must be None \(no rotary positions\) or one of \('dinov3', 'eva02'\)"),
    (dict(rope="dinov3", rope_reference_grid=(16, 16)), r"rope_reference_grid must be None or \(rows, columns\), "
                                                        r"positive ints, with rope='eva02'"),
    (dict(rope_rescale=0.5), r"rope_rescale must be None \(off\) or a number >= 1\. Received: rope_rescale=0\.5"),
    (dict(rope_theta=0), r"rope_theta must be a positive number"),
    (dict(activation="relu"), r"Unknown activation 'relu'\. Expected one of \('gelu', 'quick_gelu', 'silu'\)"),
    (dict(num_heads=0), r"num_heads must be a positive int\. Received: num_heads=0"),
    (dict(distillation_token=True, classifier="gap"), r"distillation_token=True needs classifier='token'"),
])
def test_invalid_values_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        keras_vit.decode_variant("Ti/16").replace(**change)


def test_none_means_not_given_and_user_options_win_over_the_variant():
    config = models.model_config("Ti/16", None, num_layers=2, layer_scale_init=None, gelu_approximate=None)
    assert (config.num_layers, config.hidden_dim, config.layer_scale_init, config.gelu_approximate) == (2, 192, None,
                                                                                                      True)
    with pytest.raises(ValueError, match=r"needs `variant`, the architecture arguments \['num_heads'\]"):
        models.model_config(None, None, patch_size=8, hidden_dim=48, mlp_dim=96, num_layers=2)


def test_transformer_block_takes_its_fields_from_the_config():
    config = keras_vit.ViTConfig(**TINY_VIT, qk_norm=True, layer_scale_init=0.1, activation="quick_gelu")
    block = keras_vit.TransformerBlock(**config.arguments_of(keras_vit.TransformerBlock))
    block_config = block.get_config()
    assert {name: block_config[name] for name in config.arguments_of(keras_vit.TransformerBlock)} == {
        name: getattr(config, name) for name in config.arguments_of(keras_vit.TransformerBlock)}
    assert set(config.arguments_of(keras_vit.TransformerBlock)) == {
        "num_heads", "mlp_dim", "dropout_rate", "attention_dropout_rate", "drop_path_rate", "layer_norm_epsilon",
        "gelu_approximate", "activation", "layer_scale_init", "qk_norm", "remat", "gated_mlp", "mlp_norm"}


def test_model_config_round_trips_with_the_model_and_old_configs_load(tmp_path):
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=10, qk_norm=True)
    assert model.vit_config.qk_norm and model.get_config()["vit_config"]["qk_norm"] is True
    old = {key: value for key, value in model.get_config().items()
           if key not in ("vit_config", "preprocessing_config")}  # as 0.1 saved it
    assert models.ViTModel.from_config(old).vit_config is None
    assert models.ViTModel.from_config(old).preprocessing_config is None


def test_preprocessing_is_its_own_record_carried_by_the_model_and_its_file():
    """The input fields are `PreprocessingConfig`'s, not the forward's: the builders take them as keywords, the
    model carries both records, `get_config` writes both, and a 0.2 config (input fields inside `vit_config`) is
    split when it loads."""
    assert len(variants.OPTIONS) == 33 and not set(variants.OPTIONS) & set(variants.PREPROCESSING_FIELDS)
    model = keras_vit.VisionTransformer(**TINY_VIT, input_shape=(32, 32, 3), classes=10, image_mean=(0.4, 0.5, 0.6),
                                        crop_fraction=0.875, interpolation="bicubic")
    expected = keras_vit.PreprocessingConfig(image_mean=(0.4, 0.5, 0.6), crop_fraction=0.875, interpolation="bicubic")
    assert model.preprocessing_config == expected and model.vit_config == keras_vit.ViTConfig(**TINY_VIT)
    assert keras_vit.PreprocessingConfig.from_dict(json.loads(json.dumps(expected.to_dict()))) == expected
    assert expected.resize_arguments == dict(resize_mode="squash", crop_fraction=0.875, resize_size=None,
                                             interpolation="bicubic", crop_offset="floor")
    saved = model.get_config()
    assert saved["preprocessing_config"]["crop_fraction"] == 0.875 and "crop_fraction" not in saved["vit_config"]
    as_0_2 = {key: value for key, value in saved.items() if key != "preprocessing_config"}
    as_0_2["vit_config"] = {**saved["vit_config"], **saved["preprocessing_config"]}
    loaded = models.ViTModel.from_config(as_0_2)
    assert (loaded.vit_config, loaded.preprocessing_config) == (model.vit_config, expected)
    with pytest.raises(TypeError, match="got 'image_mean', a field of the model's preprocessing, not of its forward: "
                                        "it is in keras_vit.PreprocessingConfig"):
        model.vit_config.replace(image_mean=(0.5, 0.5, 0.5))
    with pytest.raises(TypeError, match="PreprocessingConfig got an unknown option 'crop_fractoin'. Did you mean "
                                        "'crop_fraction'?"):
        expected.replace(crop_fractoin=0.9)
    with pytest.raises(TypeError, match="ViTB16 got an unknown option 'image_meen'. Did you mean 'image_mean'?"):
        keras_vit.ViTB16(weights=None, image_meen=(0.5, 0.5, 0.5))


def _counting(monkeypatch, module, name, counts):
    real = getattr(module, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_a_weights_file_header_and_config_json_are_read_once(tmp_path, monkeypatch):
    folder = tmp_path / "hf"
    folder.mkdir()
    path = save_safetensors(hf_state_dict(), folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"num_attention_heads": 3, "layer_norm_eps": 1e-12,
                                                    "hidden_act": "gelu"}))
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "ViTImageProcessor",
                                                                 "size": 32}))
    counts = {}
    _counting(monkeypatch, safetensors_file, "read_header", counts)
    _counting(monkeypatch, config_files, "read_hf_config", counts)
    _counting(monkeypatch, config_files, "read_json", counts)  # each JSON file beside it, once
    model = keras_vit.VisionTransformer(weights=path, input_shape=(32, 32, 3), classes=10,
                                        include_preprocessing=False)
    assert counts == {"read_header": 1, "read_hf_config": 1, "read_json": 2}
    assert model.vit_config.num_heads == 3 and model.vit_config.layer_norm_epsilon == 1e-12


def test_an_npz_file_is_opened_for_its_shapes_once_and_for_its_arrays_once(tmp_path, monkeypatch):
    from keras_vit.checkpoints import npz
    path = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(seed=1))
    counts = {}
    _counting(monkeypatch, npz, "read_npz_shapes", counts)
    _counting(monkeypatch, npz, "read_npz", counts)
    keras_vit.VisionTransformer(weights=path, input_shape=(32, 32, 3), classes=10)
    assert counts == {"read_npz_shapes": 1, "read_npz": 1}


def test_a_checkpoint_file_summary_can_be_passed_as_weights(tmp_path):
    path = save_checkpoint(tmp_path / "vit.npz", vit_checkpoint(seed=1))
    file = reader.read_checkpoint(path)
    assert (file.layout, file.head_classes, file.image_size) == (None, 10, 32)
    from_file = keras_vit.VisionTransformer(weights=file, input_shape=(32, 32, 3), classes=10)
    from_path = keras_vit.VisionTransformer(weights=path, input_shape=(32, 32, 3), classes=10)
    x = np.random.default_rng(0).uniform(0, 255, (2, 32, 32, 3)).astype("float32")
    np.testing.assert_array_equal(np.asarray(from_file(x)), np.asarray(from_path(x)))
    assert from_file.vit_config == from_path.vit_config


def test_models_module_opens_no_file():
    """The builder and the forward only: reading files is keras_vit.checkpoints' job."""
    import ast
    import inspect
    tree = ast.parse(inspect.getsource(models))
    calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
             for node in ast.walk(tree) if isinstance(node, ast.Call)}
    assert not calls & {"open", "read_header", "read_npz", "read_npz_shapes", "read_checkpoint", "read_hf_config",
                        "load_model", "isfile"}


def test_keras_vit_inspect_is_the_renamed_inspection_module_with_a_warning():
    import keras_vit.inspection
    with pytest.warns(DeprecationWarning, match="keras_vit.inspect is now keras_vit.inspection"):
        from keras_vit import inspect as old
    assert old is keras_vit.inspection and keras.__name__ == "keras"


def test_every_config_field_is_documented_in_the_builders_docstring_and_docs_models():
    """A new `ViTConfig` or `PreprocessingConfig` field needs its line in `models.BASE_DOCSTRING` (every builder's
    `help`) and in docs/models.md (the checklist in docs/architecture.md)."""
    with open(os.path.join(REPO, "docs", "models.md"), encoding="utf-8") as file:
        page = file.read()
    docstring = models.BASE_DOCSTRING
    assert [name for name in variants.BUILDER_OPTIONS if not re.search(rf"\b{name}\b", docstring)] == []
    assert [name for name in variants.BUILDER_OPTIONS if f"`{name}" not in page and f"{name}=" not in page] == []
