"""Checkpoints with orbax (the only module that imports it).

A checkpoint of step ``s`` holds the items ``params``, ``opt_state`` and, for models with
BatchNorm, ``batch_stats`` (pytrees of arrays, restored onto whatever shardings the caller asks
for, so a run can resume on another mesh) and ``meta`` (JSON: the step). Evaluation restores
the model's items (``params``, ``batch_stats``) alone. Empty trees are not written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for every array of ``tree``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


ARRAY_ITEMS = ("params", "opt_state", "batch_stats")
"""The pytree items a checkpoint may hold (besides ``meta``)."""


class Checkpointer:
    """Saves and restores a run's checkpoints under ``<workdir>/checkpoints``."""

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True
    ):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=True,
            ),
            item_names=(*ARRAY_ITEMS, "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, trees: dict[str, Any], meta: dict, *, force: bool = True) -> None:
        """Starts saving ``step`` (asynchronously if configured); arrays are copied before return.

        ``trees`` maps item names (``ARRAY_ITEMS``) to pytrees; empty ones are skipped.
        """
        unknown = set(trees) - set(ARRAY_ITEMS)
        if unknown:
            raise ValueError(f"unknown checkpoint items {sorted(unknown)}; known: {ARRAY_ITEMS}")
        items = {k: ocp.args.StandardSave(v) for k, v in trees.items() if jax.tree.leaves(v)}
        self._manager.save(
            step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)), force=force
        )

    def restore(self, step: int, likes: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """Restores the items named in ``likes`` onto the shapes, dtypes and shardings of the trees
        there (an empty tree comes back as it is, unread). Returns ``(trees, meta)``."""
        self._check_step(step)
        wanted = {k: v for k, v in likes.items() if jax.tree.leaves(v)}
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{k: ocp.args.StandardRestore(_abstract(v)) for k, v in wanted.items()},
                meta=ocp.args.JsonRestore(),
            ),
        )
        trees = {k: (out[k] if k in wanted else v) for k, v in likes.items()}
        return trees, dict(out["meta"])

    def _check_step(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}"
            )

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
