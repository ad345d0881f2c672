"""keras_vit: the Vision Transformer (arXiv:2010.11929) for Keras 3.

`install_requires` and the extras declare the supported version ranges; `constraints.txt` is the exact
set the tests ran with (`pip install -c constraints.txt -e ".[all]"`).

The repository's `training/` and `export/` folders are installed as `keras_vit.training` and
`keras_vit.export` (no generic top-level names in site-packages); the command lines are console scripts.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

# The one version string, also `keras_vit.__version__` (read as text: importing keras_vit needs Keras).
VERSION = re.search(r'__version__ = "([^"]+)"', Path(__file__).with_name("keras_vit").joinpath(
    "_version.py").read_text(encoding="utf-8")).group(1)
TENSORFLOW = "tensorflow>=2.19,<3"
EXTRAS = {
    # Training and export run on TensorFlow (tf.distribute, tf.data, SavedModel, TFLite), which their extras do
    # not declare: the distribution is `tensorflow`, `tensorflow-cpu` (JAX TPU images) or `tensorflow-tpu` (TPU
    # VMs), and declaring one would install it over another. The commands check `import tensorflow` and its
    # version instead (keras_vit.cli.require); this extra, and `all`, install it where there is none.
    "tensorflow": [TENSORFLOW],
    # Training: input pipelines (TFDS; importlib-resources is an undeclared need of tfds 4.9), absl flags,
    # the embedded digits dataset shipped inside scikit-learn, and TensorBoard, which the TensorBoard callback
    # of every run needs for tf.summary (TensorFlow stopped depending on it in 2.20).
    "training": ["tensorflow-datasets>=4.9.4,<5", "importlib-resources>=6", "absl-py>=2.1", "scikit-learn>=1.5",
                 "tensorboard>=2.19,<3"],
    # Export: the LiteRT interpreter (tf.lite.Interpreter is deprecated) and the embedded calibration images.
    # TF Serving's warmup requests are written without tensorflow-serving-api, which pins its own TensorFlow.
    "export": ["ai-edge-litert>=2.0,<3", "scikit-learn>=1.5"],
    # ONNX files (keras-vit-export --format onnx): Keras' own ONNX exporter, which on TensorFlow converts through
    # tf2onnx (ONNX's converter for TensorFlow graphs), and ONNX Runtime, the most used ONNX engine, which checks
    # each file against the Keras model before it is written. Separate from `export`: TFLite and SavedModel
    # users do not install them.
    "onnx": ["onnx>=1.16", "onnxruntime>=1.18", "tf2onnx>=1.16"],
    # OpenVINO IR files (keras-vit-export --format openvino): Keras' own OpenVINO exporter and OpenVINO's runtime,
    # Intel's inference engine for its CPUs, GPUs and NPUs, which checks each file against the Keras model; NNCF,
    # OpenVINO's own post-training quantization, for its int8 files (--precision int8).
    "openvino": ["openvino>=2025.1", "nncf>=2.16"],
    # Inspection plots and image files.
    "inspect": ["matplotlib>=3.8", "pillow>=10"],
    # Tests: SciPy and safetensors write the reference data; TF Serving's protos read the warmup requests;
    # JAX runs the model on a second Keras backend (PyTorch too, where it is installed); import-linter checks
    # the import contracts of `.importlinter` (its `protected` and `acyclic_siblings` contracts: 2.6+);
    # pytest-xdist runs the suite on both cores (`-n 3`: the serial run leaves one mostly idle).
    "test": ["pytest>=8", "scipy>=1.11", "safetensors>=0.4", "tensorflow-serving-api>=2.19,<3", "jax>=0.4.30",
             "import-linter>=2.6,<3", "pytest-xdist>=3.5,<4"],
}
EXTRAS["all"] = sorted({req for reqs in EXTRAS.values() for req in reqs})

COMMANDS = {
    "keras-vit-train": "keras_vit.cli.train:run",
    "keras-vit-export": "keras_vit.cli.export:main",
    "keras-vit-tflite": "keras_vit.cli.tflite:main",
    "keras-vit-inspect": "keras_vit.cli.inspect:main",
    "keras-vit-convert": "keras_vit.cli.convert:main",
    "keras-vit-fewshot": "keras_vit.cli.fewshot:main",
    "keras-vit-masked-digits": "keras_vit.cli.masked_digits:main",
}

setup(
    name="keras_vit",
    version=VERSION,
    description="Vision Transformer (ViT) models, layers and pretrained weights for Keras 3",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["keras_vit", "keras_vit.*"]) + ["keras_vit.training", "keras_vit.export"],
    package_dir={"keras_vit.training": "training", "keras_vit.export": "export"},
    package_data={"keras_vit": ["data/*"]},
    python_requires=">=3.10",
    # absl: keras-vit-train's flags (its --help works on this base install).
    install_requires=["keras>=3.10,<4", "numpy>=1.26", "absl-py>=2.1"],
    extras_require=EXTRAS,
    entry_points={"console_scripts": [f"{name}={target}" for name, target in COMMANDS.items()]},
    license="Apache-2.0",
)
