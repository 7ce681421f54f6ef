"""Cooldown branches of a warmup-stable-decay run: one run of a model size serves every budget.

A ``wsd`` run (``recscale.optim.schedules``) of ``B`` steps holds its peak learning rate up to its
decay start ``D(B) = B - cooldown_steps(B, cooldown_fraction)`` and decays over the rest. Before
``D(B)`` its learning rates are those of every longer ``wsd`` run of the same config, so the run
of budget ``B`` is, bitwise, the first ``D(B)`` steps of a longer run followed by ``B``'s own
cooldown. That lets one run of a size serve all of its budgets:

- the *stable run* is the largest budget's own run; it also checkpoints, and keeps, the decay
  starts of the smaller budgets (``train.branch_steps``; :func:`stable_config`);
- the *branch* of a budget ``B`` is a run in its own folder whose config is ``B``'s own with
  ``train.init_from`` the stable run and ``train.init_step = D(B)`` (:func:`branch_config`). It
  restores the stable run's whole training state at ``D(B)`` (parameters, optimizer state, step
  counter, random stream, data position) and trains ``B``'s cooldown, steps ``D(B)`` to ``B``.
  Its metrics and result are its own, as a separate run's are; a killed branch resumes from its
  own checkpoints like any run; ``branch.json`` records its compute: ``D(B)`` stable steps
  (shared with the stable run) and ``B - D(B)`` cooldown steps of its own.

The cost of a size's budgets is then its largest run plus the smaller budgets' cooldowns.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from data import roles
from recscale import config as config_lib

BRANCH_FILE = "branch.json"
"""A branch's record of where it starts and what it costs (:func:`write_record`)."""

_BRANCH_FREE = frozenset(
    {"train.num_steps", "train.init_from", "train.init_step", "train.branch_steps"}
)
"""Fields in which a branch's config may differ from its stable run's, besides those free on
resume."""


def branch_step(cfg: Any) -> int:
    """The step a branch of ``cfg``'s budget (``train.num_steps``) starts at: its first
    optimizer's decay start (``recscale.config.decay_start``)."""
    n = cfg.train.num_steps
    return min(config_lib.decay_start(o, n) for o in (cfg.dense_optim, cfg.embedding_optim))


def _with_train(cfg: Any, **changes: Any) -> Any:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **changes))


def stable_config(cfg: Any, budgets: Iterable[int]) -> Any:
    """The stable run of ``cfg``'s size for ``budgets`` (step counts): ``cfg`` at the largest
    budget, keeping a checkpoint at each smaller budget's branch point."""
    budgets = sorted(set(budgets))
    points = {branch_step(_with_train(cfg, num_steps=b)) for b in budgets[:-1]}
    return _with_train(cfg, num_steps=budgets[-1], branch_steps=tuple(sorted(points - {0})))


def branch_config(cfg: Any, budget: int, stable_workdir: str | Path) -> Any:
    """The branch of ``budget`` steps off the stable run in ``stable_workdir`` (built from ``cfg``
    by :func:`stable_config`). A budget whose branch point is step 0 (a cooldown as long as the
    run) has nothing to share: it is ``cfg`` at that budget, trained from scratch."""
    cfg = _with_train(cfg, num_steps=budget, branch_steps=())
    step = branch_step(cfg)
    if step == 0:
        return cfg
    return _with_train(cfg, init_from=str(Path(stable_workdir).absolute()), init_step=step)


def check_branch(cfg: Any, stable: Any) -> None:
    """Raises ``ConfigError`` unless ``cfg`` (a run with ``train.init_step``) continues the run
    of config ``stable`` as that run's own config at ``cfg``'s length would: the configs differ
    only in the run's length and fields free on resume, and every learning rate before the
    branch point is the same in both (``wsd`` or ``constant`` decay, the point at or before both
    runs' decay starts; a cosine or linear decay starts at the warmup's end)."""
    step, where = cfg.train.init_step, f"train.init_from={cfg.train.init_from}"
    free = roles.paths(type(cfg), resume_free=True) | _BRANCH_FREE
    diffs = roles.config_diffs(config_lib.to_dict(stable), config_lib.to_dict(cfg), free)
    if diffs:
        raise config_lib.ConfigError(
            f"{where}: a branch must have its stable run's config but for train.num_steps "
            f"({'; '.join(diffs)})"
        )
    for name in ("dense_optim", "embedding_optim"):
        o = getattr(cfg, name)
        starts = [config_lib.decay_start(o, c.train.num_steps) for c in (stable, cfg)]
        if step > min(starts):
            raise config_lib.ConfigError(
                f"train.init_step={step}: {name}.decay={o.decay} has its learning rate depend on "
                f"the run's length from step {min(starts)} (stable run {starts[0]}, this run "
                f"{starts[1]}); a branch starts at or before both runs' decay starts"
            )


def write_record(workdir: Path, cfg: Any) -> None:
    """``branch.json``: the stable run and step a branch starts from, and its compute in steps:
    ``shared_steps`` (trained by the stable run) and ``own_steps`` (trained here); their sum is
    the budget, ``train.num_steps``, of which ``cooldown_steps`` decay (process 0 writes it)."""
    t = cfg.train
    record = {
        "init_from": t.init_from,
        "init_step": t.init_step,
        "num_steps": t.num_steps,
        "shared_steps": t.init_step,
        "own_steps": t.num_steps - t.init_step,
        "cooldown_steps": t.num_steps - branch_step(cfg),
    }
    (Path(workdir) / BRANCH_FILE).write_text(json.dumps(record, indent=2) + "\n")
