"""HSTU's pointwise attention over jagged sequences (Zhai et al., "Actions Speak Louder than
Words", ICML 2024), forward and backward: the plain-jnp reference (``reference.py``), Pallas
Triton (``pallas_gpu.py``) and Pallas Mosaic TPU (``pallas_tpu.py``) kernels over a shared
block-aligned layout (``layout.py``); models call :func:`hstu_attention` (``api.py``)."""

from recscale.kernels.hstu_attention.api import hstu_attention

__all__ = ["hstu_attention"]
