"""Wukong (Zhang et al., ICML 2024): stacked factorization machines with linear compression."""
