"""Benchmarks of keras_vit against keras-hub and timm: `python -m benchmarks.run --help`."""
