"""Inference (issue 20): tables in serving precisions (``precision``), the exported artifact
(``export``) and its jax-only loader (``runtime``)."""
