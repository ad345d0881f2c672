"""`weights=` a `save_pretrained` directory or an `hf://org/name` in the local Hugging Face hub cache (made here,
in the layout `huggingface_hub` writes; nothing is downloaded)."""

import json

import numpy as np
import pytest

import keras_vit
from keras_vit.checkpoints import locate
from tests.testing import hf_state_dict, save_checkpoint, save_safetensors, timm_state_dict, vit_checkpoint

HF_CONFIG = {"num_attention_heads": 3, "layer_norm_eps": 1e-12, "hidden_act": "gelu"}
IMAGES = np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype("float32")


def save_pretrained(folder, state=None, config=HF_CONFIG):
    """A transformers `save_pretrained` folder: model.safetensors and config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(hf_state_dict() if state is None else state, folder / "model.safetensors")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def build(weights):
    return keras_vit.VisionTransformer(weights=weights, input_shape=(32, 32, 3), classes=10,
                                       include_preprocessing=False, classifier_activation=None)


def hub_cache(root, repo, folder_builder, revision="main", commit="0123abcd"):
    """`huggingface_hub`'s cache layout: models--org--name/refs/<revision> -> snapshots/<commit>/..."""
    model = root / ("models--" + repo.replace("/", "--"))
    (model / "refs").mkdir(parents=True)
    (model / "refs" / revision).write_text(commit)
    folder_builder(model / "snapshots" / commit)
    return root


def test_a_save_pretrained_directory_loads_like_its_file_with_its_config(tmp_path):
    folder = save_pretrained(tmp_path / "vit")
    from_folder, from_file = build(str(folder)), build(str(folder / "model.safetensors"))
    assert from_folder.vit_config == from_file.vit_config and from_folder.vit_config.layer_norm_epsilon == 1e-12
    np.testing.assert_array_equal(np.asarray(from_folder(IMAGES)), np.asarray(from_file(IMAGES)))


def test_a_directory_with_one_npz_or_timm_file_loads(tmp_path):
    (tmp_path / "npz").mkdir()
    save_checkpoint(tmp_path / "npz" / "ViT-tiny.npz", vit_checkpoint(seed=1))
    assert build(str(tmp_path / "npz")).vit_config.gelu_approximate is True
    (tmp_path / "timm").mkdir()
    save_safetensors(timm_state_dict(), tmp_path / "timm" / "model.safetensors")
    (tmp_path / "timm" / "config.json").write_text(json.dumps({"architecture": "vit_tiny_patch16_224"}))
    model = keras_vit.VisionTransformer(weights=str(tmp_path / "timm"), num_heads=3, input_shape=(32, 32, 3),
                                        classes=10)
    assert model.vit_config.layer_norm_epsilon == 1e-6  # timm's, its config.json not being Hugging Face's


def test_hub_name_loads_from_the_local_cache_offline(tmp_path, monkeypatch):
    cache = hub_cache(tmp_path / "hub", "google/vit-tiny", save_pretrained)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build("hf://google/vit-tiny")
    snapshot = cache / "models--google--vit-tiny" / "snapshots" / "0123abcd"
    np.testing.assert_array_equal(np.asarray(model(IMAGES)), np.asarray(build(str(snapshot))(IMAGES)))


def test_hub_revision_and_hf_home(tmp_path, monkeypatch):
    hub_cache(tmp_path / "home" / "hub", "org/model", save_pretrained, revision="v1", commit="feed")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert locate.locate("hf://org/model@v1") == str(
        tmp_path / "home" / "hub" / "models--org--model" / "snapshots" / "feed" / "model.safetensors")
    assert locate.locate("hf://org/model@feed").endswith("snapshots/feed/model.safetensors")  # a commit as it is


def test_hub_name_not_cached_names_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError) as error:
        build("hf://timm/vit_base_patch16_224.augreg_in21k@v2")
    message = str(error.value)
    assert "is not in the local Hugging Face cache" in message and "downloads nothing" in message
    assert "`huggingface-cli download timm/vit_base_patch16_224.augreg_in21k --revision v2`" in message


@pytest.mark.parametrize("name", ["hf://", "hf://justone", "hf://a/b/c", "hf://org/ name"])
def test_malformed_hub_name_is_named(name):
    with pytest.raises(ValueError, match=r"expected a Hugging Face hub name hf://org/name"):
        build(name)


def test_directories_without_one_weights_file_are_clear(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"holds no weights file: expected model.safetensors .*config.json"):
        build(str(empty))
    several = tmp_path / "several"
    several.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        save_safetensors(timm_state_dict(), several / name)
    with pytest.raises(ValueError, match=r"several weights files \['a.safetensors', 'b.safetensors'\]"):
        build(str(several))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="holds a sharded checkpoint"):
        build(str(sharded))


def test_a_config_json_that_contradicts_the_weights_is_an_error(tmp_path):
    folder = save_pretrained(tmp_path / "vit", config={**HF_CONFIG, "hidden_size": 64, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match=r"contradicts its weights: it says hidden_dim=64, the weights' shapes have "
                                         r"hidden_dim=48"):
        build(str(folder))
    matching = save_pretrained(tmp_path / "ok", config={**HF_CONFIG, "hidden_size": 48, "intermediate_size": 96,
                                                        "num_hidden_layers": 2, "patch_size": 8})
    assert build(str(matching)).vit_config.hidden_dim == 48
