"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3 on TensorFlow."""

from setuptools import find_packages, setup

EXTRAS = {
    # Training: input pipelines (TFDS; importlib-resources is an undeclared need of tfds 4.9.10),
    # absl flags, and the embedded digits dataset shipped inside scikit-learn.
    "training": ["tensorflow-datasets==4.9.10", "tensorboard==2.21.0", "importlib-resources>=6", "absl-py>=2.1",
                 "scikit-learn>=1.5"],
    # Export: the LiteRT interpreter (tf.lite.Interpreter is deprecated) and TF Serving's protos.
    "export": ["ai-edge-litert>=2.0", "tensorflow-serving-api==2.21.0", "absl-py>=2.1"],
    # Inspection plots.
    "inspect": ["matplotlib>=3.8"],
    "test": ["pytest>=8", "scipy>=1.11", "safetensors>=0.4"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

setup(
    name="keras_vit",
    version="0.1.0",
    description="Vision Transformer (ViT) models, layers and pretrained weights for Keras 3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["keras_vit", "keras_vit.*"]),
    package_data={"keras_vit": ["data/*"]},
    python_requires=">=3.10",
    install_requires=["keras==3.15.1", "tensorflow==2.21.0", "numpy>=1.26", "pillow>=10"],
    extras_require=EXTRAS,
    license="Apache-2.0",
)
