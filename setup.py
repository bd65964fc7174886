"""tfpar: parallelise TensorFlow training graphs by rewriting them."""
from setuptools import find_packages, setup

setup(
    name="tfpar",
    version="0.1.0",
    description="Data, tensor and pipeline parallelism for TensorFlow graphs by graph rewriting",
    packages=find_packages(include=["tfpar", "tfpar.*"]),
    python_requires=">=3.9,<3.12",
    install_requires=[
        # Either the CPU or the GPU build of TF 2.15 (the last with tf.estimator and Keras 2);
        # the Makefile installs tensorflow-cpu==2.15.1.
        "tensorflow-estimator==2.15.0",
        "numpy<2",
        "ortools",
        "networkx",
    ],
    extras_require={"cpu": ["tensorflow-cpu==2.15.1"], "gpu": ["tensorflow==2.15.1"],
                    "test": ["pytest", "pytest-timeout", "pytest-xdist"]},
    entry_points={"console_scripts": ["tfpar=tfpar.cli:main"]},
)
