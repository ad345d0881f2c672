"""The precision a served model computes in: float32, or bfloat16 where the serving CPU runs it natively.

    keras-vit-export --weights B/16 --out /models/vit --precision bfloat16   # or auto: this machine's CPU decides

A bfloat16 SavedModel is the same model with its weights stored and its layers computing in bfloat16
(`bfloat16_model`), except the pixel normalization and the classifier's outputs (`FLOAT32_LAYERS`); its
signatures take and return float32 as the float32 export does. Before anything is written it is checked against
the float32 model on real photographs (`check`): its top-1 agreement, and refused past `max_top1_drop` points, as
the int8 LiteRT files are. On CPUs with AVX512-BF16 or AMX (`keras_vit.kernels.Capabilities.native_bfloat16`)
TensorFlow's oneDNN runs its matmuls at about twice the float32 rate; elsewhere bfloat16 is emulated and slower
than float32, which `auto` then keeps.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from keras_vit import features, kernels

from . import model_io

PRECISIONS = ("float32", "bfloat16", "auto")
# Left in float32 in a bfloat16 model: the normalization of [0, 255] pixels (bfloat16 holds 8 significant bits)
# and the classifier's outputs, which the builders pin to float32 (`keras_vit.models._forward`).
FLOAT32_LAYERS = ("preprocessing", "head", "head_dist", "head_average", "predictions")
DEFAULT_MAX_TOP1_DROP = 1.0  # points of top-1 agreement with the float32 model a bfloat16 export may lose
CHECK_PHOTOS = 128  # crops of real photographs the bfloat16 model is checked on (one is 0.78 points of top-1)


class Top1DropError(ValueError):
    """A reduced-precision model (a bfloat16 SavedModel, an int8 ONNX, OpenVINO or LiteRT file) disagrees with the
    float32 model on more images than allowed: that file was not written. `report` is the report written beside the
    files that were (the LiteRT modes), else None."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def check_max_top1_drop(max_top1_drop: float) -> None:
    """Raises ValueError unless `max_top1_drop` (points of top-1) is >= 0."""
    if not max_top1_drop >= 0:
        raise ValueError(f"Expected max_top1_drop >= 0 (points of top-1). Received {max_top1_drop}.")


def resolve(precision: str) -> tuple[str, str]:
    """(`"float32"` or `"bfloat16"`, why): `auto` is bfloat16 where this machine's CPU computes bfloat16 natively
    (AVX512-BF16 or AMX), float32 elsewhere (on an accelerator too: a SavedModel for TF Serving runs on CPUs)."""
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown precision {precision!r}. Expected one of {', '.join(PRECISIONS)}.")
    if precision != "auto":
        return precision, "asked for"
    native = sorted(kernels.NATIVE_BFLOAT16_FLAGS[flag] for flag in
                    kernels.cpu_flags() & kernels.NATIVE_BFLOAT16_FLAGS.keys())
    if native:
        return "bfloat16", f"auto: this CPU has {' and '.join(native)}"
    return "float32", "auto: this CPU has no native bfloat16 (no AVX512-BF16 or AMX)"


def bfloat16_model(model: keras.Model) -> keras.Model:
    """`model` rebuilt with every layer's weights and computation in bfloat16 (Keras' `"bfloat16"` dtype policy),
    but `FLOAT32_LAYERS` and layers of another policy (a quantized layer), its weights those of `model` rounded to
    bfloat16. A functional model (a keras_vit builder's, or a model around one) only."""
    config = keras.saving.serialize_keras_object(model) if isinstance(model, keras.Model) else {}
    if "layers" not in config.get("config", {}):  # a subclassed model's config has no layers to rebuild
        raise ValueError(f"Expected a functional keras.Model (a keras_vit builder's model). Received {model!r}.")
    _to_bfloat16(config)
    twin = keras.saving.deserialize_keras_object(config)
    twin.set_weights([np.asarray(keras.ops.convert_to_numpy(weight)) for weight in model.weights])
    return twin


def _to_bfloat16(layer_config: dict) -> None:
    """Sets the dtype policy of a serialized layer, and of the layers of a serialized functional model in it."""
    config = layer_config.get("config", {})
    dtype = config.get("dtype")
    if config.get("name") not in FLOAT32_LAYERS and _policy_name(dtype) == "float32":
        config["dtype"] = keras.dtype_policies.serialize(keras.dtype_policies.DTypePolicy("bfloat16"))
    for inner in config.get("layers", ()):
        _to_bfloat16(inner)


def _policy_name(dtype) -> str | None:
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, dict):
        return dtype.get("config", {}).get("name")
    return None


def check(model: keras.Model, twin: keras.Model, images: np.ndarray,
          max_top1_drop: float = DEFAULT_MAX_TOP1_DROP) -> dict[str, Any]:
    """How the bfloat16 `twin` agrees with the float32 `model` on `images` ((N, H, W, 3) pixels in [0, 255] at the
    model's size, normalized by each model's own pixel input): max |difference| relative to the largest float32
    output, top-1 agreement (for a classifier; for an embedding, the least cosine), `refused` past `max_top1_drop`
    points of top-1."""
    reference = outputs(model_io.with_pixel_input(model), images)
    ours = outputs(model_io.with_pixel_input(twin, model_io.preprocessing_config(model)), images)
    return agreement(reference, ours, max_top1_drop, classifier=features.classifier_head(model) is not None)


def agreement(reference: np.ndarray, ours: np.ndarray, max_top1_drop: float = DEFAULT_MAX_TOP1_DROP, *,
              classifier: bool = True) -> dict[str, Any]:
    """How outputs `ours` agree with the float32 model's `reference` ((N, features) each, one row per image): max
    |difference| relative to the largest reference output and the least cosine; for a `classifier`, the top-1
    agreement, `refused` past `max_top1_drop` points of it (an embedding's largest entry is no class: a tower is
    reported, not refused)."""
    check_max_top1_drop(max_top1_drop)
    report = {"images": len(reference), "max_relative_diff": float(np.abs(ours - reference).max()
                                                                    / max(float(np.abs(reference).max()), 1e-30))}
    if classifier and reference.shape[-1] > 1:
        # From the count: 1 image of 100 is 1.0 point, not 1.0000000000000009.
        disagreements = int(np.count_nonzero(ours.argmax(-1) != reference.argmax(-1)))
        report.update(top1_agreement=(len(reference) - disagreements) / len(reference),
                      top1_drop=100.0 * disagreements / len(reference))
    norms = np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1)
    cosines = np.sum(ours * reference, -1) / np.maximum(norms, 1e-30)  # (a zero output: 0, not NaN)
    report["min_cosine"] = float(cosines.min())
    report["max_top1_drop"] = max_top1_drop
    report["refused"] = report.get("top1_drop", 0.0) > max_top1_drop
    return report


def outputs(model: keras.Model, images: np.ndarray, batch: int = 16) -> np.ndarray:
    """The model's first output on `images`, called as the SavedModel calls it (portable ops), float64, flattened
    to (N, features)."""
    results = []
    for start in range(0, len(images), batch):
        first = keras.tree.flatten(model(images[start:start + batch], training=False))[0]
        results.append(np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(first, "float32")), dtype=np.float64))
    return np.concatenate(results).reshape(len(images), -1)


def refusal(report: dict[str, Any], what: str = "The bfloat16 model") -> str:
    """One line for a refused reduced-precision export of `what`."""
    return (f"{what}'s top-1 disagrees with float32 on {report['top1_drop']:.2f} points of "
            f"{report['images']} photographs, over max_top1_drop={report['max_top1_drop']:g}, so nothing was "
            "written: export in float32 (--precision float32), or allow more (--max-top1-drop)")
