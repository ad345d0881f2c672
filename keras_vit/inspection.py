"""Looking inside a Vision Transformer (arXiv:2010.11929, Sec. 4.5, Fig. 6-7, App. D.7-D.8).

Four views, each computed from a model's own weights (attention comes from
`keras_vit.attention_model`, which shares the weights and leaves the model untouched):

- `attention_rollout`: Abnar & Zuidema (2020) rollout; the class token's row over the
  patch grid (paper Fig. 6).
- `mean_attention_distance`: per layer and head, the pixel distance between query and key
  patch centres weighted by attention (paper Fig. 7 right).
- `position_embedding_similarity`: cosine similarity of every patch's position embedding
  with every other (paper Fig. 7 centre).
- `embedding_filters`: principal components of the patch-embedding kernel as RGB tiles
  (paper Fig. 7 left).

`write_figures` draws all four as PNG (matplotlib, imported only when drawing); the command
line is `keras-vit-inspect` (`keras_vit/cli/inspect.py`).
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import keras
import numpy as np

from keras_vit import features
from keras_vit.atomic import atomic_write
from keras_vit.geometry import ModelGeometry, model_geometry

FILTER_CHANNELS = (1, 3)
FIGURES = ("attention_rollout.png", "mean_attention_distance.png", "position_embedding_similarity.png",
           "embedding_filters.png")


# === Model anatomy ===

def _fixed_size_geometry(model: keras.Model) -> ModelGeometry:
    geometry = model_geometry(model)
    if geometry.input_size is None:
        raise ValueError(f"keras_vit.inspection needs a model of a fixed input size, but model {model.name!r} takes "
                         "any size: build it at your images' size, input_shape=(height, width, 3), from the same "
                         "weights.")
    return geometry


def token_layout(model: keras.Model) -> tuple[tuple[int, int], int, tuple[int, int]]:
    """Returns `(grid_size, num_prefix_tokens, stride)` of a keras_vit model.

    `grid_size` is the (rows, columns) patch grid, `num_prefix_tokens` the tokens before it (class,
    distillation and register tokens: 1 with a class token alone, 0 for `classifier="gap"`), `stride` the
    (height, width) in pixels of the input covered by one token (patch size times the ResNet stem's stride
    for hybrids).
    """
    geometry = _fixed_size_geometry(model)
    return geometry.grid, geometry.num_prefix_tokens, geometry.stride


def _as_batch(model: keras.Model, images) -> np.ndarray:
    images = np.asarray(images, dtype="float32")
    if images.ndim == 3:
        images = images[None]
    expected = tuple(model.inputs[0].shape[1:])
    if images.ndim != 4 or images.shape[1:] != expected:
        raise ValueError(f"Expected images of shape (batch, *{expected}) or {expected}. "
                         f"Received shape: {images.shape}")
    return images


def _attention_batches(model: keras.Model, images, batch_size: int) -> Iterator[list[np.ndarray]]:
    """Yields, per batch of images, the list of per-layer attention weights (batch, heads, T, T)."""
    probe = features.attention_model(model)
    images = _as_batch(model, images)
    for start in range(0, len(images), batch_size):
        outputs = probe(images[start:start + batch_size], training=False)
        yield [keras.ops.convert_to_numpy(scores).astype("float64") for scores in outputs["attention"]]


# === Attention rollout ===

def rollout(attentions: Sequence[np.ndarray]) -> np.ndarray:
    """`keras_vit.features.rollout` (float32) of per-layer attention weights (batch, heads, tokens, tokens), as a
    (batch, tokens, tokens) NumPy array whose rows sum to 1."""
    return keras.ops.convert_to_numpy(features.rollout([np.asarray(attention) for attention in attentions]))


def rollout_map(joint: np.ndarray, grid_size: tuple[int, int], num_prefix_tokens: int,
                class_token: bool | None = None) -> np.ndarray:
    """`keras_vit.features.rollout_map` of a rolled-out attention matrix, as a (batch, rows, columns) NumPy array."""
    return keras.ops.convert_to_numpy(features.rollout_map(joint, grid_size, num_prefix_tokens, class_token))


def attention_rollout(model: keras.Model, images, batch_size: int = 32) -> np.ndarray:
    """Attention-rollout maps of images, (batch, rows, columns) over the model's patch grid.

    Args:
        model: a keras_vit model (any resolution, rectangular grids, hybrids).
        images: (batch, height, width, channels) or one image, as the model takes them.
        batch_size: int. Images per forward pass. Defaults to `32`.
    """
    geometry = _fixed_size_geometry(model)
    maps = [rollout_map(rollout(attentions), geometry.grid, geometry.num_prefix_tokens, geometry.class_token)
            for attentions in _attention_batches(model, images, batch_size)]
    return np.concatenate(maps)


# === Mean attention distance ===

def patch_distances(grid_size: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    """(N, N) pixel distances between the centres of the N = rows * columns patches."""
    rows, columns = np.mgrid[: grid_size[0], : grid_size[1]]
    y, x = rows.ravel() * stride[0], columns.ravel() * stride[1]
    return np.hypot(y[:, None] - y[None, :], x[:, None] - x[None, :])


def attention_distance(attention: np.ndarray, grid_size: tuple[int, int], stride: tuple[int, int],
                       num_prefix_tokens: int) -> np.ndarray:
    """Mean attention distance of one layer, (batch, heads), in pixels.

    Class-token rows and columns are dropped (the class token has no position) and each
    query patch's weights over the key patches are renormalized to sum to 1; the
    attention-weighted distance is then averaged over query patches.
    """
    patches = np.asarray(attention, dtype="float64")[..., num_prefix_tokens:, num_prefix_tokens:]
    if patches.shape[-1] != grid_size[0] * grid_size[1]:
        raise ValueError(f"Attention over {patches.shape[-1]} patches does not match the "
                         f"{grid_size[0]}x{grid_size[1]} grid.")
    patches = patches / patches.sum(axis=-1, keepdims=True)
    return (patches * patch_distances(grid_size, stride)).sum(axis=-1).mean(axis=-1)


def mean_attention_distance(model: keras.Model, images, batch_size: int = 32) -> np.ndarray:
    """Mean attention distance per layer and head, (layers, heads), in input pixels.

    The paper's "attention distance" (Fig. 7 right, App. D.7): see `attention_distance`
    for one layer; the result is averaged over `images`.
    """
    grid_size, prefix, stride = token_layout(model)
    total, count = 0.0, 0
    for attentions in _attention_batches(model, images, batch_size):
        per_image = np.stack([attention_distance(a, grid_size, stride, prefix) for a in attentions], axis=1)
        total, count = total + per_image.sum(axis=0), count + len(per_image)
    return total / count


# === Position embeddings and patch-embedding filters ===

def position_embedding_similarity(model: keras.Model) -> np.ndarray:
    """Cosine similarity between patch position embeddings, (rows, columns, rows, columns).

    Entry `[i, j, k, l]` compares the embedding of patch (i, j) with that of patch (k, l);
    class-token rows of the table are left out.
    """
    position = model_geometry(model).position_embedding
    table = position.embedding()
    if table is None:
        raise ValueError(f"Model {model.name!r} has position_embedding='none'; expected 'learned', "
                         f"'learned_2d' or 'sincos_2d'.")
    grid = keras.ops.convert_to_numpy(table)[0, position.num_prefix_tokens:].astype("float64")
    grid /= np.linalg.norm(grid, axis=-1, keepdims=True)
    return (grid @ grid.T).reshape(*position.grid_size, *position.grid_size)


def embedding_filters(model: keras.Model, n: int = 28) -> np.ndarray:
    """The first principal components of the patch-embedding filters as RGB (or gray) tiles.

    The kernel's D filters of shape (patch, patch, channels) are centred and decomposed;
    each of the first `n` components (fewer if the kernel has fewer) is min-max scaled to
    [0, 1]. Needs a patch embedding of 3 (RGB) or 1 (grayscale) channels: hybrids embed
    ResNet features, which have no image-space filters.

    Returns:
        (n, patch_height, patch_width, channels) array.
    """
    kernel = keras.ops.convert_to_numpy(model_geometry(model).patch_embedding.kernel).astype("float64")
    if kernel.shape[2] not in FILTER_CHANNELS:
        raise ValueError(f"Embedding filters need a patch embedding of image pixels with {FILTER_CHANNELS} "
                         f"channels. Received kernel shape {kernel.shape} ({kernel.shape[2]} input channels; "
                         f"a hybrid embeds ResNet features).")
    if n < 1:
        raise ValueError(f"`n` must be a positive int. Received: n={n}")
    filters = kernel.reshape(-1, kernel.shape[-1]).T
    _, _, components = np.linalg.svd(filters - filters.mean(axis=0), full_matrices=False)
    tiles = components[:n].reshape(-1, *kernel.shape[:3])
    low = tiles.min(axis=(1, 2, 3), keepdims=True)
    return (tiles - low) / np.maximum(tiles.max(axis=(1, 2, 3), keepdims=True) - low, 1e-12)


# === Plots ===

def _figure(**kwargs):
    """A matplotlib Figure without pyplot: it renders with Agg and leaves the user's backend alone."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("Drawing the inspection figures needs matplotlib: `pip install matplotlib`.") from error
    return Figure(**kwargs)


def _save(figure, path: str) -> str:
    with atomic_write(path) as partial:
        figure.savefig(partial, dpi=100, bbox_inches="tight")
    return path


def _display(image: np.ndarray) -> np.ndarray:
    """An image as a model takes it (0-255, 1 or 3 channels) as something imshow shows."""
    image = np.clip(np.asarray(image, dtype="float32") / 255.0, 0.0, 1.0)
    return image[..., 0] if image.shape[-1] == 1 else image


def plot_rollout(image: np.ndarray, heatmap: np.ndarray, path: str) -> str:
    """Saves the image and the rollout map overlaid on it, side by side (paper Fig. 6)."""
    height, width = image.shape[:2]
    figure = _figure(figsize=(8, 4 * height / width + 0.6))
    left, right = figure.subplots(1, 2)
    for axis, title in ((left, "input"), (right, "attention rollout")):
        axis.imshow(_display(image), cmap="gray")
        axis.set_title(title)
        axis.axis("off")
    scaled = heatmap / max(heatmap.max(), 1e-12)
    # imshow puts pixel centres on integers, so the image spans [-0.5, size - 0.5].
    right.imshow(scaled, cmap="inferno", alpha=0.6, extent=(-0.5, width - 0.5, height - 0.5, -0.5),
                 interpolation="bilinear")
    return _save(figure, path)


def plot_mean_distance(distances: np.ndarray, path: str, uniform: float | None = None) -> str:
    """Saves the mean attention distance scatter, one dot per head (paper Fig. 7 right).

    `uniform`, if given, is drawn as a dashed line: the distance of uniform attention.
    """
    figure = _figure(figsize=(5, 4))
    axis = figure.subplots()
    layers = np.arange(1, distances.shape[0] + 1)
    if uniform is not None:
        axis.axhline(uniform, color="gray", linestyle="--", linewidth=1, label="uniform attention")
    for head in range(distances.shape[1]):
        axis.scatter(layers, distances[:, head], s=18, label=f"head {head + 1}")
    axis.set_xlabel("network depth (layer)")
    axis.set_ylabel("mean attention distance (pixels)")
    axis.set_xticks(layers)
    axis.set_ylim(bottom=0)
    if distances.shape[1] <= 16:
        axis.legend(fontsize=6, ncol=2)
    return _save(figure, path)


def _mosaic(tiles: np.ndarray, columns: int) -> np.ndarray:
    """Tiles (n, h, w, ...) laid out in a grid with one-pixel NaN (blank) separators."""
    n, h, w = tiles.shape[:3]
    rows = -(-n // columns)
    mosaic = np.full((rows * (h + 1) - 1, columns * (w + 1) - 1, *tiles.shape[3:]), np.nan)
    for index, tile in enumerate(tiles):
        r, c = divmod(index, columns)
        mosaic[r * (h + 1): r * (h + 1) + h, c * (w + 1): c * (w + 1) + w] = tile
    return mosaic


def plot_position_similarity(similarity: np.ndarray, path: str) -> str:
    """Saves the grid of cosine-similarity grids (paper Fig. 7 centre)."""
    rows, columns = similarity.shape[:2]
    mosaic = _mosaic(similarity.reshape(rows * columns, rows, columns), columns)
    figure = _figure(figsize=(6, 6 * rows / columns + 0.5))
    axis = figure.subplots()
    shown = axis.imshow(mosaic, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    axis.set_title("position embedding similarity")
    axis.set_xlabel("input patch column")
    axis.set_ylabel("input patch row")
    axis.set_xticks([])
    axis.set_yticks([])
    figure.colorbar(shown, ax=axis, label="cosine similarity")
    return _save(figure, path)


def plot_filters(tiles: np.ndarray | None, path: str, columns: int = 7, note: str = "") -> str:
    """Saves the principal-component filter tiles (paper Fig. 7 left), or `note` if `tiles` is None."""
    if tiles is None:
        figure = _figure(figsize=(6, 2))
        axis = figure.subplots()
        axis.text(0.5, 0.5, note, ha="center", va="center", wrap=True)
        axis.axis("off")
        return _save(figure, path)
    mosaic = _mosaic(tiles, min(columns, len(tiles)))
    mosaic = np.where(np.isnan(mosaic), 1.0, mosaic)
    figure = _figure(figsize=(6, 6 * mosaic.shape[0] / mosaic.shape[1] + 0.5))
    axis = figure.subplots()
    axis.imshow(mosaic[..., 0] if mosaic.shape[-1] == 1 else mosaic, cmap="gray", interpolation="nearest")
    axis.set_title(f"embedding filters (first {len(tiles)} principal components)")
    axis.axis("off")
    return _save(figure, path)


# === Figures ===

def write_figures(model: keras.Model, images: np.ndarray, out_dir: str, filters: int = 28) -> list[str]:
    """Writes the four inspection figures of `model` to `out_dir`; returns their paths.

    The rollout is shown for the first image; the attention distance averages all images.
    Hybrids get a note in place of the filter tiles: they embed ResNet features, not pixels.
    """
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in FIGURES]
    plot_rollout(images[0], attention_rollout(model, images[:1])[0], paths[0])
    grid_size, _, stride = token_layout(model)
    plot_mean_distance(mean_attention_distance(model, images), paths[1],
                       uniform=patch_distances(grid_size, stride).mean())
    plot_position_similarity(position_embedding_similarity(model), paths[2])
    channels = model_geometry(model).patch_embedding.kernel.shape[2]
    if channels in FILTER_CHANNELS:
        plot_filters(embedding_filters(model, filters), paths[3])
    else:
        plot_filters(None, paths[3], note=f"No pixel filters: the patch embedding takes {channels} "
                                          f"ResNet feature channels (hybrid model).")
    return paths
