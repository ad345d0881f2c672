"""Exports a keras_vit classifier as a TF Serving SavedModel: `BASE_DIR/<version>/`.

    keras-vit-export --model vit.keras --out /models/vit [--version N] [--overwrite]
    keras-vit-export --variant B/16 --weights vit.weights.h5 --out /models/vit

(`python -m export.saved_model` in a clone; the command line is `keras_vit/cli/export.py`.)

The version is written atomically (`keras_vit.atomic.atomic_write`): everything (SavedModel and warmup
requests) is built in a hidden temporary directory next to it, which is then renamed to `<version>`. TF Serving only
watches numeric directories, so it never sees a half-written version; a failed export removes
the temporary directory and leaves no `<version>/`.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from keras_vit import image_io
from keras_vit.atomic import DiskSpaceError, atomic_write, check_room, variables_bytes

from . import model_io, serving
from . import precision as precisions

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
METADATA_FILE = os.path.join("assets.extra", "keras_vit_export.json")


def next_version(base_dir: str | os.PathLike) -> int:
    """One more than the largest numeric version directory in `base_dir` (1 when there is none)."""
    base = Path(base_dir)
    versions = [int(p.name) for p in base.iterdir() if p.is_dir() and p.name.isdigit()] if base.is_dir() else []
    return max(versions, default=0) + 1


def version_folder(base_dir: str | os.PathLike, version: int | None, overwrite: bool) -> tuple[Path, int, Path]:
    """(base folder, version, `<base>/<version>`) of an export: `version` defaults to the next free one; raises
    ValueError for a version that is not a positive int, FileExistsError for an existing folder unless
    `overwrite`."""
    base = Path(base_dir)
    version = next_version(base) if version is None else version
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"`version` must be a positive int. Received: version={version!r}")
    target = base / str(version)
    if target.exists() and not overwrite:
        raise FileExistsError(f"Version directory {target} already exists. Pass overwrite=True (--overwrite) "
                              f"to replace it, or choose another version (next free: {next_version(base)}).")
    return base, version, target


def export_saved_model(model: keras.Model, base_dir: str | os.PathLike, *, version: int | None = None,
                       overwrite: bool = False, top_k: int = 5, class_names: Sequence[str] | None = None,
                       max_pixels: int = serving.DEFAULT_MAX_PIXELS,
                       max_batch: int = serving.DEFAULT_MAX_BATCH, signatures: Sequence[str] = (),
                       feature_blocks: Sequence[int] = (-1,), embedding: str = "pooled",
                       l2_normalize: bool = False, serving_kernels: str = "onednn", precision: str = "float32",
                       check_images: np.ndarray | None = None,
                       max_top1_drop: float = precisions.DEFAULT_MAX_TOP1_DROP) -> Path:
    """Writes `base_dir/<version>/` (SavedModel, warmup requests, metadata) atomically; returns its path.

    Args:
        model: a keras_vit classifier (`include_top=True`, softmax or no activation; a zero-shot classifier), or
            an image tower without a head (`include_top=False` with a `pooling`), which serves its embedding.
        base_dir: the model's base directory, as given to TF Serving's `--model_base_path`.
        version: positive int. Defaults to one more than the largest existing version.
        overwrite: replace an existing `<version>/`. Defaults to `False` (FileExistsError).
        top_k: number of `classes`/`scores` returned per image. Defaults to `5`.
        class_names: optional names, one per class, returned as `class_names`.
        max_pixels: largest height * width of one image on every signature; larger images fail
            with INVALID_ARGUMENT before they are decoded. Defaults to 40,000,000.
        max_batch: most images in one request. Defaults to `256`.
        signatures: extra signatures from encoded images, any of `"embed"`, `"features"`, `"explain"`
            (`serving.serving_archive`). Defaults to none.
        feature_blocks: the blocks the `features` signature returns (negative: from the end). Defaults to the last.
        embedding: `"pooled"` (the head's input) or `"head"` (its output: a CLIP tower's projection), for `embed`
            and for a model without a head. Defaults to `"pooled"`.
        l2_normalize: L2-normalize that embedding (CLIP, SigLIP retrieval). Defaults to `False`.
        serving_kernels: the CPU kernels of the TensorFlow that will serve it. `"onednn"` (the default): x86
            TensorFlow on CPUs with AVX512-VNNI, AVX512-BF16 or AMX, which fuses the MLP's matmul, bias and GELU.
            `"eigen"`: AVX2-only CPUs, ARM, `TF_ENABLE_ONEDNN_OPTS=0`; the GELU in fewer ops, the attention head
            by head, and a request's images run in groups (`serving.image_group_size`). The outputs are the same
            (to 1e-5); either runs anywhere, only slower on the other kernels.
        precision: `"float32"` (the default), `"bfloat16"` (the model's weights and layers in bfloat16, but its
            pixel normalization and classifier outputs: `export.precision.bfloat16_model`; inputs and outputs stay
            float32), or `"auto"` (bfloat16 where this machine's CPU has AVX512-BF16 or AMX, else float32).
        check_images: for bfloat16, (N, H, W, 3) pixels in [0, 255] at the model's size on which it is checked
            against the float32 model. Defaults to `precision.CHECK_PHOTOS` crops of real photographs.
        max_top1_drop: for bfloat16, the most points of top-1 agreement with the float32 model it may lose;
            past it `precision.Top1DropError` is raised and nothing is written. Defaults to 1.

    A model built for any input size (`input_shape=(None, None, 3)`) is exported so: `serving_default` takes
    images at their own size, height and width multiples of its patch stride (`serving.serving_archive`).

    The limits, image size (`serving_bytes`' size, and the warmup's), formats, the preprocessing served (mean,
    std, resize, crop, interpolation), for a model of any input size its patch stride (`any_size_stride`, else
    null), `serving_kernels`, `image_group` (the images run at a time; null: the whole request) and the `precision`
    (why it was chosen, and for bfloat16 its check against float32) are recorded in
    `assets.extra/keras_vit_export.json`.
    """
    base, version, target = version_folder(base_dir, version, overwrite)
    dtype, chosen = precisions.resolve(precision)
    precision_check = None
    if dtype == "bfloat16":
        twin = precisions.bfloat16_model(model)
        if check_images is None:
            from . import data
            check_images = data.photos(model_io.image_size(model), count=precisions.CHECK_PHOTOS)
        precision_check = precisions.check(model, twin, check_images, max_top1_drop)
        if precision_check["refused"]:
            raise precisions.Top1DropError(precisions.refusal(precision_check))
        model = twin
    archive = serving.serving_archive(model, top_k=top_k, class_names=class_names, max_pixels=max_pixels,
                                      max_batch=max_batch, signatures=signatures, feature_blocks=feature_blocks,
                                      embedding=embedding, l2_normalize=l2_normalize,
                                      serving_kernels=serving_kernels)
    size = model_io.image_size(model)
    metadata = {"image_size": list(size), "any_size_stride": model_io.patch_stride(model),
                "max_pixels": max_pixels, "max_batch": max_batch,
                "top_k": min(top_k, int(model.output_shape[-1])), "serving_kernels": serving_kernels,
                "image_group": serving.image_group_size(model, max_batch, serving_kernels),
                "image_formats": list(image_io.FORMATS),
                "signatures": ["serving_default", serving.BYTES_SIGNATURE, *signatures],
                "preprocessing": model_io.preprocessing_config(model).to_dict(),
                "precision": dtype, "precision_chosen": chosen, "precision_check": precision_check}
    # At least the variables, which the SavedModel holds once (the graph and the warmup requests come on top).
    check_room({str(base): variables_bytes(model.weights)}, f"SavedModel version {version}")
    try:
        with atomic_write(target, folder=True) as partial:  # makes `base` where there is none
            archive.write_out(partial, verbose=False)
            write_warmup_requests(partial, size, model_name=base.name)
            (Path(partial) / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")
    except tf.errors.ResourceExhaustedError as error:  # TensorFlow's writer on a full disk (ENOSPC)
        raise DiskSpaceError(errno.ENOSPC, f"The disk filled up while SavedModel version {version} was written in "
                             f"{base} ({error.message.split(';')[-1].strip()}). Nothing was written and the versions "
                             "there before are whole: free some space and export again") from None
    return target


def warmup_image(size: tuple[int, int]) -> np.ndarray:
    """A deterministic colour-gradient uint8 image of shape (height, width, 3)."""
    rows, cols = np.meshgrid(np.linspace(0, 255, size[0]), np.linspace(0, 255, size[1]), indexing="ij")
    return np.stack([rows, cols, 255 - (rows + cols) / 2], axis=-1).astype(np.uint8)


def warmup_requests(size: tuple[int, int], model_name: str) -> list[tuple[str, str, np.ndarray]]:
    """(signature, input key, value): one request per signature and input kind (float pixels, a PNG, a JPEG)."""
    image = warmup_image(size)
    return [("serving_default", serving.IMAGES_KEY, image[np.newaxis].astype(np.float32)),
            (serving.BYTES_SIGNATURE, serving.BYTES_KEY, np.array([tf.io.encode_png(image).numpy()], dtype=object)),
            (serving.BYTES_SIGNATURE, serving.BYTES_KEY, np.array([tf.io.encode_jpeg(image).numpy()], dtype=object))]


# TF Serving's PredictionLog, written with the protobuf wire format so that exporting needs no
# tensorflow-serving-api (which pins its own TensorFlow release). Field numbers from
# tensorflow_serving/apis: PredictionLog.predict_log = 6, PredictLog.request = 1,
# PredictRequest.model_spec = 1 and .inputs = 2 (map<string, TensorProto>: key = 1, value = 2),
# ModelSpec.name = 1 and .signature_name = 3. tests/export/test_export.py parses it with the real protos.

def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def prediction_log(model_name: str, signature: str, key: str, value: np.ndarray) -> bytes:
    """A serialized `PredictionLog` holding one `PredictRequest` with one input tensor."""
    spec = _field(1, model_name.encode()) + _field(3, signature.encode())
    inputs = _field(1, key.encode()) + _field(2, tf.make_tensor_proto(value).SerializeToString())
    return _field(6, _field(1, _field(1, spec) + _field(2, inputs)))


def write_warmup_requests(saved_model_dir: str | os.PathLike, size: tuple[int, int], model_name: str) -> Path:
    """Writes `assets.extra/tf_serving_warmup_requests` (PredictionLog TFRecords) into a SavedModel."""
    path = Path(saved_model_dir) / WARMUP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for signature, key, value in warmup_requests(size, model_name):
            writer.write(prediction_log(model_name, signature, key, value))
    return path


def read_metadata(saved_model_dir: str | os.PathLike) -> dict:
    """The export's limits and settings from `assets.extra/keras_vit_export.json`."""
    return json.loads((Path(saved_model_dir) / METADATA_FILE).read_text(encoding="utf-8"))
