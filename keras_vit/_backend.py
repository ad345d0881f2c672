"""The check of the backend-bound packages (`keras_vit.training`, `keras_vit.export`) at import."""

import keras

_NAMES = {"tensorflow": "TensorFlow", "jax": "JAX", "torch": "PyTorch"}


def require_backend(package: str, backends: tuple[str, ...], why: str) -> None:
    """Raises ImportError, saying what to do, unless Keras runs on one of `backends`.

    Args:
        package: str. The package being imported, named in the message.
        backends: tuple of Keras backend names, e.g. `("tensorflow", "jax")`.
        why: str. What ties the package to those backends, e.g. "tf.data, SavedModel".
    """
    if keras.backend.backend() in backends:
        return
    names = " or ".join(_NAMES[backend] for backend in backends)
    settings = " or ".join(f"KERAS_BACKEND={backend}" for backend in backends)
    raise ImportError(f"{package} runs on {names} ({why}), but Keras runs on {keras.backend.backend()!r}. Set "
                      f"{settings} before Keras is imported.")


def require_tensorflow_backend(package: str) -> None:
    """Raises ImportError, saying what to do, unless Keras runs on TensorFlow."""
    require_backend(package, ("tensorflow",), "tf.distribute, tf.data, SavedModel, TFLite")
