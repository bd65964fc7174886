"""tfpar: parallelise TensorFlow training graphs by rewriting them."""
from setuptools import find_packages, setup

# TensorFlow 2.15 (tf.estimator, Keras 2 as tf.keras) or 2.16-2.21 (Keras 3 as tf.keras,
# Keras 2 as tf_keras), either its CPU or its GPU build, from an extra: "cpu" / "gpu"
# install 2.15.1 as the Makefile's default environment does, "tf221-cpu" / "tf221-gpu"
# 2.21 (`make test TF=2.21`). tfpar checks the version when it starts.
_TF215 = ["tensorflow-estimator==2.15.0", "numpy<2"]
_TF221 = ["tf-keras==2.21.*"]

setup(
    name="tfpar",
    version="0.1.0",
    description="Data, tensor and pipeline parallelism for TensorFlow graphs by graph rewriting",
    packages=find_packages(include=["tfpar", "tfpar.*"]),
    # TensorFlow 2.15 runs on Python 3.9-3.11, 2.21 on 3.10-3.13; ortools 9.9 (pinned:
    # 9.15 crashes beside TensorFlow 2.21) has wheels up to 3.12.
    python_requires=">=3.9,<3.13",
    install_requires=[
        "numpy",
        "ortools==9.9.*",
        "networkx",
    ],
    extras_require={"cpu": ["tensorflow-cpu==2.15.1", *_TF215],
                    "gpu": ["tensorflow==2.15.1", *_TF215],
                    "tf221-cpu": ["tensorflow-cpu==2.21.*", *_TF221],
                    "tf221-gpu": ["tensorflow==2.21.*", *_TF221],
                    "test": ["pytest", "pytest-timeout", "pytest-xdist"]},
    entry_points={"console_scripts": ["tfpar=tfpar.cli:main"]},
)
