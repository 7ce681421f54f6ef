"""What a family's run trains and evaluates: its data, its loss and its evaluation metrics.

The trainer (``experiment``, ``loop``, ``evaluation``) is the same for every family; a
:class:`Task` is what differs between a CTR model (batches of examples, a binary cross-entropy,
AUC and log loss) and a sequential recommender (packs of whole histories, a next-item loss,
ranking metrics). :func:`of` gives a run config's task: the one its config builds (a config
class with a ``task()`` method, e.g. ``sequential``'s) or :data:`CTR`, the CTR families'.

A task's host batches are pytrees whose every leaf has the global batch on its leading axis
(the trainer shards that axis over ``batch``; ``Experiment.device_batch``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from data.builders import make_source
from data.sources import DataSource
from recscale.metrics import EvalAccumulator
from recscale.train.steps import bce_loss, make_eval_step


class Accumulator(Protocol):
    """Mergeable evaluation metrics over the batches of an evaluation."""

    def update(self, out: Any, batch: Any) -> None:
        """Adds an eval step's output ``out`` on device batch ``batch``."""
        ...

    def result(self) -> dict:
        """The metrics of every batch added."""
        ...


class Task(Protocol):
    """The hooks a family's run plugs into the trainer (module docstring)."""

    def check(self, cfg: Any) -> None:
        """Raises ``ConfigError`` for settings of ``cfg`` this task cannot train with."""
        ...

    def make_source(
        self,
        cfg: Any,
        *,
        process_index: int,
        process_count: int,
        eval_path: str | None,
        rejects_dir: str | None,
        eval_only: bool,
    ) -> DataSource:
        """The run's data (``schema``, ``train_batch(step)``, ``eval_batches()``, ``reads``)."""
        ...

    def step_args(self, source: DataSource) -> dict[str, np.ndarray]:
        """Arrays the jitted train step takes as arguments beside the schedule's (the loss
        reads them from its ``args``), computed once on the host from the data."""
        ...

    def loss(self, model: nnx.Module, batch: Any, key: Any, args: dict) -> tuple[Any, dict]:
        """``(batch-mean loss, metrics)`` of a training call (``steps.LossFn`` with the step's
        arguments)."""
        ...

    def eval_step(self, graphdef: nnx.GraphDef) -> Any:
        """``eval_step(params, batch_stats, batch) -> out``, before jitting."""
        ...

    def accumulator(self, source: DataSource) -> Accumulator:
        """An empty accumulator of eval step outputs."""
        ...

    def rates(self, row: dict, steps: int, seconds: float) -> dict:
        """Columns added to a train row (the mean metrics of its ``steps`` steps, which took
        ``seconds``)."""
        ...

    def eval_data(self, cfg: Any, data_path: str | None) -> str:
        """What the ``evaluate`` command's result names as its data."""
        ...

    def check_eval(self, args: Any) -> None:
        """Raises ``ConfigError`` for ``evaluate`` options (``EvalArgs``) it does not support."""
        ...


class _CTRAccumulator:
    def __init__(self):
        self.acc = EvalAccumulator()

    def update(self, out: Any, batch: Any) -> None:
        logits, labels, weights = (
            np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in (out, batch.labels_b, batch.weights_b)
        )
        self.acc.update(logits, labels, weights)

    def result(self) -> dict:
        return self.acc.result()


class CTRTask:
    """The CTR families' task: ``data.DataConfig``'s sources, :func:`steps.bce_loss` of the
    model's logits, and AUC / log loss / NE / calibration (``recscale.metrics``)."""

    def check(self, cfg: Any) -> None:
        del cfg

    def make_source(self, cfg: Any, **kw: Any) -> DataSource:
        return make_source(cfg.data, **kw)

    def step_args(self, source: DataSource) -> dict[str, np.ndarray]:
        del source
        return {}

    def loss(self, model: nnx.Module, batch: Any, key: Any, args: dict) -> tuple[Any, dict]:
        del args
        return bce_loss(model, batch, key)

    def eval_step(self, graphdef: nnx.GraphDef) -> Any:
        return make_eval_step(graphdef)

    def accumulator(self, source: DataSource) -> Accumulator:
        del source
        return _CTRAccumulator()

    def rates(self, row: dict, steps: int, seconds: float) -> dict:
        del row, steps, seconds
        return {}

    def eval_data(self, cfg: Any, data_path: str | None) -> str:
        return data_path or cfg.data.eval_path or f"synthetic:{cfg.data.kind}"

    def check_eval(self, args: Any) -> None:
        del args


CTR = CTRTask()
"""The task of every config without its own (DLRM, Wukong, the baselines)."""


def of(cfg: Any) -> Task:
    """The task of run config ``cfg``: ``cfg.task()`` where its class defines one, else
    :data:`CTR`."""
    make = getattr(cfg, "task", None)
    return CTR if make is None else make()
