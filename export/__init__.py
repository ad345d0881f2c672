"""Exports keras_vit classifiers for serving: TF Serving SavedModels and LiteRT (`.tflite`) files.

`export_all(model_or_path, out_dir)` writes both and returns a report. Installed as `keras_vit.export`;
the command lines are `keras-vit-export` and `keras-vit-tflite` (`python -m export.saved_model` and
`python -m export.tflite` in a clone). Runs on the TensorFlow backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import keras
import numpy as np

import keras_vit
import keras_vit.model_files
from keras_vit._backend import require_tensorflow_backend

require_tensorflow_backend("keras_vit.export")

ALL_MODES = ("float32", "float16", "dynamic_int8", "mixed_int8", "int8", "int8_cpu")


def export_all(model_or_path: keras.Model | str | os.PathLike, out_dir: str | os.PathLike, *,
               version: int | None = None, overwrite: bool = False, class_names: Sequence[str] | None = None,
               images: np.ndarray | None = None, dataset: str | os.PathLike = "digits",
               modes: Sequence[str] | None = None, max_top1_drop: float | None = None,
               calibration_count: int = 200, evaluation_count: int = 400,
               serving_kernels: str = "onednn") -> dict[str, Any]:
    """Exports a classifier to `out_dir/saved_model/<version>/` and `out_dir/tflite/`.

    Args:
        model_or_path: a keras_vit classifier or the path of a `.keras` file.
        out_dir: output directory.
        version, overwrite, class_names, serving_kernels: as `export_saved_model`.
        images, dataset, modes, max_top1_drop, calibration_count, evaluation_count: as `export_tflite` (real
            images for int8 calibration and checks; the int8 modes' top-1 limit, `tflite.DEFAULT_MAX_TOP1_DROP`
            points when None; how many images calibrate and check).

    Returns:
        `{"saved_model": <version dir>, "tflite": <TFLite report dict>, "tflite_markdown": <its table>}`.
    """
    # Imported here, not above: `python -m export.saved_model` would otherwise run that module twice.
    from . import saved_model, tflite

    model = keras_vit.model_files.load_or_build(model_or_path)
    out = Path(out_dir)
    saved = saved_model.export_saved_model(model, out / "saved_model", version=version, overwrite=overwrite,
                                           class_names=class_names, serving_kernels=serving_kernels)
    limit = tflite.DEFAULT_MAX_TOP1_DROP if max_top1_drop is None else max_top1_drop
    report = tflite.export_tflite(model, out / "tflite", images=images, dataset=dataset, modes=modes,
                                  max_top1_drop=limit, calibration_count=calibration_count,
                                  evaluation_count=evaluation_count)
    return {"saved_model": str(saved), "tflite": report, "tflite_markdown": tflite.markdown_report(report)}


__all__ = ["export_all", "ALL_MODES"]
