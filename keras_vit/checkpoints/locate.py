"""Where a `weights=` value points: a weights file as it is; a directory (the `save_pretrained` layout of
transformers and timm: the weights, `config.json`, `preprocessor_config.json`) to the weights file in it; a
Hugging Face hub name, `hf://org/name[@revision]`, to that directory in the local hub cache.

The hub cache is read where `huggingface_hub` writes it (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`; its `models--org--name/refs/<revision>` names the snapshot folder): keras_vit
never downloads, so a cached model loads offline, and a missing one is an error naming the command that
fetches it.
"""

from __future__ import annotations

import os
import re

HUB_PREFIX = "hf://"
# The weights file of a save_pretrained directory, by preference; any single `.safetensors` or `.npz` otherwise.
WEIGHTS_FILES = ("model.safetensors", "open_clip_model.safetensors")
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_name(weights) -> bool:
    return isinstance(weights, str) and weights.startswith(HUB_PREFIX)


def locate(weights: str) -> str:
    """The weights file a `weights=` path, directory or `hf://` name points to (a file path as it is).

    Raises:
        FileNotFoundError: a hub name not in the local cache (naming the download command), or a directory
            without a weights file.
        ValueError: a malformed hub name, a directory with several candidate files, or a sharded checkpoint.
    """
    if is_hub_name(weights):
        return weights_in(hub_snapshot(weights))
    if os.path.isdir(weights):
        return weights_in(weights)
    return weights


def weights_in(directory: str) -> str:
    """The weights file of a `save_pretrained` directory."""
    names = sorted(os.listdir(directory))
    for name in WEIGHTS_FILES:
        if name in names:
            return os.path.join(directory, name)
    if any(name.endswith(".safetensors.index.json") for name in names):
        raise ValueError(f"{directory!r} holds a sharded checkpoint ({', '.join(n for n in names if 'index' in n)}): "
                         "keras_vit reads one weights file. Merge the shards into one .safetensors file (e.g. "
                         "`save_pretrained(..., max_shard_size='100GB')`).")
    candidates = [name for name in names if name.endswith((".safetensors", ".npz"))]
    if len(candidates) == 1:
        return os.path.join(directory, candidates[0])
    if not candidates:
        raise FileNotFoundError(f"{directory!r} holds no weights file: expected {' or '.join(WEIGHTS_FILES)} (a "
                                f"save_pretrained directory), or one .safetensors or .npz file. Found: {names}")
    raise ValueError(f"{directory!r} holds several weights files {candidates}: pass the one to load as weights=.")


def hub_cache() -> str:
    """The Hugging Face hub cache folder, as `huggingface_hub` resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def hub_snapshot(name: str) -> str:
    """The snapshot folder of `hf://org/name[@revision]` in the local hub cache."""
    repo, _, revision = name[len(HUB_PREFIX):].partition("@")
    if not _REPO.fullmatch(repo):
        raise ValueError(f"weights={name!r}: expected a Hugging Face hub name hf://org/name or "
                         "hf://org/name@revision (e.g. hf://timm/vit_base_patch16_224.augreg_in21k).")
    revision = revision or "main"
    cache = hub_cache()
    folder = os.path.join(cache, "models--" + repo.replace("/", "--"))
    ref = os.path.join(folder, "refs", revision)
    commit = revision
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as file:
            commit = file.read().strip()
    snapshot = os.path.join(folder, "snapshots", commit)
    if not os.path.isdir(snapshot):
        option = "" if revision == "main" else f" --revision {revision}"
        raise FileNotFoundError(f"weights={name!r} is not in the local Hugging Face cache {cache!r} (keras_vit reads "
                                f"the cache and downloads nothing): fetch it with `huggingface-cli download "
                                f"{repo}{option}`, or set HF_HUB_CACHE to the cache that holds it.")
    return snapshot
