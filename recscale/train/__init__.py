"""Training: TrainState, pure steps, the loop, checkpoints."""
