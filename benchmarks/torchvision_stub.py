"""A stand-in for torchvision, for timm's ViT on a CPU-only torch.

timm imports torchvision at import time (`FrozenBatchNorm2d`, transforms, datasets), but
its ViT forward and backward never call it. PyPI's torchvision wheels are CUDA builds:
with the CPU torch wheel their extension fails to load (`operator torchvision::nms does
not exist`; `_C.so` links `libtorch_cuda.so`), and no CPU torchvision is on PyPI. The
benchmark worker installs this stub only when a real torchvision cannot be imported,
and records that it did. Anything timm touches beyond import-time names raises.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(type):
    """Metaclass: any attribute of a placeholder class is another placeholder."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision stub: {cls.__name__} is not available (no CPU torchvision installed)")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        if spec.name == "torchvision":
            module.__version__ = "0.0+stub"
        if spec.name == "torchvision.ops.misc":
            module.FrozenBatchNorm2d = _frozen_batch_norm()
        return module

    def exec_module(self, module):
        pass


def _frozen_batch_norm():
    import torch

    class FrozenBatchNorm2d(torch.nn.Module):
        def __init__(self, num_features: int, eps: float = 1e-5):
            super().__init__()
            self.eps = eps
            self.register_buffer("weight", torch.ones(num_features))
            self.register_buffer("bias", torch.zeros(num_features))
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features))

        def forward(self, x):
            scale = self.weight * (self.running_var + self.eps).rsqrt()
            shift = self.bias - self.running_mean * scale
            return x * scale[None, :, None, None] + shift[None, :, None, None]

    return FrozenBatchNorm2d


def import_timm():
    """Imports timm; returns (timm, used_stub)."""
    try:
        import torchvision  # noqa: F401
        import timm
        return timm, False
    except Exception:  # a CUDA torchvision on CPU torch raises RuntimeError, a missing one ImportError
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith(("torchvision.", "timm"))]:
            del sys.modules[name]
        sys.meta_path.insert(0, _Finder())
        import timm
        return timm, True
