"""The trainer's parts: the hook protocol (each point called when the loop says), the plain
progress lines of a run whose output is not a terminal, and nested timing phases."""

import dataclasses
import itertools
import json
import math
import re
import shutil

import pytest

import dlrm.presets  # noqa: F401
from dlrm.model import build_model
from recscale.config import get_preset
from recscale.train import loop, timing
from recscale.train.checkpoint import Checkpointer
from recscale.train.hooks import Hook, Hooks
from recscale.train.progress import duration


def _tiny(**train):
    cfg = get_preset("dlrm/tiny")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


class Recorder(Hook):
    """Records every call; adds a train-row column and a checkpoint-meta entry."""

    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, restored, meta, step):
        self.calls.append(("start", restored, meta.get("recorder"), step))

    def batches(self, batches):
        self.calls.append(("batches",))
        return batches

    def host_batch(self, state, batch, *, train):
        self.calls.append(("host_batch", train))
        return state, batch

    def before_step(self, step, state, batch):
        assert int(state.step) == step  # the state before the update
        self.calls.append(("before_step", step))

    def train_row(self):
        self.calls.append(("train_row",))
        return {"recorder/rows": sum(c[0] == "train_row" for c in self.calls)}

    def evaluated(self, step, ev, state):
        self.calls.append(("evaluated", step, sorted(ev) == sorted(EVAL_KEYS)))

    def before_save(self, state, step):
        self.calls.append(("before_save", step))
        return state

    def meta(self):
        return {"recorder": "saved"}

    def after_save(self, step, ckpt):
        self.calls.append(("after_save", step, step in ckpt.all_steps()))

    def wants_final_eval(self, step):
        return False

    def result(self, step, last):
        self.calls.append(("result", step, last))
        return None

    def close(self):
        self.calls.append(("close",))


EVAL_KEYS = ("auc", "calibration", "logloss", "mean_label", "mean_prediction", "ne")
EVAL_KEYS += ("num_examples", "weight_sum")


def _with(monkeypatch, recorder: Recorder) -> None:
    make = loop._hooks
    monkeypatch.setattr(loop, "_hooks", lambda *a: Hooks([*make(*a), recorder]))


def test_a_hook_is_called_at_each_point_of_the_loop(tmp_path, monkeypatch):
    rec = Recorder()
    _with(monkeypatch, rec)
    wd = tmp_path / "run"
    cfg = _tiny(num_steps=6, log_every=2, eval_every=3, eval_max_batches=2, checkpoint_every=4)
    loop.train(cfg, build_model, wd)
    calls = rec.calls
    assert calls[0] == ("start", None, None, 0) and calls[1] == ("batches",)
    names = [c[0] for c in calls]
    assert [c[1] for c in calls if c[0] == "before_step"] == list(range(6))
    assert names.count("train_row") == 3  # steps 2, 4, 6
    assert [c[1:] for c in calls if c[0] == "evaluated"] == [(3, True)]
    train_batches = [c for c in calls if c == ("host_batch", True)]
    assert len(train_batches) == 6
    # the evaluation's batches: step 3's (eval_max_batches) and the final evaluation's
    eval_batches = sum(c == ("host_batch", False) for c in calls)
    assert eval_batches == 2 + math.ceil(
        cfg.data.synthetic.num_eval_examples / cfg.data.eval_batch_size
    )
    assert [c[1:] for c in calls if c[0] == "before_save"] == [(4,), (6,)]
    assert [c[1:] for c in calls if c[0] == "after_save"] == [(4, True), (6, True)]
    # the result is asked for after the final checkpoint; none: the final evaluation runs
    end = names.index("result")
    assert calls[end] == ("result", 6, None) and end > names.index("after_save")
    assert set(calls[end + 1 : -1]) == {("host_batch", False)} and calls[-1] == ("close",)
    # each step's batch goes through host_batch before before_step sees it on the device
    first = names.index("before_step")
    assert names[first - 1] == "host_batch"
    rows = [json.loads(r) for r in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [r["recorder/rows"] for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert Checkpointer(wd / "checkpoints", async_save=False).read_meta(6)["recorder"] == "saved"

    # A resume hands the hook the checkpoint's step and its meta entry back.
    shutil.rmtree(wd / "checkpoints" / "6")
    rec2 = Recorder()
    _with(monkeypatch, rec2)
    loop.train(cfg, build_model, wd)
    assert rec2.calls[0] == ("start", 4, "saved", 4)
    assert [c[1] for c in rec2.calls if c[0] == "before_step"] == [4, 5]


def test_a_run_off_a_terminal_prints_a_progress_line_per_log_interval(
    tmp_path, monkeypatch, capsys
):
    """Under pytest's capture stdout is no terminal: a line per log interval on stderr, no bar
    on stdout; ``train.progress=False`` prints none."""
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(var, raising=False)
    capsys.readouterr()
    loop.train(_tiny(num_steps=6, log_every=2, progress=True), build_model, tmp_path / "a")
    out, err = capsys.readouterr()
    line = re.compile(r"step (\d)/6  loss \d\.\d{4}  [\d,]+ ex/s  ETA (\d+)s")
    found = [m for m in map(line.fullmatch, err.splitlines()) if m]
    assert [int(m[1]) for m in found] == [2, 4, 6], err
    assert found[-1][2] == "0"  # nothing left after the last step
    # no progress bar (the embedding plan's table borders are drawn with the same character)
    bars = [x for x in (out + err).splitlines() if "━" in x and x.lstrip()[:1] not in "┏┡"]
    assert not bars, bars
    loop.train(_tiny(num_steps=6, log_every=2, progress=False), build_model, tmp_path / "b")
    assert not any(map(line.fullmatch, capsys.readouterr().err.splitlines()))


def test_duration():
    assert [duration(s) for s in (0.4, 59, 61, 3599, 3600, 11_100)] == [
        "0s",
        "59s",
        "1m01s",
        "59m59s",
        "1h00m",
        "3h05m",
    ]


def test_a_phase_inside_another_pauses_it(monkeypatch):
    # a enters at 0, b enters at 2 and exits at 5, a exits at 6; then on by 1 a reading
    clock = itertools.chain([0.0, 2.0, 5.0, 6.0], itertools.count(7.0)).__next__
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    t = timing.PhaseTimer()
    with t.phase("a"):
        with t.phase("b"):
            pass
    assert t.seconds == {"a": 3.0, "b": 3.0} and t.counts == {"a": 1, "b": 1}
    with pytest.raises(RuntimeError, match="'a' started inside itself"):
        with t.phase("a"), t.phase("a"):
            pass


def test_hooks_pass_the_state_and_batch_through_each_in_order():
    class Add(Hook):
        def __init__(self, k):
            self.k = k

        def host_batch(self, state, batch, *, train):
            return state + [self.k], batch

        def meta(self):
            return {f"m{self.k}": self.k}

    hooks = Hooks([Add(1), Add(2)])
    assert hooks.host_batch([], "b", train=True) == ([1, 2], "b")
    assert hooks.meta() == {"m1": 1, "m2": 2}
    assert Hooks([]).stop_reason() is None and not Hooks([]).needs_every_eval
