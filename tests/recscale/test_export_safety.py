"""``recscale.export`` deletes nothing it did not make (issue 35): it writes into a new folder of
its own beside ``--out`` and renames it into place; an existing ``--out`` is refused unless
``--replace`` names it, and then only a folder that is a serving artifact and nothing else."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import dlrm.presets  # noqa: F401
from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale import export
from recscale.config import get_preset
from recscale.serving import export as serving_export
from recscale.serving.export import ExportArgs
from recscale.serving.runtime import FORMAT, Model
from recscale.train.loop import train


def _tree(path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """dlrm/tiny trained 4 steps in a folder named ``model.tmp``: what the old exporter deleted
    (``<out>.tmp``) when asked for ``--out model``."""
    root = tmp_path_factory.mktemp("export_safety")
    wd = root / "model.tmp"
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, num_steps=4, progress=False)
    )
    train(cfg, build_model, wd, argv=["-m", "dlrm.train", "dlrm/tiny"])
    return root, wd


def _export(wd, out, *extra):
    return export.main(["--workdir", str(wd), "--out", str(out), *extra])


def test_export_beside_a_run_named_like_its_old_temporary_folder_keeps_the_run(runs):
    root, wd = runs
    before = _tree(wd)
    assert any(k.startswith("checkpoints/") for k in before)
    out = root / "model"
    man = _export(wd, out)
    assert man["format"] == FORMAT and Model.load(out).manifest["source"]["step"] == 4
    assert _tree(wd) == before  # the run, checkpoints included, untouched
    # nothing left beside it: the export's own temporary folder was renamed into place
    assert sorted(p.name for p in root.iterdir()) == ["model", "model.tmp"]


def test_an_existing_out_is_refused_unless_replace_and_only_an_artifact_is_replaced(
    runs, tmp_path, capsys
):
    _, wd = runs
    out = tmp_path / "m"
    _export(wd, out)
    first = _tree(out)
    # exists: a one-line error, nothing written or deleted
    with pytest.raises(SystemExit, match=r"^error: --out .*/m: exists; pass --replace"):
        _export(wd, out)
    assert _tree(out) == first
    # --replace of an artifact: replaced by rename, no temporary folder left
    (out / "manifest.json").write_text(
        json.dumps({**json.loads((out / "manifest.json").read_text()), "family": "old"})
    )
    _export(wd, out, "--replace")
    assert json.loads((out / "manifest.json").read_text())["family"] == "dlrm"
    assert sorted(os.listdir(tmp_path)) == ["m"]
    # --replace of a folder that holds more than an artifact's files (a run folder with a
    # planted manifest.json, a user's notes): refused, every file kept
    (out / "notes.txt").write_text("mine")
    kept = _tree(out)
    with pytest.raises(SystemExit, match=r"holds 'notes.txt', which no export writes"):
        _export(wd, out, "--replace")
    assert _tree(out) == kept
    # --replace of a folder whose manifest is not an artifact's, or of a file: refused
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"format": "something else"}')
    with pytest.raises(SystemExit, match=f"has no {FORMAT} manifest.json"):
        _export(wd, other, "--replace")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="is not a folder"):
        _export(wd, tmp_path / "file", "--replace")
    assert (other / "manifest.json").is_file() and (tmp_path / "file").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["file", "m", "other"]


def test_a_failed_export_deletes_only_its_own_temporary_folder(runs, tmp_path, monkeypatch):
    _, wd = runs
    (tmp_path / "m.tmp").mkdir()  # a folder that is not the export's: kept
    (tmp_path / "m.tmp" / "keep").write_text("x")

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(serving_export.shutil, "copyfile", fail)  # its last write
    with pytest.raises(OSError, match="disk full"):
        serving_export.export_workdir(
            DLRMConfig, build_model, ExportArgs(workdir=str(wd), out=str(tmp_path / "m"))
        )
    assert sorted(os.listdir(tmp_path)) == ["m.tmp"]
    assert (tmp_path / "m.tmp" / "keep").read_text() == "x"
