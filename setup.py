from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="tfmp",
    version="0.1.0",
    description="Model parallelism for Keras 3 on TensorFlow, backed by DTensor.",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfmp", "tfmp.*"]),
    python_requires=">=3.10",
    # The ranges tfmp is tested on (tfmp/integrations/ declares the same, and
    # CI runs a subset on the lowest Keras): TensorFlow 2.21 needs Keras >= 3.12.
    install_requires=["tensorflow>=2.21,<2.22", "keras>=3.12,<3.16", "numpy", "rich"],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-xdist",
            "pytest-timeout",
            "h5py",
            "tensorboard",
            "matplotlib",
            "nbformat",
            "nbclient",
            "ipykernel",
            "mkdocs>=1.6",
            "mkdocstrings[python]>=0.26",
            # The KerasHub release tfmp's attention patches were tested with
            # (tfmp/integrations/keras_hub.py).
            "keras-hub>=0.32,<0.33",
            "scikit-learn",
        ],
        "docs": ["mkdocs>=1.6", "mkdocstrings[python]>=0.26"],
        # TF Model Garden builds with tf_keras. tf-models-official itself is
        # installed without its dependencies (which pin another TensorFlow):
        # see docs/model-garden.md and .ci/run.
        "garden": [
            "tf-keras>=2.21,<2.22",
            "gin-config",
            "tensorflow-datasets",
            "etils",
            "tensorflow-hub",
            "seqeval",
            "sacrebleu",
            "portalocker",
            "tabulate",
            "lxml",
            "immutabledict",
            "pycocotools",
            "opencv-python-headless",
            "toml",
            "promise",
            "tensorflow-metadata",
        ],
        # tensorboard reads the log directories plot_memory is given.
        "plot": ["matplotlib", "tensorboard"],
    },
    entry_points={"console_scripts": ["tfmp=tfmp.cli:main"]},
)
