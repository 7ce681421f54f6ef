"""Wukong's optimized factorization machine ``X (Xᵀ Y)`` (the FMB's core): reference, Pallas
GPU/TPU kernels with Pallas backward passes, and the dispatching api."""

from recscale.kernels.fm_interaction.api import fm_interaction

__all__ = ["fm_interaction"]
