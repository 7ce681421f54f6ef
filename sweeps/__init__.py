"""Scaling-law sweeps: specs, a resumable launcher, a results store, fits and plots.

``sweeps.spec`` resolves a sweep into trials (no jax); ``sweeps.launch`` runs them (local
subprocesses, Ray or SLURM via submitit); ``sweeps.store`` holds claims, statuses and the
append-only results; ``sweeps.fit`` fits scaling laws; ``sweeps.analyze`` prints and plots.
"""
