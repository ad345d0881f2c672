"""One read of a weights file: `read_checkpoint(path)` turns an `.npz`, `.safetensors` (with the Hugging Face
`config.json` beside it) or `.weights.h5` file (or a `save_pretrained` directory, or an `hf://` name in the local
hub cache: `locate`) into a `CheckpointFile`, the summary the model builder and the
loader share: its layout, its keys' shapes in the original `.npz` layout, the `ViTConfig` fields it fixes, its
head. It reads headers only (no tensor data), once; the loader reads the tensors with the header it kept.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping

from keras_vit import variants
from keras_vit.checkpoints import config_files, locate, naflex_file, npz, preprocessing, safetensors_file, torch_layout
from keras_vit.checkpoints.architecture import read_architecture

KERAS_WEIGHTS = "keras"  # the layout of a `.weights.h5` file: keras_vit's own weight paths


@dataclasses.dataclass(frozen=True)
class CheckpointFile:
    """What a weights file says about the model that fits it.

    Attributes:
        path: the file.
        layout: `None` for an original `.npz` file, a `torch_layout` layout name for a timm / Hugging Face
            `.safetensors` file, `"keras"` for a `.weights.h5` file.
        shapes: `.npz`-layout key -> shape (empty for `.weights.h5`, which the loader leaves to Keras).
        header: the `.safetensors` header (tensor name -> dtype, shape, offsets), or None.
        hf_config: what the Hugging Face `config.json` beside the file sets (numerics, `num_heads`, `image_size`),
            or None.
        timm_config: what timm's `config.json` beside the file states of the architecture (`num_heads`, from its
            `model_args` or its entry point's name; the widths and depth `model_args` set), or None.
        preprocessing: the `PreprocessingConfig` fields (mean, std, resize, crop, interpolation) that a
            `preprocessor_config.json` or timm `config.json` beside the file declares, or None.
        preprocessing_source: the file `preprocessing` was read from, or None.
        preprocessing_problem: why the declared preprocessing could not be read (an unknown processor, a value
            keras_vit cannot reproduce), or None. The weights still load; a model that normalizes its input
            (`include_preprocessing=True`) needs the input fields given by hand (`check_preprocessing`).
        declared_size: (height, width) of the images the declared transform produces, or None.
        timm_pooling: the `global_pool` timm's `config.json` gives the model (`"avg"`, `"token"`, `"map"`), or None.
        naflex: what a SigLIP 2 NaFlex file states (layout `naflex_file.LAYOUT`; `keras_vit.naflex` builds its
            model), or None.
    """

    path: str
    layout: str | None
    shapes: Mapping[str, tuple[int, ...]]
    header: Mapping[str, safetensors_file.TensorInfo] | None = None
    hf_config: Mapping[str, Any] | None = None
    preprocessing: Mapping[str, Any] | None = None
    preprocessing_source: str | None = None
    preprocessing_problem: str | None = None
    declared_size: tuple[int, int] | None = None
    timm_config: Mapping[str, Any] | None = None
    timm_pooling: str | None = None
    naflex: naflex_file.NaFlexFile | None = None

    @property
    def fixed(self) -> dict[str, Any]:
        """The `ViTConfig` fields the file's config.json fixes (a contradicting value is an error)."""
        if self.naflex is not None:
            return dict(self.naflex.config)
        if self.layout in torch_layout.TIMM_LAYOUTS:
            return dict(self.timm_config or {})
        if self.layout not in torch_layout.HF_LAYOUTS or self.hf_config is None:
            return {}
        stated = {name: value for name, value in self.hf_config.items() if name in variants.OPTIONS}
        return {**torch_layout.NUMERICS[self.layout], **stated}

    @property
    def input_size(self) -> tuple[int, int] | None:
        """The checkpoint's own input size: the size its declared transform produces, else its config.json's
        `image_size`, else the size its position table was trained at (None without any)."""
        if self.declared_size is not None:
            return tuple(self.declared_size)
        side = (self.hf_config or {}).get("image_size") or self.image_size
        return (side, side) if side else None

    def check_image_model(self, tool: str) -> None:
        """Raises ValueError for a file whose model does not take images (SigLIP 2 NaFlex: patch sequences), which
        `tool` does not handle."""
        if self.layout == naflex_file.LAYOUT:
            raise ValueError(f"{self.path!r} is a SigLIP 2 NaFlex checkpoint, whose model takes patch sequences of "
                             f"each image's own grid, which {tool} cannot take yet. Build it in Python: "
                             "keras_vit.VisionTransformer(weights=...) gives its keras_vit.naflex.NaFlexViT, whose "
                             "inputs keras_vit.naflex.naflex_inputs makes.")

    def heads_guessed(self, num_heads: int | None) -> bool:
        """True where neither the file, its config.json nor `num_heads` gives the number of heads."""
        return self.layout not in (None, KERAS_WEIGHTS) and num_heads is None and "num_heads" not in self.fixed

    def check_preprocessing(self, options: Mapping[str, Any], include_preprocessing: bool) -> None:
        """Where the declared preprocessing is unreadable and `options` do not give the normalization by hand:
        raises ValueError for a model that takes pixels (`include_preprocessing`), which needs it; warns for one
        that does not, whose exports would normalize with the defaults."""
        if self.preprocessing_problem is None or all(options.get(name) is not None
                                                     for name in ("image_mean", "image_std")):
            return
        if not include_preprocessing:
            warnings.warn(f"keras_vit: {self.preprocessing_problem} The weights load without it; the model's "
                          "image_mean and image_std stay the defaults (0.5), which its exports (keras-vit-export, "
                          "keras-vit-tflite) would normalize with: give image_mean= and image_std= for those.",
                          stacklevel=3)
            return
        raise ValueError(f"{self.preprocessing_problem} The weights load without it: build with "
                         "include_preprocessing=False and normalize the input yourself, or give the input fields "
                         "by hand, e.g. VisionTransformer(weights=..., image_mean=(0.5, 0.5, 0.5), image_std=(0.5, "
                         "0.5, 0.5), resize_mode='shortest_edge', resize_size=256, crop_fraction=224 / 256, "
                         "interpolation='bicubic') (image_mean and image_std are needed; on the command line, save "
                         "that model as .keras and give --model).")

    @property
    def default_numerics(self) -> dict[str, Any]:
        """The numerics of the file's layout where its config.json does not fix them (empty for `.npz`)."""
        hf_config_fixes = self.layout in torch_layout.HF_LAYOUTS and self.hf_config is not None  # (`fixed`)
        if self.layout in (None, KERAS_WEIGHTS) or hf_config_fixes:
            return {}
        return dict(torch_layout.NUMERICS[self.layout])

    def architecture(self, num_heads: int | None = None) -> dict[str, Any]:
        """`read_architecture` of the file's shapes (the PyTorch layouts do not store the number of heads: it is
        `num_heads`, the config.json's, or that of the variant of the same shape)."""
        num_heads = self.fixed.get("num_heads", num_heads)
        return read_architecture(self.shapes, num_heads=num_heads, heads_stored=self.layout is None)

    def config_fields(self, num_heads: int | None = None) -> dict[str, Any]:
        """The `ViTConfig` fields the file gives: architecture, classifier, family options and numerics (its
        declared input is `preprocessing`)."""
        if self.layout == KERAS_WEIGHTS:
            return {}
        found = self.architecture(num_heads)
        architecture = {name: found[name] for name in (*variants.ARCHITECTURE, "resnet_stages")}
        resampling = (self.position_resampling or (None,))[0]
        return {**self.default_numerics, **self.fixed, **architecture, "classifier": self.classifier,
                **found["options"],
                **({"position_resampling": resampling} if resampling else {})}

    @property
    def position_resampling(self) -> tuple[str, str] | None:
        """(method, source) of how the file's source resizes its position table (`torch_layout.
        position_resampling`); None for `.npz` (the original's linear rule, `ViTConfig`'s default) and `.weights.h5`
        files."""
        if self.layout in (None, KERAS_WEIGHTS):
            return None
        return torch_layout.position_resampling(self.layout, self.header or {})

    def check_agrees(self, given: Mapping[str, Any]) -> None:
        """Raises ValueError where a given field contradicts the file's config.json."""
        for name, fixed in self.fixed.items():
            value = given.get(name)
            if value is not None and value != fixed:
                raise ValueError(f"{name}={value!r} contradicts the config.json beside {self.path!r}, whose model "
                                 f"has {name}={fixed!r}. Leave {name} out (or None) to take the config's.")

    def width(self, key: str) -> int | None:
        """The first dimension of an `.npz`-layout key (`head/bias`: the classes), or None without it."""
        return self.shapes[key][0] if key in self.shapes else None

    @property
    def classifier(self) -> str:
        """The model's `classifier`: its keys', except `"patch_gap"` where timm's config.json pools the patch tokens'
        mean beside a class token without fc_norm (`global_pool="avg"`: timm's DINOv3, its heads included)."""
        classifier = read_architecture(self.shapes, num_heads=1)["classifier"]
        if classifier == "token" and self.timm_pooling == "avg" and "fc_norm/scale" not in self.shapes:
            return "patch_gap"
        return classifier

    @property
    def pooling(self) -> str:
        """The `pooling` that returns what the file's model pools without its head: `"token"`, `"avg"` (the
        classifiers `"gap"` and `"patch_gap"`, and timm's `global_pool="avg"`), `"map"` or `"token_avg"` (the
        classifier `"token_gap"`); a NaFlex file's MAP head, `"map"`."""
        if self.naflex is not None:
            return "map"
        classifier = self.classifier
        if classifier == "token" and self.timm_pooling == "avg":  # after fc_norm
            return "avg"
        return {"gap": "avg", "patch_gap": "avg", "token_gap": "token_avg"}.get(classifier, classifier)

    @property
    def head_classes(self) -> int | None:
        return self.width("head/bias")

    @property
    def representation_size(self) -> int | None:
        return self.width("pre_logits/bias")

    @property
    def image_size(self) -> int | None:
        """The square input side its position embedding was trained at (None without one)."""
        return read_architecture(self.shapes, num_heads=1).get("image_size") if self.shapes else None


def missing_file(weights: str) -> FileNotFoundError:
    """The error for a `weights=` path that does not exist."""
    return FileNotFoundError(f"weights={weights!r}: no such file (relative to {os.getcwd()!r}). Give the path of an "
                             "existing .npz, .safetensors or .weights.h5 file or save_pretrained directory, an "
                             "hf://org/name in the local hub cache, or a registered name (keras_vit.list_weights()).")


def check_file_kind(path: str) -> None:
    """Refuses pickle files (never opened) and whole-model `.keras` files, saying what to use."""
    safetensors_file.refuse_pickle(path)
    if path.endswith(".keras"):
        raise ValueError(f"{path!r} is a whole Keras model, not a weights file: load it with "
                         "`keras.saving.load_model(path)`. Weights files are `.npz` and `.safetensors` "
                         "checkpoints and `.weights.h5`.")


def read_checkpoint(path: str | os.PathLike) -> CheckpointFile:
    """Reads a weights file's header (and a Hugging Face `config.json` beside it) once.

    Args:
        path: a weights file, a `save_pretrained` directory, or `hf://org/name[@revision]` (local hub cache).

    Raises:
        FileNotFoundError: no such file, or a hub name not in the local cache.
        ValueError: a pickle or `.keras` file, an unreadable file, an unknown layout, or model features keras_vit
            does not implement (named by key).
    """
    path = locate.locate(os.fspath(path))
    check_file_kind(path)
    if not os.path.isfile(path):
        raise missing_file(path)
    if path.endswith(".h5"):
        return CheckpointFile(path, KERAS_WEIGHTS, {})
    files = config_files.Beside(path)  # config.json and preprocessor_config.json, each read once
    if naflex_file.is_naflex_config(files.config):  # SigLIP 2 NaFlex: its own reader and model (`keras_vit.naflex`)
        return CheckpointFile(path, naflex_file.LAYOUT, {}, naflex=naflex_file.naflex_file_of(path, files))
    declared = _declared_input(files)
    if not path.endswith(".safetensors"):
        return CheckpointFile(path, None, npz.read_npz_shapes(path), **declared)
    header = safetensors_file.read_header(path)
    shapes = {name: info.shape for name, info in header.items()}
    layout = torch_layout.detect_layout(shapes)
    if layout in (torch_layout.TIMM, torch_layout.TIMM_EVA):  # the config.json names timm's entry point
        if config_files.TIMM_EVA_NAME.fullmatch(config_files.timm_architecture(files)):
            layout = torch_layout.TIMM_EVA  # (an Eva whose keys look like timm's ViT: no layer scale, no biases)
        if config_files.timm_eva_family(files) == "eva02":
            layout = torch_layout.TIMM_EVA02
    torch_layout.check_supported(shapes, layout, origin=path)
    npz_shapes = torch_layout.npz_shapes(shapes, layout)
    hf_config = config_files.read_hf_config(files, layout) if layout in torch_layout.HF_LAYOUTS else None
    timm_config = timm_pooling = None
    if layout in torch_layout.TIMM_LAYOUTS and "embedding/kernel" in npz_shapes:
        timm_config = config_files.read_timm_config(files, npz_shapes["embedding/kernel"][-1])
        timm_pooling = config_files.timm_pooling(files)
    if layout in (torch_layout.TIMM_EVA, torch_layout.TIMM_EVA02):
        gated = any(key.endswith("/MlpBlock_3/Dense_gate/kernel") for key in npz_shapes)
        timm_config = {**(timm_config or {}), **config_files.read_timm_eva_config(files, gated)}
    file = CheckpointFile(path, layout, npz_shapes, header, hf_config, timm_config=timm_config,
                          timm_pooling=timm_pooling, **declared)
    _check_config_matches_weights(file)
    return file


def _declared_input(files: config_files.Beside) -> dict[str, Any]:
    """The `CheckpointFile` fields of the preprocessing declared in `files`; a file keras_vit cannot read or
    reproduce is kept as `preprocessing_problem`, for the models that need it."""
    try:
        declared = preprocessing.read_preprocessing(files)
    except ValueError as error:
        return dict(preprocessing_problem=str(error))
    if declared is None:
        return {}
    return dict(preprocessing=declared.fields, preprocessing_source=declared.source,
                declared_size=declared.image_size)


def _check_config_matches_weights(file: CheckpointFile) -> None:
    """Raises ValueError where the config.json beside a file describes another architecture than its weights."""
    stated = file.fixed
    declared_fields = {field: stated.get(field) for field in config_files.HF_ARCHITECTURE.values()}
    if not any(value is not None for value in declared_fields.values()):
        return
    try:
        found = read_architecture(file.shapes, num_heads=1)
    except ValueError:
        return  # keys that do not make a ViT: the loader names every problem
    for field, declared in declared_fields.items():
        if declared is not None and declared != found[field]:
            raise ValueError(f"The config.json beside {file.path!r} contradicts its weights: it says {field}="
                             f"{declared}, the weights' shapes have {field}={found[field]}. Keep the config.json "
                             "saved with these weights (save_pretrained writes both), or remove it.")
