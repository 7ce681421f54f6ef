"""One JAX process of a multi-process test run (``tests/recscale/test_multiprocess.py``).

``python -m recscale.launch --processes N -- python multiprocess_child.py JOBS.json``: every
process starts JAX's distributed runtime from the launcher's environment, then runs the jobs
one after another with the real trainer and evaluator (one start-up for many runs):
``{"kind": "train", "family": "dlrm", "args": [preset, "--workdir", DIR, ...]}`` or
``{"kind": "evaluate", "family": "dlrm", "workdir": DIR, "output": FILE}``, or
``{"kind": "staging", "output": PREFIX}`` (:func:`_staging`).

``MP_KILL='{"process": 1, "step": 6}'``: that process dies by SIGKILL right after dispatching
its 6th train step (0-based count of this start's steps), while the step's collectives are in
flight on every process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from recscale.launch import exit_at_once_on_error, initialize_from_env  # noqa: E402

initialize_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from recscale import families, sharding  # noqa: E402
from recscale.config import MeshConfig, parse_preset_cli  # noqa: E402
from recscale.embeddings import row_moves  # noqa: E402
from recscale.train import loop  # noqa: E402
from recscale.train.evaluation import EvalArgs, evaluate_workdir  # noqa: E402


def _install_kill(spec: dict) -> None:
    if jax.process_index() != spec["process"]:
        return
    init = loop._TrainRun.__init__

    def patched(self, *a, **k):
        init(self, *a, **k)
        step_fn, calls = self._train_step, [0]

        def killing(*args):
            out = step_fn(*args)  # dispatched: its collectives are running
            if calls[0] == spec["step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            calls[0] += 1
            return out

        self._train_step = killing

    loop._TrainRun.__init__ = patched


def _staging(prefix: str) -> None:
    """Saved buffers staged for a re-layout (``row_moves.staging``) on this run's mesh, with
    rows that divide over all its devices and rows that do not, each read back by every process
    (``row_moves.gather``) and written (``row_moves.scatter``): ``PREFIX<process>.json`` lists
    per shape the staging mesh's shape and whether the rows read and written were right."""
    mesh_cfg = MeshConfig(data_parallel=-1)
    out = []
    with sharding.activate(sharding.make_mesh(mesh_cfg), mesh_cfg):
        for shape in [(352, 3), (350, 8), (351,)]:
            s = row_moves.staging(shape)
            full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
            x = jax.make_array_from_callback(shape, s, lambda i, f=full: f[i], dtype=np.float32)
            idx = np.array([0, 5, shape[0] - 1, -1, 200], np.int32)
            want = full[idx]
            want[3] = 0  # index -1: no row
            read = bool(np.array_equal(row_moves.gather(x, idx), want))
            x = row_moves.scatter(x, np.array([7, -1], np.int32), np.full((2, *shape[1:]), -1.0))
            got = row_moves.gather(x, np.array([7, 8], np.int32))
            wrote = bool((got[0] == -1).all() and np.array_equal(got[1], full[8]))
            out.append(
                {"shape": list(shape), "mesh": dict(s.mesh.shape), "read": read, "wrote": wrote}
            )
    Path(f"{prefix}{jax.process_index()}.json").write_text(json.dumps(out))


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    if os.environ.get("MP_KILL"):
        _install_kill(json.loads(os.environ["MP_KILL"]))
    for job in jobs:
        if job["kind"] == "staging":
            _staging(job["output"])
            continue
        family = families.load(job["family"])  # checked against the registry
        if job["kind"] == "train":
            workdir, cfg = parse_preset_cli(f"{family.name}/", job["args"], prog="child")
            loop.train(cfg, family.build_model, workdir)
        else:
            evaluate_workdir(
                family.config_cls,
                family.build_model,
                EvalArgs(workdir=job["workdir"], output=job["output"]),
            )


if __name__ == "__main__":
    with exit_at_once_on_error():
        main()
