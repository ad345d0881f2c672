"""A SigLIP 2 NaFlex model (`keras_vit.naflex.NaFlexViT`) as a TF Serving SavedModel from encoded images.

    keras-vit-export --weights <Siglip2VisionModel folder> --max-num-patches 256 --out /models/siglip2

Every signature takes `image_bytes` (a batch of JPEG / PNG / GIF / BMP strings, bounded as `serving_bytes`:
`max_batch` images, each checked for `max_pixels` from its header before it is decoded, `keras_vit.image_io`) and
applies `Siglip2ImageProcessor`'s rule inside the graph, one image at a time: the image keeps its aspect ratio,
resized to the largest grid of at most `max_num_patches` patches (`image_io.naflex_image_size`, the same binary
search as `keras_vit.naflex.naflex_image_size` in float64), bilinearly (`tf.image.resize(..., antialias=True)`,
PIL's triangle filter in float32, not rounded: PIL resizes uint8 in fixed point, so values differ from its by at
most one level), cut into row-major patches padded to the budget with their mask and grid
(`image_io.naflex_patches`, which keras-vit-train's NaFlex batches use too).

- `serving_default`, `serving_bytes`, `embed`: `{"embedding": (batch, D)}`, the MAP head's pooled vector
  (`pooler_output`), L2-normalized with `l2_normalize`; with `class_embeddings`, `serving_default` and
  `serving_bytes` are a zero-shot classifier of it instead (`logits`, `probabilities`, top-k `classes` and
  `scores`, `class_names` where given);
- `features` (asked for): `{"tokens": (batch, max_num_patches, D), "patch_mask": (batch, max_num_patches),
  "spatial_shapes": (batch, 2)}`, each image's final-norm tokens at its own (rows, columns) grid, row-major, the
  padding rows after them.

The version folder is written atomically as `export.saved_model` writes one, with warmup requests and
`assets.extra/keras_vit_export.json` (`saved_model.read_metadata`), which records `max_num_patches`.
"""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_vit import features, image_io, kernels
from keras_vit.atomic import DiskSpaceError, atomic_write, check_room, variables_bytes
from keras_vit.geometry import is_naflex_model

from . import model_io, saved_model, serving

SIGNATURES = ("embed", "features")  # what `signatures=` may ask for; embed is always served
RESIZE = "bilinear, antialiased (tf.image.resize in float32, not rounded to uint8 as PIL's), aspect ratio kept"
_WARMUP_SIZE = (48, 80)


def decode(image_bytes: tf.Tensor, patch_size: int, max_num_patches: int,
           max_pixels: int = serving.DEFAULT_MAX_PIXELS) -> dict[str, tf.Tensor]:
    """A batch of encoded images -> the model's inputs (`naflex_patches` of each), decoded one after another
    (`image_io.decode_rgb`: empty, unsupported, corrupt, truncated or over-`max_pixels` images raise
    InvalidArgumentError for the whole request, as on `serving_bytes`)."""
    width = patch_size * patch_size * 3
    signature = (tf.TensorSpec((max_num_patches, width), tf.float32), tf.TensorSpec((max_num_patches,), tf.int32),
                 tf.TensorSpec((2,), tf.int32))
    patches, mask, shapes = tf.map_fn(
        lambda data: image_io.naflex_patches(image_io.decode_rgb(data, max_pixels), patch_size, max_num_patches),
        image_bytes, fn_output_signature=signature, parallel_iterations=1)
    return {"patches": patches, "patch_mask": mask, "spatial_shapes": shapes}


def patch_size_of(model: keras.Model) -> int:
    """The patch size of a `NaFlexViT` that takes [0, 255] patches; ValueError for one that is not, or that takes
    normalized patches (`include_preprocessing=False`)."""
    if not is_naflex_model(model) or not isinstance(model.input, dict) or "patches" not in model.input:
        raise ValueError(f"Model {model.name!r} is not a NaFlex ViT (keras_vit.naflex.NaFlexViT).")
    if "preprocessing" not in [layer.name for layer in model.layers]:
        raise ValueError(f"Model {model.name!r} takes normalized patches (include_preprocessing=False); the served "
                         "model decodes [0, 255] pixels: build it with include_preprocessing=True.")
    width = int(model.input["patches"].shape[-1])
    patch = math.isqrt(width // 3)
    if patch * patch * 3 != width:
        raise ValueError(f"Model {model.name!r}: patches of {width} values are not patch * patch * 3.")
    return patch


def _check(max_num_patches: int, signatures: Sequence[str]) -> None:
    if not isinstance(max_num_patches, int) or isinstance(max_num_patches, bool) or max_num_patches < 1:
        raise ValueError(f"`max_num_patches` must be a positive int. Received: max_num_patches={max_num_patches!r}")
    unknown = [name for name in signatures if name not in SIGNATURES]
    if unknown or isinstance(signatures, str):
        raise ValueError(f"Signature {(unknown or [signatures])[0]!r} is not served for a NaFlex model. Expected "
                         f"a sequence of {', '.join(SIGNATURES)}.")


def naflex_archive(model: keras.Model, max_num_patches: int, *, max_pixels: int = serving.DEFAULT_MAX_PIXELS,
                   max_batch: int = serving.DEFAULT_MAX_BATCH, signatures: Sequence[str] = (),
                   l2_normalize: bool = False, serving_kernels: str = "onednn", class_embeddings=None,
                   logit_scale: float = 100.0, logit_bias: float = 0.0, top_k: int = 5,
                   class_names: Sequence[str] | None = None) -> keras.export.ExportArchive:
    """An ExportArchive of `model` (a `NaFlexViT`) with `serving_default`, `serving_bytes` and `embed` (the
    embedding) and, asked for, `features` (tokens, mask, grids), each from encoded images (see the module). With
    `class_embeddings` ((classes, D), e.g. a SigLIP 2 text tower's embeddings of prompts), `serving_default` and
    `serving_bytes` are a zero-shot classifier of the embedding, `logit_scale * cos(image, class) + logit_bias`
    (`keras_vit.features.zero_shot_weights`), with the top-k outputs of `export.serving`'s classifiers."""
    serving.check_limits(max_pixels, max_batch)
    kernels.check_serving_kernels(serving_kernels)
    _check(max_num_patches, signatures)
    patch_size = patch_size_of(model)
    if class_embeddings is not None:
        kernel, bias = (tf.constant(array) for array in features.zero_shot_weights(
            class_embeddings, model.output["embedding"].shape[-1], logit_scale=logit_scale, logit_bias=logit_bias,
            of=f"the embedding of model {model.name!r}"))
        top_k = serving.checked_top_k(top_k, int(bias.shape[0]), class_names)
    elif class_names is not None:
        raise ValueError("class_names name the classes of class_embeddings; a NaFlex model without them serves its "
                         "embedding.")

    def inputs_of(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        with tf.control_dependencies([serving.check_batch(tf.size(image_bytes), max_batch)]):
            return decode(tf.identity(image_bytes), patch_size, max_num_patches, max_pixels)

    def embed(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        with kernels.served_on(serving_kernels):
            embedding = model(inputs_of(image_bytes), training=False)["embedding"]
            return {"embedding": tf.math.l2_normalize(embedding, axis=-1) if l2_normalize else embedding}

    def token_maps(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        with kernels.served_on(serving_kernels):
            inputs = inputs_of(image_bytes)
            return {"tokens": model(inputs, training=False)["tokens"], "patch_mask": inputs["patch_mask"],
                    "spatial_shapes": inputs["spatial_shapes"]}

    def classify(image_bytes: tf.Tensor) -> dict[str, tf.Tensor]:
        embedding = tf.cast(embed(image_bytes)["embedding"], tf.float32)
        logits = tf.math.l2_normalize(embedding, axis=-1) @ kernel + bias
        return serving.predictions(logits, top_k, class_names)

    archive = model_io.export_archive(model)
    spec = [tf.TensorSpec((None,), tf.string, serving.BYTES_KEY)]
    for name in ("serving_default", serving.BYTES_SIGNATURE):
        archive.add_endpoint(name, embed if class_embeddings is None else classify, input_signature=spec)
    archive.add_endpoint("embed", embed, input_signature=spec)
    if "features" in signatures:
        archive.add_endpoint("features", token_maps, input_signature=spec)
    return archive


def signature_names(signatures: Sequence[str] = ()) -> list[str]:
    """The signatures an export with `signatures=` asked for serves, in order."""
    return ["serving_default", serving.BYTES_SIGNATURE, "embed", *(["features"] if "features" in signatures else [])]


def _warmup_requests(model_name: str) -> list[bytes]:
    """PredictionLogs: a PNG and a JPEG on `serving_default`."""
    image = saved_model.warmup_image(_WARMUP_SIZE)
    encoded = (tf.io.encode_png(image).numpy(), tf.io.encode_jpeg(image).numpy())
    return [saved_model.prediction_log(model_name, "serving_default", serving.BYTES_KEY, np.array([data], object))
            for data in encoded]


def export_naflex_saved_model(model: keras.Model, base_dir: str | os.PathLike, *, max_num_patches: int,
                              version: int | None = None, overwrite: bool = False,
                              max_pixels: int = serving.DEFAULT_MAX_PIXELS,
                              max_batch: int = serving.DEFAULT_MAX_BATCH, signatures: Sequence[str] = (),
                              l2_normalize: bool = False, serving_kernels: str = "onednn", class_embeddings=None,
                              logit_scale: float = 100.0, logit_bias: float = 0.0, top_k: int = 5,
                              class_names: Sequence[str] | None = None) -> Path:
    """Writes `base_dir/<version>/` (SavedModel, warmup requests, metadata) of a `NaFlexViT` atomically; returns its
    path.

    Args:
        model: a `keras_vit.naflex.NaFlexViT` taking [0, 255] patches (`VisionTransformer(weights=<SigLIP 2 NaFlex
            folder>)`).
        base_dir: the model's base directory, as given to TF Serving's `--model_base_path`.
        max_num_patches: the patch budget of every image (the processor's `max_num_patches`).
        version, overwrite, max_pixels, max_batch, l2_normalize, serving_kernels: as
            `saved_model.export_saved_model`.
        signatures: `"features"` for the tokens signature (`"embed"` is always served).
        class_embeddings, logit_scale, logit_bias, top_k, class_names: a zero-shot classifier on `serving_default`
            and `serving_bytes` (`naflex_archive`); without `class_embeddings` they serve the embedding.
    """
    base, version, target = saved_model.version_folder(base_dir, version, overwrite)
    archive = naflex_archive(model, max_num_patches, max_pixels=max_pixels, max_batch=max_batch,
                             signatures=signatures, l2_normalize=l2_normalize, serving_kernels=serving_kernels,
                             class_embeddings=class_embeddings, logit_scale=logit_scale, logit_bias=logit_bias,
                             top_k=top_k, class_names=class_names)
    names = signature_names(signatures)
    zero_shot = None if class_embeddings is None else {
        "classes": len(class_embeddings), "logit_scale": logit_scale, "logit_bias": logit_bias,
        "top_k": serving.checked_top_k(top_k, len(class_embeddings), class_names),
        "class_names": class_names is not None}
    metadata = {"model": "naflex", "max_num_patches": max_num_patches, "patch_size": patch_size_of(model),
                "image_size": None, "max_pixels": max_pixels, "max_batch": max_batch, "l2_normalize": l2_normalize,
                "serving_kernels": serving_kernels, "image_formats": list(image_io.FORMATS), "signatures": names,
                "zero_shot": zero_shot,
                "preprocessing": {"resize": RESIZE, "rule": "Siglip2ImageProcessor (transformers 4.57.6)"}}
    check_room({str(base): variables_bytes(model.weights)}, f"SavedModel version {version}")
    try:
        with atomic_write(target, folder=True) as partial:
            archive.write_out(partial, verbose=False)
            warmup = Path(partial) / saved_model.WARMUP_FILE
            warmup.parent.mkdir(parents=True, exist_ok=True)
            with tf.io.TFRecordWriter(str(warmup)) as writer:
                for record in _warmup_requests(base.name):
                    writer.write(record)
            (Path(partial) / saved_model.METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n",
                                                                   encoding="utf-8")
    except tf.errors.ResourceExhaustedError as error:  # TensorFlow's writer on a full disk (ENOSPC)
        raise DiskSpaceError(errno.ENOSPC, f"The disk filled up while SavedModel version {version} was written in "
                             f"{base} ({error.message.split(';')[-1].strip()}). Nothing was written and the versions "
                             "there before are whole: free some space and export again") from None
    return target
