"""recscale: a JAX toolkit for training and scaling deep learning recommendation models."""

__version__ = "0.1.0"
