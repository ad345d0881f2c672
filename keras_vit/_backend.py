"""The check of the TensorFlow-only packages (`keras_vit.training`, `keras_vit.export`) at import."""

import keras


def require_tensorflow_backend(package: str) -> None:
    """Raises ImportError, saying what to do, unless Keras runs on TensorFlow."""
    if keras.backend.backend() != "tensorflow":
        raise ImportError(f"{package} runs on TensorFlow (tf.distribute, tf.data, SavedModel, TFLite), but Keras "
                          f"runs on {keras.backend.backend()!r}. Set KERAS_BACKEND=tensorflow before Keras is "
                          "imported.")
