"""The one table of ViT variants (paper Table 1, plus Ti/S and B/8, and the hybrids).

Keys are the paper's names without the "ViT-" prefix; hybrids take patch size 1 on the
ResNet feature map, whose stride is 2 ** (1 + number of stages): (3, 4, 9) gives 16,
(2, 2, 2, 2) and (3, 4, 6, 3) give 32.
"""

from __future__ import annotations

from typing import Any

_TINY = dict(hidden_dim=192, mlp_dim=768, num_heads=3, num_layers=12)
_SMALL = dict(hidden_dim=384, mlp_dim=1536, num_heads=6, num_layers=12)
_BASE = dict(hidden_dim=768, mlp_dim=3072, num_heads=12, num_layers=12)
_LARGE = dict(hidden_dim=1024, mlp_dim=4096, num_heads=16, num_layers=24)
_HUGE = dict(hidden_dim=1280, mlp_dim=5120, num_heads=16, num_layers=32)

VARIANTS: dict[str, dict[str, Any]] = {
    "Ti/16": dict(_TINY, patch_size=16),
    "S/16": dict(_SMALL, patch_size=16),
    "S/32": dict(_SMALL, patch_size=32),
    "B/8": dict(_BASE, patch_size=8),
    "B/16": dict(_BASE, patch_size=16),
    "B/32": dict(_BASE, patch_size=32),
    "L/16": dict(_LARGE, patch_size=16),
    "L/32": dict(_LARGE, patch_size=32),
    "H/14": dict(_HUGE, patch_size=14),
    "R50+B/16": dict(_BASE, patch_size=1, resnet_stages=(3, 4, 9)),
    "R26+S/32": dict(_SMALL, patch_size=1, resnet_stages=(2, 2, 2, 2)),
    "R50+L/32": dict(_LARGE, patch_size=1, resnet_stages=(3, 4, 6, 3)),
}

def decode_variant(variant: str) -> dict[str, Any]:
    """Returns the architecture of a variant ("B/16", "ViT-B/16", "ViT-B_16", "R50+ViT-B/16", ...)."""
    key = variant.replace("ViT-", "").replace("_", "/")
    if key not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r}. Expected one of {sorted(VARIANTS)}.")
    return dict(VARIANTS[key])


def canonical_variant(variant: str) -> str:
    """"ViT-B_16" -> "B/16"; raises ValueError for unknown names."""
    decode_variant(variant)
    return variant.replace("ViT-", "").replace("_", "/")


def total_stride(config: dict[str, Any]) -> int:
    """Pixels per token along each axis: patch size times the ResNet stem's stride."""
    stages = config.get("resnet_stages")
    return config["patch_size"] * (2 ** (1 + len(stages)) if stages else 1)
