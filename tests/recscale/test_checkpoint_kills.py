"""SIGKILL at points of a checkpoint write (issue 7, items 1-2).

A child process (``ckpt_kill_child.py``: the real ``python -m dlrm.train`` with one orbax hook)
dies by SIGKILL in the middle of an item's write, after the write and before the step's commit
(the atomic rename of its temporary directory), or while an asynchronous save is in flight and
training goes on, at seeded moments. After each kill the step being written exists only as a
temporary directory, ``Checkpointer`` lists the two previous complete checkpoints (retention
has deleted neither for the uncommitted one) and restores them, and the plain CLI relaunch
restores the latest complete one and ends bitwise equal to one uninterrupted run: every logged
loss and the final state. With ``--train.max-checkpoints 1`` a loadable checkpoint exists after
a kill right after ``save`` returns and after a kill in the middle of retention's deletion,
and every step ``all_steps()`` lists loads: orbax alone deletes old steps in place, so such a
kill left a half-deleted step listed; ``Checkpointer`` has retention rename them into
``deleted/`` first (atomic) and purges them from there.

Every child costs seconds of JAX start-up, so they share a persistent compilation cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401  (registers dlrm/tiny)
from dlrm.model import build_model
from recscale import sharding
from recscale.config import get_preset
from recscale.train.checkpoint import DELETED, Checkpointer
from recscale.train.experiment import Experiment

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("ckpt_kill_child.py")
STEPS, EVERY, KEEP = 14, 3, 2  # saves at steps 3, 6, 9, 12 and the final 14; two kept
TMP = ".orbax-checkpoint-tmp"  # orbax's suffix of a directory not yet committed
DLRM_ITEMS = ("params", "opt_state")  # DLRM's pytree items (it has no batch_stats)
PHASES = ("mid_write", "before_commit", "async_inflight")


def _kill_cases(n: int = 5) -> list:
    """``n`` seeded kill moments. Phases take turns (each is hit), and so do their variants
    (which item is written first; death on entering the commit or just before its rename);
    the seed draws which save (the 3rd or 4th, so two complete checkpoints precede it), how
    long after the first item's write, and how many steps after an asynchronous save."""
    cases = []
    for seed in range(n):
        rng = np.random.default_rng(seed)
        phase, turn = PHASES[seed % len(PHASES)], seed // len(PHASES)
        step = EVERY * int(rng.integers(3, 5))
        delay = round(float(rng.uniform(0.0, 0.2)), 3)
        after_steps = int(rng.integers(1, EVERY))
        spec: dict[str, Any] = {"phase": phase, "step": step}
        if phase == "mid_write":
            spec.update(first=DLRM_ITEMS[turn % 2], delay=delay)
        elif phase == "before_commit":
            spec.update(at=("finalize", "rename")[turn % 2])
        else:
            spec.update(after_steps=after_steps)
        cases.append(pytest.param(spec, id=f"seed{seed}-{phase}-step{step}"))
    return cases


KILL_CASES = _kill_cases()


def _cli_args(workdir: Path, keep: int) -> list[str]:
    return [
        "dlrm/tiny",
        "--workdir",
        str(workdir),
        "--train.num-steps",
        str(STEPS),
        "--train.no-progress",
        "--train.log-every",
        "1",
        "--train.checkpoint-every",
        str(EVERY),
        "--train.max-checkpoints",
        str(keep),
    ]


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _train(workdir: Path, env: dict, keep: int = KEEP) -> subprocess.CompletedProcess:
    """The plain CLI, to the end."""
    proc = _run([sys.executable, "-m", "dlrm.train", *_cli_args(workdir, keep)], env)
    assert proc.returncode == 0, proc.stderr
    return proc


def _kill(workdir: Path, env: dict, spec: dict, keep: int = KEEP) -> dict:
    """Runs the child with the hook of ``spec``; it must die by SIGKILL. Returns the marker the
    hook wrote just before (``spec`` and the checkpoint directory's entries and files then)."""
    marker = workdir.parent / "kill.json"
    child_env = {**env, "CKPT_KILL": json.dumps({**spec, "marker": str(marker)})}
    proc = _run([sys.executable, str(CHILD), *_cli_args(workdir, keep)], child_env)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    hit = json.loads(marker.read_text())
    assert {k: hit[k] for k in spec} == spec  # the hook that killed it is the one asked for
    return hit


def _losses(workdir: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of metrics.jsonl's train rows, in file order (a relaunch appends)."""
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


def _raw_items(step_dir: Path) -> dict[str, Any]:
    """Every pytree item of a checkpoint step, restored by orbax without a target."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as c:
        return {
            p.name: c.restore(p.absolute())
            for p in sorted(step_dir.iterdir())
            if (p / "_METADATA").is_file()
        }


def _assert_trees_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert la and len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class Reference(NamedTuple):
    """The uninterrupted run: losses by step, final eval line, final state."""

    losses: dict[int, float]
    result: dict
    state: dict[str, Any]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """Children's environment: CPU, and one persistent compilation cache for all of them (the
    same executables, loaded instead of compiled: ~3 s of each child's ~8 s)."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


@pytest.fixture(scope="module")
def full(tmp_path_factory, env) -> Reference:
    wd = tmp_path_factory.mktemp("full") / "run"
    proc = _train(wd, env)
    losses = dict(_losses(wd))
    assert sorted(losses) == list(range(1, STEPS + 1))
    state = _raw_items(wd / "checkpoints" / str(STEPS))
    assert set(DLRM_ITEMS) <= set(state)
    return Reference(losses, json.loads(proc.stdout.splitlines()[-1]), state)


@pytest.fixture(scope="module")
def likes() -> dict[str, Any]:
    """``Checkpointer.restore`` targets: the trainer's abstract params and optimizer state
    (their tree structure, which the checkpoint's fingerprints are keyed by)."""
    cfg = get_preset("dlrm/tiny")
    # the children's one CPU device: the engine's buffers are laid out for it
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data_parallel=1))
    mesh = sharding.make_mesh(cfg.mesh)
    with sharding.activate(mesh, cfg.mesh):
        abstract = Experiment.build(cfg, build_model).abstract_state
    return {"params": abstract.params, "opt_state": abstract.opt_state}


def _inspect(ckpt_dir: Path, likes: dict) -> tuple[int | None, dict[int, str | None]]:
    """What a relaunch would see: ``latest_step()`` and, for each step of ``all_steps()``, None
    when ``Checkpointer.restore`` reads it (params, optimizer state, meta) or else the error."""
    ckpt = Checkpointer(ckpt_dir, async_save=False)
    try:
        errors: dict[int, str | None] = {}
        for step in ckpt.all_steps():
            try:
                trees, meta = ckpt.restore(step, likes)
                assert meta["step"] == step and all(jax.tree.leaves(t) for t in trees.values())
                errors[step] = None
            except Exception as e:  # recorded: the caller asserts on it
                errors[step] = f"{type(e).__name__}: {e}"
        return ckpt.latest_step(), errors
    finally:
        ckpt.close()


def _relaunch_equals_uninterrupted(
    workdir: Path, env: dict, full: Reference, keep: int, resume: int
) -> None:
    """The plain CLI relaunch restores ``resume`` and ends bitwise equal to ``full``."""
    killed = _losses(workdir)
    # Steps the killed run logged were already equal, the kill notwithstanding.
    assert all(loss == full.losses[s] for s, loss in killed) and killed
    proc = _train(workdir, env, keep)
    assert f"restored checkpoint step {resume} from" in proc.stderr
    resumed = _losses(workdir)[len(killed) :]
    assert [s for s, _ in resumed] == list(range(resume + 1, STEPS + 1))  # no step skipped
    assert [loss for _, loss in resumed] == [full.losses[s] for s in range(resume + 1, STEPS + 1)]
    assert json.loads(proc.stdout.splitlines()[-1]) == full.result  # final evaluation
    state = _raw_items(workdir / "checkpoints" / str(STEPS))
    assert set(state) == set(full.state)
    for item in full.state:
        _assert_trees_equal(state[item], full.state[item])
    # The relaunch saved the killed step again, replacing its temporary directory.
    assert not [p for p in os.listdir(workdir / "checkpoints") if TMP in p]


def _data_files(files: list[str], item_dir: str) -> list[str]:
    """Array chunk files (OCDBT ``d/`` entries) under ``item_dir``."""
    return [f for f in files if f.startswith(item_dir + "/") and "/d/" in f]


@pytest.mark.slow
@pytest.mark.parametrize("spec", KILL_CASES)
def test_sigkill_during_a_checkpoint_write_resumes_from_the_last_complete_one(
    tmp_path, env, full, likes, spec
):
    wd = tmp_path / "run"
    step = spec["step"]
    latest, previous = step - EVERY, step - 2 * EVERY
    hit = _kill(wd, env, spec)
    partial = f"{step}{TMP}"
    # Where it died: the step existed only as a temporary directory, in the state of its phase.
    assert partial in hit["entries"] and str(step) not in hit["entries"]
    files = hit["files"]
    if spec["phase"] == "mid_write":
        # Some but not all of the step's files: the first item's arrays, no other's.
        assert _data_files(files, f"{partial}/{spec['first']}{TMP}")
        for item in set(DLRM_ITEMS) - {spec["first"]}:
            assert not _data_files(files, f"{partial}/{item}{TMP}")
        assert not [f for f in files if f.startswith(partial) and "commit_success" in f]
    elif spec["phase"] == "before_commit":
        # Every item written and finalised; the step's own commit pending.
        for item in (*DLRM_ITEMS, "meta"):
            assert f"{partial}/{item}/commit_success.txt" in files
        assert hit["commit_file"] == (spec["at"] == "rename")
    else:
        # Training went on after save returned, with no array of the step written yet.
        assert hit["steps_after_save"] == spec["after_steps"] >= 1
        assert not _data_files(files, partial)

    # After the kill: the partial directory is there and never listed; the latest complete
    # checkpoint and the one before it (which keep-2 retention deletes only once the new step
    # commits) are listed and restore.
    ckpt_dir = wd / "checkpoints"
    listed = [p for p in os.listdir(ckpt_dir) if p != DELETED]  # retired steps wait there
    assert sorted(listed) == sorted([str(previous), str(latest), partial])
    latest_step, errors = _inspect(ckpt_dir, likes)
    assert latest_step == latest
    assert errors == {previous: None, latest: None}
    _relaunch_equals_uninterrupted(wd, env, full, KEEP, resume=latest)


@pytest.mark.slow
def test_keep_last_1_killed_right_after_save_returns_keeps_the_previous_checkpoint(
    tmp_path, env, full, likes
):
    # The save's writes are held, so the kill (0.5 s after save returned, time enough for the
    # background finalisation to do anything it would do before the commit) finds it
    # uncommitted: the only complete checkpoint must not have been deleted to make room for it.
    wd, step, previous = tmp_path / "run", 3 * EVERY, 2 * EVERY
    hit = _kill(wd, env, {"phase": "keep1_after_save", "step": step, "settle": 0.5}, keep=1)
    assert [e for e in hit["entries"] if e != DELETED] == [str(previous), f"{step}{TMP}"]
    latest_step, errors = _inspect(wd / "checkpoints", likes)
    assert latest_step == previous and errors == {previous: None}
    _relaunch_equals_uninterrupted(wd, env, full, keep=1, resume=previous)


class MidDelete(NamedTuple):
    workdir: Path
    hit: dict
    latest_step: int | None
    errors: dict[int, str | None]


@pytest.fixture(scope="module")
def mid_delete(tmp_path_factory, env, likes) -> MidDelete:
    """Keep-last-1, killed halfway through retention's deletion of the previous step (after the
    new step committed); what a relaunch would see, read before any relaunch."""
    wd = tmp_path_factory.mktemp("mid_delete") / "run"
    spec = {"phase": "keep1_mid_delete", "step": 3 * EVERY, "old_step": 2 * EVERY}
    hit = _kill(wd, env, spec, keep=1)
    assert 0 < hit["unlinked"] < hit["of"]
    return MidDelete(wd, hit, *_inspect(wd / "checkpoints", likes))


@pytest.mark.slow
def test_keep_last_1_killed_while_deleting_the_previous_checkpoint_keeps_the_new_one(
    mid_delete, env, full
):
    step = 3 * EVERY
    assert mid_delete.latest_step == step and mid_delete.errors[step] is None
    _relaunch_equals_uninterrupted(mid_delete.workdir, env, full, keep=1, resume=step)


@pytest.mark.slow
def test_every_listed_step_is_loadable_after_a_kill_during_retention(mid_delete):
    assert mid_delete.errors == dict.fromkeys(mid_delete.errors)
