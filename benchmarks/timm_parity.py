"""keras_vit vs timm's own forward pass, on timm ViTs with random weights (needs torch and timm).

    python -m benchmarks.timm_parity [--models vit_tiny_patch16_224 vit_base_patch16_224] [--out DIR]

For each model: `timm.create_model(name, pretrained=False)` (its random initialization, with
random non-zero biases, norms, tokens and head so every term counts), the state dict saved with
`safetensors.torch.save_file`, loaded with the keras_vit builder of the same size (`weights=`
that file, `include_preprocessing=False`), and the max |logit difference| printed: Keras model
vs timm on the same [-1, 1] images (NHWC for Keras, NCHW for torch), then the SavedModel that
`export/saved_model.py` writes (its `serving_default` takes [0, 255] pixels) and the float32 TFLite
file of `export/tflite.py`, run with the LiteRT interpreter, vs timm.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

BUILDERS = {"vit_tiny_patch16_224": "ViTTi16", "vit_small_patch16_224": "ViTS16",
            "vit_base_patch16_224": "ViTB16", "vit_large_patch16_224": "ViTL16"}
# The ViT family's timm models, built from the file alone (`convert_checkpoint`: architecture and options read
# from the keys, the number of heads given), at 224 px with a 1000-class head: (timm name, create_model kwargs).
FAMILIES = {"deit3_small_patch16_224": {}, "deit_small_distilled_patch16_224": {},
            "vit_small_patch14_reg4_dinov2": {"img_size": 224, "num_classes": 1000},
            "vit_small_patch14_dinov2": {"img_size": 224, "num_classes": 1000}}


def timm_model(name: str, seed: int = 0):
    """A timm model in eval mode whose parameters are all random and non-zero."""
    import torch

    from benchmarks.torchvision_stub import import_timm

    timm, _ = import_timm()  # timm imports torchvision, which has no CPU build on PyPI
    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False, **FAMILIES.get(name, {})).eval()
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if parameter.ndim == 1 or key in ("cls_token", "pos_embed"):  # zeros / ones at init
                parameter.add_(torch.randn_like(parameter) * 0.1)
            if key == "head.weight":
                parameter.normal_(0, 0.1)
    return model


def compare(name: str, out_dir: str, batch: int = 2) -> dict[str, float]:
    import tensorflow as tf
    import torch
    from safetensors.torch import save_file

    import keras_vit
    from ai_edge_litert.interpreter import Interpreter

    from keras_vit.export import saved_model, tflite

    model = timm_model(name)
    path = os.path.join(out_dir, f"{name}.safetensors")
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, path)
    images = np.random.default_rng(1).uniform(-1, 1, (batch, 224, 224, 3)).astype("float32")
    with torch.no_grad():
        expected = model(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    if name in BUILDERS:
        keras_model = getattr(keras_vit, BUILDERS[name])(weights=path, include_preprocessing=False,
                                                         classifier_activation=None)
    else:
        from keras_vit.convert import convert_checkpoint
        keras_model, _ = convert_checkpoint(path, os.path.join(out_dir, f"{name}.keras"),
                                            num_heads=model.blocks[0].attn.num_heads)
    logits = np.asarray(keras_model(images))
    pixels = (images + 1.0) * 127.5  # The exports take [0, 255] pixels.
    export_dir = saved_model.export_saved_model(keras_model, os.path.join(out_dir, name))
    serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
    served = serve(images=tf.constant(pixels))["logits"].numpy()
    interpreter = Interpreter(model_path=str(tflite.convert(keras_model, os.path.join(out_dir, f"{name}.tflite"),
                                                            "float32")))
    interpreter.allocate_tensors()
    (given,), (output,) = interpreter.get_input_details(), interpreter.get_output_details()
    lite = []
    for image in pixels:
        interpreter.set_tensor(given["index"], image[np.newaxis])
        interpreter.invoke()
        lite.append(interpreter.get_tensor(output["index"])[0])
    return {"logit range": float(np.abs(expected).max()), "keras vs timm": float(np.abs(logits - expected).max()),
            "SavedModel vs timm": float(np.abs(served - expected).max()),
            "float32 TFLite vs timm": float(np.abs(np.stack(lite) - expected).max())}


def compare_features(name: str, out_dir: str, blocks: tuple[int, ...] = (0, 5, 11), batch: int = 2) -> dict:
    """Max |difference| of `keras_vit.features_model` from timm's `forward_intermediates` (NCHW maps of the
    same blocks, without the final norm, and the prefix tokens) on a family model built from the file."""
    import torch
    from safetensors.torch import save_file

    import keras_vit
    from keras_vit.convert import convert_checkpoint

    model = timm_model(name)
    path = os.path.join(out_dir, f"{name}.safetensors")
    save_file({key: value.contiguous() for key, value in model.state_dict().items()}, path)
    images = np.random.default_rng(2).uniform(-1, 1, (batch, 224, 224, 3)).astype("float32")
    keras_model, _ = convert_checkpoint(path, os.path.join(out_dir, f"{name}.keras"),
                                        num_heads=model.blocks[0].attn.num_heads)
    ours = keras_vit.features_model(keras_model, blocks)(images)
    with torch.no_grad():
        intermediates = model.forward_intermediates(torch.from_numpy(images.transpose(0, 3, 1, 2)),
                                                    indices=list(blocks), norm=False, output_fmt="NCHW",
                                                    intermediates_only=False, return_prefix_tokens=True)[1]
    maps = max(float(np.abs(np.asarray(ours[f"block_{b}"]) - spatial.numpy().transpose(0, 2, 3, 1)).max())
               for b, (spatial, _) in zip(blocks, intermediates))
    prefix = max(float(np.abs(np.asarray(ours[f"block_{b}_prefix"]) - tokens.numpy()).max())
                 for b, (_, tokens) in zip(blocks, intermediates))
    return {"blocks": list(blocks), "maps vs timm": maps, "prefix tokens vs timm": prefix,
            "feature range": float(max(np.abs(spatial.numpy()).max() for spatial, _ in intermediates))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["vit_tiny_patch16_224", "vit_base_patch16_224"],
                        choices=sorted({**BUILDERS, **FAMILIES}))
    parser.add_argument("--out", help="folder for the .safetensors files and SavedModels (default: a temp folder)")
    parser.add_argument("--features", action="store_true",
                        help="compare keras_vit.features_model with timm's forward_intermediates instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        out_dir = args.out or temporary
        for name in args.models:
            results = compare_features(name, out_dir) if args.features else compare(name, out_dir)
            print(name + ": " + ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                                          for key, value in results.items()))


if __name__ == "__main__":
    main()
