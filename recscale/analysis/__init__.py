"""Measurements of training itself, beside the loss: the gradient noise scale (the critical
batch size's predictor), and (to come) the curvature of the loss."""
