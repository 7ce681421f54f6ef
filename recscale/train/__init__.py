"""Training: TrainState, pure steps, the loop, checkpoints."""

DIVERGED_EXIT_CODE = 3
"""Exit status of a train command whose loss became non-finite (sweeps record DIVERGED, and do
not retry: the run is deterministic, a retry would diverge again). Here, not in ``cli``, so that
sweep workers read it without importing jax."""
