"""keras_vit vs the PyTorch models' own forward pass, on timm and Hugging Face ViTs with random weights.

    python -m benchmarks.parity [--models deit3_small_patch16_224 hf_siglip ...] [--out DIR]
    python -m benchmarks.parity --features --models vit_small_patch14_reg4_dinov2

Needs torch, timm and (for the `hf_*` models) transformers; not part of the test suite. For each model: the
PyTorch model with random weights (every bias, norm, token and scale perturbed so that no parameter is
degenerate), its state dict saved as `.safetensors` (Hugging Face models with `save_pretrained`, which writes
`config.json` beside it), a keras_vit model built from the file alone (`VisionTransformer(weights=path,
...)`: the architecture from the keys, the heads and numerics from the config or the arguments below), and
the max |difference| of its output from the PyTorch model's on the same [-1, 1] images (NHWC for Keras, NCHW
for torch): the Keras model, then a SavedModel and the float32 TFLite file of `export/`, run with TensorFlow and
the LiteRT interpreter. The output is the logits where the model has a head, else its pooled embedding.
Classifiers go through `export/saved_model.py` (whose `serving_default` takes [0, 255] pixels); embedding
towers through `keras.Model.export`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import numpy as np

SIZE = 224


@dataclasses.dataclass(frozen=True)
class Case:
    """A PyTorch model to compare: a timm name (with `create_model` arguments) or a transformers class built
    from its config; `build`: the keras_vit arguments a user gives (what the file does not record)."""

    source: str  # "timm" or "hf"
    name: str  # timm model name, or transformers class name
    kwargs: dict = dataclasses.field(default_factory=dict)  # timm create_model / transformers config arguments
    build: dict = dataclasses.field(default_factory=dict)
    head: bool = True  # the output is logits (else the pooled embedding)


_HF_SMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                 image_size=SIZE)
CASES = {
    # timm: the plain ViTs, built by the variant builder of the same size.
    "vit_tiny_patch16_224": Case("timm", "vit_tiny_patch16_224", build=dict(num_heads=3)),
    "vit_base_patch16_224": Case("timm", "vit_base_patch16_224", build=dict(num_heads=12)),
    # timm: the ViT family.
    "deit3_small_patch16_224": Case("timm", "deit3_small_patch16_224", build=dict(num_heads=6)),
    "deit_small_distilled_patch16_224": Case("timm", "deit_small_distilled_patch16_224", build=dict(num_heads=6)),
    "vit_small_patch14_reg4_dinov2": Case("timm", "vit_small_patch14_reg4_dinov2",
                                          dict(img_size=SIZE, num_classes=1000), build=dict(num_heads=6)),
    "vit_small_patch14_dinov2": Case("timm", "vit_small_patch14_dinov2", dict(img_size=SIZE, num_classes=1000),
                                     build=dict(num_heads=6)),
    # OpenAI CLIP (QuickGELU, LayerNorm eps 1e-5: not in the file, so given) and SigLIP (attention pooling).
    "vit_base_patch16_clip_quickgelu_224": Case(
        "timm", "vit_base_patch16_clip_quickgelu_224", dict(num_classes=512),
        build=dict(num_heads=12, layer_norm_epsilon=1e-5, activation="quick_gelu")),
    "vit_base_patch16_siglip_224": Case("timm", "vit_base_patch16_siglip_224", dict(num_classes=1000),
                                        build=dict(num_heads=12)),
    # Hugging Face: numerics and heads from config.json.
    "hf_deit_distilled": Case("hf", "DeiTForImageClassificationWithTeacher",
                              dict(_HF_SMALL, patch_size=16, num_labels=1000)),
    "hf_dinov2": Case("hf", "Dinov2Model", dict(_HF_SMALL, patch_size=14), head=False),
    "hf_dinov2_registers": Case("hf", "Dinov2WithRegistersModel", dict(_HF_SMALL, patch_size=14,
                                                                       num_register_tokens=4), head=False),
    "hf_clip": Case("hf", "CLIPVisionModel", dict(_HF_SMALL, patch_size=16), head=False),
    "hf_clip_projection": Case("hf", "CLIPVisionModelWithProjection", dict(_HF_SMALL, patch_size=16,
                                                                          projection_dim=512)),
    "hf_siglip": Case("hf", "SiglipVisionModel", dict(_HF_SMALL, patch_size=16), head=False),
}
DEFAULT_MODELS = ("vit_tiny_patch16_224", "deit3_small_patch16_224", "vit_base_patch16_clip_quickgelu_224",
                  "vit_base_patch16_siglip_224", "hf_deit_distilled", "hf_dinov2_registers", "hf_clip",
                  "hf_siglip")


def _perturb(model, seed: int) -> None:
    """Random non-degenerate values where initializations are constant (biases, norms, tokens, scales)."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if parameter.ndim == 1 or key.endswith(("token", "tokens", "pos_embed", "latent", "probe",
                                                    "class_embedding", "lambda1", "gamma")):
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif key.endswith(("head.weight", "classifier.weight", "head_dist.weight")):
                parameter.normal_(0, 0.1)


def torch_model(case: Case, out_dir: str, seed: int = 0):
    """(PyTorch model in eval mode with perturbed weights, path of its `.safetensors` file)."""
    import torch

    torch.manual_seed(seed)
    if case.source == "timm":
        from safetensors.torch import save_file

        from benchmarks.torchvision_stub import import_timm

        timm, _ = import_timm()  # timm imports torchvision, which has no CPU build on PyPI
        model = timm.create_model(case.name, pretrained=False, **case.kwargs).eval()
        _perturb(model, seed)
        path = os.path.join(out_dir, f"{case.name}.safetensors")
        save_file({key: value.contiguous() for key, value in model.state_dict().items()}, path)
        return model, path
    import transformers

    config_class = getattr(transformers, case.name).config_class
    model = getattr(transformers, case.name)(config_class(**case.kwargs)).eval()
    _perturb(model, seed)
    folder = os.path.join(out_dir, case.name)
    model.save_pretrained(folder, safe_serialization=True)  # model.safetensors and config.json
    return model, os.path.join(folder, "model.safetensors")


def torch_output(case: Case, model, images: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.from_numpy(images.transpose(0, 3, 1, 2)))
    if case.source == "timm":
        return out.numpy()
    for name in ("logits", "image_embeds", "pooler_output"):
        if getattr(out, name, None) is not None:
            return getattr(out, name).numpy()
    raise ValueError(f"no output of {case.name}")


def keras_model(case: Case, path: str):
    import keras_vit
    from keras_vit.checkpoints.reader import read_checkpoint

    file = read_checkpoint(path)  # once: the builder and the loader take it
    found = file.architecture(num_heads=1)
    pooling = None if case.head else file.pooling
    return keras_vit.VisionTransformer(weights=file, input_shape=(SIZE, SIZE, 3), include_preprocessing=False,
                                       include_top=case.head, classes=found["classes"] or 1000, pooling=pooling,
                                       classifier_activation=None, **case.build)


def compare(name: str, out_dir: str, batch: int = 2) -> dict[str, float]:
    import tensorflow as tf
    from ai_edge_litert.interpreter import Interpreter

    from keras_vit.export import saved_model, tflite

    case = CASES[name]
    model, path = torch_model(case, out_dir)
    images = np.random.default_rng(1).uniform(-1, 1, (batch, SIZE, SIZE, 3)).astype("float32")
    expected = torch_output(case, model, images)
    ours = keras_model(case, path)
    output = np.asarray(ours(images))
    pixels = (images + 1.0) * 127.5  # The exports take [0, 255] pixels.
    if case.head:
        export_dir = saved_model.export_saved_model(ours, os.path.join(out_dir, name))
        serve = tf.saved_model.load(str(export_dir)).signatures["serving_default"]
        served = serve(images=tf.constant(pixels))["logits"].numpy()
    else:
        export_dir = os.path.join(out_dir, name + "_saved_model")
        ours.export(export_dir, format="tf_saved_model", verbose=False)
        loaded = tf.saved_model.load(export_dir)  # kept alive while its function runs
        served = loaded.serve(tf.constant(images)).numpy()
    interpreter = Interpreter(model_path=str(tflite.convert(ours, os.path.join(out_dir, f"{name}.tflite"),
                                                            "float32")))
    interpreter.allocate_tensors()
    (given,), (result,) = interpreter.get_input_details(), interpreter.get_output_details()
    lite = []
    for image in pixels:
        interpreter.set_tensor(given["index"], image[np.newaxis])
        interpreter.invoke()
        lite.append(interpreter.get_tensor(result["index"])[0])
    scale = float(np.abs(expected).max())
    return {"output": "logits" if case.head else "embedding", "output range": scale,
            "keras": float(np.abs(output - expected).max()), "SavedModel": float(np.abs(served - expected).max()),
            "float32 TFLite": float(np.abs(np.stack(lite) - expected).max())}


def compare_features(name: str, out_dir: str, blocks: tuple[int, ...] = (0, 5, 11), batch: int = 2) -> dict:
    """Max |difference| of `keras_vit.features_model` from timm's `forward_intermediates` (NCHW maps of the
    same blocks, without the final norm, and the prefix tokens) on a timm family model built from the file."""
    import torch

    import keras_vit

    case = CASES[name]
    if case.source != "timm":
        raise ValueError(f"--features compares with timm's forward_intermediates: {name} is not a timm model")
    model, path = torch_model(case, out_dir)
    images = np.random.default_rng(2).uniform(-1, 1, (batch, SIZE, SIZE, 3)).astype("float32")
    ours = keras_vit.features_model(keras_model(case, path), blocks)(images)
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
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(CASES))
    parser.add_argument("--out", help="folder for the .safetensors files and exports (default: a temp folder)")
    parser.add_argument("--features", action="store_true",
                        help="compare keras_vit.features_model with timm's forward_intermediates instead")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        out_dir = args.out or temporary
        for name in args.models:
            results = compare_features(name, out_dir) if args.features else compare(name, out_dir)
            print(name + ": " + ", ".join(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                                          for key, value in results.items()), flush=True)


if __name__ == "__main__":
    main()
