"""DLRM dot interaction: the lower triangle of X·Xᵀ per example, forward and backward, as XLA
(``reference.py``), Pallas Triton (``pallas_gpu.py``) and Pallas Mosaic TPU (``pallas_tpu.py``)
kernels; models call :func:`dot_interaction` (``api.py``)."""

from recscale.kernels.dot_interaction.api import dot_interaction

__all__ = ["dot_interaction"]
