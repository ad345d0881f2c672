"""Makes tests/data/families/: small random checkpoints of each family, saved by the source libraries themselves
(transformers' `save_pretrained`, timm's `save_for_hf`), none at 224 px, each with a processor away from its
defaults, and what those libraries compute from them (reference.npz), for tests/test_family_files.py.

Run once, where torch, transformers and timm are installed (not needed by the tests):

    pip install torch==2.13.0 "transformers==4.57.*" timm==1.0.31 pillow safetensors
    python -m tests.data.make_family_files

Made with torch 2.13.0 (CPU), transformers 4.57.6, timm 1.0.31 (through benchmarks.torchvision_stub: no CPU
torchvision installs beside that torch), Pillow 12 (the NaFlex folders, hf_siglip2_224 and photo_tall.jpg: Pillow
13.0.0, which writes the other JPEGs byte for byte as Pillow 12 did; it resizes some images a level apart). The NaFlex
budget 256 came later from this code: the earlier budgets' arrays were kept as first made (a rerun gives the same
pixels and weights, the outputs within 1.2e-7). sizes.json holds transformers' resize sizes
(`transformers_resize_sizes`). Each folder's reference.npz holds:
- `pixels`: the processor's output for photo.jpg before normalization (uint8, NHWC: PIL resizes in uint8; float32
  for DINOv3, whose processor resizes in float);
- `output`: the model's output on the processor's normalized output (logits, or the pooled embedding of a
  headless tower);
- `size_<i>`, `outputs_<i>`, `patch_tokens_<i>`: two other input sizes (DINOv3: three, 224x224, 256x192 and
  320x320), and the model's outputs and its patch tokens after the final norm on `random_inputs(name, i)` at them
  (transformers: `interpolate_pos_encoding=True`; timm: `dynamic_img_size=True`; DINOv3 has no table: its rotary
  positions come from each grid), which show how each model class resizes its position table;
- DINOv3, EVA-02 and fixed-resolution SigLIP 2 folders: `embedding_<i>`, the pooled embedding (a head's input) of
  each of `PHOTOS` (photo.jpg and `EXTRA_PHOTOS`, other aspect ratios; DINOv3 and EVA-02: the first four, made
  before the tall one) through the processor, for the served `embed` signature's check; SigLIP 2 also
  `pixels_<i>`, the processor's uint8 pixels of each.
transformers' slow (PIL) processors compute `pixels`; DINOv3's (`DINOv3ViTImageProcessorFast`, which needs
torchvision) is computed by its arithmetic (`dinov3_processor`); timm's evaluation transform (`resolve_data_config` +
`create_transform`, which needs torchvision) is computed here by its documented arithmetic: PIL resize of the
short side to floor(size / crop_pct), torchvision's CenterCrop (offsets rounded), ToTensor, Normalize.
hf_siglip2_naflex_p8 (`siglip2_naflex_case`, alone: `python -m tests.data.make_family_files siglip2_naflex`) holds
a SigLIP 2 NaFlex tower, its five test JPEGs and its own reference.npz (described there), for
tests/checkpoints/test_naflex.py; timm_naflexvit_siglip_p8 (`timm_naflex_case`, alone: `... timm_naflex`) the same
weights as timm's NaFlexVit saves them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import numpy as np
from PIL import Image

# torch, transformers and timm are imported where used: the tests import this module for its names alone.
FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "families")
PHOTO = os.path.join(FOLDER, "photo.jpg")
TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
TINY_DINOV2 = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=2)  # no intermediate_size
MEAN, STD = [0.45, 0.4, 0.55], [0.2, 0.25, 0.3]  # away from every family's defaults


def photo() -> Image.Image:
    """A smooth 300x500 test picture (not square: the shortest-edge rules matter), saved as a JPEG."""
    y, x = np.mgrid[0:300, 0:500] / 100.0
    image = np.stack([128 + 90 * np.sin(x + y), 128 + 90 * np.cos(1.3 * x - y), 128 + 80 * np.sin(2.1 * y)], -1)
    os.makedirs(FOLDER, exist_ok=True)
    Image.fromarray(image.round().astype(np.uint8)).save(PHOTO, quality=92)
    return Image.open(PHOTO).convert("RGB")


# The served-embedding check's other photographs (file name, height, width): portrait (3:5), wide (16:5),
# near-square and tall (1:3, added with hf_siglip2_224: the folders made before hold the first four's embeddings).
EXTRA_PHOTOS = (("photo_portrait.jpg", 500, 300), ("photo_wide.jpg", 200, 640), ("photo_square.jpg", 333, 345),
                ("photo_tall.jpg", 300, 100))
PHOTOS = (PHOTO, *(os.path.join(FOLDER, name) for name, _, _ in EXTRA_PHOTOS))  # embedding_<i> of reference.npz


def photographs() -> list[Image.Image]:
    """`photo()` and the `EXTRA_PHOTOS`, smooth pictures of other aspect ratios, each saved as a JPEG and read back
    (the order of `PHOTOS`)."""
    images = [photo()]
    for index, (name, height, width) in enumerate(EXTRA_PHOTOS, start=1):
        y, x = np.mgrid[0:height, 0:width] / (max(height, width) / 5.0)
        image = np.stack([128 + 90 * np.sin(x - y + index), 128 + 90 * np.cos(1.1 * x + y),
                          128 + 80 * np.sin(1.7 * y + 0.6 * x)], -1)
        Image.fromarray(image.round().astype(np.uint8)).save(os.path.join(FOLDER, name), quality=92)
        images.append(Image.open(os.path.join(FOLDER, name)).convert("RGB"))
    return images


def loud_table(parameter) -> None:
    """A position table as large as the patch embeddings' outputs (initializers make it ~50x smaller), so that the
    outputs at other sizes show how it was resized: one class's rule against another's moves them by ~1e-3, not
    ~1e-5."""
    import torch

    with torch.no_grad():
        parameter.normal_(0, 5.0)


def nhwc(tensor) -> np.ndarray:
    return np.asarray(tensor, np.float32).transpose(0, 2, 3, 1)


def random_inputs(name: str, index: int, size) -> np.ndarray:
    """The normalized (1, height, width, 3) inputs of the folder's `index`-th extra size (the tests make the same)."""
    seed = sum(name.encode()) * 10 + index
    return np.random.default_rng(seed).normal(size=(1, *size, 3)).astype(np.float32)


def save_reference(folder: str, pixels: np.ndarray, pixel_values: np.ndarray, output: np.ndarray,
                   extra: list[tuple[tuple[int, int], np.ndarray, np.ndarray]], meta: dict,
                   float_pixels: bool = False, embeddings: list[np.ndarray] = (),
                   photo_pixels: list[np.ndarray] = ()) -> None:
    """`float_pixels`: the processor resizes in float (DINOv3's), else in uint8 (PIL's). `embeddings`: the pooled
    embedding (a head's input) of each of `PHOTOS` through the processor, stored as `embedding_<i>`;
    `photo_pixels`, the processor's uint8 pixels of each, as `pixels_<i>`."""
    assert (float_pixels or np.array_equal(pixels, pixels.round())) and pixels.min() >= 0 and pixels.max() <= 255
    normalized = (pixels / np.float32(255) - np.float32(MEAN)) / np.float32(STD)
    assert np.abs(normalized - pixel_values).max() < 1e-5  # the processor's normalization, as the tests redo it
    arrays = dict(pixels=pixels.astype(np.float32 if float_pixels else np.uint8), output=output.astype(np.float32))
    for i, (size, outputs, patch_tokens) in enumerate(extra):
        arrays.update({f"size_{i}": np.asarray(size), f"outputs_{i}": outputs.astype(np.float32),
                       f"patch_tokens_{i}": patch_tokens.astype(np.float32)})
    arrays.update({f"embedding_{i}": embedding.astype(np.float32) for i, embedding in enumerate(embeddings)})
    arrays.update({f"pixels_{i}": values.astype(np.uint8) for i, values in enumerate(photo_pixels)})
    np.savez_compressed(os.path.join(folder, "reference.npz"), **arrays)
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as file:
        json.dump(meta, file, indent=1, sort_keys=True)


# --- transformers ---

def hf_patch_tokens(model, inputs) -> np.ndarray:
    """The patch tokens after the model's final norm (its `last_hidden_state` past the prefix tokens; CLIP's
    through `post_layernorm`, which its `last_hidden_state` has not had), at any input size."""
    import torch

    backbones = ("vit", "deit", "dinov2", "dinov2_with_registers", "vision_model")
    backbone = next((getattr(model, name) for name in backbones if hasattr(model, name)), model)
    with torch.no_grad():
        tokens = backbone(pixel_values=inputs, interpolate_pos_encoding=True).last_hidden_state
        if "CLIP" in type(model).__name__:
            tokens = backbone.post_layernorm(tokens)
    kind = type(model).__name__
    prefix = ("Siglip" not in kind) + ("DeiT" in kind) + getattr(model.config, "num_register_tokens", 0)
    return tokens[:, prefix:].numpy()


def hf_case(name: str, model, processor, image: Image.Image, sizes, output: str, meta: dict,
            photos: list[Image.Image] = ()) -> None:
    """`photos`: pictures whose pooled `output` through the processor is stored as `embedding_<i>`."""
    import torch

    folder = os.path.join(FOLDER, name)
    shutil.rmtree(folder, ignore_errors=True)
    model.eval()
    with torch.no_grad():  # weights of one scale (transformers initializes most at 0.02: near-uniform attention)
        for key, parameter in model.named_parameters():
            parameter.normal_(0, 0.2)
            if "position_embedding" in key:
                loud_table(parameter)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    for extra in ("model.safetensors.index.json", "generation_config.json"):
        assert not os.path.exists(os.path.join(folder, extra))
    raw = processor(image, do_normalize=False, do_rescale=False, return_tensors="np")["pixel_values"]
    values = processor(image, return_tensors="pt")["pixel_values"]

    def run(inputs, interpolate=False):
        with torch.no_grad():
            kwargs = {"interpolate_pos_encoding": True} if interpolate else {}
            result = model(pixel_values=inputs, **kwargs)
        return getattr(result, output).numpy()

    extra = []
    for index, size in enumerate(sizes):
        inputs = torch.from_numpy(random_inputs(name, index, size).transpose(0, 3, 1, 2).copy())
        extra.append((size, run(inputs, interpolate=True), hf_patch_tokens(model, inputs)))
    embeddings = [run(processor(picture, return_tensors="pt")["pixel_values"])[0] for picture in photos]
    save_reference(folder, nhwc(raw), nhwc(values), run(values), extra, dict(meta, source="transformers",
                                                                              output=output), embeddings=embeddings,
                   photo_pixels=[nhwc(processor(picture, do_normalize=False, do_rescale=False,
                                                return_tensors="np")["pixel_values"])[0] for picture in photos])


def transformers_cases(image: Image.Image) -> None:
    import torch
    from transformers import (BitImageProcessor, CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel,
                              DeiTConfig, DeiTForImageClassificationWithTeacher, DeiTImageProcessor, Dinov2Config,
                              Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel,
                              SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel, ViTConfig,
                              ViTForImageClassification, ViTImageProcessor)

    torch.manual_seed(0)
    bicubic, bilinear = 3, 2
    # ViT at 256 px, squashed bilinearly to 256.
    hf_case("hf_vit_256", ViTForImageClassification(ViTConfig(**TINY, image_size=256, patch_size=32, num_labels=5)),
            ViTImageProcessor(size={"height": 256, "width": 256}, image_mean=MEAN, image_std=STD, resample=bilinear),
            image, [(256, 192), (320, 320)], "logits", dict(native_size=[256, 256], family="vit"))
    # DeiT distilled at 384 px: squash to 438, crop 384 (DeiT's 256 -> 224 proportion).
    hf_case("hf_deit_384", DeiTForImageClassificationWithTeacher(
        DeiTConfig(**TINY, image_size=384, patch_size=48, num_labels=5)),
        DeiTImageProcessor(size={"height": 438, "width": 438}, crop_size={"height": 384, "width": 384},
                           image_mean=MEAN, image_std=STD, resample=bicubic),
        image, [(336, 240), (480, 480)], "logits", dict(native_size=[384, 384], family="deit"))
    # DINOv2: a table at 256 px, served at the processor's crop 224 of a 400 short side (where floor(224 / (224 /
    # 400)) is 399).
    hf_case("hf_dinov2_224", Dinov2Model(Dinov2Config(**TINY_DINOV2, image_size=256, patch_size=32,
                                                       layerscale_value=0.5)),
            BitImageProcessor(size={"shortest_edge": 400}, crop_size={"height": 224, "width": 224},
                              image_mean=MEAN, image_std=STD, resample=bicubic),
            image, [(256, 192), (320, 320)], "pooler_output", dict(native_size=[224, 224], family="dinov2"))
    # DINOv2 with registers: resized with antialiasing by transformers.
    hf_case("hf_dinov2_registers_256", Dinov2WithRegistersModel(Dinov2WithRegistersConfig(
        **TINY_DINOV2, image_size=256, patch_size=32, num_register_tokens=4, layerscale_value=0.5)),
        BitImageProcessor(size={"shortest_edge": 292}, crop_size={"height": 256, "width": 256},
                          image_mean=MEAN, image_std=STD, resample=bicubic),
        image, [(256, 192), (320, 320)], "pooler_output", dict(native_size=[256, 256], family="dinov2_registers"))
    # CLIP at 336 px: short side 375 (floor(336 / (336 / 375)) is 374), crop 336.
    hf_case("hf_clip_336", CLIPVisionModel(CLIPVisionConfig(**TINY, image_size=336, patch_size=48)),
            CLIPImageProcessor(size={"shortest_edge": 375}, crop_size={"height": 336, "width": 336},
                               image_mean=MEAN, image_std=STD, resample=bicubic),
            image, [(336, 240), (432, 432)], "pooler_output", dict(native_size=[336, 336], family="clip"))
    # SigLIP at 256 px (the bug report's tower): squash to 256.
    hf_case("hf_siglip_256", SiglipVisionModel(SiglipVisionConfig(**TINY, image_size=256, patch_size=32)),
            SiglipImageProcessor(size={"height": 256, "width": 256}, image_mean=MEAN, image_std=STD,
                                 resample=bicubic),
            image, [(256, 192), (320, 320)], "pooler_output", dict(native_size=[256, 256], family="siglip"))


def siglip2_fixed_case(photos: list[Image.Image]) -> None:
    """The fixed-resolution SigLIP 2: SigLIP's architecture (transformers' `SiglipVisionModel`) at 224 px with the
    `SiglipImageProcessor` SigLIP 2's fixed-resolution files carry (a squash to 224, bilinear: resample 2, where
    SigLIP's own files resize bicubically, as hf_siglip_256), and the embedding of each of `photos` (1:3 to 16:5)."""
    import torch
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    hf_case("hf_siglip2_224", SiglipVisionModel(SiglipVisionConfig(**TINY, image_size=224, patch_size=32)),
            SiglipImageProcessor(size={"height": 224, "width": 224}, image_mean=MEAN, image_std=STD, resample=2),
            photos[0], [(224, 160), (288, 288)], "pooler_output", dict(native_size=[224, 224], family="siglip2"),
            photos=photos)


# --- DINOv3 (transformers) ---

def dinov3_processor(image: Image.Image, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """(pixels before normalization in [0, 255], float32; normalized values), both NHWC, as
    `DINOv3ViTImageProcessorFast._preprocess` computes them from `config` (its preprocessor_config.json): the
    image's [0, 255] values times `rescale_factor`, torchvision's resize of that float tensor (`F.resize`:
    `torch.nn.functional.interpolate(align_corners=False, antialias=True)`, no rounding or clamping for floats),
    `BaseImageProcessorFast.center_crop` (offsets int((size - crop) / 2)), then (x - mean) / std."""
    import torch

    modes = {2: "bilinear", 3: "bicubic"}
    x = torch.from_numpy(np.asarray(image, np.uint8).transpose(2, 0, 1).copy())[None].float()
    x = x * config["rescale_factor"]
    size = config["size"]
    x = torch.nn.functional.interpolate(x, size=(size["height"], size["width"]), mode=modes[config["resample"]],
                                        align_corners=False, antialias=True)
    if config["do_center_crop"]:
        crop = config["crop_size"]
        top, left = int((x.shape[2] - crop["height"]) / 2.0), int((x.shape[3] - crop["width"]) / 2.0)
        x = x[:, :, top:top + crop["height"], left:left + crop["width"]]
    values = (x - torch.tensor(config["image_mean"])[:, None, None]) / torch.tensor(config["image_std"])[:, None, None]
    return nhwc(x * 255), nhwc(values)


def dinov3_case(name: str, photos: list[Image.Image], model_config: dict, processor_config: dict) -> None:
    """A random `DINOv3ViTModel` (every parameter drawn anew, biases and layer scales included) saved with
    `save_pretrained`, its processor's preprocessor_config.json as `save_pretrained` writes it (the processor itself
    needs torchvision), its pooled output on the photo (and on each of `photos`, the photo first), and its outputs
    and patch tokens at 224x224, 256x192 and 320x320. The scales make the attention, hence the rotary positions,
    move the outputs: a small patch embedding, layer scales around 1, sharp attention (`rope_theta` 100 instead of
    75 moves the patch tokens by ~1e-3 of their largest value; at one scale for all, by ~2e-5)."""
    import torch
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    folder = os.path.join(FOLDER, name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    model = DINOv3ViTModel(DINOv3ViTConfig(**model_config)).eval()
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if "lambda1" in key:  # the layer scales
                parameter.normal_(1.0, 0.3)
            else:
                std = 0.03 if "patch_embeddings.weight" in key else 0.4 if key.endswith(("q_proj.weight",
                                                                                          "k_proj.weight")) else 0.2
                parameter.normal_(0, std)
    model.save_pretrained(folder)
    processor_config = dict(processor_config, image_processor_type="DINOv3ViTImageProcessorFast", do_resize=True,
                            do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=MEAN,
                            image_std=STD, default_to_square=True, data_format="channels_first")
    with open(os.path.join(folder, "preprocessor_config.json"), "w", encoding="utf-8") as file:
        json.dump(processor_config, file, indent=2, sort_keys=True)
    pixels, values = dinov3_processor(photos[0], processor_config)
    prefix = 1 + model.config.num_register_tokens

    def run(inputs):
        with torch.no_grad():
            output = model(pixel_values=torch.from_numpy(inputs.transpose(0, 3, 1, 2).copy()))
        return output.pooler_output.numpy(), output.last_hidden_state[:, prefix:].numpy()

    extra = [(size, *run(random_inputs(name, index, size)))
             for index, size in enumerate([(224, 224), (256, 192), (320, 320)])]
    crop = processor_config["crop_size"]
    save_reference(folder, pixels, values, run(values)[0], extra,
                   dict(source="transformers", output="pooler_output", family="dinov3",
                        native_size=[crop["height"], crop["width"]]), float_pixels=True,
                   embeddings=[run(dinov3_processor(image, processor_config)[1])[0] for image in photos])


def dinov3_cases(photos: list[Image.Image]) -> None:
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=16, num_register_tokens=4,
                layerscale_value=0.5, image_size=112)
    # Squash to 128, crop 112 (DINOv2's proportion): a small native size, as its float pixels are stored.
    processor = dict(size={"height": 128, "width": 128}, do_center_crop=True, crop_size={"height": 112, "width": 112},
                     resample=2)
    # ViT-S/B/L form: plain MLP, exact GELU, no key bias.
    dinov3_case("hf_dinov3_112", photos, dict(tiny, intermediate_size=64, hidden_act="gelu"), processor)
    # H+ / 7B form: SwiGLU (gated SiLU) MLP; another rope_theta.
    dinov3_case("hf_dinov3_swiglu_112", photos, dict(tiny, intermediate_size=48, hidden_act="silu",
                                                    use_gated_mlp=True, rope_theta=75.0), processor)


# --- SigLIP 2 NaFlex (transformers) ---

NAFLEX = "hf_siglip2_naflex_p8"
TIMM_NAFLEX = "timm_naflexvit_siglip_p8"  # hf_siglip2_naflex_p8's weights under timm's NaFlexVit names
NAFLEX_FOLDERS = (NAFLEX, TIMM_NAFLEX)  # folders whose model takes patch sequences, not images
NAFLEX_BUDGETS = (64, 37, 256)  # the processor's max_num_patches, another, and SigLIP 2's default
# (height, width): aspect ratios 1:3, 3:4, 1:1, 16:5 (width:height), and a tiny one that grows to a few patches.
NAFLEX_SHAPES = ((300, 100), (240, 320), (250, 250), (160, 512), (20, 45))


def naflex_photo(height: int, width: int, index: int) -> Image.Image:
    """A smooth test picture of the given shape, saved as a JPEG (naflex_<index>.jpg in the NaFlex folder) and
    read back, as `photo()` makes its own."""
    y, x = np.mgrid[0:height, 0:width] / (max(height, width) / 5.0)
    image = np.stack([128 + 90 * np.sin(x + y + index), 128 + 90 * np.cos(1.3 * x - y),
                      128 + 80 * np.sin(2.1 * y - 0.5 * x)], -1)
    path = os.path.join(FOLDER, NAFLEX, f"naflex_{index}.jpg")
    Image.fromarray(image.round().astype(np.uint8)).save(path, quality=92)
    return Image.open(path).convert("RGB")


def siglip2_naflex_case() -> None:
    """A random `Siglip2VisionModel` (patch 8, a 4x4 position table made loud, every weight perturbed) and its
    `Siglip2ImageProcessor` (slow, PIL bilinear; mean and std away from the defaults, max_num_patches 64),
    saved with `save_pretrained`, and reference.npz: for each picture of `NAFLEX_SHAPES` at each budget of
    `NAFLEX_BUDGETS` (key suffix `_<image>_<budget>`), the processor's `pixel_values`, `pixel_attention_mask`,
    `spatial_shapes`, its pixels before rescaling and normalization (`raw`, PIL's uint8 values), and the model's
    `pooler_output` and `last_hidden_state` on that image alone. A batch of all pictures at one budget is checked
    here to give each image's outputs alone."""
    import torch
    from transformers import Siglip2ImageProcessor, Siglip2VisionConfig, Siglip2VisionModel

    folder = os.path.join(FOLDER, NAFLEX)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    torch.manual_seed(0)
    model = Siglip2VisionModel(Siglip2VisionConfig(**TINY, patch_size=8, num_patches=16)).eval()
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            parameter.normal_(0, 0.2)
            if "position_embedding" in key:
                loud_table(parameter)
    model.save_pretrained(folder)
    processor = Siglip2ImageProcessor(patch_size=8, max_num_patches=NAFLEX_BUDGETS[0], image_mean=MEAN,
                                      image_std=STD)
    processor.save_pretrained(folder)
    images = [naflex_photo(height, width, index) for index, (height, width) in enumerate(NAFLEX_SHAPES)]
    arrays = {}

    def run(inputs):
        with torch.no_grad():
            return model(**{key: torch.from_numpy(value) for key, value in inputs.items()})

    for budget in NAFLEX_BUDGETS:
        batch = processor(images, max_num_patches=budget, return_tensors="np")
        together = run(batch)
        for index, image in enumerate(images):
            inputs = processor(image, max_num_patches=budget, return_tensors="np")
            raw = processor(image, max_num_patches=budget, do_rescale=False, do_normalize=False,
                            return_tensors="np")["pixel_values"]
            assert np.array_equal(raw, raw.round()) and raw.max() <= 255
            alone = run(inputs)
            valid = int(inputs["pixel_attention_mask"].sum())
            for name in ("pooler_output", "last_hidden_state"):
                one, batched = getattr(alone, name)[0].numpy(), getattr(together, name)[index].numpy()
                if name == "last_hidden_state":
                    one, batched = one[:valid], batched[:valid]
                assert np.abs(one - batched).max() <= 1e-5 * max(1.0, np.abs(one).max()), (name, index, budget)
            suffix = f"_{index}_{budget}"
            arrays.update({f"raw{suffix}": raw[0].astype(np.uint8),
                           f"pixel_values{suffix}": inputs["pixel_values"][0].astype(np.float32),
                           f"pixel_attention_mask{suffix}": inputs["pixel_attention_mask"][0].astype(np.int32),
                           f"spatial_shapes{suffix}": inputs["spatial_shapes"][0].astype(np.int32),
                           f"pooler_output{suffix}": alone.pooler_output[0].numpy(),
                           f"last_hidden_state{suffix}": alone.last_hidden_state[0].numpy()})
    np.savez_compressed(os.path.join(folder, "reference.npz"), **arrays)
    meta = dict(source="transformers", family="siglip2_naflex", budgets=list(NAFLEX_BUDGETS),
                shapes=[list(shape) for shape in NAFLEX_SHAPES])
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as file:
        json.dump(meta, file, indent=1, sort_keys=True)


def timm_naflex_state(hf: dict) -> dict:
    """A transformers `Siglip2VisionModel` state dict (NumPy, without its `vision_model.` prefix) under timm's
    NaFlexVit names: q, k, v side by side as `qkv`, the MAP head's in-projection split into `q` and `kv`, the
    position table as (1, rows, columns, D)."""
    width = hf["embeddings.patch_embedding.weight"].shape[0]
    side = math.isqrt(hf["embeddings.position_embedding.weight"].shape[0])
    state = {"embeds.proj.weight": hf["embeddings.patch_embedding.weight"],
             "embeds.proj.bias": hf["embeddings.patch_embedding.bias"],
             "embeds.pos_embed": hf["embeddings.position_embedding.weight"].reshape(1, side, side, width),
             "norm.weight": hf["post_layernorm.weight"], "norm.bias": hf["post_layernorm.bias"],
             "attn_pool.latent": hf["head.probe"],
             "attn_pool.q.weight": hf["head.attention.in_proj_weight"][:width],
             "attn_pool.q.bias": hf["head.attention.in_proj_bias"][:width],
             "attn_pool.kv.weight": hf["head.attention.in_proj_weight"][width:],
             "attn_pool.kv.bias": hf["head.attention.in_proj_bias"][width:]}
    for ours, theirs in (("proj", "attention.out_proj"), ("norm", "layernorm"), ("mlp.fc1", "mlp.fc1"),
                         ("mlp.fc2", "mlp.fc2")):
        for kind in ("weight", "bias"):
            state[f"attn_pool.{ours}.{kind}"] = hf[f"head.{theirs}.{kind}"]
    layers = sum(key.endswith(".layer_norm1.weight") for key in hf)
    for i in range(layers):
        theirs, ours = f"encoder.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            state[ours + f"attn.qkv.{kind}"] = np.concatenate(
                [hf[theirs + f"self_attn.{name}_proj.{kind}"] for name in "qkv"])
            for a, b in (("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("attn.proj", "self_attn.out_proj"),
                         ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")):
                state[ours + f"{a}.{kind}"] = hf[theirs + f"{b}.{kind}"]
    return state


def timm_naflex_case() -> None:
    """timm's NaFlexVit (entry point `naflexvit_base_patch16_siglip` at hf_siglip2_naflex_p8's size) holding that
    folder's weights under timm's names (`timm_naflex_state`), saved with `save_for_hf` (its `model_args`;
    `pretrained_cfg` with the NaFlex processor's mean and std), and reference.npz: timm's pooled output
    `pooled_<image>_<budget>` on the transformers processor's `pixel_values` of each picture (hf_siglip2_naflex_p8's
    reference.npz), `patch_coord` from its `spatial_shapes` (row-major (y, x)) and `patch_valid` its mask. Each is
    checked here to equal transformers' `pooler_output`: timm resizes this entry point's table as transformers does
    (bilinear, antialiased)."""
    import torch
    from safetensors.numpy import load_file

    from benchmarks.torchvision_stub import import_timm

    timm = import_timm()[0]
    from timm.models._hub import save_for_hf  # after the torchvision stub

    source = os.path.join(FOLDER, NAFLEX)
    hf = {key.removeprefix("vision_model."): value
          for key, value in load_file(os.path.join(source, "model.safetensors")).items()}
    model_args = dict(embed_dim=TINY["hidden_size"], depth=TINY["num_hidden_layers"],
                      num_heads=TINY["num_attention_heads"], mlp_ratio=TINY["intermediate_size"] / TINY["hidden_size"],
                      patch_size=8, pos_embed_grid_size=(4, 4))
    model = timm.create_model("naflexvit_base_patch16_siglip", pretrained=False, num_classes=0, **model_args).eval()
    model.load_state_dict({key: torch.from_numpy(value) for key, value in timm_naflex_state(hf).items()}, strict=True)
    model.pretrained_cfg = dict(model.pretrained_cfg, mean=tuple(MEAN), std=tuple(STD))
    folder = os.path.join(FOLDER, TIMM_NAFLEX)
    shutil.rmtree(folder, ignore_errors=True)
    save_for_hf(model, folder, model_args=model_args, safe_serialization=True)
    with np.load(os.path.join(source, "reference.npz")) as arrays:
        reference = dict(arrays)
    pooled = {}
    for budget in NAFLEX_BUDGETS:
        for index in range(len(NAFLEX_SHAPES)):
            suffix = f"_{index}_{budget}"
            rows, columns = reference["spatial_shapes" + suffix]
            mask = reference["pixel_attention_mask" + suffix].astype(bool)
            coords = np.zeros((len(mask), 2), np.int64)
            coords[:rows * columns] = np.stack(np.divmod(np.arange(rows * columns), columns), axis=-1)
            with torch.no_grad():
                out = model(dict(patches=torch.from_numpy(reference["pixel_values" + suffix][None]),
                                 patch_coord=torch.from_numpy(coords[None]),
                                 patch_valid=torch.from_numpy(mask[None]))).numpy()[0]
            expected = reference["pooler_output" + suffix]
            assert np.abs(out - expected).max() <= 1e-5 * max(1.0, np.abs(expected).max()), suffix
            pooled["pooled" + suffix] = out
    np.savez_compressed(os.path.join(folder, "reference.npz"), **pooled)
    meta = dict(source="timm", family="siglip2_naflex", weights_of=NAFLEX, budgets=list(NAFLEX_BUDGETS))
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as file:
        json.dump(meta, file, indent=1, sort_keys=True)


# --- timm ---

def timm_transform(image: Image.Image, size: int, crop_pct: float, interpolation: int,
                   crop_mode: str = "center") -> np.ndarray:
    """timm's evaluation transform, in [0, 255]: Resize(floor(size / crop_pct)) of the short side (torchvision:
    the long side int(short * long / short_in)), or of both sides (`crop_mode="squash"`), CenterCrop(size) with
    torchvision's rounded offsets."""
    short = math.floor(size / crop_pct)
    width, height = image.size
    if crop_mode == "squash":
        new = (short, short)
    elif width <= height:
        new = (short, int(short * height / width))
    else:
        new = (int(short * width / height), short)
    resized = np.asarray(image.resize(new, interpolation), np.float32)
    top = int(round((resized.shape[0] - size) / 2.0))
    left = int(round((resized.shape[1] - size) / 2.0))
    return resized[None, top:top + size, left:left + size]


def timm_case(name: str, timm, image: Image.Image, model_args: dict, size: int, crop_pct: float, sizes,
              meta: dict) -> None:
    import torch
    from timm.models._hub import save_for_hf

    folder = os.path.join(FOLDER, name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False, img_size=size, dynamic_img_size=True,
                              **model_args).eval()
    with torch.no_grad():  # random, not zero, heads and tokens
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    loud_table(model.pos_embed)
    model.pretrained_cfg = dict(model.pretrained_cfg, mean=tuple(MEAN), std=tuple(STD), crop_pct=crop_pct,
                                interpolation="bilinear", input_size=(3, size, size))
    save_for_hf(model, folder, safe_serialization=True)
    pixels = timm_transform(image, size, crop_pct, Image.BILINEAR)
    values = (pixels / 255 - np.asarray(MEAN, np.float32)) / np.asarray(STD, np.float32)

    def run(inputs, tokens=False):
        with torch.no_grad():
            inputs = torch.from_numpy(inputs.transpose(0, 3, 1, 2).copy())
            if tokens:  # after the final norm, past the prefix tokens
                return model.forward_features(inputs)[:, model.num_prefix_tokens:].numpy()
            return model(inputs).numpy()

    extra = [(size, run(inputs), run(inputs, tokens=True)) for index, size in enumerate(sizes)
             for inputs in [random_inputs(name, index, size)]]
    save_reference(folder, pixels, values, run(values), extra, dict(meta, source="timm", native_size=[size, size]))


def timm_cases(image: Image.Image) -> None:
    from benchmarks.torchvision_stub import import_timm

    timm, _ = import_timm()
    tiny = dict(embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0)
    timm_case("timm_vit_256", timm, image, dict(tiny, patch_size=32, num_classes=5), 256, 0.95,
              [(256, 192), (320, 320)], dict(family="vit"))
    timm_case("timm_dinov2_252", timm, image, dict(tiny, patch_size=28, num_classes=0, reg_tokens=4,
                                                   init_values=0.5, no_embed_class=True), 252, 1.0,
              [(224, 168), (308, 308)], dict(family="dinov2_registers"))
    timm_case("timm_siglip_384", timm, image, dict(tiny, patch_size=48, num_classes=0, class_token=False,
                                                   global_pool="map"), 384, 1.0,
              [(336, 240), (480, 480)], dict(family="siglip"))


def timm_eva_case(name: str, timm, photos: list[Image.Image], architecture: str, model_args: dict, size: int,
                  crop_pct: float, sizes, family: str) -> None:
    """A random timm `Eva` (DINOv3 or EVA-02: `architecture` with small `model_args`) saved with `save_for_hf`,
    every parameter drawn anew at dinov3_case's scales (EVA-02's position table made loud), its output (its head, or
    its `global_pool`) on the photo through timm's transform, its pooled embedding (`forward_head(pre_logits=True)`)
    on each of `photos` (the photo first), and its outputs and patch tokens at `sizes`."""
    import torch
    from timm.models._hub import save_for_hf

    folder = os.path.join(FOLDER, name)
    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(0)
    model = timm.create_model(architecture, pretrained=False, img_size=size, **model_args).eval()
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if "gamma_" in key:  # the layer scales
                parameter.normal_(1.0, 0.3)
            else:
                std = 0.03 if key.startswith("patch_embed.") else 0.4 if key.endswith(
                    ("qkv.weight", "q_proj.weight", "k_proj.weight")) else 0.2
                parameter.normal_(0, std)
        if model.pos_embed is not None:
            loud_table(model.pos_embed)
    model.pretrained_cfg = dict(model.pretrained_cfg, mean=tuple(MEAN), std=tuple(STD), crop_pct=crop_pct,
                                interpolation="bilinear", input_size=(3, size, size))
    save_for_hf(model, folder, safe_serialization=True)

    def normalized(image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
        """timm's transform, with the entry point's own crop mode (EVA-02 at 448: "squash"), and normalization."""
        pixels = timm_transform(image, size, crop_pct, Image.BILINEAR, model.pretrained_cfg.get("crop_mode", "center"))
        return pixels, (pixels / 255 - np.asarray(MEAN, np.float32)) / np.asarray(STD, np.float32)

    def run(inputs, pre_logits=False):
        with torch.no_grad():
            tokens = model.forward_features(torch.from_numpy(inputs.transpose(0, 3, 1, 2).copy()))
            pooled = model.forward_head(tokens, pre_logits=pre_logits)
            return pooled.numpy(), tokens[:, model.num_prefix_tokens:].numpy()

    pixels, values = normalized(photos[0])
    extra = [(size, *run(random_inputs(name, index, size))) for index, size in enumerate(sizes)]
    save_reference(folder, pixels, values, run(values)[0], extra,
                   dict(source="timm", family=family, native_size=[size, size]),
                   embeddings=[run(normalized(image)[1], pre_logits=True)[0] for image in photos])


def timm_eva_cases() -> None:
    from benchmarks.torchvision_stub import import_timm

    timm, _ = import_timm()
    tiny = dict(embed_dim=32, depth=2, num_heads=2)
    photos, dinov3_sizes = photographs(), [(224, 224), (256, 192), (320, 320)]
    # DINOv3 S/B/L form: plain MLP (exact GELU), no query/key/value bias; a head on timm's default pooling, the patch
    # tokens' mean beside the class token (no fc_norm): a DINOv3 fine-tuned with timm.
    timm_eva_case("timm_dinov3_112", timm, photos, "vit_small_patch16_dinov3", dict(tiny, mlp_ratio=2.0, num_classes=3),
                  112, 0.875, dinov3_sizes, "dinov3")
    # DINOv3 H+ form: SwiGLU MLP (SiLU), query and value biases, another base period, pooled by the class token.
    timm_eva_case("timm_dinov3_swiglu_128", timm, photos, "vit_huge_plus_patch16_dinov3",
                  dict(tiny, mlp_ratio=1.5, qkv_bias=True, rope_temperature=75.0, global_pool="token",
                       num_classes=0), 128, 1.0, dinov3_sizes, "dinov3")
    # EVA-02 Ti / S form: packed SwiGLU MLP, fused query/key/value with query and value biases, positions in patches
    # of the 16 x 16 grid at an 8 x 8 one; a head on the patch tokens' mean after fc_norm.
    timm_eva_case("timm_eva02_112", timm, photos, "eva02_tiny_patch14_224",
                  dict(tiny, num_classes=5, dynamic_img_size=True), 112, 0.9, [(126, 98), (224, 224)], "eva02")
    # EVA-02 B / L form: separate query/key/value (no key bias), split SwiGLU MLP with its hidden-layer norm; the
    # tower (no head): the patch tokens' mean after fc_norm. Its entry point's transform squashes (crop_mode).
    timm_eva_case("timm_eva02_mlp_norm_126", timm, photos, "eva02_base_patch14_448",
                  dict(tiny, num_classes=0, dynamic_img_size=True), 126, 1.0, [(140, 98), (224, 224)], "eva02")


CROPS = (224, 256, 336, 384, 448, 518)
IMAGE_SHAPES = ((300, 500), (640, 427), (333, 333))


def transformers_resize_sizes() -> None:
    """sizes.json: for each crop in `CROPS`, shortest edge 160-640 (at least the crop) and image shape in
    `IMAGE_SHAPES`, the (height, width) transformers' `get_resize_output_image_size` resizes to (what every
    shortest-edge processor of the family calls)."""
    from transformers.image_transforms import get_resize_output_image_size

    table = {}
    for crop in CROPS:
        for edge in range(max(160, crop), 641):
            for height, width in IMAGE_SHAPES:
                image = np.zeros((height, width, 3), np.uint8)
                size = get_resize_output_image_size(image, size=edge, default_to_square=False,
                                                    input_data_format="channels_last")
                table.setdefault(str(crop), {}).setdefault(str(edge), []).append([height, width, *size])
    with open(os.path.join(FOLDER, "sizes.json"), "w", encoding="utf-8") as file:
        json.dump(table, file, separators=(",", ":"))


def dinov2_classifier_cases(image: Image.Image) -> None:
    """transformers' DINOv2 ImageNet classifiers (`Dinov2ForImageClassification`, as the hub's
    facebook/dinov2-*-imagenet1k-1-layer, and its registers twin): a linear head on [class token; mean patch token]
    (the registers left out of the mean), under the backbone prefix `dinov2.` / `dinov2_with_registers.`."""
    import torch
    from transformers import (BitImageProcessor, Dinov2Config, Dinov2ForImageClassification,
                              Dinov2WithRegistersConfig, Dinov2WithRegistersForImageClassification)

    torch.manual_seed(1)
    bicubic = 3
    hf_case("hf_dinov2_classifier_224", Dinov2ForImageClassification(Dinov2Config(
        **TINY_DINOV2, image_size=256, patch_size=32, layerscale_value=0.5, num_labels=5)),
        BitImageProcessor(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224},
                          image_mean=MEAN, image_std=STD, resample=bicubic),
        image, [(256, 192), (320, 320)], "logits", dict(native_size=[224, 224], family="dinov2_classifier"))
    hf_case("hf_dinov2_registers_classifier_256", Dinov2WithRegistersForImageClassification(
        Dinov2WithRegistersConfig(**TINY_DINOV2, image_size=256, patch_size=32, num_register_tokens=4,
                                  layerscale_value=0.5, num_labels=5)),
        BitImageProcessor(size={"shortest_edge": 292}, crop_size={"height": 256, "width": 256},
                          image_mean=MEAN, image_std=STD, resample=bicubic),
        image, [(256, 192), (320, 320)], "logits", dict(native_size=[256, 256],
                                                        family="dinov2_registers_classifier"))


def main() -> None:
    """Every family's files; `python -m tests.data.make_family_files siglip2_naflex` (with timm's NaFlexVit of the
    same weights; `timm_naflex` that alone; `siglip2_fixed`, the fixed-resolution SigLIP 2 folder; `dinov3`,
    transformers' DINOv3 folders; `timm_eva`, timm's DINOv3 and EVA-02 folders; `dinov2_classifiers`, transformers'
    DINOv2 classifiers) makes those alone."""
    if sys.argv[1:] == ["timm_eva"]:
        timm_eva_cases()
        return
    if sys.argv[1:] == ["dinov2_classifiers"]:
        dinov2_classifier_cases(photographs()[0])
        return
    if sys.argv[1:] == ["dinov3"]:
        dinov3_cases(photographs())
        return
    if sys.argv[1:] == ["siglip2_naflex"]:
        siglip2_naflex_case()
        timm_naflex_case()
        return
    if sys.argv[1:] == ["timm_naflex"]:
        timm_naflex_case()
        return
    if sys.argv[1:] == ["siglip2_fixed"]:
        siglip2_fixed_case(photographs())
        return
    photos = photographs()
    image = photos[0]
    transformers_cases(image)
    siglip2_fixed_case(photos)
    dinov2_classifier_cases(image)
    dinov3_cases(photos)
    timm_cases(image)
    timm_eva_cases()
    siglip2_naflex_case()
    timm_naflex_case()
    transformers_resize_sizes()
    for root, _, files in sorted(os.walk(FOLDER)):
        for name in sorted(files):
            print(f"{os.path.getsize(os.path.join(root, name)):>9,}  {os.path.relpath(os.path.join(root, name))}")


if __name__ == "__main__":
    main()
