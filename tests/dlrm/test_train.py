"""End to end: train, checkpoint, resume bitwise, 1 vs 8 devices, evaluate from a workdir."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import dlrm.presets  # noqa: F401
from dlrm import evaluate as dlrm_evaluate
from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale import config as config_lib
from recscale.config import get_preset
from recscale.train import experiment, loop
from recscale.train.early_stopping import BestTracker, EarlyStopping
from recscale.train.loop import train
from tests.run_files import trained_parameters

REPO = Path(__file__).resolve().parents[2]


def _tiny(**train_overrides):
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, progress=False, **train_overrides)
    )


def _rows(workdir, split="train"):
    return [
        r
        for r in map(json.loads, (Path(workdir) / "metrics.jsonl").read_text().splitlines())
        if r["split"] == split
    ]


def _ckpt_params(workdir, step):
    import orbax.checkpoint as ocp

    path = Path(workdir) / "checkpoints" / str(step) / "params"
    with ocp.StandardCheckpointer() as c:
        return c.restore(path.absolute())


def test_every_tiny_preset_trains_two_steps(tmp_path):
    from recscale.config import preset_names

    tiny = [n for n in preset_names("dlrm/") if n.endswith("/tiny")]
    assert tiny
    for name in tiny:
        cfg = get_preset(name)
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, num_steps=2, progress=False, log_every=1)
        )
        wd = tmp_path / name.replace("/", "_")
        result = train(cfg, build_model, wd)
        assert result["step"] == 2
        assert {"auc", "logloss", "ne", "calibration", "num_examples"} <= set(result)
        assert result["num_examples"] == cfg.data.synthetic.num_eval_examples
        losses = [r["loss"] for r in _rows(wd)]
        assert len(losses) == 2 and all(np.isfinite(losses))
        assert config_lib.load_json(type(cfg), wd / "config.json") == cfg
        assert (wd / "command.txt").read_text().strip()
        assert (wd / "checkpoints" / "2").is_dir()


def test_tiny_learns_and_accounts_for_its_wall_time(tmp_path):
    experiment._PROGRAMS.clear()  # compiled here, not reused from an earlier test in this process
    wd = tmp_path / "run"
    t0 = time.time()
    cfg = _tiny(num_steps=150, log_every=50, eval_every=50, checkpoint_every=75)
    result = train(cfg, build_model, wd)
    t1 = time.time()
    assert result["auc"] > 0.65, result
    # timings.jsonl: every step, evaluation and checkpoint in its phase, compiles where they ran.
    (row,) = map(json.loads, (wd / "timings.jsonl").read_text().splitlines())
    ph = row["phases"]
    assert ph["train"]["count"] == ph["data"]["count"] == 150
    assert ph["eval"]["count"] == 2 and ph["final_eval"]["count"] == 1  # steps 50, 100; 150
    assert ph["checkpoint"]["count"] == 2  # step 75 and the final one
    built = {k: v["compiles"] for k, v in ph.items()}  # compiled, or loaded from the cache
    assert built["init"] >= 1 and built["train"] == 1
    assert built["eval"] >= 1 and built["final_eval"] == 0  # the eval program is built once
    assert 0 < ph["train"]["compile_s"] < ph["train"]["seconds"]
    assert t0 <= row["entered_at"] <= row["exited_at"] <= t1
    assert sum(p["seconds"] for p in ph.values()) == pytest.approx(row["total_s"], abs=1e-3)
    assert row["total_s"] <= row["exited_at"] - row["entered_at"]
    assert (row["start_step"], row["end_step"]) == (0, 150)


def test_runs_of_one_model_in_one_process_share_programs_and_results(tmp_path):
    """A second run differing only in length, seed, learning rates and cadences reuses the
    first run's compiled programs (no compile, no cache load) and gets bitwise the results of
    compiling its own; a different model compiles its own."""
    base = get_preset("dlrm/tiny")

    def cfg(steps, seed, lr, **model):
        c = _tiny(num_steps=steps, seed=seed, log_every=1, eval_every=0, checkpoint_every=steps)
        return dataclasses.replace(
            c,
            model=dataclasses.replace(base.model, **model),
            dense_optim=dataclasses.replace(base.dense_optim, learning_rate=lr, warmup_steps=2),
        )

    def built(wd):
        (row,) = map(json.loads, (wd / "timings.jsonl").read_text().splitlines())
        return {k: v["compiles"] for k, v in row["phases"].items() if v["compiles"]}

    experiment._PROGRAMS.clear()
    train(cfg(6, 0, 3e-3), build_model, tmp_path / "a")
    second = cfg(9, 1, 1e-3)
    train(second, build_model, tmp_path / "b")
    assert built(tmp_path / "b") == {}  # init, train and eval steps all reused
    experiment._PROGRAMS.clear()
    train(second, build_model, tmp_path / "b_alone")
    assert built(tmp_path / "b_alone")["train"] == 1
    assert [r["loss"] for r in _rows(tmp_path / "b")] == [
        r["loss"] for r in _rows(tmp_path / "b_alone")
    ]
    for x, y in zip(
        jax.tree.leaves(_ckpt_params(tmp_path / "b", 9)),
        jax.tree.leaves(_ckpt_params(tmp_path / "b_alone", 9)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    wider = cfg(6, 0, 3e-3, top_mlp=(32, 1))
    train(wider, build_model, tmp_path / "c")
    assert built(tmp_path / "c")["train"] == 1


def test_resume_equals_uninterrupted_bitwise_and_differs_from_cold_start(tmp_path, capsys):
    cfg = _tiny(
        num_steps=8, checkpoint_every=4, log_every=1, max_checkpoints=5, async_checkpoint=True
    )
    full = tmp_path / "full"
    train(cfg, build_model, full)

    def interrupted_copy(name):
        # The state a run killed after step 4 leaves: checkpoint 4 and the metrics of steps 1..4.
        wd = tmp_path / name
        shutil.copytree(full, wd)
        shutil.rmtree(wd / "checkpoints" / "8")
        rows = [r for r in _rows(wd) if r["step"] <= 4]
        (wd / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return wd

    resumed = interrupted_copy("resumed")
    capsys.readouterr()
    train(cfg, build_model, resumed)
    assert "restored checkpoint step 4" in capsys.readouterr().err
    full_rows, res_rows = _rows(full), _rows(resumed)
    assert [r["step"] for r in res_rows] == list(range(1, 9))  # resumed at 5: no step twice
    assert [r["loss"] for r in res_rows] == [r["loss"] for r in full_rows]  # bitwise
    a, b = _ckpt_params(full, 8), _ckpt_params(resumed, 8)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # The restored state is what the continuation depends on: swap in checkpoint 4 of a run with
    # another seed (a different state at the same step), and steps 5..8 no longer match.
    other = tmp_path / "other_seed"
    train(
        dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=1)), build_model, other
    )
    swapped = interrupted_copy("swapped")
    shutil.rmtree(swapped / "checkpoints" / "4")
    shutil.copytree(other / "checkpoints" / "4", swapped / "checkpoints" / "4")
    train(cfg, build_model, swapped)
    swapped_losses = [r["loss"] for r in _rows(swapped) if r["step"] > 4]
    assert all(
        x != y for x, y in zip(swapped_losses, [r["loss"] for r in full_rows[4:]], strict=True)
    )


@pytest.mark.parametrize("embeddings", ["auto", "off"])
def test_one_device_equals_eight(tmp_path, embeddings):
    """The engine (its plan differs on 1 and 8 devices) and the per-table reference (rows
    sharded over the devices) train the same on one device and on eight."""
    results = {}
    for n in (1, 8):
        cfg = _tiny(num_steps=6, log_every=1)
        cfg = dataclasses.replace(
            cfg,
            mesh=dataclasses.replace(cfg.mesh, data_parallel=n),
            embeddings=dataclasses.replace(cfg.embeddings, sharding=embeddings),
        )
        wd = tmp_path / f"d{n}"
        train(cfg, build_model, wd)
        results[n] = (
            [r["loss"] for r in _rows(wd)],
            trained_parameters(DLRMConfig, build_model, wd),
        )
    np.testing.assert_allclose(results[1][0], results[8][0], rtol=1e-5)
    assert results[1][1].keys() == results[8][1].keys()
    assert any(k.startswith("table/") for k in results[1][1])
    for k, x in results[1][1].items():
        np.testing.assert_allclose(results[8][1][k], x, rtol=1e-4, atol=1e-6, err_msg=k)


def test_evaluate_round_trip_from_workdir(tmp_path, capsys):
    wd = tmp_path / "run"
    cfg = _tiny(num_steps=6, checkpoint_every=3, log_every=3)
    final = train(cfg, build_model, wd)
    capsys.readouterr()
    out_file = tmp_path / "eval.json"
    got = dlrm_evaluate.main(["--workdir", str(wd), "--output", str(out_file)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == got == json.loads(out_file.read_text())
    for key in ("auc", "logloss", "ne", "calibration", "num_examples", "step"):
        assert got[key] == final[key], key
    # Inference with int8 row-wise tables (fused dequantize-and-pool): close to float32, not
    # equal (the quantized tables ran: a row's codes are within scale/2 of its values).
    int8 = dlrm_evaluate.main(["--workdir", str(wd), "--embeddings-int8"])
    assert int8["embeddings"] == "int8" and int8["num_examples"] == got["num_examples"]
    assert int8["logloss"] != got["logloss"]
    np.testing.assert_allclose(int8["logloss"], got["logloss"], rtol=1e-3)
    np.testing.assert_allclose(int8["auc"], got["auc"], atol=1e-2)
    earlier = dlrm_evaluate.main(["--workdir", str(wd), "--step", "3"])
    assert earlier["step"] == 3 and earlier["auc"] != got["auc"]
    # A missing checkpoint or run is one line naming it (the CLI prints it, no traceback).
    with pytest.raises(SystemExit, match=r"^error: no checkpoint for step 5 .*available steps"):
        dlrm_evaluate.main(["--workdir", str(wd), "--step", "5"])
    with pytest.raises(SystemExit, match=r"^error: .*nope/config\.json not found"):
        dlrm_evaluate.main(["--workdir", str(tmp_path / "nope")])


@pytest.mark.slow
def test_command_line_train_then_evaluate(tmp_path):
    wd = tmp_path / "cli"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrm.train",
            "dlrm/tiny",
            "--workdir",
            str(wd),
            "--train.num-steps",
            "4",
            "--train.no-progress",
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    assert json.loads((wd / "config.json").read_text())["train"]["num_steps"] == 4
    assert "dlrm/tiny" in (wd / "command.txt").read_text()
    out = subprocess.run(
        [sys.executable, "-m", "dlrm.evaluate", "--workdir", str(wd)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["step"] == 4 and 0.0 <= result["auc"] <= 1.0


def test_frappe_short_run_on_real_data(tmp_path, frappe_dir):
    cfg = get_preset("dlrm/frappe")
    data = dataclasses.replace(
        cfg.data, train_path=str(frappe_dir / "train.csv"), eval_path=str(frappe_dir / "valid.csv")
    )
    cfg = dataclasses.replace(
        cfg,
        data=data,
        train=dataclasses.replace(
            cfg.train, num_steps=40, eval_every=0, checkpoint_every=0, progress=False, log_every=20
        ),
    )
    result = train(cfg, build_model, tmp_path / "frappe")
    assert result["num_examples"] == 57_722
    assert result["auc"] > 0.9, result


def test_resuming_with_a_changed_config_is_refused(tmp_path):
    wd = tmp_path / "run"
    train(_tiny(num_steps=2), build_model, wd)
    changed = _tiny(num_steps=2)
    changed = dataclasses.replace(
        changed, dense_optim=dataclasses.replace(changed.dense_optim, learning_rate=0.5)
    )
    with pytest.raises(ValueError, match=r"dense_optim.learning_rate: saved 0.003, now 0.5"):
        train(changed, build_model, wd)


def test_resuming_with_changed_logging_fields_is_allowed(tmp_path):
    wd = tmp_path / "run"
    train(_tiny(num_steps=2), build_model, wd)
    result = train(_tiny(num_steps=2, log_every=1, eval_every=1), build_model, wd)
    assert result["step"] == 2


def test_init_from_another_run_restores_its_parameters(tmp_path):
    a = train(_tiny(num_steps=6), build_model, tmp_path / "a")
    b = train(_tiny(num_steps=0, init_from=str(tmp_path / "a")), build_model, tmp_path / "b")
    fresh = train(_tiny(num_steps=0), build_model, tmp_path / "fresh")
    assert b["step"] == 0
    assert b["auc"] == a["auc"] and b["logloss"] == a["logloss"]
    assert fresh["logloss"] != a["logloss"]
    with pytest.raises(FileNotFoundError, match="init_from"):
        train(_tiny(num_steps=1, init_from=str(tmp_path / "nope")), build_model, tmp_path / "c")


def test_early_stopping_keeps_and_reports_the_best_checkpoint(tmp_path, capsys):
    """BARS protocol: with a min_delta no evaluation can beat, the first evaluation stays the
    best, the run stops after `patience` evaluations, and its result is the best parameters'
    full evaluation, which `evaluate --best` repeats; a relaunch trains no further."""
    wd = tmp_path / "run"
    cfg = _tiny(
        num_steps=40,
        eval_every=4,
        log_every=4,
        early_stopping_metric="logloss",
        early_stopping_patience=2,
        early_stopping_min_delta=1.0,
    )
    result = train(cfg, build_model, wd)
    assert result["stopped_early"] and result["best_step"] == 4 and result["step"] == 12
    evals = _rows(wd, "eval")
    assert [r["step"] for r in evals] == [4, 8, 12]
    best_row = _rows(wd, "eval_best")[-1]
    assert best_row["step"] == 4 and best_row["logloss"] == result["logloss"]
    capsys.readouterr()
    again = dlrm_evaluate.main(["--workdir", str(wd), "--best"])
    assert again["step"] == 4
    for key in ("auc", "logloss", "num_examples"):
        assert again[key] == result[key], key
    latest = dlrm_evaluate.main(["--workdir", str(wd)])
    assert latest["step"] == 12 and latest["logloss"] != result["logloss"]
    relaunch = train(cfg, build_model, wd)
    assert relaunch["step"] == 12 and relaunch["logloss"] == result["logloss"]
    assert [r["step"] for r in _rows(wd, "eval")] == [4, 8, 12]  # no training after the stop
    # Without the impossible min_delta the same run improves and keeps training past step 12.
    free = train(
        dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, early_stopping_min_delta=0.0, num_steps=16)
        ),
        build_model,
        tmp_path / "free",
    )
    assert free["best_step"] > 4 and free["step"] == 16
    with pytest.raises(ValueError, match="eval_every"):
        _tiny(early_stopping_metric="auc")


def test_early_stopping_best_survives_a_resume_that_replays_differently(
    tmp_path, monkeypatch, capsys
):
    """Killed after a new best (step 6) but before the regular checkpoint that records it: the
    resumed state (step 4) names best 4, which must still be there though the resumed run,
    with another evaluation cadence (resumes allow it), never evaluates step 6 again; the stale
    later best is dropped."""
    from recscale.train.checkpoint import Checkpointer

    wd = tmp_path / "run"
    cfg = _tiny(
        num_steps=8,
        eval_every=2,
        checkpoint_every=4,
        log_every=2,
        early_stopping_metric="logloss",
        early_stopping_patience=10,
    )
    original = EarlyStopping.evaluated

    def killed_after_best_6(self, done, ev, state):
        original(self, done, ev, state)
        if done == 6:
            raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(EarlyStopping, "evaluated", killed_after_best_6)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, build_model, wd)
    monkeypatch.setattr(EarlyStopping, "evaluated", original)
    assert Checkpointer(wd / "checkpoints", async_save=False).all_steps() == [4]
    assert 6 in Checkpointer(wd / "checkpoints_best", async_save=False).all_steps()
    no_evals = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=100))
    # The resume's restore: the state is step 4's, naming best 4; the bests after it are gone.
    from recscale import sharding
    from recscale.train.timing import PhaseTimer

    run_cfg = config_lib.absolute_paths(no_evals)
    mesh = sharding.make_mesh(run_cfg.mesh)
    with sharding.activate(mesh, run_cfg.mesh):
        exp = experiment.Experiment.build(run_cfg, build_model, workdir=str(wd))
        run = loop._TrainRun(run_cfg, build_model, exp, wd, PhaseTimer())
        run.restore_or_init()
        (early,) = run.hooks
        assert run.start_step == 4 and early.tracker.best_step == 4
        assert early.best_ckpt.all_steps() == [2, 4]
        run.ckpt.close()
        early.close()
    # Going on, the last step is a candidate too (logloss still falls): it is the best.
    resumed = train(no_evals, build_model, wd)
    assert resumed["step"] == 8 and resumed["best_step"] == 8
    assert Checkpointer(wd / "checkpoints_best", async_save=False).all_steps() == [8]
    final = dlrm_evaluate.main(["--workdir", str(wd)])  # the last checkpoint is the best
    assert final["logloss"] == resumed["logloss"]


def test_early_stopping_never_takes_a_nonfinite_evaluation_as_best():
    es = BestTracker(
        _tiny(eval_every=1, early_stopping_metric="auc", early_stopping_patience=3).train
    )
    assert not es.observe(1, {"auc": float("nan")})  # a one-class AUC on few batches
    assert es.observe(2, {"auc": 0.7}) and es.best_step == 2
    assert not es.observe(3, {"auc": float("nan")}) and es.best_step == 2
    assert es.observe(4, {"auc": 0.8}) and es.best_step == 4 and not es.stopped


def test_entry_points_print_config_errors_as_one_line(tmp_path):
    wd = tmp_path / "run"
    wd.mkdir()
    d = config_lib.to_dict(get_preset("dlrm/tiny"))
    d["model"]["top_mlp"] = [16, 2]
    (wd / "config.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match=r"^error: .*config\.json\.model: top_mlp must end in 1"):
        dlrm_evaluate.main(["--workdir", str(wd)])
    # A config's own check raised while a run is set up is one line; any other ValueError (a
    # bug) keeps its traceback.
    from recscale.train.cli import one_line_errors

    with pytest.raises(SystemExit, match=r"^error: top_mlp must end in 1"), one_line_errors():
        dataclasses.replace(get_preset("dlrm/tiny").model, top_mlp=(16, 2))
    with pytest.raises(ValueError, match="^not a config check$"), one_line_errors():
        raise ValueError("not a config check")
