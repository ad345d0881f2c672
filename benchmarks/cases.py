"""Benchmark cases, model sizes and their FLOP counts."""

from __future__ import annotations

import dataclasses

ARCHS = {
    # name: (image, patch, hidden, layers, heads, mlp, classes)
    "B/16": dict(image=224, patch=16, hidden=768, layers=12, heads=12, mlp=3072, classes=1000),
    "Ti/16": dict(image=224, patch=16, hidden=192, layers=12, heads=3, mlp=768, classes=1000),
    "tiny": dict(image=32, patch=8, hidden=32, layers=2, heads=2, mlp=64, classes=10),
    # DINOv3 B/16's encoder (4 registers, layer scale, rotary positions): keras_vit only (`DINOV3_OPTIONS`).
    "DINOv3-B/16": dict(image=224, patch=16, hidden=768, layers=12, heads=12, mlp=3072, classes=1000, registers=4,
                        family="dinov3"),
    "DINOv3-tiny": dict(image=32, patch=8, hidden=32, layers=2, heads=2, mlp=64, classes=10, registers=4,
                        family="dinov3"),
}
# keras_vit's options for the DINOv3 rows of ARCHS (also benchmarks.dinov3's model): rotary positions of base 100,
# layer scale, no position table, LayerNorm eps 1e-5, the exact GELU.
DINOV3_OPTIONS = dict(position_embedding="none", rope="dinov3", rope_theta=100.0, layer_scale_init=1e-5,
                      layer_norm_epsilon=1e-5, gelu_approximate=False)
TIMM_NAMES = {"B/16": "vit_base_patch16_224", "Ti/16": "vit_tiny_patch16_224"}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str            # "inference", "train" or "startup"
    arch: str
    batch: int
    dtype: str           # "float32" or "bfloat16"
    warmup: int
    iters: int

    def to_dict(self):
        return dataclasses.asdict(self)


def forward_flops(arch: str) -> float:
    """Multiply-add FLOPs (2 per MAC) of one image's forward pass."""
    a = ARCHS[arch]
    patches = (a["image"] // a["patch"]) ** 2
    tokens = patches + 1 + a.get("registers", 0)
    d, m = a["hidden"], a["mlp"]
    per_layer = tokens * (4 * d * d + 2 * d * m) + 2 * tokens * tokens * d
    embed = patches * a["patch"] ** 2 * 3 * d
    return 2.0 * (a["layers"] * per_layer + embed + d * a["classes"])


def forward_matmuls(arch: str, batch: int) -> list[tuple[int, int, int, int, int]]:
    """Every matmul of a forward pass of `batch` images, as (count, batched, m, k, n): `count` ops, each
    `batched` independent (m, k) @ (k, n) products. Their FLOPs, 2 * count * batched * m * k * n summed, are
    `forward_flops(arch) * batch`."""
    a = ARCHS[arch]
    patches = (a["image"] // a["patch"]) ** 2
    tokens = patches + 1 + a.get("registers", 0)
    rows, d, m, heads = batch * tokens, a["hidden"], a["mlp"], a["heads"]
    return [(1, 1, batch * patches, a["patch"] ** 2 * 3, d),          # patch embedding
            (4 * a["layers"], 1, rows, d, d),                          # q, k, v and output projections
            (a["layers"], 1, rows, d, m), (a["layers"], 1, rows, m, d),  # MLP
            (a["layers"], batch * heads, tokens, d // heads, tokens),  # logits q k^T
            (a["layers"], batch * heads, tokens, tokens, d // heads),  # attention-weighted values
            (1, 1, batch, d, a["classes"])]                            # head


def case_flops(case: Case) -> float:
    """FLOPs of one step of a case (training ~ 3x forward: forward, input and weight gradients)."""
    return forward_flops(case.arch) * case.batch * (3 if case.kind == "train" else 1)


FULL_CASES = (
    Case("infer_fp32_bs1", "inference", "B/16", 1, "float32", 3, 20),
    Case("infer_fp32_bs16", "inference", "B/16", 16, "float32", 2, 6),
    Case("infer_bf16_bs1", "inference", "B/16", 1, "bfloat16", 3, 20),
    Case("infer_bf16_bs16", "inference", "B/16", 16, "bfloat16", 2, 6),
    Case("train_fp32_bs32", "train", "Ti/16", 32, "float32", 3, 10),
    Case("startup", "startup", "B/16", 1, "float32", 0, 1),
)

# On the CPU, run when named (`--cases`): training in bfloat16 (`mixed_bfloat16`; timm: autocast) and ViT-B/16
# training, the rows of a bfloat16 table beside `train_fp32_bs32`.
TRAINING_CASES = (
    Case("train_bf16_bs32", "train", "Ti/16", 32, "bfloat16", 3, 10),
    Case("train_b16_fp32_bs8", "train", "B/16", 8, "float32", 2, 5),
    Case("train_b16_bf16_bs8", "train", "B/16", 8, "bfloat16", 2, 5),
)

# Run when named too: DINOv3 B/16 inference, whose blocks take the rotary tables (keras_vit only; batch 8 is the
# largest under `keras_vit.kernels.XLA_BLOCK_MAX_ROWS`).
DINOV3_CASES = (
    Case("infer_dinov3_bs1", "inference", "DINOv3-B/16", 1, "float32", 3, 20),
    Case("infer_dinov3_bs8", "inference", "DINOv3-B/16", 8, "float32", 2, 8),
)
NAMED_CASES = (*TRAINING_CASES, *DINOV3_CASES)

# On a GPU (`--gpu`): larger batches, and ViT-B/16 training too.
GPU_CASES = (
    Case("infer_fp32_bs64", "inference", "B/16", 64, "float32", 3, 20),
    Case("infer_bf16_bs64", "inference", "B/16", 64, "bfloat16", 3, 20),
    Case("train_fp32_bs64", "train", "Ti/16", 64, "float32", 5, 20),
    Case("train_b16_fp32_bs64", "train", "B/16", 64, "float32", 5, 20),
    Case("train_b16_bf16_bs64", "train", "B/16", 64, "bfloat16", 5, 20),
)


def cases(quick: bool, gpu: bool = False, named: tuple[str, ...] = ()) -> list[Case]:
    """The full cases (GPU ones with `gpu`) and the CPU cases among `named` (`NAMED_CASES`), or with
    `quick` the same cases on the tiny model with at most 1 warm-up and 3 timed steps."""
    if gpu:
        return list(GPU_CASES)
    full = [*FULL_CASES, *(case for case in NAMED_CASES if case.name in named)]
    if not quick:
        return full
    return [dataclasses.replace(case, arch="DINOv3-tiny" if ARCHS[case.arch].get("family") else "tiny",
                                warmup=min(case.warmup, 1), iters=min(case.iters, 3))
            for case in full]


def case_names(gpu: bool = False) -> list[str]:
    """Every case `--cases` may name."""
    return [case.name for case in (GPU_CASES if gpu else (*FULL_CASES, *NAMED_CASES))]
