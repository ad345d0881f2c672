"""keras-vit-convert: a checkpoint as a Keras file, checked. An original `.npz` (either Flax naming) or a
timm / Hugging Face `.safetensors` file becomes a `.weights.h5` file or a `.keras` model (inputs in [0, 255]
for an `.npz`, [-1, 1] for a `.safetensors` file). The written file is read back and compared with the
checkpoint-loaded model; prints the max absolute difference (0 when faithful).

    keras-vit-convert ViT-B_16.npz vit_b16_384.weights.h5 --variant B/16 --image-size 384
    keras-vit-convert vit_tiny.safetensors vit_tiny.keras
    keras-vit-convert vit_base_patch16_clip_224.safetensors clip.keras --num-heads 12 \
        --layer-norm-epsilon 1e-5 --activation quick_gelu

A timm file records neither its heads nor its numerics: give them (timm's defaults are 1e-6 and exact GELU; an
OpenAI CLIP tower has 1e-5 and QuickGELU). A Hugging Face file takes them from the config.json beside it.

A `.weights.h5` result holds the weights alone: the command prints the `keras_vit.VisionTransformer(...)` call
that builds its model (the architecture, the options and preprocessing the checkpoint's files gave, the input
shape, the head or pooling) and loads it. A `.keras` result holds all of it.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from keras_vit import cli
from keras_vit.cli import common


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keras-vit-convert", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="original .npz checkpoint, or a timm / Hugging Face .safetensors file")
    parser.add_argument("output", help="output path, ending in .weights.h5 or .keras")
    parser.add_argument("--variant", help="variant, e.g. B/16 or R50+B/16 (default: read from the checkpoint)")
    parser.add_argument("--image-size", type=int, nargs="+", metavar="SIZE",
                        help="input size, one value (square) or height width (default: the checkpoint's)")
    parser.add_argument("--num-heads", type=int,
                        help="attention heads of a .safetensors model not in the variant table (default: the "
                             "config.json's, the variant's, or that of the variant with the checkpoint's shapes)")
    parser.add_argument("--layer-norm-epsilon", type=float,
                        help="LayerNorm epsilon of a timm model (default: its config.json's, else the layout's)")
    parser.add_argument("--activation", choices=("gelu", "quick_gelu"),
                        help="MLP activation (default: the config.json's, else gelu)")
    parser.add_argument("--gelu-approximate", action=argparse.BooleanOptionalAction, default=None,
                        help="tanh-approximate GELU (default: the config.json's, else exact for .safetensors files)")
    return parser


@cli.one_line_exits("keras-vit-convert", cli.NOTHING_HALF_WRITTEN)
def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    cli.require("keras-vit-convert", None)
    from keras_vit import convert

    image_size = common.image_size(parser, args.image_size) if args.image_size else None
    if not args.output.endswith((".weights.h5", ".keras")):
        parser.error(f"output must end in .weights.h5 or .keras. Received: {args.output!r}")
    if args.num_heads and not args.checkpoint.endswith(".safetensors"):
        parser.error("--num-heads is for .safetensors files; an .npz checkpoint stores its heads.")
    model, difference = convert.convert_checkpoint(  # A file that does not fit, or contradicting options: one line.
        args.checkpoint, args.output, variant=args.variant, num_heads=args.num_heads, image_size=image_size,
        layer_norm_epsilon=args.layer_norm_epsilon, gelu_approximate=args.gelu_approximate, activation=args.activation)
    height, width = model.inputs[0].shape[1:3]
    print(f"Wrote {args.output} ({model.count_params():,} parameters, input {height}x{width}, "
          f"output {model.outputs[0].shape[-1]}).")
    print(f"validate_output: max abs difference {difference:.3g} (the written file, read back, vs. the "
          f"checkpoint-loaded model)")
    if args.output.endswith(".weights.h5"):
        from keras_vit.checkpoints.reader import read_checkpoint

        pooling = read_checkpoint(args.checkpoint).pooling  # of a model without a head: the file's, as converted
        print(f"Load it with: {convert.load_call(model, args.output, pooling=pooling)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
