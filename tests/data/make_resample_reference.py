"""Writes tests/data/resample_reference.npz: PyTorch's bicubic position-embedding resizes, the reference of
tests/test_resample.py. Needs torch (not in the README's environment):

    python3 -m venv /tmp/torchref && /tmp/torchref/bin/pip install torch numpy
    /tmp/torchref/bin/python tests/data/make_resample_reference.py

Each case is a random float32 grid (rows, columns, 6), fixed seed, resized as timm and transformers call
`F.interpolate`: the table reshaped to (1, rows, columns, D) and permuted to NCHW (a channels-last view),
`mode="bicubic", align_corners=False`, `antialias` False (transformers) and True (timm). The same grid in
float64 is resized too: the exact arithmetic, apart from torch's float32 rounding of its weights.
"""

import os

import numpy as np
import torch
import torch.nn.functional as F

CASES = {"dinov2_518_to_224": ((37, 37), (16, 16)), "deit_224_to_384": ((14, 14), (24, 24)),
         "non_square": ((7, 7), (5, 9))}
DEPTH = 6  # 8 would take the file past 200 KB


def interpolate(grid: np.ndarray, size: tuple[int, int], antialias: bool) -> np.ndarray:
    """`grid` (rows, columns, D) resized as timm's `resample_abs_pos_embed` / transformers' code calls torch."""
    table = torch.from_numpy(grid).reshape(1, *grid.shape).permute(0, 3, 1, 2)
    out = F.interpolate(table, size=size, mode="bicubic", align_corners=False, antialias=antialias)
    return out.permute(0, 2, 3, 1)[0].numpy()


def main() -> None:
    rng = np.random.default_rng(34)
    arrays = {"torch_version": np.array(torch.__version__)}
    for name, (old, new) in CASES.items():
        grid = rng.standard_normal((*old, DEPTH)).astype(np.float32)
        arrays[f"{name}/input"] = grid
        arrays[f"{name}/new_size"] = np.array(new)
        for antialias in (False, True):
            suffix = "antialias" if antialias else "plain"
            arrays[f"{name}/{suffix}"] = interpolate(grid, new, antialias)
            arrays[f"{name}/{suffix}_float64"] = interpolate(grid.astype(np.float64), new, antialias)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resample_reference.npz")
    np.savez_compressed(path, **arrays)
    print(f"wrote {path} ({os.path.getsize(path)} bytes, torch {torch.__version__})")


if __name__ == "__main__":
    main()
