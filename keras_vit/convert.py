"""Converts an original `.npz` checkpoint into a Keras `.weights.h5` file.

    python -m keras_vit.convert ViT-B_16.npz vit_b16_384.weights.h5 --variant B/16 --image-size 384

Builds the model with the checkpoint loaded (position embeddings resampled to
`--image-size`), saves its weights, reloads them into a fresh model and prints the
largest absolute difference between the two models' logits on a fixed random input
(0 for a faithful conversion). Without `--variant` the architecture is read from the
checkpoint's shapes. Load the result with `weights="path.weights.h5"` and the same
arguments (variant, input size, classes, representation size).

A timm or Hugging Face ViT `.safetensors` file converts to `.weights.h5` or `.keras`
(`keras_vit.torch_checkpoints.convert_safetensors`); the printed difference is then against a
NumPy forward pass of the source model, on [-1, 1] inputs:

    python -m keras_vit.convert vit_tiny.safetensors vit_tiny.keras
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Sequence

import numpy as np

from keras_vit import models, torch_checkpoints, variants
from keras_vit import weights as weights_lib


def checkpoint_architecture(arrays: dict[str, np.ndarray]) -> dict:
    """Reads the architecture of a checkpoint from its key names and shapes.

    Returns:
        `VisionTransformer` keyword arguments: patch_size, hidden_dim, mlp_dim, num_heads,
        num_layers, resnet_stages (None for a plain ViT), classifier, representation_size.
    """
    if "embedding/kernel" not in arrays:
        raise ValueError(f"Not a ViT checkpoint: no 'embedding/kernel' among its {len(arrays)} keys.")
    patch, _, _, hidden = arrays["embedding/kernel"].shape
    blocks = {int(m.group(1)) for key in arrays for m in [re.match(r"Transformer/encoderblock_(\d+)/", key)] if m}
    paths = {target[0]: array for key, array in arrays.items() for target in [weights_lib.keras_path(key)] if target}
    mlp_path, query_path = ("encoderblock_0/MlpBlock_3/Dense_0/kernel",
                            "encoderblock_0/MultiHeadDotProductAttention_1/query/kernel")
    if mlp_path not in paths or query_path not in paths:
        raise ValueError(f"Not a ViT checkpoint: no keys for {mlp_path!r} and {query_path!r}.")
    mlp, query = paths[mlp_path], paths[query_path]
    units = [tuple(map(int, m.groups())) for key in arrays for m in [re.match(r"block(\d+)/unit(\d+)/conv1/", key)]
             if m]
    stages = tuple(max(u for s, u in units if s == stage) for stage in sorted({s for s, _ in units}))
    return dict(patch_size=patch, hidden_dim=hidden, mlp_dim=mlp.shape[1], num_heads=query.shape[1],
                num_layers=len(blocks), resnet_stages=stages or None,
                classifier="token" if "cls" in arrays else "gap",
                representation_size=arrays["pre_logits/bias"].shape[0] if "pre_logits/bias" in arrays else None)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m keras_vit.convert", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="original .npz checkpoint (either Flax naming), or a timm / Hugging "
                                           "Face .safetensors file")
    parser.add_argument("output", help="output path, ending in .weights.h5 (or .keras for a .safetensors file)")
    parser.add_argument("--variant", help="variant, e.g. B/16 or R50+B/16 (default: read from the checkpoint)")
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIZE",
                        help="input size, one value or height width (default: the checkpoint's)")
    parser.add_argument("--classes", type=int,
                        help="head size; another value than the checkpoint's leaves the head zero "
                             "(default: the checkpoint's)")
    parser.add_argument("--num-heads", type=int,
                        help="attention heads of a .safetensors model not in the variant table (default: the "
                             "variant's, or that of the variant with the checkpoint's shapes)")
    args = parser.parse_args(argv)
    if args.checkpoint.endswith(".safetensors"):
        if not args.output.endswith((".weights.h5", ".keras")):
            parser.error(f"output must end in .weights.h5 or .keras. Received: {args.output!r}")
    elif not args.output.endswith(".weights.h5"):
        parser.error(f"output must end in .weights.h5. Received: {args.output!r}")
    if args.image_size and len(args.image_size) > 2:
        parser.error(f"--image-size takes 1 or 2 values. Received: {args.image_size}")
    return args


def _build(architecture: dict, variant: str | None, image_size: tuple[int, int], classes: int, weights: str):
    kwargs = {} if variant else {key: value for key, value in architecture.items()
                                 if key not in ("classifier", "representation_size")}
    return models.VisionTransformer(
        variant, **kwargs, weights=weights, input_shape=(*image_size, 3), classes=classes,
        classifier=architecture["classifier"], representation_size=architecture["representation_size"],
        classifier_activation=None)


def _convert_safetensors(args: argparse.Namespace) -> int:
    image_size = (args.image_size[0], args.image_size[-1]) if args.image_size else None
    difference = torch_checkpoints.convert_safetensors(args.checkpoint, args.output, variant=args.variant,
                                                       num_heads=args.num_heads, image_size=image_size,
                                                       classes=args.classes)
    print(f"Wrote {args.output}.")
    print(f"validate_output: max abs difference {difference:.3g} (converted model vs. a NumPy forward pass of "
          "the source model, on [-1, 1] inputs)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.checkpoint.endswith(".safetensors"):
        return _convert_safetensors(args)
    arrays = weights_lib.read_npz(args.checkpoint)
    architecture = checkpoint_architecture(arrays)
    if args.image_size:
        image_size = (args.image_size[0], args.image_size[-1])
    else:
        tokens = arrays["Transformer/posembed_input/pos_embedding"].shape[1]
        side = math.isqrt(tokens - (architecture["classifier"] == "token"))
        image_size = (side * variants.total_stride(architecture),) * 2
    checkpoint_classes = arrays["head/bias"].shape[0] if "head/bias" in arrays else None
    classes = args.classes or checkpoint_classes or 1000
    if classes != checkpoint_classes:
        architecture["representation_size"] = None  # as the original fine-tuning: a new head, no pre_logits
    reference = _build(architecture, args.variant, image_size, classes, args.checkpoint)
    reference.save_weights(args.output)
    converted = _build(architecture, args.variant, image_size, classes, args.output)
    images = np.random.default_rng(0).uniform(0, 255, (2, *image_size, 3)).astype("float32")
    difference = np.abs(np.asarray(converted(images)) - np.asarray(reference(images)))
    print(f"Wrote {args.output} ({reference.count_params():,} parameters, input {image_size[0]}x{image_size[1]}, "
          f"{classes} classes).")
    print(f"validate_output: max abs difference {difference.max():.3g}, mean {difference.mean():.3g} "
          "(converted .weights.h5 model vs. .npz-loaded model)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
