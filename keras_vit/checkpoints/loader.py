"""Loading checkpoints into a built keras_vit model: `resolve` a `weights=` value, then `load` it.

The loader checks the *whole* checkpoint against the model before it assigns anything: a missing or
unexpected key, or a shape it cannot reconcile, is a `ValueError` listing every problem, and the model
is left untouched. `.npz` files are matched through `npz.KEY_TABLE`; timm and Hugging Face
`.safetensors` files are first translated into that layout (`torch_layout`) and their problems are named
by the file's own keys. Works on any `keras.Model` whose weights carry keras_vit's names; imports no
model code.
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import Sequence

import keras
import numpy as np

from keras_vit.checkpoints import locate, npz, registry, resample, safetensors_file, torch_layout
from keras_vit.checkpoints.reader import KERAS_WEIGHTS, CheckpointFile, missing_file, read_checkpoint

_TOP_LAYERS = ("pre_logits", "head")
_POSEMB_PATH = "posembed_input/pos_embedding"
# The loader's words for each way a file's source resizes its position embedding (`CheckpointFile.
# position_resampling`; `resample`'s docstring names the code).
_HOW = {resample.LINEAR_CORNERS: "linearly", resample.BICUBIC_ANTIALIAS: "bicubically with antialiasing",
        resample.BICUBIC: "bicubically"}


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """What `weights=` resolved to.

    Attributes:
        location: str. Local path, or the URL of a registered checkpoint (fetched on load).
        checkpoint: the registry entry, or None for a local file.
        file: the `reader.CheckpointFile` of a local file (read once, its header kept for the load), or None.
        representation_size: int or None. `pre_logits` width the model should be built with
            when the caller left `representation_size=None`: the checkpoint's, if its head is
            going to be loaded (`include_top=True`), else None.
        head_classes: int or None. Width of the checkpoint's head; None when it has none or
            when the file does not say (`.weights.h5`).
    """

    location: str
    checkpoint: registry.Checkpoint | None = None
    file: CheckpointFile | None = None
    representation_size: int | None = None
    head_classes: int | None = None


def resolve(weights: str | CheckpointFile | None, *, variant: str | None, image_size: tuple[int, int],
            include_top: bool, classes: int) -> WeightsSource | None:
    """Validates `weights=` without downloading anything.

    Args:
        weights: None, `"imagenet"`, a registered tag (see `keras_vit.list_weights`), a path to an
            `.npz` checkpoint, a `.weights.h5` file or a timm / Hugging Face `.safetensors` file, or the
            `CheckpointFile` of one (`reader.read_checkpoint`: then the file is not read again).
        variant: str or None. The model's variant; registered names need one.
        image_size: (int, int). The model's input height and width.
        include_top: bool. Whether the model has a head.
        classes: int. Size of the model's head.

    Returns:
        None for `weights=None`, else a `WeightsSource`.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: unknown name or unreadable file; or, as `keras.applications`, pretrained weights
            with `include_top=True` and `classes` other than the checkpoint's head (a new head would be
            all zeros under softmax: every prediction uniform).
    """
    if weights is None:
        return None
    if isinstance(weights, CheckpointFile):
        source = _resolve_file(weights)
    elif not isinstance(weights, str):
        raise ValueError(f"`weights` must be None, a registered name or a file path. Received: {weights!r}")
    else:
        file = local_file(weights)
        source = _resolve_file(file) if file is not None else _resolve_name(weights, variant, image_size)
    if not include_top:
        return dataclasses.replace(source, representation_size=None)
    if source.file is None or source.file.layout != KERAS_WEIGHTS:  # A Keras weights file does not say.
        _check_head(weights if isinstance(weights, str) else source.location, source.head_classes, classes)
    return source


WEIGHTS_SUFFIXES = (".npz", ".safetensors", ".h5", ".keras", *safetensors_file.PICKLE_SUFFIXES)


def local_file(weights: str | CheckpointFile | None) -> CheckpointFile | None:
    """The `CheckpointFile` of a `weights=` value that is a local weights file, a `save_pretrained` directory or an
    `hf://` name (read once), the given one, or None (no weights, or a registered name).

    Raises:
        FileNotFoundError: a value that names a file (a weights suffix or a directory part) which does not exist,
            before anything reads an architecture from it or takes it for a registered name.
    """
    if isinstance(weights, CheckpointFile):
        return weights
    if not isinstance(weights, str):
        return None
    if os.path.exists(weights) or locate.is_hub_name(weights):
        return read_checkpoint(weights)
    if weights.endswith(WEIGHTS_SUFFIXES) or os.sep in weights or "/" in weights:
        raise missing_file(weights)
    return None


def _resolve_name(weights: str, variant: str | None, image_size: tuple[int, int]) -> WeightsSource:
    """A registered name: the registry entry that fits the variant and input size."""
    if variant is None:
        raise ValueError(f"`weights={weights!r}` is not an existing file, and registered weights names need a "
                         "`variant` (e.g. variant='B/16').")
    entries = registry.list_weights(variant)
    if weights == "imagenet":
        candidates = [entry for entry in entries if entry.tag in registry.IMAGENET_TAGS]
        tags = registry.IMAGENET_TAGS
    else:
        candidates = [entry for entry in entries if entry.tag == weights]
        tags = (weights,)
    if not candidates:
        names = sorted({entry.tag for entry in entries} | ({"imagenet"} if any(
            entry.tag in registry.IMAGENET_TAGS for entry in entries) else set()))
        raise ValueError(f"Unknown weights {weights!r} for variant {variant!r}: not a file, and not a registered "
                         f"name. Expected None, a path to a .npz, .weights.h5 or .safetensors file, or one of "
                         f"{names}.")
    entry = registry.pick(candidates, image_size, tags)
    return WeightsSource(entry.url, entry, representation_size=entry.representation_size, head_classes=entry.classes)


def _resolve_file(file: CheckpointFile) -> WeightsSource:
    """A local file, as `read_checkpoint` read it: its head and pre-logits widths."""
    return WeightsSource(file.path, file=file, representation_size=file.representation_size,
                         head_classes=file.head_classes)


def _check_head(weights: str, checkpoint_classes: int | None, classes: int) -> None:
    """With `include_top=True`, pretrained weights must bring the head: same `classes`."""
    if checkpoint_classes is None:
        raise ValueError(f"weights={weights!r} has no classification head, but the model was asked for "
                         "include_top=True: build it with include_top=False (and `pooling`) and add your head.")
    if checkpoint_classes != classes:
        raise ValueError(
            f"weights={weights!r} has a {checkpoint_classes}-class head, but the model was asked for include_top=True "
            f"and classes={classes}: its head would be a new all-zeros layer (uniform predictions). Pass "
            f"classes={checkpoint_classes} to use the checkpoint's head, or, to fine-tune for your classes, build the "
            "backbone with include_top=False and pooling='token' (pooling='avg' for classifier='gap') and add your "
            f"head: `keras_vit.ViTModel(backbone.input, keras.layers.Dense({classes})(backbone.output))`.")


def load(model: keras.Model, source: WeightsSource | CheckpointFile | str) -> None:
    """Loads weights into a model built by `keras_vit`; all-or-nothing for `.npz` and `.safetensors` files.

    A timm / Hugging Face `.safetensors` file needs a model built with its numerics: build it
    with `weights=` that file (or with the options in `torch_layout.NUMERICS` or its `config.json`).

    Args:
        model: a `keras.Model` from `keras_vit.VisionTransformer` or a variant builder.
        source: a `WeightsSource` from `resolve`, a `CheckpointFile`, or a path to an `.npz` checkpoint, a
            `.weights.h5` file or a `.safetensors` file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable file, or a checkpoint that does not fit the model (the error
            lists every missing key, unexpected key and shape mismatch); the model is unchanged.
    """
    if isinstance(source, (str, os.PathLike)):
        file = read_checkpoint(source)
    elif isinstance(source, CheckpointFile):
        file = source
    else:
        file = source.file or read_checkpoint(registry.fetch(source.checkpoint))
    if file.layout == KERAS_WEIGHTS:
        model.load_weights(file.path)
        return
    if file.header is not None:
        assignments = _plan_safetensors(model, file)
    else:
        assignments = plan_assignments(model, npz.read_npz(file.path), origin=file.path)
    for variable, value in assignments:
        variable.assign(value)
    _warn_if_zero_head(model, assignments)


def _plan_safetensors(model: keras.Model, file: CheckpointFile) -> list[tuple[keras.Variable, np.ndarray]]:
    """`plan_assignments` for a timm / Hugging Face file, its problems named by the file's keys."""
    tensors = safetensors_file.read_safetensors(file.path, header=file.header)
    queries = [variable for variable in model.weights
               if variable.path.endswith("MultiHeadDotProductAttention_1/query/kernel")]
    num_heads = queries[0].shape[1] if queries else 1
    translation = torch_layout.translate(tensors, file.layout, num_heads)
    sources = torch_layout.weight_sources(file.layout, len(queries), torch_layout.hf_prefix(tensors))
    return plan_assignments(model, translation.arrays, origin=file.path, source_keys=translation.source_keys,
                            weight_sources=sources, problems=translation.problems,
                            resampling=file.position_resampling)


def plan_assignments(model: keras.Model, arrays: dict[str, np.ndarray], origin: str = "checkpoint", *,
                     source_keys: dict[str, str] | None = None, weight_sources: dict[str, str] | None = None,
                     problems: Sequence[str] = (), resampling: str | None = None
                     ) -> list[tuple[keras.Variable, np.ndarray]]:
    """Matches every checkpoint array to a model weight; assigns nothing.

    Backbone weights must match one-to-one (position embeddings are resampled to the
    model's grid). Top layers (`pre_logits`, `head`) follow the transfer rules: the head is
    loaded when its shape matches, else left at its initialization (with a warning); `pre_logits`
    is then loaded when the model has one and dropped otherwise.

    Args:
        model: the model.
        arrays: `.npz` key -> array.
        origin: str. The file, for messages.
        source_keys: optional `.npz` key -> the key of a translated file it came from, for messages.
        weight_sources: optional model weight path -> the translated file's key that would feed it,
            for messages about missing keys.
        problems: problems found before (e.g. in translation), listed with the others.
        resampling: (method, source): how the file's source resizes its position embedding (`resample.METHODS`),
            and its name; None: the original loader's linear rule (`.npz` files).

    Returns:
        (variable, value) pairs to assign.

    Raises:
        ValueError: listing every problem found.
    """
    source_keys, weight_sources = source_keys or {}, weight_sources or {}

    def name(key: str) -> str:
        source = source_keys.get(key, key)
        return repr(key) if source == key else f"{source!r} (as {key!r})"

    variables = {variable.path: variable for variable in model.weights}
    mapped, problems = {}, list(problems)
    for key, array in arrays.items():
        target = npz.keras_path(key)
        if target is None:
            problems.append(f"unexpected key {name(key)} {array.shape}: no model weight corresponds to it")
            continue
        path, transform = target
        if path in mapped:
            problems.append(f"keys {name(mapped[path][0])} and {name(key)} both map to model weight {path!r}")
        mapped[path] = (key, transform(array))

    head_kept = _head_loads(variables, mapped)
    assignments, kept, resized = [], [], None
    method, source = resampling or (resample.LINEAR_CORNERS, None)
    as_source = f"{_HOW[method]}, as {source} does" if source else "as the original loader does"
    for path, variable in variables.items():
        layer = path.split("/")[0]
        if path not in mapped or (layer == "head" and not head_kept):
            if head_kept or layer not in _TOP_LAYERS:
                source = f" {weight_sources[path]!r}" if path in weight_sources else ""
                problems.append(f"missing key{source} for model weight {path!r} (expected shape "
                                f"{tuple(variable.shape)})")
            kept.append(path)
            continue
        key, value = mapped.pop(path)
        if path == _POSEMB_PATH and value.shape != tuple(variable.shape):
            table = _owner(model, variable)
            rows, columns = table.grid_size
            resized = (f"{name(key)} resampled from {value.shape[1]} to {variable.shape[1]} tokens "
                       f"({rows}x{columns} grid)")
            value = _resample_for(table, value, variable, name(key), problems, method)
        if value is not None and value.shape != tuple(variable.shape):
            problems.append(f"shape mismatch for key {name(key)} -> {path!r}: expected {tuple(variable.shape)}, "
                            f"found {value.shape}")
        elif value is not None:
            assignments.append((variable, value))
    for path, (key, value) in mapped.items():
        if head_kept or path.split("/")[0] not in _TOP_LAYERS:
            problems.append(f"unexpected key {name(key)} {value.shape}: the model has no weight {path!r}")
    if problems:
        raise ValueError(_mismatch_message(model, arrays, variables, problems, origin))
    # Without a head (include_top=False) dropping the checkpoint's top layers is what was asked for.
    if "head/kernel" in variables:
        _warn_top_changes(kept, dropped=[source_keys.get(key, key) for key, _ in mapped.values()])
    if resized:
        warnings.warn(f"keras_vit: position embedding {resized}, {as_source}.", stacklevel=3)
    return assignments


def _head_loads(variables: dict, mapped: dict) -> bool:
    """True if the checkpoint's head fits the model's head (then `pre_logits` must match too)."""
    if "head/kernel" not in variables or "head/kernel" not in mapped:
        return False
    return mapped["head/kernel"][1].shape == tuple(variables["head/kernel"].shape)


def _warn_top_changes(kept: list[str], dropped: list[str]) -> None:
    """Warns of the top-layer weights left at their initialization and the checkpoint keys not used."""
    if kept:
        warnings.warn("keras_vit: not in the checkpoint or of another shape, left at their initialization "
                      f"(zeros for the head): {', '.join(kept)}.", stacklevel=3)
    if dropped:
        warnings.warn(f"keras_vit: checkpoint keys not used by this model: {', '.join(dropped)}.", stacklevel=3)


def _owner(model: keras.Model, variable: keras.Variable) -> keras.layers.Layer:
    """The innermost layer of `model` that holds `variable` (the loader maps weights by their paths and never finds
    a layer by its name: the position table's own layer tells its grid)."""
    for layer in model.layers:
        if any(weight is variable for weight in layer.weights):
            return _owner(layer, variable) if isinstance(layer, keras.Model) else layer
    raise ValueError(f"No layer of model {model.name!r} holds the weight {variable.path!r}.")


def _resample_for(layer: keras.layers.Layer, value: np.ndarray, variable, key: str, problems: list,
                  method: str) -> np.ndarray | None:
    """Position embedding resampled to the grid of `layer` (the model's position embedding, which holds
    `variable`) with `method` (`resample.METHODS`), or None (with a problem) if impossible.

    `key` is the checkpoint key as messages show it (quoted)."""
    if value.ndim != 3 or value.shape[-1] != variable.shape[-1]:
        problems.append(f"shape mismatch for key {key}: expected {tuple(variable.shape)}, found {value.shape}")
        return None
    try:
        return npz.resample_position_embedding(value, layer.grid_size, num_prefix_tokens=layer.num_prefix_tokens,
                                               method=method)
    except ValueError as error:
        problems.append(f"cannot resample key {key} {value.shape} to {tuple(variable.shape)}: {error}")
        return None


def _architecture_summary(widths: dict[str, tuple], block_keys) -> str:
    width = widths.get("embedding/kernel", ("?",))[-1]
    blocks = {re.search(r"encoderblock_(\d+)", key).group(1) for key in block_keys if "encoderblock_" in key}
    return f"hidden size {width}, {len(blocks)} encoder blocks"


def _mismatch_message(model, arrays, variables, problems: list[str], origin: str) -> str:
    model_widths = {path: tuple(variable.shape) for path, variable in variables.items()}
    checkpoint_widths = {"embedding/kernel": arrays["embedding/kernel"].shape} if "embedding/kernel" in arrays else {}
    # Key-set problems first: they tell a wrong variant apart from a resolution change.
    problems = sorted(problems, key=lambda problem: not problem.startswith(("missing", "unexpected")))
    shown = problems[:20]
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    checkpoint, built = _architecture_summary(checkpoint_widths, arrays), _architecture_summary(model_widths, variables)
    return (f"{origin!r} does not fit model {model.name!r} ({len(problems)} problem(s); no weight was "
            f"changed): build the model from the file, `VisionTransformer(weights={origin!r})` (its architecture "
            f"and options are read from the file), or with the checkpoint's variant.\n  checkpoint: {checkpoint}; "
            f"model: {built}.\n  - " + "\n  - ".join(shown) + more)


def _warn_if_zero_head(model: keras.Model, assignments) -> None:
    for variable, value in assignments:
        if variable.path == "head/kernel" and not np.any(value):
            warnings.warn(f"keras_vit: the loaded head of model {model.name!r} is all zeros (an ImageNet-21k "
                          "pre-training checkpoint with its head zeroed): every logit equals the bias, whatever "
                          "the image. Build with include_top=False and add your head to fine-tune.", stacklevel=3)
