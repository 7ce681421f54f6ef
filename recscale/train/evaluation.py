"""Checkpoint evaluation: rebuild a run from its workdir, restore parameters, evaluate.

The JSON contract (later tooling depends on it): one object on the last line of stdout with at
least ``auc``, ``logloss``, ``ne``, ``calibration``, ``num_examples``, ``step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jax
from flax import nnx

from recscale import config as config_lib
from recscale import sharding
from recscale.analysis import comm_sensitivity, curvature
from recscale.embeddings import EmbeddingCollection, EmbeddingTable, engine, relayout, tier_view
from recscale.train.checkpoint import Checkpointer
from recscale.train.loop import BEST_DIR, BuildModel, Experiment
from recscale.train.steps import weighted_bce


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalArgs:
    """Evaluate a saved run."""

    workdir: str
    """The run's directory (holds config.json and checkpoints/)."""
    step: int | None = None
    """Checkpoint step to evaluate (default: the latest)."""
    best: bool = False
    """Evaluate the early-stopping best checkpoint (``checkpoints_best/``, written with
    ``train.early_stopping_metric``) instead of the latest."""
    data_path: str | None = None
    """Evaluate on this file instead of the run's eval set (same format as the run's dataset)."""
    eval_split: Literal["valid", "test"] | None = None
    """Sequential runs: the held-out split to evaluate (``valid`` or ``test``) instead of the
    run's ``data.eval_split`` (a run tuned on ``valid`` reports ``test`` with this)."""
    output: str | None = None
    """Also write the metrics JSON object to this file."""
    num_devices: int = 0
    """Devices to evaluate on (0: as many as divide the eval batch)."""
    curvature: bool = False
    """Also measure the curvature of the training loss at the checkpoint, with respect to the
    dense parameters (tables fixed; ``recscale.analysis.curvature``): the Hessian's top
    eigenvalues and its smallest (Lanczos) and Keskar's ε-sharpness, on the first
    ``curvature_batches`` training batches in evaluation mode. The JSON adds ``curvature``,
    also written to ``DIR/curvature.json``."""
    curvature_batches: int = 4
    """Training batches the curvature's loss averages over."""
    curvature_top_k: int = 5
    """Top Hessian eigenvalues to report."""
    curvature_iters: int = 40
    """Lanczos steps (Hessian-vector products)."""
    curvature_epsilon: tuple[float, ...] = (1e-3, 5e-4)
    """Box sizes ε of the ε-sharpness (Keskar et al. report 1e-3 and 5e-4)."""
    curvature_ascent_steps: int = 20
    """Projected ascent steps of each ε-sharpness maximisation."""
    comm_sensitivity: bool = False
    """Also measure each table's sensitivity to a compressed embedding exchange on the first
    ``comm_sensitivity_batches`` training batches (``recscale.analysis.comm_sensitivity``) and
    propose per-table bounds (``embeddings.comm_error_bound_tables``) around
    ``comm_error_bound``. The JSON adds ``comm_sensitivity``, also written to
    ``DIR/comm_sensitivity.json``."""
    comm_sensitivity_batches: int = 8
    """Training batches the sensitivity sums over."""
    comm_error_bound: float = 0.0
    """The base bound the proposed scales multiply (0: the run's ``comm_error_bound``, or 0.002,
    8-bit codes, if it had none)."""
    comm_budget: Literal["bytes", "error"] = "bytes"
    """``bytes``: less predicted error at about the uniform bound's bytes; ``error``: fewer
    bytes at about its predicted error."""
    comm_grad: Literal["base", "same"] = "same"
    """``same``: the proposed scales bound both exchanges; ``base``: the forward one only, the
    gradients keep the base bound."""
    comm_max_shift: int = 3
    """Largest power of two a table's bound may move from the base bound (each is about a bit
    per value)."""
    embeddings_int8: bool = False
    """Quantize the embedding tables to int8 row-wise (FBGEMM's format: per-row scale and
    bias) and evaluate with the fused dequantize-and-pool lookup (inference serving's tables:
    about a quarter of the float32 bytes). The JSON adds ``embeddings: "int8"``."""


def json_line(obj: dict) -> str:
    """One-line JSON with non-finite floats (a NaN AUC of a single-class set) written as null."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps(clean(obj), sort_keys=True, allow_nan=False)


@dataclasses.dataclass
class Restored:
    """A run's checkpoint restored for inference (:func:`restored`)."""

    cfg: Any
    exp: Experiment
    params: Any
    batch_stats: Any
    step: int
    """The checkpoint's step."""


@contextlib.contextmanager
def restored(
    config_cls: type,
    build_model: BuildModel,
    workdir: str | Path,
    *,
    step: int | None = None,
    best: bool = False,
    num_devices: int = 0,
    data_path: str | None = None,
    train_batches: bool = False,
    kernels: Any = None,
    eval_split: str | None = None,
) -> Iterator[Restored]:
    """The run in ``workdir`` rebuilt on this machine's devices, its checkpoint (``step``, the
    latest by default; ``best``: the early-stopping best) restored, inside its mesh.

    ``num_devices``: the data-parallel devices (0: as many as divide the eval batch, and the
    training batch with ``train_batches``). Checkpoints restore onto any mesh; the engine's
    buffers are re-laid out from the layout the checkpoint records. ``kernels``: a
    ``KernelConfig`` to build the model with instead of the run's (implementations only).
    ``eval_split``: a sequential run's held-out split instead of its ``data.eval_split``.

    A tiered run's tables (``embeddings.tiers``) come back whole: the checkpoint holds their
    caches, their stores every row as of the checkpoint (``tier_view.StoreView``), and the
    model is built without tiers (``Restored.cfg``), its tables in device memory."""
    workdir = Path(workdir)
    cfg_path = workdir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a recscale run directory?")
    cfg = config_lib.load_json(config_cls, cfg_path)
    if kernels is not None:
        cfg = dataclasses.replace(cfg, kernels=kernels)
    if eval_split is not None:
        if not hasattr(cfg.data, "eval_split"):
            raise config_lib.ConfigError(f"--eval-split: {cfg_path} is not a sequential run")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_split=eval_split))
    run_cfg, tier_dir = cfg, None
    if cfg.embeddings.tiers:
        tier_dir = tier_view.store_dir(cfg.embeddings, workdir)
        cfg = dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, tiers=()))
    if best and not (workdir / BEST_DIR).is_dir():
        raise FileNotFoundError(
            f"{workdir / BEST_DIR} not found: --best needs a run trained with "
            "train.early_stopping_metric"
        )
    ckpt = Checkpointer(workdir / (BEST_DIR if best else "checkpoints"), async_save=False)
    try:
        step = step if step is not None else ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoints in {ckpt.directory}")
        n = num_devices or math.gcd(cfg.data.eval_batch_size, jax.device_count())
        if train_batches and not num_devices:
            n = math.gcd(n, cfg.data.batch_size)
        spec = engine.EngineSpec.from_config(cfg)
        # Data parallel only: inference holds no optimizer state, and checkpoints reshard.
        mesh_cfg = dataclasses.replace(cfg.mesh, data_parallel=n, model_parallel=1)
        mesh = sharding.make_mesh(mesh_cfg)
        with sharding.activate(mesh, mesh_cfg):
            exp = Experiment.build(
                cfg,
                build_model,
                eval_path=data_path,
                with_optimizer=False,
                eval_only=not train_batches,
                workdir=str(workdir),
            )
            abstract = exp.abstract_state
            # The layout the checkpoint was saved under: recorded in its meta, or (checkpoints
            # written before that) the run's config on the training mesh's device count.
            meta = ckpt.read_meta(step)
            saved = meta.get("layout")
            if saved is None and spec is not None:
                n_train = cfg.mesh.data_parallel
                n_train = _trained_device_count(workdir) if n_train == -1 else n_train
                saved = relayout.layout_meta(run_cfg, device_count=n_train)
            if tier_dir is not None or relayout.needs_relayout(saved, cfg):
                # The engine's buffers are laid out for the training mesh and plan (and hold
                # the tiered tables' caches): restored there and re-laid out for this one,
                # table by table.
                trees = relayout.restore_relaid(
                    ckpt,
                    step,
                    exp,
                    cfg,
                    build_model,
                    saved,
                    with_opt_state=False,
                    tier_dir=tier_dir,
                )
            else:
                trees, _ = ckpt.restore(
                    step, {"params": abstract.params, "batch_stats": abstract.batch_stats}
                )
            yield Restored(
                cfg, exp, trees["params"], trees["batch_stats"], int(meta.get("step", step))
            )
    finally:
        ckpt.close()


def evaluate_workdir(config_cls: type, build_model: BuildModel, args: EvalArgs) -> dict:
    workdir = Path(args.workdir)
    with restored(
        config_cls,
        build_model,
        workdir,
        step=args.step,
        best=args.best,
        num_devices=args.num_devices,
        data_path=args.data_path,
        train_batches=args.curvature or args.comm_sensitivity,
        eval_split=args.eval_split,
    ) as r:
        exp, params, batch_stats = r.exp, r.params, r.batch_stats
        exp.task.check_eval(args)
        graphdef = None
        if args.embeddings_int8:
            graphdef, params, batch_stats = quantize_embeddings_int8(
                exp.graphdef, params, batch_stats
            )
        metrics = exp.evaluate(params, batch_stats, graphdef=graphdef)
        curv = _curvature(exp, params, batch_stats, args) if args.curvature else None
        sens = None
        if args.comm_sensitivity:
            sens = _comm_sensitivity(exp, params, batch_stats, args, workdir)
        cfg = r.cfg
    result: dict[str, Any] = {**metrics, "step": r.step}
    if curv is not None:
        result["curvature"] = curv
        if jax.process_index() == 0:
            (workdir / "curvature.json").write_text(
                json_line({**curv, "step": result["step"]}) + "\n"
            )
    if sens is not None:
        result["comm_sensitivity"] = sens
        if jax.process_index() == 0:
            (workdir / "comm_sensitivity.json").write_text(
                json_line({**sens, "step": result["step"]}) + "\n"
            )
    if args.embeddings_int8:
        result["embeddings"] = "int8"
    result["data_path"] = exp.task.eval_data(cfg, args.data_path)
    if args.eval_split is not None:
        result["eval_split"] = cfg.data.eval_split
    eval_stats = (getattr(exp.source, "stats", None) or {}).get("eval")
    if isinstance(eval_stats, dict) and "oov" in eval_stats:
        result["eval_data"] = eval_stats  # rows read and rejected, unseen values per feature
    if args.output and jax.process_index() == 0:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json_line(result) + "\n")
    return result


def _curvature(exp: Experiment, params, batch_stats, args: EvalArgs) -> dict:
    """The curvature of the training loss at ``params`` with respect to the dense parameters
    (tables fixed), on the first ``args.curvature_batches`` training batches."""
    if args.curvature_batches < 1:
        raise ValueError(f"curvature_batches={args.curvature_batches}: must be >= 1")
    tables, dense = nnx.split_state(params, EmbeddingTable, ...)
    batches = [exp.device_batch(exp.source.train_batch(i)) for i in range(args.curvature_batches)]
    graphdef = exp.graphdef

    def loss(dense, batches):
        total = 0.0
        for b in batches:
            logits = nnx.merge(graphdef, tables, dense, batch_stats)(b.dense_bn, b.ids_bfh)
            total = total + weighted_bce(logits, b.labels_b, b.weights_b)
        return total / len(batches)

    out = curvature.hessian_extremes(
        loss, dense, batches, top_k=args.curvature_top_k, iters=args.curvature_iters
    )
    out["sharpness"] = [
        curvature.epsilon_sharpness(
            loss, dense, batches, epsilon=e, steps=args.curvature_ascent_steps
        )
        for e in args.curvature_epsilon
    ]
    out["batches"] = args.curvature_batches
    out["examples"] = sum(int(b.labels_b.shape[0]) for b in batches)
    return out


def _comm_sensitivity(exp: Experiment, params, batch_stats, args: EvalArgs, workdir: Path) -> dict:
    """Each table's measured sensitivity to its compressed exchange and the per-table bounds
    proposed from it (``recscale.analysis.comm_sensitivity``), on the exchange's blocks of the
    training mesh."""
    if args.comm_sensitivity_batches < 1:
        raise config_lib.ConfigError(
            f"comm_sensitivity_batches={args.comm_sensitivity_batches}: must be >= 1"
        )
    cfg = exp.cfg
    n_train = cfg.mesh.data_parallel
    n_train = _trained_device_count(workdir) if n_train == -1 else n_train
    batches = [
        exp.device_batch(exp.source.train_batch(i)) for i in range(args.comm_sensitivity_batches)
    ]

    def loss(logits, b):
        return weighted_bce(logits, b.labels_b, b.weights_b)

    eps = args.comm_error_bound or cfg.embeddings.comm_error_bound or 0.002
    try:  # bad arguments (a bound out of range, a batch the devices do not divide): one line
        sens = comm_sensitivity.measure(
            exp.graphdef, params, batch_stats, batches, blocks=n_train, loss_fn=loss
        )
        plan = comm_sensitivity.propose(
            sens, eps, budget=args.comm_budget, max_shift=args.comm_max_shift, grad=args.comm_grad
        )
    except ValueError as e:
        raise config_lib.ConfigError(f"--comm-sensitivity: {e}") from None
    return {"tables": sens, **plan, "batches": len(batches), "blocks": n_train}


def quantize_embeddings_int8(graphdef, params, batch_stats):
    """``(graphdef, params, batch_stats)`` of the same model with every embedding collection's
    tables quantized to int8 row-wise (:meth:`EmbeddingCollection.quantize_int8`), laid out on
    the active mesh."""
    model = nnx.merge(graphdef, params, batch_stats)
    collections = [m for _, m in nnx.iter_modules(model) if isinstance(m, EmbeddingCollection)]
    if not collections:
        raise ValueError("embeddings_int8: the model has no embedding collection to quantize")
    for coll in collections:
        coll.quantize_int8()
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    params = jax.device_put(params, sharding.state_shardings(params))
    return graphdef, params, batch_stats


def _trained_device_count(workdir: Path) -> int:
    info = workdir / "run_info.json"
    if not info.is_file():
        raise FileNotFoundError(
            f"{info} is missing: cannot tell the mesh the engine's buffers need"
        )
    return int(json.loads(info.read_text())["starts"][-1]["device_count"])
