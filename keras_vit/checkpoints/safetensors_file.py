"""Reading `.safetensors` files with NumPy alone (no torch), and refusing PyTorch pickle files.

A `.safetensors` file is an 8-byte little-endian header length, a JSON header of tensor dtypes, shapes
and data offsets, then the tensor data. PyTorch pickle files (`.bin`, `.pth`, ...) are never unpickled
(unpickling can run arbitrary code): `PICKLE_HINT` converts one to `.safetensors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl")
PICKLE_HINT = ("python -c \"import sys, torch; from safetensors.torch import save_file; "
               "save_file({k: v.contiguous() for k, v in torch.load(sys.argv[1], weights_only=True).items()}, "
               "sys.argv[2])\" model.bin model.safetensors")

_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a `.safetensors` header; `begin`/`end` are absolute file offsets."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _corrupt(path: str, reason: str) -> ValueError:
    return ValueError(f"Could not read {path!r} as a .safetensors file: {reason}. Expected an 8-byte little-endian "
                      "header length, a JSON header of tensor dtypes, shapes and data offsets, then the tensor "
                      "data. The file is truncated, corrupt or of another format.")


def refuse_pickle(path: str) -> None:
    """Raises for a PyTorch pickle file: unpickling can run arbitrary code, so it is never read."""
    if path.endswith(PICKLE_SUFFIXES):
        raise ValueError(f"{path!r} is a PyTorch pickle file; keras_vit does not unpickle files (unpickling can "
                         "run arbitrary code). Convert it to .safetensors where you trust it, e.g.:\n  "
                         + PICKLE_HINT)


def read_header(path: str) -> dict[str, TensorInfo]:
    """Reads and checks a `.safetensors` header against the file's size; reads no tensor data.

    Raises:
        ValueError: truncated or corrupt file, or a dtype other than F64, F32, F16, BF16.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"it has {size} bytes, fewer than the 8-byte header length")
        length = int.from_bytes(prefix, "little")
        if length > size - 8:
            raise _corrupt(path, f"its header length is {length} bytes, but only {size - 8} bytes follow")
        raw = file.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(path, f"its header is not JSON ({error})") from error
    if not isinstance(header, dict):
        raise _corrupt(path, f"its header is a JSON {type(header).__name__}, not an object")
    data_start, data_size = 8 + length, size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as error:
            raise _corrupt(path, f"the header entry of tensor {name!r} is malformed: {entry!r}") from error
        if dtype not in _DTYPES:
            raise ValueError(f"Tensor {name!r} of {path!r} has dtype {dtype}; expected one of {sorted(_DTYPES)} "
                             "(floating-point weights).")
        expected = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise _corrupt(path, f"tensor {name!r} {dtype}{list(shape)} needs {expected} bytes, but its data "
                                 f"offsets are [{begin}, {end}]")
        if end > data_size:
            raise _corrupt(path, f"tensor {name!r} ends at byte {end} of the data, but the file holds only "
                                 f"{data_size} bytes of data (truncated?)")
        tensors[name] = TensorInfo(dtype, shape, data_start + begin, data_start + end)
    return tensors


def read_safetensors(path: str, header: dict[str, TensorInfo] | None = None) -> dict[str, np.ndarray]:
    """Reads every tensor of a `.safetensors` file as float32 NumPy arrays (no torch needed); `header`, if given,
    is the file's `read_header` (not read again)."""
    header = read_header(path) if header is None else header
    arrays = {}
    with open(path, "rb") as file:
        for name, info in header.items():
            file.seek(info.begin)
            data = np.frombuffer(file.read(info.end - info.begin), _DTYPES[info.dtype])
            if info.dtype == "BF16":
                data = (data.astype(np.uint32) << 16).view(np.float32)
            arrays[name] = data.astype(np.float32).reshape(info.shape)
    return arrays
