"""JPEG bytes -> embedding (or logits), end to end: transformers' / timm's own preprocessing and model against
keras_vit's SavedModel, which reads the preprocessing from the files beside the weights.

    python -m benchmarks.end_to_end [--out DIR]
    python -m benchmarks.end_to_end --resampled

Needs torch, transformers and timm; not part of the test suite. Per family (CLIP with its projection, SigLIP,
DINOv2, a timm ViT): the PyTorch model with random, perturbed weights (`benchmarks.parity`), saved with its
image processor (`save_pretrained`; timm: `model.safetensors` and a `config.json` holding `pretrained_cfg`, as
timm writes for the hub), so that the folder looks like a hub snapshot; keras_vit builds the model from the folder
alone (`VisionTransformer(weights=folder)`: mean, std, resize, crop and interpolation from the files) and exports
it with the `embed` signature (`export/saved_model.py`). The same JPEG bytes of real photographs (scikit-learn's
two sample images and crops of other aspect ratios) go to both:

- reference: PIL decodes; transformers' image processor (timm: its evaluation transform, written here with PIL
  as torchvision applies it to PIL images: resize of the short side to floor(224 / crop_pct), centre crop,
  normalize) makes the pixels; the PyTorch model computes the output;
- keras_vit: the SavedModel's `embed` (or `serving_bytes`) signature, bytes in (TensorFlow decodes).

Printed: the fields read, 1 - the cosine similarity of the outputs (its min over images), their max |difference|
relative to the largest value, top-1 agreement where there is a head, and the same model on the reference's own
pixels (isolating the model from the resize, which PIL computes in 8 bits and TensorFlow in float).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import tempfile

import numpy as np

from benchmarks import parity

SIZE = 224
FAMILIES = {
    # name: (parity case, transformers processor class and arguments, L2-normalized embedding source)
    "CLIP (CLIPVisionModelWithProjection)": ("hf_clip_projection", ("CLIPImageProcessor", {}), "head"),
    "SigLIP (SiglipVisionModel)": ("hf_siglip", ("SiglipImageProcessor", {}), "pooled"),
    "DINOv2 (Dinov2Model)": ("hf_dinov2", ("BitImageProcessor", dict(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, resample=3,
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225], do_convert_rgb=True)), "pooled"),
    "timm ViT B/16 (augreg in21k-ft-in1k cfg)": ("vit_base_patch16_224", None, None),
}
TIMM_CFG = {"input_size": [3, 224, 224], "interpolation": "bicubic", "crop_pct": 0.9, "crop_mode": "center",
            "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "num_classes": 1000}


def photographs() -> list[bytes]:
    """JPEG bytes of scikit-learn's two sample photographs and four crops of other aspect ratios."""
    import tensorflow as tf
    from sklearn.datasets import load_sample_images

    china, flower = load_sample_images().images
    images = [china, flower, china[50:350, 100:300], flower[:200, :], china[100:400, 200:500], flower[10:250, 300:]]
    return [tf.io.encode_jpeg(np.ascontiguousarray(image), quality=92).numpy() for image in images]


def save_folder(name: str, out_dir: str):
    """(torch model, folder as a hub snapshot, transformers processor or None)."""
    import transformers

    case_name, processor_spec, _ = FAMILIES[name]
    case = parity.CASES[case_name]
    model, path = parity.torch_model(case, out_dir)
    folder = os.path.dirname(path)
    if case.source == "timm":  # timm's hub layout: model.safetensors and config.json with pretrained_cfg
        folder = os.path.join(out_dir, case.name)
        os.makedirs(folder, exist_ok=True)
        os.replace(path, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as file:
            json.dump({"architecture": case.name, "num_classes": 1000, "pretrained_cfg": TIMM_CFG}, file)
        return model, folder, None
    processor_class, arguments = processor_spec
    processor = getattr(transformers, processor_class)(**arguments)
    processor.save_pretrained(folder)
    return model, folder, processor


def timm_pixels(image) -> np.ndarray:
    """timm's evaluation transform of a PIL image, as torchvision computes it on PIL images (NCHW float32)."""
    from PIL import Image

    scale = math.floor(SIZE / TIMM_CFG["crop_pct"])
    width, height = image.size
    new = (scale, int(scale * width / height)) if height <= width else (int(scale * height / width), scale)
    resized = image.resize((new[1], new[0]), Image.BICUBIC)
    top, left = int(round((new[0] - SIZE) / 2.0)), int(round((new[1] - SIZE) / 2.0))
    pixels = np.asarray(resized, np.float32)[top:top + SIZE, left:left + SIZE] / 255.0
    return ((pixels - TIMM_CFG["mean"]) / TIMM_CFG["std"]).transpose(2, 0, 1)[None].astype("float32")


def reference(model, processor, data: bytes, case) -> tuple[np.ndarray, np.ndarray]:
    """(pixels NCHW as the reference preprocesses them, the PyTorch model's output on them)."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    pixels = timm_pixels(image) if processor is None else processor(images=image, return_tensors="np")[
        "pixel_values"].astype("float32")
    return pixels, parity.torch_output(case, model, pixels.transpose(0, 2, 3, 1))


def import_torch_side() -> None:
    """Imports the PyTorch models' modules before TensorFlow: torch._dynamo, which transformers' models import,
    crashes (SIGSEGV) when imported after TensorFlow in one process (torch 2.14, TensorFlow 2.21)."""
    import torch._dynamo  # noqa: F401
    import transformers

    for name in ("CLIPVisionModelWithProjection", "SiglipVisionModel", "Dinov2Model"):
        getattr(transformers, name)
    from benchmarks.torchvision_stub import import_timm

    import_timm()


def compare(name: str, out_dir: str) -> dict:
    import tensorflow as tf

    import keras_vit
    from keras_vit.checkpoints.reader import read_checkpoint
    from keras_vit.export import saved_model

    case_name, _, embedding = FAMILIES[name]
    case = parity.CASES[case_name]
    model, folder, processor = save_folder(name, out_dir)
    file = read_checkpoint(folder)
    found = file.architecture(num_heads=1)
    head = case.head and embedding != "head"  # a CLIP projection is the embedding, served L2-normalized
    pooling = None if case.head else file.pooling
    ours = keras_vit.VisionTransformer(weights=folder, input_shape=(SIZE, SIZE, 3), include_top=case.head,
                                       classes=found["classes"] or 1000, pooling=pooling, classifier_activation=None,
                                       **case.build)
    l2 = embedding is not None
    export_dir = saved_model.export_saved_model(ours, os.path.join(out_dir, "served", case_name), version=1,
                                                signatures=() if head else ("embed",), embedding=embedding or
                                                "pooled", l2_normalize=l2)
    loaded = tf.saved_model.load(str(export_dir))
    signature = loaded.signatures["serving_bytes" if head else "embed"]
    images = photographs()
    served = signature(image_bytes=tf.constant(images))["logits" if head else "embedding"].numpy()
    pixels, expected = zip(*(reference(model, processor, data, case) for data in images))
    expected = np.concatenate(expected)
    same_pixels = np.asarray(keras_vit.VisionTransformer(
        weights=folder, input_shape=(SIZE, SIZE, 3), include_top=case.head, classes=found["classes"] or 1000,
        pooling=pooling, classifier_activation=None, include_preprocessing=False, **case.build)(
            np.concatenate(pixels).transpose(0, 2, 3, 1)))
    if l2:
        expected = expected / np.linalg.norm(expected, axis=1, keepdims=True)
        same_pixels = same_pixels / np.linalg.norm(same_pixels, axis=1, keepdims=True)
    cosine = np.sum(served * expected, 1) / np.linalg.norm(served, axis=1) / np.linalg.norm(expected, axis=1)
    scale = float(np.abs(expected).max())
    fields = ours.preprocessing_config.to_dict()
    return {"read from": os.path.basename(file.preprocessing_source or "nothing"),
            "mean": [round(v, 4) for v in fields["image_mean"]], "std": [round(v, 4) for v in fields["image_std"]],
            "resize": f"{fields['resize_mode']}, crop {fields['crop_fraction']:.3g}, {fields['interpolation']}",
            "output": "logits" if head else ("L2 embedding" if l2 else "embedding"),
            "images": len(images), "1 - min cosine": float(1.0 - cosine.min()),
            "max |diff| / max |value|": float(np.abs(served - expected).max()) / scale,
            "top-1 agreement": f"{int((served.argmax(1) == expected.argmax(1)).sum())}/{len(images)}" if head else "-",
            "same pixels: max |diff| / max |value|": float(np.abs(same_pixels - expected).max()) / scale}


RESAMPLED = {
    # name: (parity case overrides, size stored, size built)
    "DINOv2 S/14 (Dinov2Model) stored at 518, run at 224": ("hf_dinov2", dict(image_size=518), 224),
    "DeiT S/16 (timm deit_small_patch16_224) stored at 224, run at 384": ("deit_small_patch16_224", {}, 384),
}


def compare_resampled(name: str, out_dir: str) -> dict:
    """Max |difference| of a model built at another size than its file's position table from the PyTorch model run
    at that size (transformers interpolates its table in the forward pass; timm's `set_input_size` resamples it as
    its loader does), on [-1, 1] images."""
    import torch

    import keras_vit

    case_name, overrides, size = RESAMPLED[name]
    base = parity.CASES.get(case_name) or parity.Case("timm", case_name, build=dict(num_heads=6))
    case = dataclasses.replace(base, kwargs={**base.kwargs, **overrides})
    model, path = parity.torch_model(case, out_dir)
    if case.source == "timm":
        model.set_input_size(img_size=size)  # timm's resample_abs_pos_embed (bicubic, antialiased)
    images = np.random.default_rng(5).uniform(-1, 1, (2, size, size, 3)).astype("float32")
    with torch.no_grad():
        pixels = torch.from_numpy(images.transpose(0, 3, 1, 2))
        out = model(pixels) if case.source == "timm" else model(pixel_values=pixels).pooler_output
    expected = out.numpy()
    from keras_vit.checkpoints.reader import read_checkpoint

    file = read_checkpoint(path)
    architecture = file.architecture(num_heads=1)
    pooling = None if case.head else file.pooling
    ours = keras_vit.VisionTransformer(weights=file, input_shape=(size, size, 3), include_preprocessing=False,
                                       include_top=case.head, classes=architecture["classes"] or 1000,
                                       pooling=pooling, classifier_activation=None, **case.build)
    output = np.asarray(ours(images))
    return {"stored grid": architecture["image_size"] // architecture["patch_size"],
            "built grid": size // architecture["patch_size"], "output": "logits" if case.head else "embedding",
            "max |value|": float(np.abs(expected).max()), "max |diff|": float(np.abs(output - expected).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--out", help="folder for the saved models and exports (default: a temp folder)")
    parser.add_argument("--resampled", action="store_true",
                        help="instead: models built at another size than their file's position table (DINOv2 518 -> "
                             "224, DeiT 224 -> 384) against the PyTorch models at that size")
    args = parser.parse_args()
    import_torch_side()
    with tempfile.TemporaryDirectory() as temporary:
        for name in (RESAMPLED if args.resampled else args.families):
            results = (compare_resampled if args.resampled else compare)(name, args.out or temporary)
            print(name + ": " + "; ".join(f"{key} {value:.6g}" if isinstance(value, float) else f"{key} {value}"
                                          for key, value in results.items()), flush=True)


if __name__ == "__main__":
    main()
