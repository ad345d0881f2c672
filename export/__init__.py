"""Exports keras_vit classifiers for serving: TF Serving SavedModels and LiteRT (`.tflite`) files.

`export_all(model_or_path, out_dir)` writes both and returns a report; `python -m
export.saved_model` and `python -m export.tflite` are the command-line entry points.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import keras
import numpy as np

import keras_vit

ALL_MODES = ("float32", "float16", "dynamic_int8", "int8")


def export_all(model_or_path: keras.Model | str | os.PathLike, out_dir: str | os.PathLike, *,
               version: int | None = None, overwrite: bool = False, class_names: Sequence[str] | None = None,
               images: np.ndarray | None = None, dataset: str | os.PathLike = "digits",
               modes: Sequence[str] = ALL_MODES) -> dict[str, Any]:
    """Exports a classifier to `out_dir/saved_model/<version>/` and `out_dir/tflite/`.

    Args:
        model_or_path: a keras_vit classifier or the path of a `.keras` file.
        out_dir: output directory.
        version, overwrite, class_names: as `export_saved_model`.
        images, dataset, modes: as `export_tflite` (real images for int8 calibration and checks).

    Returns:
        `{"saved_model": <version dir>, "tflite": <TFLite report dict>, "tflite_markdown": <its table>}`.
    """
    # Imported here so that `python -m export.saved_model` does not import its own module twice.
    from export import saved_model, tflite

    model = keras_vit.models.load_or_build(model_or_path)
    out = Path(out_dir)
    saved = saved_model.export_saved_model(model, out / "saved_model", version=version, overwrite=overwrite,
                               class_names=class_names)
    report = tflite.export_tflite(model, out / "tflite", images=images, dataset=dataset, modes=modes)
    return {"saved_model": str(saved), "tflite": report, "tflite_markdown": tflite.markdown_report(report)}


__all__ = ["export_all", "ALL_MODES"]
