"""Checkpoint evaluation: rebuild a run from its workdir, restore parameters, evaluate.

The JSON contract (later tooling depends on it): one object on the last line of stdout with at
least ``auc``, ``logloss``, ``ne``, ``calibration``, ``num_examples``, ``step``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax

from recscale import config as config_lib
from recscale import sharding
from recscale.embeddings import engine
from recscale.train.checkpoint import Checkpointer
from recscale.train.loop import BuildModel, Experiment


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalArgs:
    """Evaluate a saved run."""

    workdir: str
    """The run's directory (holds config.json and checkpoints/)."""
    step: int | None = None
    """Checkpoint step to evaluate (default: the latest)."""
    data_path: str | None = None
    """Evaluate on this file instead of the run's eval set (same format as the run's dataset)."""
    output: str | None = None
    """Also write the metrics JSON object to this file."""


def json_line(obj: dict) -> str:
    """One-line JSON with non-finite floats (a NaN AUC of a single-class set) written as null."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps(clean(obj), sort_keys=True, allow_nan=False)


def evaluate_workdir(config_cls: type, build_model: BuildModel, args: EvalArgs) -> dict:
    workdir = Path(args.workdir)
    cfg_path = workdir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: is {workdir} a recscale run directory?")
    cfg = config_lib.load_json(config_cls, cfg_path)
    ckpt = Checkpointer(workdir / "checkpoints", async_save=False)
    step = args.step if args.step is not None else ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"no checkpoints in {ckpt.directory}")
    # Evaluate on this machine's devices, whatever mesh the run trained on (checkpoints restore
    # onto any mesh): as many as divide the eval batch.
    n = math.gcd(cfg.data.eval_batch_size, jax.device_count())
    spec = engine.EngineSpec.from_config(cfg)
    if spec is not None:
        # The engine's buffers are laid out for the training mesh: restore onto as many devices.
        n = cfg.mesh.data_parallel
        n = _trained_device_count(workdir) if n == -1 else n
        if n > jax.device_count():
            raise ValueError(
                f"{workdir} was trained with the embedding engine on {n} devices; its table "
                f"buffers restore only onto {n} devices and this process has {jax.device_count()}"
            )
    mesh = sharding.make_mesh(dataclasses.replace(cfg.mesh, data_parallel=n))
    with sharding.activate(mesh, cfg.mesh.rules, engine=spec):
        exp = Experiment.build(
            cfg,
            build_model,
            eval_path=args.data_path,
            with_optimizer=False,
            eval_only=True,
            workdir=str(workdir),
        )
        abstract = exp.abstract_state
        trees, meta = ckpt.restore(
            step, {"params": abstract.params, "batch_stats": abstract.batch_stats}
        )
        metrics = exp.evaluate(trees["params"], trees["batch_stats"])
    ckpt.close()
    result: dict[str, Any] = {**metrics, "step": int(meta.get("step", step))}
    result["data_path"] = args.data_path or cfg.data.eval_path or f"synthetic:{cfg.data.kind}"
    if args.output and jax.process_index() == 0:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json_line(result) + "\n")
    return result


def _trained_device_count(workdir: Path) -> int:
    info = workdir / "run_info.json"
    if not info.is_file():
        raise FileNotFoundError(
            f"{info} is missing: cannot tell the mesh the engine's buffers need"
        )
    return int(json.loads(info.read_text())["starts"][-1]["device_count"])
