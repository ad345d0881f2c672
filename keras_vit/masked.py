"""Self-supervised masked patch prediction (arXiv:2010.11929, Sec. 4.6 and App. B.1.2).

BERT's masked language modelling carried over to patches. After the patch projection
(`embedding`) and before the class token and position embedding, 50% of each image's patch
embeddings are corrupted: of those, 80% are replaced by a learnable `[mask]` embedding, 10% by
the embedding of another random patch of the same image, and 10% are kept as they are. From the
final representation of every corrupted patch a head predicts its target; only corrupted patches
count in the loss. The paper's targets, all implemented here:

- `"mean"`: the patch's mean colour, 3 bits per channel (8^3 = 512 classes); the paper's choice.
- `"4x4"`: the patch downsized to 4x4 in 3-bit colours (16 predictions of 512 classes).
- `"l2"`: L2 regression of the full patch, normalized to [-1, 1].

`masked_patch_model(...)` wraps the encoder of any keras_vit model (plain or hybrid) into a
`MaskedPatchModel` that `model.fit` trains on images alone; `transfer_encoder_weights(...)` then
copies the encoder into a classifier built with the same architecture (same layer names).
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
from keras import ops

from keras_vit import layers as vit_layers
from keras_vit.geometry import ModelGeometry, model_geometry
from keras_vit.vit_model import CpuKernelSteps

TARGETS = ("mean", "4x4", "l2")
DOWNSAMPLED_SIZE = 4  # The "4x4" target's grid inside each patch.

_register = keras.saving.register_keras_serializable(package="keras_vit")


# === Corruption ===


@_register
class PatchCorruption(keras.layers.Layer):
    """BERT-style corruption of patch embeddings with a learnable `[mask]` embedding.

    Exactly `round(corruption_rate * num_patches)` patches of each image are chosen uniformly at
    random. Each chosen patch is, independently, replaced by the `mask_embedding` weight with
    probability `mask_rate`, by the embedding of another patch of the same image (a uniformly drawn
    different position) with probability `random_rate`, and left unchanged otherwise. The layer
    corrupts at every call, in training and inference: it exists for pre-training only.

    Args:
        corruption_rate: float. Fraction of patches corrupted per image. Defaults to `0.5`.
        mask_rate: float. Fraction of corrupted patches set to the `[mask]` embedding. Defaults to `0.8`.
        random_rate: float. Fraction of corrupted patches set to another patch's embedding.
            Defaults to `0.1`.
        seed: optional int. Seed of the layer's `keras.random.SeedGenerator`: two layers with the
            same seed draw the same corruptions call after call.

    Call arguments:
        tokens: (batch, num_patches, hidden_dim) patch embeddings.

    Returns:
        `(corrupted_tokens, mask)`: the tokens and a float32 (batch, num_patches) tensor, 1 at the
        corrupted positions (all three kinds) and 0 elsewhere.
    """

    def __init__(self, corruption_rate: float = 0.5, mask_rate: float = 0.8, random_rate: float = 0.1,
                 seed: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 < corruption_rate <= 1.0:
            raise ValueError(f"`corruption_rate` must be in (0, 1]. Received: {corruption_rate}")
        if mask_rate < 0 or random_rate < 0 or mask_rate + random_rate > 1.0:
            raise ValueError(f"`mask_rate` and `random_rate` must be >= 0 with a sum <= 1. "
                             f"Received: mask_rate={mask_rate}, random_rate={random_rate}")
        self.corruption_rate = corruption_rate
        self.mask_rate = mask_rate
        self.random_rate = random_rate
        self.seed = seed
        self.seed_generator = keras.random.SeedGenerator(seed, name="corruption_seed")

    def build(self, input_shape):
        self.mask_embedding = self.add_weight(name="mask_embedding", shape=(input_shape[-1],),
                                              initializer=keras.initializers.RandomNormal(stddev=0.02))

    def num_corrupted(self, num_patches: int) -> int:
        """Patches corrupted per image: `corruption_rate * num_patches`, rounded, at least 1."""
        return max(1, int(round(self.corruption_rate * num_patches)))

    def call(self, tokens):
        batch, num_patches = ops.shape(tokens)[0], tokens.shape[1]
        if num_patches is None:
            raise ValueError("PatchCorruption needs a static number of patches.")
        # The k positions with the largest uniform noise: a uniform random k-subset per image.
        noise = keras.random.uniform((batch, num_patches), seed=self.seed_generator)
        threshold = ops.top_k(noise, self.num_corrupted(num_patches))[0][:, -1:]
        corrupted = noise >= threshold
        kind = keras.random.uniform((batch, num_patches), seed=self.seed_generator)
        use_mask = corrupted & (kind < self.mask_rate)
        use_other = corrupted & (kind >= self.mask_rate) & (kind < self.mask_rate + self.random_rate)
        x = ops.where(use_mask[..., None], ops.cast(self.mask_embedding, tokens.dtype), tokens)
        x = ops.where(use_other[..., None], self._other_patches(tokens), x)
        return x, ops.cast(corrupted, "float32")

    def _other_patches(self, tokens):
        """For every position, the embedding of a different, uniformly drawn position of the image."""
        batch, num_patches = ops.shape(tokens)[0], tokens.shape[1]
        if num_patches < 2:
            return tokens
        offset = keras.random.randint((batch, num_patches), 1, num_patches, seed=self.seed_generator)
        index = (ops.arange(num_patches)[None, :] + offset) % num_patches
        return ops.take_along_axis(tokens, ops.cast(index, "int32")[..., None], axis=1)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape), tuple(input_shape[:2])

    def compute_output_spec(self, tokens):
        return (keras.KerasTensor(tokens.shape, tokens.dtype), keras.KerasTensor(tokens.shape[:2], "float32"))

    def get_config(self):
        config = super().get_config()
        config.update({"corruption_rate": self.corruption_rate, "mask_rate": self.mask_rate,
                       "random_rate": self.random_rate, "seed": self.seed})
        return config


# === Targets ===


def _patch_grid(images, patch_size: int | Sequence[int]):
    """(batch, H, W, C) -> (batch, num_patches, ph, pw, C), patches in row-major grid order."""
    patch_size = vit_layers.to_pair(patch_size, "patch_size")
    rows, columns = vit_layers.patch_grid(images, patch_size)
    patches = vit_layers.extract_patches(images, patch_size)  # Flattened in (row, column, channel) order.
    return ops.reshape(patches, (-1, rows * columns, *patch_size, images.shape[-1]))


def _quantize_colours(colours, bits: int):
    """(..., C) colours in [0, 1] -> (...,) class ids: `bits` bits per channel, first channel most significant."""
    levels = 2 ** bits
    q = ops.clip(ops.floor(colours * levels), 0, levels - 1)
    channels = colours.shape[-1]
    place = np.array([levels ** (channels - 1 - c) for c in range(channels)], "float32")
    return ops.cast(ops.sum(q * place, axis=-1), "int32")


def num_target_classes(channels: int = 3, bits: int = 3) -> int:
    """Classes of the `"mean"` and `"4x4"` targets: 2^bits levels per channel, e.g. 512 for RGB."""
    return (2 ** bits) ** channels


def patch_targets(images, patch_size: int | Sequence[int], target: str = "mean", bits: int = 3,
                  value_range: Sequence[float] = (0.0, 255.0)):
    """The prediction targets of every patch of `images` (paper App. B.1.2).

    Args:
        images: (batch, H, W, C) pixels in `value_range`.
        patch_size: int or (int, int). The patch size on the image (for hybrids, the ViT patch
            size times the ResNet stem's stride).
        target: `"mean"`, `"4x4"` or `"l2"` (see the module docstring). Defaults to `"mean"`.
        bits: int. Bits per channel of the quantized colours. Defaults to `3`.
        value_range: (low, high) of the pixels. Defaults to `(0, 255)`.

    Returns:
        `"mean"`: int32 (batch, num_patches) class ids in [0, 2^(bits * C)).
        `"4x4"`: int32 (batch, num_patches, 16), the 4x4 cells in row-major order.
        `"l2"`: float32 (batch, num_patches, ph * pw * C), pixels in [-1, 1], (row, column, channel) order.
    """
    if target not in TARGETS:
        raise ValueError(f"Unknown target {target!r}. Expected one of {TARGETS}.")
    low, high = float(value_range[0]), float(value_range[1])
    unit = (ops.cast(images, "float32") - low) / (high - low)
    patches = _patch_grid(unit, patch_size)  # (batch, N, ph, pw, C) in [0, 1]
    if target == "mean":
        return _quantize_colours(ops.mean(patches, axis=(2, 3)), bits)
    if target == "l2":
        return ops.reshape(2.0 * patches - 1.0, (-1, patches.shape[1], int(np.prod(patches.shape[2:]))))
    ph, pw, channels = patches.shape[2:]
    size = DOWNSAMPLED_SIZE
    if ph % size or pw % size:
        raise ValueError(f"The '4x4' target needs a patch size divisible by 4. Received: {(ph, pw)}")
    cells = ops.reshape(patches, (-1, patches.shape[1], size, ph // size, size, pw // size, channels))
    cells = ops.reshape(ops.mean(cells, axis=(3, 5)), (-1, patches.shape[1], size * size, channels))
    return _quantize_colours(cells, bits)


@_register
class PatchTargets(keras.layers.Layer):
    """`patch_targets` as a layer (no weights); always computes in float32.

    Args:
        patch_size: int or (int, int). Patch size on the image.
        target: `"mean"`, `"4x4"` or `"l2"`. Defaults to `"mean"`.
        bits: int. Bits per colour channel. Defaults to `3`.
        value_range: (low, high) of the input pixels. Defaults to `(0, 255)`.
    """

    def __init__(self, patch_size: int | Sequence[int], target: str = "mean", bits: int = 3,
                 value_range: Sequence[float] = (0.0, 255.0), **kwargs):
        kwargs["dtype"] = "float32"  # Quantizing bfloat16 pixel means would move colours across bins.
        super().__init__(**kwargs)
        if target not in TARGETS:
            raise ValueError(f"Unknown target {target!r}. Expected one of {TARGETS}.")
        self.patch_size = vit_layers.to_pair(patch_size, "patch_size")
        self.target = target
        self.bits = bits
        self.value_range = (float(value_range[0]), float(value_range[1]))

    def call(self, images):
        return patch_targets(images, self.patch_size, self.target, self.bits, self.value_range)

    def compute_output_spec(self, images):
        height, width, channels = images.shape[1:]
        num_patches = (height // self.patch_size[0]) * (width // self.patch_size[1])
        if self.target == "mean":
            return keras.KerasTensor((images.shape[0], num_patches), "int32")
        if self.target == "4x4":
            return keras.KerasTensor((images.shape[0], num_patches, DOWNSAMPLED_SIZE ** 2), "int32")
        return keras.KerasTensor((images.shape[0], num_patches, self.patch_size[0] * self.patch_size[1] * channels),
                                 "float32")

    def get_config(self):
        config = super().get_config()
        config.pop("dtype", None)
        config.update({"patch_size": self.patch_size, "target": self.target, "bits": self.bits,
                       "value_range": self.value_range})
        return config


# === Head and loss ===


@_register
class MaskedPatchHead(keras.layers.Layer):
    """One Dense layer from each patch's final representation to its target; float32 output.

    Args:
        target: `"mean"`, `"4x4"` or `"l2"`.
        num_classes: int. Classes per prediction for `"mean"` / `"4x4"` (512 for RGB at 3 bits).
        patch_dim: int. Values per patch for `"l2"` (ph * pw * C).

    Returns:
        `"mean"`: logits (batch, N, num_classes); `"4x4"`: logits (batch, N, 16, num_classes);
        `"l2"`: (batch, N, patch_dim).
    """

    def __init__(self, target: str = "mean", num_classes: int = 512, patch_dim: int = 0, **kwargs):
        kwargs["dtype"] = "float32"
        super().__init__(**kwargs)
        if target not in TARGETS:
            raise ValueError(f"Unknown target {target!r}. Expected one of {TARGETS}.")
        if target == "l2" and patch_dim < 1:
            raise ValueError(f"target='l2' needs patch_dim >= 1. Received: {patch_dim}")
        self.target = target
        self.num_classes = num_classes
        self.patch_dim = patch_dim
        self.dense = keras.layers.Dense(self._units(), name="dense", dtype="float32")

    def _units(self) -> int:
        return {"mean": self.num_classes, "4x4": DOWNSAMPLED_SIZE ** 2 * self.num_classes, "l2": self.patch_dim}[
            self.target]

    def build(self, input_shape):
        self.dense.build(input_shape)

    def call(self, tokens):
        y = self.dense(ops.cast(tokens, "float32"))
        if self.target == "4x4":
            y = ops.reshape(y, (-1, tokens.shape[1], DOWNSAMPLED_SIZE ** 2, self.num_classes))
        return y

    def compute_output_shape(self, input_shape):
        if self.target == "4x4":
            return (*input_shape[:2], DOWNSAMPLED_SIZE ** 2, self.num_classes)
        return (*input_shape[:2], self._units())

    def get_config(self):
        config = super().get_config()
        config.pop("dtype", None)
        config.update({"target": self.target, "num_classes": self.num_classes, "patch_dim": self.patch_dim})
        return config


def per_patch_loss(targets, predictions, target: str = "mean"):
    """(batch, N) loss of every patch: cross-entropy (`"4x4"`: mean over the 16 cells) or, for
    `"l2"`, the mean squared error over the patch's values."""
    predictions = ops.cast(predictions, "float32")
    if target == "l2":
        return ops.mean(ops.square(predictions - ops.cast(targets, "float32")), axis=-1)
    losses = keras.losses.sparse_categorical_crossentropy(targets, predictions, from_logits=True)
    return ops.mean(losses, axis=-1) if target == "4x4" else losses


def masked_patch_loss(targets, predictions, mask, target: str = "mean"):
    """Mean of `per_patch_loss` over the corrupted patches (`mask` == 1) only."""
    mask = ops.cast(mask, "float32")
    total = ops.sum(per_patch_loss(targets, predictions, target) * mask)
    return total / ops.maximum(ops.sum(mask), 1.0)


def masked_patch_accuracy(targets, predictions, mask):
    """Fraction of corrupted patches (of all predictions, for `"4x4"`) whose argmax is the target."""
    hits = ops.cast(ops.equal(ops.argmax(predictions, axis=-1), ops.cast(targets, "int64")), "float32")
    mask = ops.cast(mask, "float32")
    if len(hits.shape) == 3:
        mask = ops.broadcast_to(mask[..., None], ops.shape(hits))
    return ops.sum(hits * mask) / ops.maximum(ops.sum(mask), 1.0)


@_register
class PatchTokens(keras.layers.Layer):
    """Drops the `num_prefix_tokens` leading (class, distillation, register) tokens:
    (batch, P + N, D) -> (batch, N, D)."""

    def __init__(self, num_prefix_tokens: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.num_prefix_tokens = num_prefix_tokens

    def call(self, tokens):
        return tokens[:, self.num_prefix_tokens:]

    def compute_output_shape(self, input_shape):
        size = None if input_shape[1] is None else input_shape[1] - self.num_prefix_tokens
        return (input_shape[0], size, input_shape[2])

    def get_config(self):
        config = super().get_config()
        config.update({"num_prefix_tokens": self.num_prefix_tokens})
        return config


# === Model ===


@_register
class MaskedPatchModel(CpuKernelSteps, keras.Model):
    """A masked-patch-prediction network trained by `model.fit(images)`: no labels needed.

    `network` maps images to `{"predictions", "targets", "mask"}` (see `masked_patch_model`); this
    model's loss is `masked_patch_loss` over the corrupted patches. Under `tf.distribute` each
    replica's loss is divided by the replica count, as Keras' own losses do, so the summed
    gradients are those of the global mean (every image has the same number of corrupted patches).
    Metrics: `loss` and, for the classification targets, `masked_accuracy`.

    Args:
        network: the functional network built by `masked_patch_model`.
        target: `"mean"`, `"4x4"` or `"l2"`, the network's target kind.
    """

    def __init__(self, network: keras.Model, target: str = "mean", **kwargs):
        super().__init__(**kwargs)
        if target not in TARGETS:
            raise ValueError(f"Unknown target {target!r}. Expected one of {TARGETS}.")
        self.network = network
        self.target = target
        self.accuracy_tracker = keras.metrics.Mean(name="masked_accuracy") if target != "l2" else None
        self.built = network.built  # Its weights exist: saving needs no call first.

    def call(self, images, training=None):
        return self.network(images, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """The masked-patch loss of `y_pred` (labels `y`, if any, are ignored)."""
        loss = masked_patch_loss(y_pred["targets"], y_pred["predictions"], y_pred["mask"], self.target)
        if self.accuracy_tracker is not None:
            self.accuracy_tracker.update_state(
                masked_patch_accuracy(y_pred["targets"], y_pred["predictions"], y_pred["mask"]))
        for extra in self.losses:  # Regularizers, if any.
            loss = loss + ops.sum(ops.cast(extra, "float32"))
        return loss / _num_replicas()

    def get_config(self):
        config = super().get_config()
        config.update({"network": keras.saving.serialize_keras_object(self.network), "target": self.target})
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        network = keras.saving.deserialize_keras_object(config.pop("network"), custom_objects=custom_objects)
        return cls(network=network, **config)


def _num_replicas() -> int:
    """Replicas of the current tf.distribute strategy (1 outside one)."""
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def _encoder_layers(model: keras.Model, geometry: ModelGeometry) -> list[keras.layers.Layer]:
    """The model's layers up to the encoder's end (`encoder_norm`), its input layer included."""
    if geometry.encoder_end is None:
        raise ValueError(f"Model {model.name!r} has no encoder end (its final norm or last encoder block) at the top "
                         "level: expected a keras_vit model (keras_vit.VisionTransformer or a variant builder).")
    return model.layers[:model.layers.index(geometry.encoder_end) + 1]


def _encoder_chain(model: keras.Model, geometry: ModelGeometry) -> list[keras.layers.Layer]:
    """The layers from the input to the encoder's end, checked to be a single chain (as keras_vit builds them)."""
    chain = _encoder_layers(model, geometry)[1:]
    previous = model.layers[0].output
    for layer in chain:
        if layer.input is not previous:
            raise ValueError(f"Layer {layer.name!r} of model {model.name!r} does not take the previous layer's "
                             f"output: masked_patch_model needs the encoder as one chain of layers.")
        previous = layer.output
    return chain


def _build_encoder(model_or_builder_kwargs: keras.Model | dict[str, Any]) -> keras.Model:
    if isinstance(model_or_builder_kwargs, keras.Model):
        return model_or_builder_kwargs
    from keras_vit.models import VisionTransformer

    kwargs = {"weights": None, "include_top": False, **model_or_builder_kwargs}
    return VisionTransformer(**kwargs)


def masked_patch_model(model_or_builder_kwargs: keras.Model | dict[str, Any], target: str = "mean",
                       corruption_rate: float = 0.5, mask_rate: float = 0.8, random_rate: float = 0.1,
                       bits: int = 3, seed: int | None = None, name: str | None = None) -> MaskedPatchModel:
    """Wraps a keras_vit model's encoder into a masked-patch-prediction model (paper Sec. 4.6).

    The encoder's layers (preprocessing, hybrid ResNet stem, `embedding`, `cls`, `posembed_input`,
    `dropout`, `encoderblock_i`, `encoder_norm`) are reused, weights shared with the given
    model; its pooling, pre-logits and head are dropped. A `PatchCorruption` layer (`corruption`)
    sits between `embedding` and `cls`; a `MaskedPatchHead` (`masked_patch_head`) predicts each
    patch's target from its final representation; a `PatchTargets` layer (`targets`) computes the
    targets from the input pixels.

    Args:
        model_or_builder_kwargs: a keras_vit `keras.Model`, or keyword arguments for
            `keras_vit.VisionTransformer` (`weights=None` and `include_top=False` unless given).
        target: `"mean"` (3-bit mean colour, the paper's), `"4x4"` or `"l2"`. Defaults to `"mean"`.
        corruption_rate: float. Fraction of patches corrupted per image. Defaults to `0.5`.
        mask_rate, random_rate: float. Shares of the corrupted patches set to `[mask]` and to another
            patch (the rest are unchanged). Default to `0.8` and `0.1`.
        bits: int. Bits per colour channel of the classification targets. Defaults to `3`.
        seed: optional int. Seed of the corruption: equal seeds give equal corruptions.
        name: optional model name. Defaults to `"<model name>_masked_patches"`.

    Returns:
        A `MaskedPatchModel`: call it on images ((batch, H, W, C), the wrapped model's input range)
        for `{"predictions", "targets", "mask"}`; compile it with an optimizer only and fit on images.
    """
    model = _build_encoder(model_or_builder_kwargs)
    geometry = model_geometry(model)
    if geometry.input_size is None:
        raise ValueError(f"masked_patch_model needs a model of a fixed input size, but model {model.name!r} takes "
                         "any size: build it with input_shape=(height, width, channels).")
    chain = _encoder_chain(model, geometry)
    channels = model.input_shape[-1]
    patch_size = geometry.stride
    image = keras.Input(shape=(*geometry.input_size, channels), name="image")
    x = image
    for layer in chain:
        x = layer(x)
        if layer is geometry.patch_embedding:
            x, mask = PatchCorruption(corruption_rate, mask_rate, random_rate, seed, name="corruption")(x)
    x = PatchTokens(geometry.num_prefix_tokens, name="patch_tokens")(x)  # class, distillation, registers
    predictions = MaskedPatchHead(target, num_target_classes(channels, bits),
                                  patch_size[0] * patch_size[1] * channels, name="masked_patch_head")(x)
    targets = PatchTargets(patch_size, target, bits, geometry.value_range, name="targets")(image)
    network = keras.Model(image, {"predictions": predictions, "targets": targets, "mask": mask},
                          name=f"{model.name}_masked_network")
    return MaskedPatchModel(network, target, name=name or f"{model.name}_masked_patches")


# === Moving the encoder ===


def encoder_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The weighted encoder layers of a keras_vit model or a `MaskedPatchModel` (up to `encoder_norm`)."""
    network = model.network if isinstance(model, MaskedPatchModel) else model
    layers = _encoder_layers(network, model_geometry(network))
    return [layer for layer in layers if layer.weights and not isinstance(layer, PatchCorruption)]


def transfer_encoder_weights(source: keras.Model, destination: keras.Model) -> list[str]:
    """Copies the encoder weights of `source` into the encoder layers of `destination`, which must have the same
    names, in the same order.

    Typically `source` is a trained `MaskedPatchModel` and `destination` a classifier built with the
    same architecture (e.g. `keras_vit.VisionTransformer(..., weights=None)`); its head and
    pre-logits keep their initialization. Values are copied unchanged.

    Returns:
        The names of the layers copied.

    Raises:
        ValueError: encoder layers that differ by name or by a weight's shape (nothing is copied).
    """
    sources, targets = encoder_layers(source), encoder_layers(destination)
    source_names, target_names = [layer.name for layer in sources], [layer.name for layer in targets]
    if source_names != target_names:
        raise ValueError(f"Cannot move the encoder of {source.name!r} into {destination.name!r}: encoder layers "
                         f"{source_names} vs {target_names}")
    plan, problems = [], []
    for layer, target in zip(sources, targets):
        shapes = [tuple(w.shape) for w in layer.weights]
        if shapes != [tuple(w.shape) for w in target.weights]:
            problems.append(f"layer {layer.name!r}: weights {shapes} vs {[tuple(w.shape) for w in target.weights]}")
            continue
        plan.append((layer, target))
    if problems:
        raise ValueError(f"Cannot move the encoder of {source.name!r} into {destination.name!r}: "
                         + "; ".join(problems))
    for layer, target in plan:
        target.set_weights(layer.get_weights())
    return [layer.name for layer, _ in plan]
