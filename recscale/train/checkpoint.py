"""Checkpoints with orbax (the only module that imports it).

A checkpoint of step ``s`` holds three items: ``params`` and ``opt_state`` (pytrees of arrays,
restored onto whatever shardings the caller asks for, so a run can resume on another mesh) and
``meta`` (JSON: the step). Evaluation restores ``params`` alone.
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
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


class Checkpointer:
    """Saves and restores a run's checkpoints under ``<workdir>/checkpoints``."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=True,
            ),
            item_names=("params", "opt_state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, params: Any, opt_state: Any, meta: dict, *, force: bool = True) -> None:
        """Starts saving ``step`` (asynchronously if configured); arrays are copied before return."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=force,
        )

    def restore(self, step: int, params_like: Any, opt_state_like: Any) -> tuple[Any, Any, dict]:
        """Restores ``step`` onto the shapes, dtypes and shardings of the ``*_like`` trees."""
        self._check_step(step)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_like)),
                opt_state=ocp.args.StandardRestore(_abstract(opt_state_like)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["params"], out["opt_state"], dict(out["meta"])

    def restore_params(self, step: int, params_like: Any) -> tuple[Any, dict]:
        """Restores only the parameters (and meta) of ``step``."""
        self._check_step(step)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_abstract(params_like)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["params"], dict(out["meta"])

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
