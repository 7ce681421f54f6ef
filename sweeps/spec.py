"""Sweep specs: families, compute budgets and model-size ladders, resolved into concrete trials.

No jax import: a spec is expanded (and ``--dry-run`` printed) on a login node in a second.

A **sweep** is a set of model families, a list of compute budgets ``C`` (training FLOPs) and,
per family, a **ladder** of model sizes (rungs, smallest first). Each (family, budget, rung,
seed) resolves to one concrete **trial**:

* FLOPs per example ``f`` = the rung's analytic training FLOPs (``ModelCost.train_flops``:
  forward + backward matmul FLOPs, 2 per multiply-add, see ``recscale/flops.py``); a run
  config that prices its own examples (``example_cost``) is asked instead: a sequential
  family's example is a pack of histories (``sequential.run_config``), and its ``batch_size``
  counts packs;
* examples = ``C / f``; steps = ``round(examples / global_batch)`` (at least ``min_steps``, else
  the pair is skipped with a reason); the trial's actual compute ``steps * batch * f`` is what
  fits use;
* learning rates from the batch-size rule (:class:`BatchRule`), warmup a fraction of the steps.

Which rungs run at a budget (``sizes_per_budget``): ``0`` runs every rung at every budget (a
full IsoFLOP grid); ``k > 0`` runs ``k`` consecutive rungs on a diagonal that climbs the ladder
as the budget grows (the first budget gets rungs ``0..k-1``, the last ``n-k..n-1``), which
still gives ``k``-point IsoFLOP curves at every budget at a fraction of the cost; a family with
an ``optimum`` law (``FamilySpec.optimum``) runs instead the ``k`` rungs centred on the
compute-optimal size that law predicts at each budget.

**Trial identity** is a hash of the canonical resolved config minus the fields whose declared
role (``data.roles``) is outside identity (logging, eval and checkpoint cadence, output paths,
where the data is), plus the family, the code version and a data fingerprint: changing a
hyperparameter makes a new trial, changing where or how often it logs does not.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import json
import math
from pathlib import Path
from typing import Any, Literal

import tpu_gpu_configs
from data.config import DataConfig
from recscale import config as config_lib
from recscale import families
from sweeps import grouping
from sweeps.identity import current_code_version, data_fingerprint, trial_id
from sweeps.ladders import (  # noqa: F401 (specs import the ladder builders from here)
    WUKONG_TABLE5_LADDER,
    Rung,
    dlrm_ladder,
    wukong_ladder,
    wukong_rung,
)
from sweeps.trial import Trial  # noqa: F401 (sweeps.spec.Trial, its documented home)

FLOPS_CONVENTION = (
    "train: analytic forward+backward matmul FLOPs per example, 2 per multiply-add, "
    "backward = 2x forward plus the embedding scatter (recscale.flops)"
)

# ------------------------------------------------------------------------------------------------
# Spec.


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchRule:
    """Learning rate as a function of the global batch, from the base preset's tuned values.

    ``lr(B) = lr_base * (B / B_base) ** power`` with ``B_base`` the base preset's batch. The
    power is 0.5 (square-root rule) for adaptive optimizers (Adam, AdamW, LAMB, Adagrad and
    row-wise Adagrad; Malladi et al. 2022, "On the SDEs and scaling rules for adaptive gradient
    algorithms") and 1 (linear rule; Goyal et al. 2017) for SGD and LARS, unless set here.
    """

    dense_power: float | None = None
    """Exponent for the dense optimizer (None = by optimizer name)."""
    embedding_power: float | None = None
    """Exponent for the embedding optimizer (None = by optimizer name)."""
    warmup_fraction: float = 0.05
    """Linear warmup over this fraction of the trial's steps (both optimizers)."""

    @staticmethod
    def default_power(optimizer: str) -> float:
        return 1.0 if optimizer in ("sgd", "lars") else 0.5


LR_RULES = ("none", "sqrt", "linear", "cowclip")
"""Learning-rate recipes of a batch-size sweep (``SweepSpec.lr_rules``), from the base preset's
rates at its batch ``B_base`` to a batch ``B`` (``s = B / B_base``): ``none`` keeps both rates;
``sqrt`` multiplies both by ``sqrt(s)``, ``linear`` by ``s``; ``cowclip`` is CowClip's recipe
(Zheng et al. 2023; ``recscale.optim.cowclip``): the dense rate times ``sqrt(s)``, the tables'
rate unchanged, their gradients clipped by CowClip and their touched-row L2 times ``s``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """One model family of a sweep."""

    family: str
    """The family's name in this sweep, e.g. ``wukong`` (or ``wukong@lr2`` for a variant)."""
    preset: str
    """Base preset: data, optimizers and every model field a rung does not set. Its prefix
    (``wukong`` of ``wukong/frappe``) names the model family (``recscale.families``), whose
    train entry point runs the trials."""
    ladder: tuple[Rung, ...]
    """Model sizes, smallest first."""
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Config fields set on the base preset for every trial, by dotted path
    (``{"model.top_mlp": (64, 1), "dense_optim.decay": "cosine"}``); rungs set theirs after."""
    optimum: tuple[float, float, float] | None = None
    """``(n0, c0, a)``: the compute-optimal training FLOPs per example predicted for this family,
    ``N*(C) = n0 * (C / c0) ** a`` (e.g. a previous sweep's loss surface, ``sweeps.surface``).
    With ``SweepSpec.sizes_per_budget = k``, each budget runs the ``k`` consecutive rungs whose
    mean log FLOPs per example is nearest ``log N*(C)``, so the IsoFLOP window follows the
    predicted optimum instead of the climbing diagonal. None: the diagonal."""

    def __post_init__(self):
        if self.optimum is not None:
            n0, c0, a = self.optimum
            if not (n0 > 0 and c0 > 0 and math.isfinite(n0 * c0) and math.isfinite(a)):
                raise ValueError(
                    f"family {self.family}: optimum (n0, c0, a) needs n0 > 0, c0 > 0 and a "
                    f"finite exponent, got {self.optimum}"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """A whole sweep (see the module docstring for how it resolves into trials)."""

    name: str
    families: tuple[FamilySpec, ...]
    budgets: tuple[float, ...]
    """Compute budgets in training FLOPs (per trial, all examples)."""
    sizes_per_budget: int = 0
    """Rungs per budget: 0 = every rung (IsoFLOP grid); k = k rungs on a climbing diagonal."""
    seeds: tuple[int, ...] = (0,)
    data: DataConfig | None = None
    """Dataset of every trial (None = each base preset's own)."""
    extend_below: int = 0
    """With ``sizes_per_budget = k``: also run this many rungs below each budget's diagonal
    window (where the ladder has them), e.g. when the IsoFLOP minima sit at the window's
    lower edge."""
    batch_size: int = 0
    """Global batch of every trial (0 = each base preset's own)."""
    batch_rule: BatchRule = BatchRule()
    batch_sizes: tuple[int, ...] = ()
    """A batch-size sweep: every (family, budget, rung, seed) runs at each of these global
    batches, with ``budget / FLOPs per example`` examples whatever the batch (so fewer steps
    for larger batches), its learning rates set by each of ``lr_rules`` times each of
    ``lr_multipliers``. Empty: one batch (``batch_size``), rates by ``batch_rule``."""
    lr_rules: tuple[str, ...] = ()
    """Recipes of a batch-size sweep (``LR_RULES``); empty: ``batch_rule``."""
    lr_multipliers: tuple[float, ...] = (1.0,)
    """A small learning-rate search around each recipe: both rates times each multiplier."""
    cowclip_ratio: float = 1.0
    """The ``cowclip`` recipe's clipping ratio ``r`` (ζ is the base preset's)."""
    cowclip_row_l2: float = 0.0
    """The ``cowclip`` recipe's touched-row L2 at the base batch (times ``s`` at batch B)."""
    examples_per_trial: int = 0
    """Nonzero: every trial trains on this many examples (``round(examples / batch)`` steps),
    whatever its batch and size; ``budgets`` (one, conventionally) only name the run. For
    batch-size sweeps at fixed data."""
    noise_scales_per_trial: int = 0
    """Gradient noise-scale measurements per trial (``train.noise_scale_every``; 0 = none)."""
    steps_per_trial: int = 0
    """Nonzero: every trial runs this many steps whatever its size, and ``budgets`` (one,
    conventionally) only name the run: a fixed-data study of quality against model size, where
    the data, not compute, is the limit (``sweeps.specs.study_frappe``)."""
    min_steps: int = 20
    """(budget, rung) pairs with fewer steps are skipped (reported by ``--dry-run``)."""
    max_steps: int = 0
    """(budget, rung) pairs with more steps are skipped (0 = no limit). With
    ``sizes_per_budget=0`` the two bounds make the classic IsoFLOP design: at each budget, every
    model size whose run length is feasible."""
    evals_per_trial: int = 4
    """Evaluations during a trial (for the best-eval metric); the last is at the final step."""
    eval_max_batches: int = 0
    """Cap on eval batches of the intermediate evaluations (0 = all); the final one uses all."""
    checkpoints_per_trial: int = 4
    """Checkpoints during a trial: a killed or preempted trial resumes from the last one."""
    max_retries: int = 1
    """A FAILED trial (non-zero exit, not a divergence) is retried this many times."""
    trial_timeout_s: float = 0.0
    """Wall-clock limit of one attempt of a trial (0 = none): killed, it counts as a failure."""
    max_takeovers: int = 3
    """A trial whose worker died more often than this (e.g. it kills its host) is FAILED."""
    metric: Literal["logloss", "auc", "loss"] = "logloss"
    """The quality metric fits use (AUC is fitted as 1 - AUC, so lower is better for all);
    ``loss`` is a sequential family's eval next-item loss (nats, ``sequential.task``)."""
    hardware: str = "cpu-local"
    """``tpu_gpu_configs`` preset the trials run on (mesh, XLA flags, SLURM resources)."""
    analyses: tuple[Literal["sparse_dense", "quality_vs_size"], ...] = ()
    """Extra analyses ``sweeps.analyze`` runs: ``sparse_dense`` tabulates and plots each
    budget's grid of embedding capacity (``model.embed_dim`` x ``data.max_table_rows``)
    against dense size (the rung name's last ``/``-separated part); ``quality_vs_size`` the
    final and best eval metrics against model size, seeds averaged (a fixed-data sweep)."""
    branches: bool = False
    """One run per model size serves every budget (``recscale.train.branches``): of the trials
    of one (family, rung, seed, batch, recipe), the largest budget's is the *stable run*, which
    keeps a checkpoint at each smaller budget's decay start, and each smaller budget's trial is
    a *cooldown branch* that starts from that checkpoint and trains only its own cooldown. Both
    optimizers need ``wsd`` (or ``constant``) decay, and a size's trials share one warmup:
    ``batch_rule.warmup_fraction`` of its smallest budget's steps (a stable phase is shared
    from step 0). A branch's id, config, metrics and results row are those of the one-piece run
    it equals bitwise; the row adds what the branch itself cost (``own_steps``,
    ``own_compute``), and the sweep's cost is the sum of those."""
    populations: bool = False
    """The seeds of a point train as one population (``recscale.train.population``): the trials
    that differ only in their seed and learning-rate multiplier (``lr_multipliers``; the stable
    runs of one size, or its branches of one budget) run as one vmapped program, each in its own
    run folder with its own results row. Trial ids are those of the separate runs (each member
    equals its run to float32 rounding)."""
    code_version: str = "auto"
    """Part of every trial id: ``auto`` = package version + git commit (+ hash of uncommitted
    changes to tracked files)."""

    def __post_init__(self):
        if not self.families:
            raise ValueError("a sweep needs at least one family")
        if not self.budgets or any(not (b > 0 and math.isfinite(b)) for b in self.budgets):
            raise ValueError(f"budgets must be positive and finite, got {self.budgets}")
        if list(self.budgets) != sorted(set(self.budgets)):
            raise ValueError(f"budgets must be strictly increasing, got {self.budgets}")
        for rule in self.lr_rules:
            if rule not in LR_RULES:
                raise ValueError(f"lr_rules: unknown recipe {rule!r}; known: {LR_RULES}")
        if any(b < 1 for b in self.batch_sizes) or len(set(self.batch_sizes)) != len(
            self.batch_sizes
        ):
            raise ValueError(f"batch_sizes must be distinct and >= 1, got {self.batch_sizes}")
        if not self.lr_multipliers or any(not m > 0 for m in self.lr_multipliers):
            raise ValueError(f"lr_multipliers must be > 0, got {self.lr_multipliers}")
        if self.branches and (self.steps_per_trial or self.examples_per_trial):
            raise ValueError(
                "branches: every budget of a size must be a different run length; "
                "steps_per_trial and examples_per_trial fix it"
            )
        for fam in self.families:
            if not fam.ladder:
                raise ValueError(f"family {fam.family}: empty ladder")
            if self.sizes_per_budget > len(fam.ladder):
                raise ValueError(
                    f"sizes_per_budget={self.sizes_per_budget} > {len(fam.ladder)} rungs of "
                    f"family {fam.family}"
                )


# ------------------------------------------------------------------------------------------------
# Trials.


@dataclasses.dataclass(frozen=True)
class Resolution:
    trials: tuple[Trial, ...]
    skipped: tuple[str, ...]
    """(family, budget, rung) pairs not run, with the reason."""
    code_version: str
    data_fingerprints: dict[str, str]


def resolve(spec: SweepSpec) -> Resolution:
    """Expands ``spec`` into its trials (deterministic order: family, budget, rung, seed)."""
    from data.schemas import schema_of  # noqa: PLC0415  (numpy only)

    code_version = current_code_version() if spec.code_version == "auto" else spec.code_version
    trials: list[Trial] = []
    skipped: list[str] = []
    seen: dict[str, Trial] = {}
    cfgs: dict[str, Any] = {}  # each trial's config object, by id
    fingerprints: dict[str, str] = {}
    schemas: dict[str, Any] = {}
    for fam in spec.families:
        try:
            model_family = families.of_preset(fam.preset)  # registers its presets
        except families.UnknownFamilyError as e:
            raise ValueError(f"family {fam.family}: preset {fam.preset!r}: {e}") from None
        base = _override(config_lib.get_preset(fam.preset), fam.overrides, fam.family)
        data = spec.data if spec.data is not None else base.data
        hw = tpu_gpu_configs.get(spec.hardware)
        batch = spec.batch_size or hw.global_batch or data.batch_size
        base = dataclasses.replace(
            base, mesh=dataclasses.replace(base.mesh, data_parallel=hw.data_parallel)
        )
        if hw.profile and base.embeddings.sharding != "off" and not base.embeddings.profile:
            # The engine plans for the machine the trial runs on (its memory, bandwidths and
            # devices per host), not for the backend's default profile.
            base = dataclasses.replace(
                base,
                embeddings=dataclasses.replace(
                    base.embeddings, profile=hw.profile, host_size=hw.devices_per_host
                ),
            )
        batches = spec.batch_sizes or (batch,)
        recipes = [(r, m) for r in spec.lr_rules for m in spec.lr_multipliers] or [("", 1.0)]
        data = dataclasses.replace(data, batch_size=batch)
        data_fp = data_fingerprint(data)
        fingerprints[fam.family] = data_fp
        base_batch = base.data.batch_size
        n_rungs, n_budgets = len(fam.ladder), len(spec.budgets)
        rungs = []  # (model, data, cost) of every rung
        for rung in fam.ladder:
            try:
                model = dataclasses.replace(base.model, **rung.model)
                rung_data = data
                if rung.overrides:  # the schema (table sizes) may depend on them
                    probe = dataclasses.replace(base, model=model, data=data)
                    rung_data = _override(probe, rung.overrides, fam.family).data
            except (TypeError, ValueError) as e:
                raise ValueError(f"family {fam.family}, rung {rung.name}: {e}") from e
            if hasattr(base, "example_cost"):  # a sequential run: packs, not rows of a schema
                run = dataclasses.replace(base, model=model, data=rung_data)
                cost = _override(run, rung.overrides, fam.family).example_cost()
            else:
                key = json.dumps(config_lib.to_dict(rung_data), sort_keys=True)
                if key not in schemas:
                    schemas[key] = schema_of(rung_data)
                cost = model.cost(schemas[key])
            rungs.append((model, rung_data, cost))
        log_fpe = [math.log(float(c.train_flops)) for _, _, c in rungs]
        for bi, budget in enumerate(spec.budgets):
            k = spec.sizes_per_budget or n_rungs
            if spec.sizes_per_budget and fam.optimum is not None:
                lo = _window_on_optimum(log_fpe, k, fam.optimum, budget)
            else:
                lo = round(bi * (n_rungs - k) / max(n_budgets - 1, 1))
            lo, hi = max(lo - spec.extend_below, 0), lo + k
            for ri in range(lo, hi):
                rung = fam.ladder[ri]
                model, rung_data, cost = rungs[ri]
                fpe = float(cost.train_flops)
                for b, (rule, mult) in itertools.product(batches, recipes):
                    steps = spec.steps_per_trial or round(
                        (spec.examples_per_trial or budget / fpe) / b
                    )
                    where = f"{fam.family} budget {budget:.3g} rung {rung.name}"
                    if spec.batch_sizes:
                        where += f" batch {b}"
                    if steps < spec.min_steps:
                        skipped.append(f"{where}: {steps} steps < min_steps={spec.min_steps}")
                        continue
                    if spec.max_steps and steps > spec.max_steps:
                        skipped.append(f"{where}: {steps} steps > max_steps={spec.max_steps}")
                        continue
                    b_data = dataclasses.replace(rung_data, batch_size=b)
                    for seed in spec.seeds:
                        cfg = _trial_config(
                            spec, base, model, b_data, steps, seed, base_batch, rule, mult
                        )
                        cfg = _override(cfg, rung.overrides, fam.family)
                        cdict = config_lib.to_dict(cfg)
                        tid = trial_id(fam.family, cdict, code_version, data_fp, type(cfg))
                        if tid in seen and rule:  # recipes that coincide (at the base batch)
                            i = trials.index(seen[tid])
                            seen[tid] = trials[i] = dataclasses.replace(
                                trials[i], also=(*trials[i].also, (rule, mult))
                            )
                            continue
                        if tid in seen:  # two budgets rounding to the same run: one trial
                            skipped.append(
                                f"{where} seed {seed}: same run as {seen[tid].rung} "
                                f"at budget {seen[tid].budget:.3g}"
                            )
                            continue
                        t = Trial(
                            trial_id=tid,
                            family=fam.family,
                            package=model_family.package,
                            rung=rung.name,
                            rung_index=ri,
                            budget=float(budget),
                            seed=seed,
                            config=cdict,
                            flops_per_example=fpe,
                            examples=steps * b,
                            steps=steps,
                            batch_size=b,
                            params_dense=int(cost.dense_params),
                            params_sparse=int(cost.sparse_params),
                            lr_rule=rule,
                            lr_multiplier=mult,
                        )
                        seen[tid] = t
                        cfgs[tid] = cfg
                        trials.append(t)
    if spec.branches:
        trials = grouping.as_branches(trials, cfgs, code_version, fingerprints)
    if spec.populations:
        trials = grouping.as_populations(trials)
    return Resolution(tuple(trials), tuple(skipped), code_version, fingerprints)


def _window_on_optimum(
    log_fpe: list[float], k: int, optimum: tuple[float, float, float], budget: float
) -> int:
    """First rung of the ``k`` consecutive rungs whose mean log FLOPs per example is nearest
    the predicted optimum's at ``budget`` (the lower window on a tie)."""
    n0, c0, a = optimum
    target = math.log(n0) + a * (math.log(budget) - math.log(c0))
    starts = range(len(log_fpe) - k + 1)
    return min(starts, key=lambda lo: abs(sum(log_fpe[lo : lo + k]) / k - target))


def _override(cfg: Any, overrides: dict[str, Any], family: str) -> Any:
    """``cfg`` with dotted-path fields replaced (validated by the config classes)."""
    if not overrides:
        return cfg
    d = config_lib.to_dict(cfg)
    for dotted, value in overrides.items():
        node = d
        *parents, leaf = dotted.split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"family {family}: override {dotted!r}: no config section {p!r}")
            node = node[p]
        if leaf not in node:
            raise ValueError(f"family {family}: override {dotted!r}: no field {leaf!r}")
        node[leaf] = config_lib.to_dict(value)
    return config_lib.from_dict(type(cfg), d, path=f"{family} overrides")


def _trial_config(spec, base, model, data, steps, seed, base_batch, lr_rule="", lr_mult=1.0):
    rule = spec.batch_rule
    ratio = data.batch_size / base_batch
    dpow = (
        rule.dense_power
        if rule.dense_power is not None
        else rule.default_power(base.dense_optim.name)
    )
    epow = (
        rule.embedding_power
        if rule.embedding_power is not None
        else rule.default_power(base.embedding_optim.name)
    )
    emb = base.embedding_optim
    if lr_rule:  # a batch-size sweep's recipe (LR_RULES)
        dpow, epow = {
            "none": (0.0, 0.0),
            "sqrt": (0.5, 0.5),
            "linear": (1.0, 1.0),
            "cowclip": (0.5, 0.0),
        }[lr_rule]
        if lr_rule == "cowclip":
            emb = dataclasses.replace(
                emb, cowclip_ratio=spec.cowclip_ratio, row_l2=spec.cowclip_row_l2 * ratio
            )
    warmup = round(rule.warmup_fraction * steps)
    evals = max(spec.evals_per_trial, 1)
    ckpts = max(spec.checkpoints_per_trial, 1)
    return dataclasses.replace(
        base,
        model=model,
        data=data,
        dense_optim=dataclasses.replace(
            base.dense_optim,
            learning_rate=base.dense_optim.learning_rate * ratio**dpow * lr_mult,
            warmup_steps=warmup,
        ),
        embedding_optim=dataclasses.replace(
            emb,
            learning_rate=emb.learning_rate * ratio**epow * lr_mult,
            warmup_steps=warmup,
        ),
        train=dataclasses.replace(
            base.train,
            num_steps=steps,
            seed=seed,
            eval_every=max(steps // evals, 1) if evals > 1 else 0,
            eval_max_batches=spec.eval_max_batches,
            checkpoint_every=max(steps // ckpts, 1),
            log_every=max(min(steps // 20, 100), 1),
            progress=False,
            noise_scale_every=(
                max(steps // spec.noise_scales_per_trial, 1) if spec.noise_scales_per_trial else 0
            ),
        ),
    )


def load_spec(ref: str) -> SweepSpec:
    """A spec from ``module.path`` or ``path/to/file.py``: its ``SPEC`` or ``spec()``."""
    if ref.endswith(".py"):
        path = Path(ref).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"sweep spec file {ref} not found")
        spec = importlib.util.spec_from_file_location(f"_sweep_spec_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(ref)
    obj = getattr(module, "SPEC", None)
    if obj is None and callable(getattr(module, "spec", None)):
        obj = module.spec()
    if not isinstance(obj, SweepSpec):
        raise TypeError(f"{ref} defines no SPEC (a sweeps.spec.SweepSpec) or spec() returning one")
    return obj
