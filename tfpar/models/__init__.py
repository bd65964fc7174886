"""Training graphs of common architectures, built with TensorFlow's public TF1
API: what ``tfpar plan --model`` plans and what the benchmarks measure.

Each builder makes its graph in the default graph (token-id placeholders
``ids`` and ``labels``, an LM-style loss, ``AdamOptimizer(1e-4).minimize``)
and returns the train op. Importing this package does not import
TensorFlow; ``builder(name)`` does.
"""
import importlib

__all__ = ["MODELS", "builder"]

MODELS = {"bert": "bert_train_op", "gpt": "gpt_train_op", "llama": "llama_train_op"}


def builder(name: str):
    """The train-op builder of model ``name`` (a key of ``MODELS``)."""
    return getattr(importlib.import_module(f"tfpar.models.{name}"), MODELS[name])
