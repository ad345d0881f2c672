"""Training configurations as code: the paper's recipes as named, overridable dataclasses.

`get_config("pretrain")`, `get_config("finetune")` and `get_config("digits")` return a `Config`;
`apply_overrides(config, ["lr=0.01", "batch_size=64"])` changes any field by name. The defaults
are the paper's (arXiv:2010.11929, Appendix B, Tables 3-4):

    keras-vit-train --config=pretrain --workdir=/tmp/vit_b16_i1k    # ViT-B/16, ImageNet, 300 epochs
    keras-vit-train --config=finetune --workdir=/tmp/ft \\
        --override weights=/ckpt/ViT-B_16.npz --override dataset=cifar10 --override total_steps=10000
    keras-vit-train --config=digits --workdir=/tmp/digits           # >= 95% top-1 in minutes on CPU
    keras-vit-train --config=masked_patches --workdir=/tmp/mpp      # self-supervised (Sec. 4.6)
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from typing import Any, Iterable


@dataclasses.dataclass
class Config:
    """Every hyperparameter of a run. Field comments give the meaning; defaults are `pretrain`'s."""

    recipe: str = "pretrain"  # "pretrain" (keeps the builder's head), "finetune" (new zero-init head) or
    # "masked_patches" (self-supervised masked patch prediction on the images; labels ignored).
    # Model: a variant ("B/16", "R50+B/16", ...) or, with variant "", the explicit architecture below. With
    # `weights` a file that states its architecture (`states_architecture`), the model is the file's: `apply_overrides`
    # clears these six fields and `classifier` (`FROM_FILE`: variant "", the others 0, "the file's") but those it
    # is given, which the builder checks against the file (a contradiction is an error naming the field).
    variant: str = "B/16"
    patch_size: int = 16
    hidden_dim: int = 768
    mlp_dim: int = 3072
    num_heads: int = 12
    num_layers: int = 12
    classifier: str = "token"  # "token", "gap" or "map" (attention pooling); "": the weights file's.
    representation_size: int = 768  # Pre-logits Dense + tanh width; 0 for none.
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0
    drop_path_rate: float = 0.0
    weights: str = ""  # Passed to the builder as `weights=`: "" for None, a `.npz` / `.safetensors` / `.weights.h5`
    # path, a `save_pretrained` folder (transformers, timm), an `hf://` name or a registered name.
    image_size: int = 224
    # NaFlex (SigLIP 2's native aspect, keras_vit.naflex): > 0, each image keeps its aspect ratio, resized to the
    # largest grid of at most this many patches, its patch sequence padded to this length with a mask; the model
    # is a NaFlexViT (classifier "map"; from scratch, its position table is image_size / patch_size patches
    # square). 0: square images of image_size.
    max_num_patches: int = 0
    # Data: "digits" (embedded), "folder" (`data_dir/<split>/<class>/*.jpg`) or a TFDS name.
    dataset: str = "imagenet2012"
    data_dir: str = ""
    max_image_pixels: int = 40_000_000  # Image folders: larger images are skipped (and counted), never decoded.
    train_split: str = "train[:99%]"
    eval_split: str = "validation"
    download: bool = False  # TFDS: download and prepare if missing.
    shuffle_buffer: int = 10_000  # 0 or 1: no shuffling.
    inception_crop: bool = True
    crop_min_area: float = 0.05  # Inception crop covers this much to 100% of the image.
    random_flip: bool = True
    randaugment: bool = False  # keras.layers.RandAugment on training batches.
    mixup_alpha: float = 0.0  # keras.layers.MixUp on training batches; 0 disables.
    # Optimization.
    optimizer: str = "adamw"  # "adamw" (b1, b2, decoupled weight decay) or "sgd" (momentum).
    lr: float = 3e-3
    b1: float = 0.9
    b2: float = 0.999
    momentum: float = 0.9
    weight_decay: float = 0.3
    warmup_steps: int = 10_000
    decay: str = "cosine"  # "cosine" or "linear", after a linear warmup from 0.
    global_clipnorm: float = 1.0  # 0 disables clipping.
    grad_accum_steps: int = 1  # Micro-batches per update (the original fine-tuning code uses 8).
    batch_size: int = 4096  # Global batch of one micro-step, over all replicas and workers.
    epochs: int = 300
    steps_per_epoch: int = 0  # 0: one pass over the training split.
    total_steps: int = 0  # If > 0, overrides `epochs`: epochs = ceil(total_steps / steps_per_epoch).
    loss: str = "softmax"  # "softmax" or "sigmoid" cross-entropy.
    label_smoothing: float = 0.0
    precision: str = "float32"  # "float32" or "bfloat16" (Keras "mixed_bfloat16").
    validate: bool = True  # Evaluate the eval split after every epoch (for the best checkpoint).
    backup_every_steps: int = 0  # BackupAndRestore frequency; 0 backs up at the end of each epoch.
    seed: int = 0
    # Masked patch prediction (recipe "masked_patches"; paper Sec. 4.6, App. B.1.2).
    masked_target: str = "mean"  # "mean" (3-bit mean colour, 512 classes), "4x4" or "l2" (keras_vit.masked).
    corruption_rate: float = 0.5  # Patches corrupted per image ...
    mask_rate: float = 0.8  # ... of which this share gets the learnable [mask] embedding,
    random_rate: float = 0.1  # this share another patch's embedding, the rest unchanged.
    target_bits: int = 3  # Bits per colour channel of the classification targets.

    def __post_init__(self):
        """Refuses values out of range (`RANGES`), naming each, when a config is made or changed."""
        wrong = [f"{name}={getattr(self, name)!r} (expected {_describe(low, high)})"
                 for name, (low, high) in RANGES.items()
                 if getattr(self, name) < low or (high is not None and getattr(self, name) > high)]
        if self.mask_rate + self.random_rate > 1:
            wrong.append(f"mask_rate + random_rate = {self.mask_rate + self.random_rate:g} (expected at most 1: the "
                         "shares of the corrupted patches that are masked or replaced)")
        if wrong:
            raise ValueError(f"Config values out of range: {'; '.join(wrong)}.")
        if self.max_num_patches:
            self._check_naflex()

    def _check_naflex(self) -> None:
        """Refuses, by name, what a NaFlex run (`max_num_patches`) cannot do."""
        square_only = [name for name, value in (("recipe='masked_patches'", self.recipe == "masked_patches"),
                                                ("randaugment", self.randaugment),
                                                ("mixup_alpha", self.mixup_alpha > 0)) if value]
        if square_only:
            raise ValueError(f"max_num_patches={self.max_num_patches} (NaFlex patch sequences) does not go with "
                             f"{', '.join(square_only)}: they work on square images of one size. Set "
                             "max_num_patches=0, or leave them out.")
        if self.classifier not in ("map", "") or self.representation_size:
            raise ValueError(f"max_num_patches={self.max_num_patches}: a NaFlex ViT pools its patch sequence with the "
                             f"MAP head and has no pre-logits (classifier={self.classifier!r}, representation_size="
                             f"{self.representation_size} given). Set classifier=map and representation_size=0.")


# The range of each numeric field of `Config`: (lowest, highest) allowed, None for no upper bound.
RANGES: dict[str, tuple[float, float | None]] = {
    **dict.fromkeys(["image_size", "max_image_pixels", "grad_accum_steps", "batch_size"], (1, None)),
    **dict.fromkeys(["patch_size", "hidden_dim", "mlp_dim", "num_heads", "num_layers"], (0, None)),  # 0: the file's
    **dict.fromkeys(["representation_size", "max_num_patches", "shuffle_buffer", "warmup_steps", "epochs",
                     "steps_per_epoch", "total_steps", "backup_every_steps", "seed", "lr", "weight_decay",
                     "global_clipnorm", "mixup_alpha"], (0, None)),
    **dict.fromkeys(["dropout_rate", "attention_dropout_rate", "drop_path_rate", "crop_min_area", "b1", "b2",
                     "momentum", "label_smoothing", "corruption_rate", "mask_rate", "random_rate"], (0, 1)),
    "target_bits": (1, 8),
}


def _describe(low: float, high: float | None) -> str:
    return f">= {low}" if high is None else f"{low} to {high}"


def as_json(config: Config) -> dict[str, Any]:
    """`config`'s fields as JSON gives them back (what a saved config is compared with)."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def _pretrain() -> Config:
    """ViT-B/16 on ImageNet from scratch (Table 3): Adam, lr 3e-3 cosine, wd 0.3, dropout 0.1, clip 1."""
    return Config()


def _finetune() -> Config:
    """Fine-tuning (Table 4): SGD momentum 0.9, no weight decay, 500 warmup steps then cosine, clip 1,
    batch 512 as 8 accumulated micro-batches of 64, 384 px, ImageNet 20k steps at lr 0.03 (code default)."""
    return dataclasses.replace(
        Config(), recipe="finetune", representation_size=0, dropout_rate=0.0, image_size=384,
        train_split="train[:98%]", optimizer="sgd", lr=0.03, weight_decay=0.0, warmup_steps=500,
        decay="cosine", grad_accum_steps=8, batch_size=64, steps_per_epoch=500, total_steps=20_000)


def _digits() -> Config:
    """A small ViT from scratch on scikit-learn's 8x8 digits at 32 px: what `python demo.py` runs."""
    return dataclasses.replace(
        Config(), variant="", patch_size=4, hidden_dim=64, mlp_dim=128, num_heads=4, num_layers=4,
        representation_size=0, dropout_rate=0.0, image_size=32, dataset="digits", train_split="train",
        eval_split="test", shuffle_buffer=2048, inception_crop=True, crop_min_area=0.6, random_flip=False,
        lr=2e-3, weight_decay=0.05, warmup_steps=100, batch_size=64, epochs=45, label_smoothing=0.1,
        validate=False)


def _masked_patches() -> Config:
    """Self-supervised masked patch prediction (Sec. 4.6, App. B.1.2): ViT-B/16, Adam (no weight decay),
    base lr 2e-4, 10k warmup steps then cosine, batch 4096, 1M steps (the paper's JFT run), 50% of the
    patches corrupted, 3-bit mean colour targets. Labels of the dataset are ignored. Its outputs
    (`encoder.weights.h5`, `encoder.keras`) start a `finetune` (`weights=`) or `training.fewshot`."""
    return dataclasses.replace(
        Config(), recipe="masked_patches", representation_size=0, dropout_rate=0.0, optimizer="adamw",
        lr=2e-4, weight_decay=0.0, warmup_steps=10_000, decay="cosine", batch_size=4096,
        steps_per_epoch=10_000, total_steps=1_000_000)


RECIPES = {"pretrain": _pretrain, "finetune": _finetune, "digits": _digits, "masked_patches": _masked_patches}


def get_config(name: str = "pretrain") -> Config:
    """Returns the named recipe (`pretrain`, `finetune`, `digits`, `masked_patches`) with the paper's defaults."""
    if name not in RECIPES:
        raise ValueError(f"Unknown config {name!r}. Expected one of {sorted(RECIPES)}.")
    return RECIPES[name]()


def _parse(field: dataclasses.Field, text: str) -> Any:
    kind = typing.get_type_hints(Config)[field.name]
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"Override {field.name}={text!r}: expected true or false.")
        return text.lower() in ("true", "1")
    try:
        return kind(text)
    except ValueError:
        article = "an" if kind.__name__[0] in "aeiou" else "a"
        raise ValueError(f"Override {field.name}={text!r}: expected {article} {kind.__name__}.") from None


# The architecture fields (and the classifier, which the file's pooling gives) and their "not given: the weights
# file's" values.
FROM_FILE = {"variant": "", "patch_size": 0, "hidden_dim": 0, "mlp_dim": 0, "num_heads": 0, "num_layers": 0,
             "classifier": ""}


def states_architecture(weights: str) -> bool:
    """Whether `weights` names a file the builder reads the architecture from: an existing `.npz` or `.safetensors`
    file, a `save_pretrained` folder, or an `hf://` name (not a `.weights.h5` file, which states none, nor a
    registered name, which needs its variant)."""
    return bool(weights) and not weights.endswith(".h5") and (weights.startswith("hf://") or os.path.exists(weights))


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """Returns `config` with each `"key=value"` applied, values parsed to the field's type. Where the result's
    `weights` states its architecture (`states_architecture`), the architecture fields not overridden here are
    cleared (`FROM_FILE`): the file's architecture wins over the recipe's, and an overridden one that contradicts it
    is the builder's error."""
    fields = {field.name: field for field in dataclasses.fields(Config)}
    changes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"Override {item!r} is not key=value.")
        if key not in fields:
            raise ValueError(f"Unknown config field {key!r} in override {item!r}. Expected one of {sorted(fields)}.")
        changes[key] = _parse(fields[key], value)
    if states_architecture(changes.get("weights", config.weights)):
        changes = {**FROM_FILE, **changes}
    return dataclasses.replace(config, **changes)  # checked once, as a whole
