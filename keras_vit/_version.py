"""The one version string of keras_vit: `setup.py` reads it, `keras_vit.__version__` exports it."""

__version__ = "0.3.0"
