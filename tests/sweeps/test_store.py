"""The sweep directory's claims and append-only results."""

from __future__ import annotations

import builtins
import dataclasses
import io
import json
import os
import time

import pytest

from sweeps.store import SweepStore, read_results, read_tolerant


def row(tid, status="SUCCESS"):
    return {"trial_id": tid, "status": status}


def test_truncated_last_line_is_skipped_then_repaired(tmp_path):
    store = SweepStore(tmp_path)
    store.append_result(row("a"))
    store.append_result(row("b"))
    with open(store.results_path, "a") as f:
        f.write('{"trial_id": "c", "sta')  # a writer killed mid-append
    res = read_results(store.results_path)
    assert [r["trial_id"] for r in res.rows] == ["a", "b"] and res.truncated == 1
    assert store.finished_ids() == {"a", "b"}  # so trial c is run again
    assert store.append_result(row("c"))
    res = read_results(store.results_path)
    assert [r["trial_id"] for r in res.rows] == ["a", "b", "c"] and res.truncated == 0
    saved = (tmp_path / "results.truncated.jsonl").read_text()
    assert saved == '{"trial_id": "c", "sta\n'  # kept for audit, not silently dropped


def test_corruption_in_the_middle_names_the_line(tmp_path):
    p = tmp_path / "results.jsonl"
    p.write_text('{"trial_id": "a"}\nnot json\n{"trial_id": "b"}\n')
    with pytest.raises(ValueError, match="results.jsonl:2"):
        read_results(p)


def test_append_is_idempotent_per_trial(tmp_path):
    store = SweepStore(tmp_path)
    assert store.append_result(row("a"))
    assert not store.append_result(row("a", "FAILED"))
    assert len(store.results()) == 1


def test_claims_heartbeats_and_takeover(tmp_path):
    store = SweepStore(tmp_path, stale_after=5.0)
    assert store.claim("t", "A") == "new"
    assert store.claim("t", "B") is None  # live owner
    assert store.status("t") == "RUNNING"
    claim = tmp_path / "trials" / "t" / "claim.json"
    old = time.time() - 10
    os.utime(claim, (old, old))  # A's heartbeat stopped 10 s ago
    assert store.status("t") == "STALE"
    assert store.claim("t", "B") == "takeover"
    assert not store.heartbeat("t", "A")  # A learns it lost the trial
    assert store.heartbeat("t", "B")
    store.append_result(row("t"))
    assert store.claim("t", "C") is None and store.status("t") == "SUCCESS"
    events = [json.loads(x)["event"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["claim", "takeover", "claim"]


def test_a_torn_attempt_line_does_not_block_the_trial(tmp_path, capsys):
    """A worker killed while appending to ``attempts.jsonl`` leaves a line without its newline
    (or, on some file systems after a crash, zeros): the trial's next attempt is recorded on a
    line of its own, and every read skips the torn line, counted and reported once."""
    store = SweepStore(tmp_path)
    store.trial_dir("t").mkdir(parents=True)
    store.record_attempt("t", {"exit_code": 1, "owner": "A"})
    path = store.trial_dir("t") / "attempts.jsonl"
    with open(path, "ab") as f:
        f.write(b'{"exit_code": 0, "ow')  # B killed mid-append
    assert store.attempts("t") == [{"exit_code": 1, "owner": "A"}]
    store.record_attempt("t", {"exit_code": 1, "owner": "C"})
    with open(path, "ab") as f:
        f.write(b"\0\0\0\n")  # a zero-filled tail
    store.record_attempt("t", {"exit_code": 0, "owner": "D"})
    assert [a["owner"] for a in store.attempts("t")] == ["A", "C", "D"]
    assert read_tolerant(path).truncated == 2
    err = capsys.readouterr().err
    assert err.count("attempts.jsonl: skipped") == 1 and "warning:" in err  # once per file
    assert path.read_bytes().splitlines()[1] == b'{"exit_code": 0, "ow'  # kept, for audit


class _DiesHalfway:
    """A file whose write stops halfway and fails, as a process killed mid-write leaves it."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(28, "No space left on device (a simulated kill)")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _dying_writes(monkeypatch, name: str) -> None:
    """Every write of a file whose name contains ``name`` (a temporary one too) dies halfway."""
    real = io.open

    def fake_open(file, mode="r", *a, **k):
        f = real(file, mode, *a, **k)
        if any(c in mode for c in "wxa") and name in os.path.basename(os.fspath(file)):
            return _DiesHalfway(f)
        return f

    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(builtins, "open", fake_open)


def test_sweep_trial_and_config_json_are_written_whole(tmp_path, monkeypatch):
    from sweeps.launch import write_sweep
    from sweeps.spec import FamilySpec, SweepSpec, dlrm_ladder, resolve

    fam = FamilySpec(family="dlrm", preset="dlrm/tiny", ladder=dlrm_ladder(((4, (8, 4), (8, 1)),)))
    small = SweepSpec(name="t", families=(fam,), budgets=(2e7,), min_steps=5, code_version="x")
    big = dataclasses.replace(small, budgets=(2e7, 6e7))
    store = SweepStore(tmp_path)
    write_sweep(store, small, resolve(small))
    sweep_json = (tmp_path / "sweep.json").read_bytes()
    # A launcher killed while rewriting sweep.json leaves the old one whole.
    with monkeypatch.context() as m:
        _dying_writes(m, "sweep.json")
        with pytest.raises(OSError, match="simulated kill"):
            write_sweep(store, big, resolve(big))
    assert (tmp_path / "sweep.json").read_bytes() == sweep_json
    # One killed while writing a new trial's config.json: the next launch writes it whole.
    res = resolve(big)
    with monkeypatch.context() as m:
        _dying_writes(m, "config.json")
        with pytest.raises(OSError, match="simulated kill"):
            write_sweep(store, big, res)
    write_sweep(store, big, res)
    assert json.loads((tmp_path / "sweep.json").read_text())["trial_ids"] == [
        t.trial_id for t in res.trials
    ]
    for t in res.trials:
        tdir = store.trial_dir(t.trial_id)
        assert json.loads((tdir / "config.json").read_text()) == t.config
        assert json.loads((tdir / "trial.json").read_text()) == json.loads(json.dumps(t.to_dict()))
    leftovers = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []
