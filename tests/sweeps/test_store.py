"""The sweep directory's claims and append-only results."""

from __future__ import annotations

import json
import os
import time

import pytest

from sweeps.store import SweepStore, read_results


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
