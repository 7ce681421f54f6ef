"""One concrete run of a sweep (``sweeps.spec.resolve`` makes them; ``sweeps.runner`` runs
them): its id, config, size and budget, and how it shares work with other trials (a cooldown
branch of a stable run, a member of a population)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trial:
    """One concrete run of a sweep."""

    trial_id: str
    family: str
    package: str
    rung: str
    rung_index: int
    budget: float
    """The budget this trial was resolved for."""
    seed: int
    config: dict[str, Any]
    """The full resolved config (``recscale.config.to_dict`` form)."""
    flops_per_example: float
    examples: int
    steps: int
    batch_size: int
    params_dense: int
    params_sparse: int
    lr_rule: str = ""
    """A batch-size sweep's learning-rate recipe (``LR_RULES``); empty: ``batch_rule``."""
    lr_multiplier: float = 1.0
    also: tuple[tuple[str, float], ...] = ()
    """Other ``(lr_rule, lr_multiplier)`` pairs that resolve to this same run (at the base
    batch ``none``, ``sqrt`` and ``linear`` coincide): one trial serves them all."""
    branch_of: str = ""
    """A cooldown branch (``SweepSpec.branches``): the trial id of the stable run it starts
    from, at step ``branch_step``; empty for a run from scratch (a stable run keeps its
    branches' points in ``config["train"]["branch_steps"]``)."""
    branch_step: int = 0
    population: tuple[str, ...] = ()
    """With ``SweepSpec.populations``: the trial ids of the population this trial trains in
    (itself included; sorted), whose members run as one program; empty: a run of its own."""

    @property
    def compute(self) -> float:
        """The trial's actual training FLOPs (steps x batch x FLOPs per example): the point's
        compute, whether a branch shares part of it with its stable run or not."""
        return self.flops_per_example * self.examples

    @property
    def own_compute(self) -> float:
        """The training FLOPs this trial itself runs: a branch's cooldown steps only."""
        return self.flops_per_example * self.batch_size * (self.steps - self.branch_step)

    def run_config(self, stable_workdir: str | Path) -> dict[str, Any]:
        """The config this trial trains with: its own, and for a branch the stable run (in
        ``stable_workdir``) and step it starts from."""
        if not self.branch_of:
            return self.config
        train = {
            **self.config["train"],
            "init_from": str(Path(stable_workdir).absolute()),
            "init_step": self.branch_step,
        }
        return {**self.config, "train": train}

    def train_command(self, config_path: str | Path, workdir: str | Path) -> list[str]:
        """The normal train command of the family, on this trial's config file."""
        return ["-m", f"{self.package}.train", str(config_path), "--workdir", str(workdir)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trial:
        return cls(**d)
