"""SigLIP 2 NaFlex against transformers 4.57.6: the processor's rule, the per-image position-table resize, masked
attention and pooling, from the random `Siglip2VisionModel` folder of tests/data/families (made by
`python -m tests.data.make_family_files siglip2_naflex`: five JPEGs of aspect ratios 1:3 to 16:5 at three budgets,
with transformers' processor outputs and model outputs for each image alone)."""

import json
import os
import re
import shutil

import keras
import numpy as np
import pytest
from PIL import Image

import keras_vit
from keras_vit import naflex
from keras_vit.layers.naflex import NaFlexPositionEmbedding
from keras_vit.variants import ViTConfig
from tests.data.make_family_files import FOLDER, NAFLEX, NAFLEX_BUDGETS, NAFLEX_SHAPES, TIMM_NAFLEX
from tests.testing import hub_cache_of

CASE = os.path.join(FOLDER, NAFLEX)
PATCH = 8
TOLERANCE = 1e-4  # max |difference| / max(1, max |reference|)


@pytest.fixture(scope="module")
def reference() -> dict:
    with np.load(os.path.join(CASE, "reference.npz")) as arrays:
        return dict(arrays)


@pytest.fixture(scope="module")
def model() -> keras.Model:
    return keras_vit.VisionTransformer(weights=CASE)


def image(index: int) -> np.ndarray:
    return np.asarray(Image.open(os.path.join(CASE, f"naflex_{index}.jpg")).convert("RGB"))


def to_numpy(x) -> np.ndarray:
    """A model output on any backend as NumPy."""
    return np.asarray(keras.ops.convert_to_numpy(x))


def relative(ours, theirs) -> float:
    ours, theirs = to_numpy(ours).astype(np.float64), to_numpy(theirs).astype(np.float64)
    return float(np.abs(ours - theirs).max() / max(1.0, np.abs(theirs).max()))


def reference_inputs(reference: dict, indices, budget: int) -> dict:
    """The processor's own outputs (transformers') for these images, as the model's inputs ([0, 255] patches)."""
    return dict(patches=np.stack([reference[f"raw_{i}_{budget}"] for i in indices]).astype(np.float32),
                patch_mask=np.stack([reference[f"pixel_attention_mask_{i}_{budget}"] for i in indices]),
                spatial_shapes=np.stack([reference[f"spatial_shapes_{i}_{budget}"] for i in indices]))


@pytest.mark.parametrize("budget", NAFLEX_BUDGETS)
def test_processor_matches_transformers(reference, budget):
    """Sizes, masks and grids exactly as `Siglip2ImageProcessor`; pixels as PIL's bilinear resize in uint8, within
    one level (Pillow 13 runs its two passes in an order it chooses, which moves a few values by one)."""
    for index, (height, width) in enumerate(NAFLEX_SHAPES):
        assert image(index).shape[:2] == (height, width)
        ours = naflex.naflex_inputs([image(index)], PATCH, budget)
        suffix = f"_{index}_{budget}"
        np.testing.assert_array_equal(ours["spatial_shapes"][0], reference["spatial_shapes" + suffix])
        np.testing.assert_array_equal(ours["patch_mask"][0], reference["pixel_attention_mask" + suffix])
        assert np.abs(ours["patches"][0] - reference["raw" + suffix]).max() <= 1.0, suffix


def test_resize_equals_pils_on_every_picture_but_the_1_to_3_one(reference):
    """Exact where Pillow 13 also takes the horizontal pass first: here every picture but the 1:3 one."""
    for index in range(1, len(NAFLEX_SHAPES)):
        for budget in NAFLEX_BUDGETS:
            ours = naflex.naflex_inputs([image(index)], PATCH, budget)
            np.testing.assert_array_equal(ours["patches"][0], reference[f"raw_{index}_{budget}"])


# Budget 256 on TensorFlow only (the other backends' runs leave `slow` out: each new shape compiles there).
@pytest.mark.parametrize("budget", [pytest.param(budget, marks=pytest.mark.slow) if budget == 256 else budget
                                    for budget in NAFLEX_BUDGETS])
def test_model_matches_transformers(model, reference, budget):
    """Pooled embedding and the image's tokens (last_hidden_state) of each image on transformers' pixels."""
    for index in range(len(NAFLEX_SHAPES)):
        outputs = model(reference_inputs(reference, [index], budget))
        suffix = f"_{index}_{budget}"
        valid = int(reference["pixel_attention_mask" + suffix].sum())
        assert relative(outputs["embedding"][0], reference["pooler_output" + suffix]) < TOLERANCE, suffix
        tokens = to_numpy(outputs["tokens"][0])[:valid]
        assert relative(tokens, reference["last_hidden_state" + suffix][:valid]) < TOLERANCE, suffix


def test_normalized_input_matches_transformers_pixel_values(reference):
    """include_preprocessing=False takes transformers' normalized `pixel_values`."""
    plain = naflex.NaFlexViT(weights=CASE, include_preprocessing=False)
    inputs = reference_inputs(reference, [0, 3], 64)
    inputs["patches"] = np.stack([reference[f"pixel_values_{i}_64"] for i in (0, 3)])
    outputs = plain(inputs)
    for row, index in enumerate((0, 3)):
        assert relative(outputs["embedding"][row], reference[f"pooler_output_{index}_64"]) < TOLERANCE


def test_a_batch_of_aspect_ratios_equals_each_alone(model):
    """Five grids (12x4 to 4x13) in one padded batch: each row as that image alone, to 1e-6."""
    images = [image(index) for index in range(len(NAFLEX_SHAPES))]
    batch = model(naflex.naflex_inputs(images, PATCH, 64))
    for index, picture in enumerate(images):
        inputs = naflex.naflex_inputs([picture], PATCH, 64)
        alone = model(inputs)
        valid = int(inputs["patch_mask"].sum())
        assert relative(batch["embedding"][index], alone["embedding"][0]) < 1e-6
        assert relative(to_numpy(batch["tokens"][index])[:valid], to_numpy(alone["tokens"][0])[:valid]) < 1e-6


def numpy_antialiased_bilinear(table: np.ndarray, height: int, width: int) -> np.ndarray:
    """(rows, columns, D) -> (height, width, D) as PyTorch's `F.interpolate(mode="bilinear", align_corners=False,
    antialias=True)` computes it (aten/src/ATen/native/cpu/UpSampleKernel.cpp, `_compute_index_ranges_weights`
    with the triangle filter): each axis in turn, float64, weights looped as the C++ loops them."""

    def axis_matrix(length: int, size: int) -> np.ndarray:
        scale = length / size
        support = scale if scale >= 1.0 else 1.0
        invscale = 1.0 / scale if scale >= 1.0 else 1.0
        matrix = np.zeros((size, length))
        for i in range(size):
            center = scale * (i + 0.5)
            xmin = max(int(center - support + 0.5), 0)
            xsize = min(int(center + support + 0.5), length) - xmin
            weights = [max(0.0, 1.0 - abs((j + xmin - center + 0.5) * invscale)) for j in range(xsize)]
            total = sum(weights)
            for j, weight in enumerate(weights):
                matrix[i, xmin + j] = weight / total if total else weight
        return matrix

    rows = np.einsum("hr,rcd->hcd", axis_matrix(table.shape[0], height), table.astype(np.float64))
    return np.einsum("wc,hcd->hwd", axis_matrix(table.shape[1], width), rows)


def test_position_table_resize_is_antialiased_bilinear_per_image():
    """The layer's table at five grids in one batch (shrinking, growing, 1x1, mixed) against the NumPy loops; the
    padding rows take the grid's first row, as transformers fills them."""
    rng = np.random.default_rng(0)
    table = rng.normal(0, 5, (4, 5, 6)).astype(np.float32)
    shapes = np.array([[3, 7], [6, 2], [4, 5], [1, 1], [9, 9], [2, 13]], np.int32)
    layer = NaFlexPositionEmbedding((4, 5))
    tokens = 81
    layer.build((None, tokens, 6))
    layer.pos_embedding.assign(table.reshape(1, 20, 6))
    out = to_numpy(layer(np.zeros((len(shapes), tokens, 6), np.float32), shapes))
    for row, (height, width) in enumerate(shapes):
        expected = numpy_antialiased_bilinear(table, height, width).reshape(height * width, 6)
        count = height * width
        assert relative(out[row, :count], expected) < 1e-6, (height, width)
        np.testing.assert_allclose(out[row, count:], np.broadcast_to(expected[0], (tokens - count, 6)), atol=1e-5)


def test_padding_changes_nothing(model, reference):
    """The same image at budget 37 padded further (to 50 rows of garbage patches): outputs unchanged."""
    inputs = reference_inputs(reference, [3], 37)
    valid = int(inputs["patch_mask"].sum())
    rng = np.random.default_rng(1)
    padded = {key: value.copy() for key, value in inputs.items()}
    padded["patches"] = np.concatenate([inputs["patches"], rng.uniform(0, 255, (1, 13, PATCH * PATCH * 3))], 1)
    padded["patches"][:, valid:] = rng.uniform(0, 255, padded["patches"][:, valid:].shape)
    padded["patches"] = padded["patches"].astype(np.float32)
    padded["patch_mask"] = np.concatenate([inputs["patch_mask"], np.zeros((1, 13), np.int32)], 1)
    ours, again = model(inputs), model(padded)
    assert relative(again["embedding"], ours["embedding"]) < 1e-6
    assert relative(to_numpy(again["tokens"])[0, :valid], to_numpy(ours["tokens"])[0, :valid]) < 1e-6


def test_config_round_trip(model, reference, tmp_path):
    """get_config / from_config rebuilds the same model (weights copied), a `.keras` file reloads it, and the layers'
    configs say their grids."""
    rebuilt = keras.Model.from_config(model.get_config())
    rebuilt.set_weights(model.get_weights())
    inputs = reference_inputs(reference, [1], 64)
    np.testing.assert_array_equal(to_numpy(rebuilt(inputs)["embedding"]), to_numpy(model(inputs)["embedding"]))
    model.save(tmp_path / "naflex.keras")
    reloaded = keras.saving.load_model(tmp_path / "naflex.keras")
    np.testing.assert_array_equal(to_numpy(reloaded(inputs)["embedding"]), to_numpy(model(inputs)["embedding"]))
    assert model.get_layer("posembed_input").get_config()["grid_size"] == [4, 4]


def test_file_config_and_preprocessing(model):
    """The config.json's architecture and numerics, the processor's mean and std."""
    file = naflex.naflex_file.read_naflex_checkpoint(CASE)
    assert file.config == dict(patch_size=8, hidden_dim=16, mlp_dim=32, num_heads=2, num_layers=2, classifier="map",
                               layer_norm_epsilon=1e-6, activation="gelu", gelu_approximate=True)
    assert file.position_grid == (4, 4)
    assert file.preprocessing == dict(image_mean=(0.45, 0.4, 0.55), image_std=(0.2, 0.25, 0.3), max_num_patches=64)
    scale = np.asarray(model.get_layer("preprocessing").get_config()["scale"])
    np.testing.assert_allclose(scale[:3], 1 / (255 * np.array([0.2, 0.25, 0.3])))


def copy_case(tmp_path, **processor_changes) -> str:
    folder = tmp_path / "naflex"
    shutil.copytree(CASE, folder)
    path = folder / "preprocessor_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(config, **processor_changes)))
    return str(folder)


def test_what_is_not_supported_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="SigLIP 2 NaFlex checkpoint.*input_shape=\\(64, 64, 3\\)"):
        keras_vit.VisionTransformer(weights=CASE, input_shape=(64, 64, 3))
    with pytest.raises(ValueError, match="pooling='avg'"):
        keras_vit.VisionTransformer(weights=CASE, pooling="avg")
    with pytest.raises(ValueError, match="resample=3"):
        naflex.NaFlexViT(weights=copy_case(tmp_path / "a", resample=3))
    with pytest.raises(ValueError, match="patch_size=16 \\(the model's is 8\\)"):
        naflex.NaFlexViT(weights=copy_case(tmp_path / "b", patch_size=16))
    with pytest.raises(ValueError, match="needs a `config`"):
        naflex.NaFlexViT()
    with pytest.raises(ValueError, match="classifier='token'"):
        naflex.NaFlexViT(ViTConfig(patch_size=8, hidden_dim=16, mlp_dim=32, num_heads=2, num_layers=1))
    with pytest.raises(ValueError, match="RGB \\(height, width, 3\\) uint8"):
        naflex.naflex_inputs([np.zeros((20, 30, 3), np.float32)], PATCH, 16)
    with pytest.raises(ValueError, match="not a SigLIP 2 checkpoint"):
        naflex.naflex_file.read_naflex_checkpoint(os.path.join(FOLDER, "hf_siglip_256"))


def test_the_command_line_tools_refuse_it_by_name(tmp_path, capsys):
    """keras-vit-tflite (and the other tools that build an image model from --weights, but keras-vit-export, which
    serves it: tests/export/test_naflex_serving.py) and keras-vit-convert say what the file is and how to build it,
    and write nothing."""
    from keras_vit.cli import tflite as tflite_cli
    from keras_vit.convert import convert_checkpoint

    with pytest.raises(SystemExit) as stopped:
        tflite_cli.main(["--weights", CASE, "--out", str(tmp_path / "served")])
    assert stopped.value.code == 1  # the tools' status for an input they refuse
    assert re.search(r"is a SigLIP 2 NaFlex checkpoint, whose model takes patch sequences .* which the command-line "
                     r"tools \(keras-vit-tflite", capsys.readouterr().err)
    with pytest.raises(ValueError, match=r"which keras-vit-convert cannot take yet"):
        convert_checkpoint(CASE, str(tmp_path / "model.keras"))
    assert list(tmp_path.iterdir()) == []


def test_loads_from_the_hub_cache_by_name(model, reference, tmp_path, monkeypatch):
    """`hf://google/siglip2-base-patch16-naflex` offline from the hub cache (huggingface_hub's layout: links to
    blobs): the folder's model, its outputs on transformers' pixels."""
    hub_cache_of(tmp_path, "google/siglip2-base-patch16-naflex", CASE)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    by_name = keras_vit.VisionTransformer(weights="hf://google/siglip2-base-patch16-naflex")
    inputs = reference_inputs(reference, [0, 3], 64)
    np.testing.assert_array_equal(to_numpy(by_name(inputs)["embedding"]), to_numpy(model(inputs)["embedding"]))
    assert relative(by_name(inputs)["embedding"][1], reference["pooler_output_3_64"]) < TOLERANCE


def test_a_naflex_folder_is_read_once_for_its_model(monkeypatch):
    """`VisionTransformer(weights=<NaFlex folder>)`: its safetensors header, config.json and processor are read
    once each, by the checkpoint reader, whose reading the NaFlex model is built from."""
    from keras_vit.checkpoints import config_files, safetensors_file

    counts = {}
    for module, name in ((safetensors_file, "read_header"), (config_files, "read_json")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, real=real, name=name, **kwargs: (
            counts.__setitem__(name, counts.get(name, 0) + 1), real(*args, **kwargs))[1])
    model = keras_vit.VisionTransformer(weights=CASE)
    assert counts == {"read_header": 1, "read_json": 2} and model.name == "naflex_vit"


# --- timm's NaFlexVit of the same weights (`python -m tests.data.make_family_files timm_naflex`) ---

TIMM_CASE = os.path.join(FOLDER, TIMM_NAFLEX)


def test_timm_naflexvit_file_matches_timm_and_transformers(model, reference):
    """timm's `naflexvit_base_patch16_siglip` file of the transformers folder's weights: keras_vit's model of it
    equals timm's pooled output on each picture at every budget (and so transformers', which timm's equals: the
    generator checks it) and holds the same weights as the transformers folder's model."""
    timm_model = keras_vit.VisionTransformer(weights=TIMM_CASE)
    with np.load(os.path.join(TIMM_CASE, "reference.npz")) as arrays:
        timm_reference = dict(arrays)
    for budget in NAFLEX_BUDGETS:
        for index in range(len(NAFLEX_SHAPES)):
            suffix = f"_{index}_{budget}"
            outputs = timm_model(reference_inputs(reference, [index], budget), training=False)
            assert relative(outputs["embedding"][0], timm_reference["pooled" + suffix]) < TOLERANCE, suffix
            assert relative(outputs["embedding"][0], reference["pooler_output" + suffix]) < TOLERANCE, suffix
    ours, theirs = ({variable.path.split("/", 1)[-1]: to_numpy(variable) for variable in m.weights}
                    for m in (timm_model, model))
    assert ours.keys() == theirs.keys()
    for path, value in ours.items():
        np.testing.assert_array_equal(value, theirs[path], err_msg=path)


def copy_timm_case(folder, **model_args) -> str:
    shutil.copytree(TIMM_CASE, folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["architecture"] = model_args.pop("architecture", config["architecture"])
    config["model_args"].update(model_args)
    path.write_text(json.dumps(config))
    return str(folder)


def test_timm_naflexvit_options_not_implemented_are_refused_by_name(tmp_path):
    """(keras-vit-export's refusal of timm's files: tests/export/test_naflex_serving.py.)"""
    with pytest.raises(ValueError, match=r"timm's naflexvit_base_patch16_map is not implemented; keras_vit reads "
                                         r"timm's SigLIP 2 NaFlexVit entry points \(naflexvit_base_patch16_siglip"):
        keras_vit.VisionTransformer(weights=copy_timm_case(tmp_path / "a", architecture="naflexvit_base_patch16_map"))
    with pytest.raises(ValueError, match=r"model_args pos_embed_interp_mode='bicubic' is not implemented"):
        keras_vit.VisionTransformer(weights=copy_timm_case(tmp_path / "b", pos_embed_interp_mode="bicubic"))
    with pytest.raises(ValueError, match=r"model_args reg_tokens=4, qk_norm=True is not implemented"):
        keras_vit.VisionTransformer(weights=copy_timm_case(tmp_path / "c", reg_tokens=4, qk_norm=True))
