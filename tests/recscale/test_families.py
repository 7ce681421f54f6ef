"""The registry of model families (``recscale.families``): each family registers itself once,
without jax, with its presets, config class and entry points; a family named by a file (a
run's ``command.txt``) or the command line is checked against the registry, never imported."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from recscale import export, families
from recscale.config import get_preset, preset_names

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(families.KNOWN))
def test_every_known_family_registers_its_presets_config_and_entry_points(name):
    fam = families.load(name)
    assert fam.name == name and fam.package == families.KNOWN[name]
    assert families.by_package(fam.package) is fam and families.of_preset(f"{name}/x") is fam
    assert f"{name}/tiny" in preset_names(f"{name}/")
    assert all(type(get_preset(p)) is fam.config_cls for p in preset_names(f"{name}/"))
    assert {"train", "evaluate"} <= set(fam.entries)
    for entry in fam.entries:  # python -m PACKAGE.ENTRY
        assert importlib.import_module(fam.module(entry)).FAMILY is fam


def test_registration_imports_no_jax():
    code = (
        "import sys; from recscale import families;"
        "[families.load(n) for n in families.KNOWN];"
        "bad = [m for m in ('jax', 'flax', 'optax') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="'dlrm' registered twice"):
        families.register(dataclasses.replace(families.load("dlrm")))


def test_a_name_from_a_file_is_checked_never_imported(tmp_path, monkeypatch):
    """``recscale.export`` reads the family from the run's ``command.txt``: a package there that
    is no family's is refused by name, and the module it names is never imported."""
    pkg = tmp_path / "lib" / "evilfam"
    pkg.mkdir(parents=True)
    for f in ("__init__.py", "train.py", "export.py"):
        (pkg / f).write_text("raise RuntimeError('evilfam was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    with pytest.raises(families.UnknownFamilyError, match="unknown model family 'evilfam'"):
        families.load("evilfam")
    with pytest.raises(families.UnknownFamilyError, match="no model family has package 'evilfam'"):
        families.by_package("evilfam")
    wd = tmp_path / "run"
    wd.mkdir()
    (wd / "command.txt").write_text("-m evilfam.train evilfam/tiny --workdir run\n")
    out = str(tmp_path / "model")
    with pytest.raises(SystemExit, match=r"command.txt: no model family has package 'evilfam'"):
        export.main(["--workdir", str(wd), "--out", out])
    assert not any(m.split(".")[0] == "evilfam" for m in sys.modules)
    (wd / "command.txt").write_text("-m baselines.dcnv2.train dcnv2/tiny --workdir run\n")
    assert export.family_of(str(wd)) is families.load("dcnv2")
