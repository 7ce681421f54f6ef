"""How a sweep's trials share work (``sweeps.spec.resolve``): the budgets of one model size as a
stable run and its cooldown branches (``SweepSpec.branches``), the seeds of one point as a
population (``SweepSpec.populations``). Either way every trial keeps the id, config and results
row of the separate run it stands for."""

from __future__ import annotations

import dataclasses
from typing import Any

from recscale import config as config_lib
from recscale.train import branches
from sweeps.identity import trial_id
from sweeps.trial import Trial


def as_branches(
    trials: list[Trial], cfgs: dict[str, Any], code_version: str, fingerprints: dict[str, str]
) -> list[Trial]:
    """``trials`` as stable runs and cooldown branches (``SweepSpec.branches``), in the same
    order: per (family, rung, seed, batch, recipe), every budget warms up as its shortest does,
    the longest is the stable run and the others branch off it."""
    groups: dict[tuple, list[Trial]] = {}
    for t in trials:
        key = (t.family, t.rung, t.seed, t.batch_size, t.lr_rule, t.lr_multiplier)
        groups.setdefault(key, []).append(t)
    out: dict[str, Trial] = {}
    for members in groups.values():
        warmup = min(cfgs[t.trial_id].dense_optim.warmup_steps for t in members)
        one_piece = {}
        for t in members:
            cfg = cfgs[t.trial_id]
            for name in ("dense_optim", "embedding_optim"):
                o = getattr(cfg, name)
                if o.decay not in ("wsd", "constant"):
                    raise ValueError(
                        f"family {t.family}: branches need {name}.decay 'wsd' (or 'constant'), "
                        f"got {o.decay!r}: a {o.decay} schedule's rates depend on the run's "
                        "length from its warmup's end, so no run can share another's steps"
                    )
                cfg = dataclasses.replace(
                    cfg, **{name: dataclasses.replace(o, warmup_steps=warmup)}
                )
            one_piece[t.trial_id] = cfg
        by_steps = sorted(members, key=lambda t: t.steps)
        stable = branches.stable_config(
            one_piece[by_steps[-1].trial_id], [t.steps for t in by_steps]
        )
        stable_id = None
        for t in reversed(by_steps):
            cfg = one_piece[t.trial_id]
            cdict = config_lib.to_dict(cfg)
            tid = trial_id(t.family, cdict, code_version, fingerprints[t.family], type(cfg))
            if stable_id is None:  # the longest: the stable run (its checkpoints kept for all)
                stable_id = tid
                out[t.trial_id] = dataclasses.replace(
                    t, trial_id=tid, config=config_lib.to_dict(stable)
                )
                continue
            step = branches.branch_step(cfg)  # 0: a cooldown as long as the run, from scratch
            out[t.trial_id] = dataclasses.replace(
                t,
                trial_id=tid,
                config=cdict,
                branch_of=stable_id if step else "",
                branch_step=step,
            )
    return [out[t.trial_id] for t in trials]


def as_populations(trials: list[Trial]) -> list[Trial]:
    """``trials`` with each group of runs of one point that differ only in their seed and
    learning-rate multiplier (same family, rung, budget, batch and recipe; for a branch, the
    same branch step) as a population (``Trial.population``); a lone run stays a run of its
    own. A multiplier scales both peak rates, which members may differ in
    (``recscale.train.population.MEMBER_FREE``)."""
    groups: dict[tuple, list[Trial]] = {}
    for t in trials:
        key = (t.family, t.rung, t.budget, t.batch_size, t.lr_rule)
        groups.setdefault((*key, bool(t.branch_of), t.branch_step), []).append(t)
    members = {}
    for group in groups.values():
        if len(group) > 1:
            ids = tuple(sorted(t.trial_id for t in group))
            members.update(dict.fromkeys(ids, ids))
    return [dataclasses.replace(t, population=members.get(t.trial_id, ())) for t in trials]
