"""Position embeddings are resized the way the checkpoint's source does (issue 34): `.npz` files with the
original vit_jax rule, timm files with PyTorch's antialiased bicubic resize, Hugging Face files with its plain
bicubic one (`keras_vit.checkpoints.resample`). The reference is PyTorch itself: tests/data/resample_reference.npz
(written by tests/data/make_resample_reference.py), and `F.interpolate` directly where torch is installed."""

import os
import warnings

import numpy as np
import pytest
import scipy.ndimage

import keras
import keras_vit
from keras_vit.checkpoints import resample, torch_layout
from tests.reference import TORCH_EPS, gelu_erf, released_from_torch, vit_logits
from tests.testing import (TINY_VIT, hf_state_dict, needs, save_checkpoint, save_safetensors, timm_state_dict,
                           vit_checkpoint)

REFERENCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "resample_reference.npz")
CASES = ("dinov2_518_to_224", "deit_224_to_384", "non_square")
TORCH_OPTION = {resample.BICUBIC: "plain", resample.BICUBIC_ANTIALIAS: "antialias"}


@pytest.fixture(scope="module")
def reference():
    with np.load(REFERENCE) as archive:
        return dict(archive)


# --- the loader's resize against PyTorch's outputs ---


@pytest.mark.parametrize("method", sorted(TORCH_OPTION))
@pytest.mark.parametrize("case", CASES)
def test_bicubic_matches_torch_reference(reference, case, method):
    grid, size = reference[f"{case}/input"], tuple(reference[f"{case}/new_size"])
    exact, as_run = reference[f"{case}/{TORCH_OPTION[method]}_float64"], reference[f"{case}/{TORCH_OPTION[method]}"]
    # float64 in: PyTorch's own arithmetic, to the last bits.
    np.testing.assert_allclose(resample.resize_grid(grid.astype(np.float64), size, method), exact, rtol=0, atol=1e-12)
    out = resample.resize_grid(grid, size, method)
    assert out.dtype == np.float32 and out.shape == (*size, grid.shape[-1])
    assert np.abs(out - exact).max() < 1e-6  # the exact resize, rounded to float32
    # What timm / transformers produce in float32 is off by its float32 weights' rounding, and we by no more.
    torch_rounding = np.abs(as_run - exact).max()
    assert torch_rounding < 1e-5 and np.abs(out - as_run).max() <= torch_rounding + 1e-6


def test_reference_records_its_torch():
    with np.load(REFERENCE) as archive:
        assert str(archive["torch_version"]).startswith("2.")


@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("sizes", [(4, 4), (1, 5), (5, 1), (37, 16), (14, 24)])
def test_bicubic_matrix_rows_sum_to_one(sizes, antialias):
    matrix = keras.ops.convert_to_numpy(resample.bicubic_matrix(*sizes, antialias, "float64"))
    assert matrix.shape == sizes[::-1]
    np.testing.assert_allclose(matrix.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    if sizes[0] == sizes[1]:
        np.testing.assert_allclose(matrix, np.eye(sizes[0]), rtol=0, atol=1e-12)


def test_linear_corners_is_scipy_zoom():
    grid = np.random.default_rng(0).standard_normal((7, 5, 3)).astype("float32")
    expected = scipy.ndimage.zoom(grid.astype(np.float64), (4 / 7, 9 / 5, 1), order=1)
    np.testing.assert_allclose(resample.resize_grid(grid, (4, 9), resample.LINEAR_CORNERS), expected, atol=1e-6)


def test_unknown_method_and_bad_grid_are_errors():
    with pytest.raises(ValueError, match="Unknown resampling method 'bilinear'; expected one of linear_corners"):
        resample.resize_grid(np.zeros((2, 2, 1)), 3, "bilinear")
    with pytest.raises(ValueError, match=r"must have shape \(rows, columns, D\)"):
        resample.resize_grid(np.zeros((4, 1)), 3)


# --- the loader picks the file's source's method ---


def test_each_model_class_resamples_as_its_source():
    def method(layout, *keys):
        return torch_layout.position_resampling(layout, ["embeddings.cls_token", *keys])

    assert {layout: method(layout)[0] for layout in (torch_layout.TIMM, *torch_layout.HF_LAYOUTS)} == {
        torch_layout.TIMM: resample.BICUBIC_ANTIALIAS, torch_layout.HUGGING_FACE: resample.BICUBIC,
        torch_layout.HF_DINOV2: resample.BICUBIC, torch_layout.HF_CLIP: resample.BICUBIC,
        torch_layout.HF_SIGLIP: resample.BICUBIC, torch_layout.HF_DINOV3: resample.BICUBIC}  # DINOv3: no table
    # transformers' Dinov2WithRegistersModel (4.48 to 5.24) resizes with antialias=True, Dinov2Model without.
    for keys in (["embeddings.register_tokens"], ["dinov2.embeddings.register_tokens"]):
        assert method(torch_layout.HF_DINOV2, *keys) == (resample.BICUBIC_ANTIALIAS,
                                                          "transformers' Dinov2WithRegistersModel")


def load_at(path, input_shape=(40, 24, 3)):
    """A tiny model at `input_shape` (a 5x3 grid) from a file of a 4x4 grid, and the resize warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = keras_vit.VisionTransformer(**TINY_VIT, weights=str(path), input_shape=input_shape, classes=10,
                                            include_preprocessing=False, classifier_activation=None)
    messages = [str(w.message) for w in caught if "position embedding" in str(w.message)]
    table = keras.ops.convert_to_numpy(model.get_layer("posembed_input").pos_embedding)
    return model, table, messages


def resized(posemb, method, grid=(5, 3)):
    posemb = np.asarray(posemb, np.float32)
    return np.concatenate([posemb[:, :1], resample.resize_grid(posemb[0, 1:].reshape(4, 4, -1), grid, method)
                           .reshape(1, grid[0] * grid[1], -1)], axis=1)


@pytest.mark.parametrize("source", ["timm", "huggingface", "npz"])
def test_loader_resamples_with_the_files_method(tmp_path, source):
    if source == "timm":
        state = timm_state_dict()
        posemb, path = state["pos_embed"], save_safetensors(state, tmp_path / "timm.safetensors")
        method, words = resample.BICUBIC_ANTIALIAS, "bicubically with antialiasing, as timm does"
    elif source == "huggingface":
        state = hf_state_dict()
        posemb = state["vit.embeddings.position_embeddings"]
        path = save_safetensors(state, tmp_path / "hf.safetensors")
        method, words = resample.BICUBIC, "bicubically, as transformers does"
    else:
        arrays = vit_checkpoint(grid=4, seed=3)
        posemb, path = arrays["Transformer/posembed_input/pos_embedding"], save_checkpoint(tmp_path / "vit.npz", arrays)
        method, words = resample.LINEAR_CORNERS, "as the original loader does"
    _, table, messages = load_at(path)
    np.testing.assert_allclose(table, resized(posemb, method), rtol=0, atol=1e-6)
    others = [other for other in resample.METHODS if other != method]
    assert all(np.abs(table - resized(posemb, other)).max() > 1e-3 for other in others)  # the methods differ here
    assert len(messages) == 1 and messages[0].endswith(f" resampled from 17 to 16 tokens (5x3 grid), {words}.")
    if source == "npz":  # the vit_jax rule, as before: scipy's zoom of the grid
        grid = np.asarray(posemb, np.float64)[0, 1:].reshape(4, 4, -1)
        expected = scipy.ndimage.zoom(grid, (5 / 4, 3 / 4, 1), order=1).reshape(15, -1)
        np.testing.assert_allclose(table[0, 1:], expected, rtol=0, atol=1e-6)


def test_hugging_face_resized_logits_match_the_reference_with_bicubic_table(tmp_path):
    state = hf_state_dict()  # trained at 32x32: a 4x4 grid, run at 40x24 (5x3)
    model, _, _ = load_at(save_safetensors(state, tmp_path / "hf.safetensors"))
    key = "vit.embeddings.position_embeddings"
    at_size = dict(state, **{key: resized(state[key], resample.BICUBIC)})  # the table transformers would use
    x = np.random.default_rng(1).uniform(-1, 1, (2, 40, 24, 3)).astype("float32")
    expected = vit_logits(released_from_torch(at_size, num_heads=3), x, posemb_grid=(5, 3),
                          eps=TORCH_EPS["huggingface"], gelu=gelu_erf, pixels=False)
    assert np.abs(expected).max() > 1.0
    np.testing.assert_allclose(keras.ops.convert_to_numpy(model(x)), expected, rtol=0, atol=1e-5)


# --- directly against PyTorch (.ci/torch) ---


@needs("torch", "the reference of PyTorch's bicubic resize")
def test_bicubic_matches_torch_interpolate_on_random_sizes():
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    for _ in range(60):
        # Outputs of one column are left out: there torch 2.13's 2-D antialiased kernel disagrees with its own
        # two 1-D passes (and with PIL's rule); no position-embedding grid is one patch wide.
        old, new = tuple(int(v) for v in rng.integers(1, 40, 2)), tuple(int(v) for v in rng.integers(2, 40, 2))
        grid = rng.standard_normal((*old, 4))
        for method, antialias in ((resample.BICUBIC, False), (resample.BICUBIC_ANTIALIAS, True)):
            expected = F.interpolate(torch.from_numpy(grid).permute(2, 0, 1)[None].contiguous(), size=new,
                                     mode="bicubic", align_corners=False, antialias=antialias)[0].permute(1, 2, 0)
            np.testing.assert_allclose(resample.resize_grid(grid, new, method), expected.numpy(), rtol=0, atol=1e-12,
                                       err_msg=f"{old} -> {new}, antialias={antialias}")


@pytest.mark.parametrize("antialias", [False, True])
def test_the_layers_graph_matrix_is_the_loaders(antialias):
    """`resample.bicubic_matrix` as a model's layer computes it (float32, sizes known at run time) against the
    loader's (float64, checked against torch above), down and up, including sizes given as tensors in a traced
    function, as a model of any input size computes them."""
    import tensorflow as tf

    for length, size in ((37, 16), (14, 24), (7, 5), (7, 9), (4, 4), (16, 2)):
        expected = keras.ops.convert_to_numpy(resample.bicubic_matrix(length, size, antialias, "float64"))
        eager = np.asarray(resample.bicubic_matrix(length, size, antialias))
        traced = tf.function(lambda n: resample.bicubic_matrix(length, n, antialias))(tf.constant(size)).numpy()
        np.testing.assert_allclose(eager, expected, rtol=0, atol=2e-6, err_msg=f"{length} -> {size}")
        np.testing.assert_allclose(traced, expected, rtol=0, atol=2e-6, err_msg=f"{length} -> {size}")


def test_position_resampling_names_agree_and_layouts_carry_theirs(tmp_path):
    from keras_vit import variants
    from keras_vit.checkpoints.reader import read_checkpoint

    assert variants.POSITION_RESAMPLINGS == resample.METHODS
    timm_file = read_checkpoint(save_safetensors(timm_state_dict(), tmp_path / "timm.safetensors"))
    hf_file = read_checkpoint(save_safetensors(hf_state_dict(), tmp_path / "hf.safetensors"))
    assert timm_file.config_fields(3)["position_resampling"] == resample.BICUBIC_ANTIALIAS
    assert hf_file.config_fields(3)["position_resampling"] == resample.BICUBIC
    with pytest.raises(ValueError, match="Unknown position_resampling 'cubic'"):
        keras_vit.ViTTi16(weights=None, position_resampling="cubic")
