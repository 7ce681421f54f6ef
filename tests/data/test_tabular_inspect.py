"""``data.tabular.inspect`` proposes a spec that prepares as is, on the generated shop log."""

from __future__ import annotations

import pytest
import yaml

from data.tabular import example, inspect, prepare
from data.tabular.spec import load_spec


def test_inspect_proposes_a_working_spec_for_the_shop_log(tmp_path, capsys):
    example.make(str(tmp_path), rows=4000)
    files = [str(tmp_path / f) for f in ("interactions.csv", "users.csv", "items.csv")]
    out = tmp_path / "spec.yaml"
    assert inspect.main([*files, "--rows", "10000", "--out", str(out)]) == 0
    spec = yaml.safe_load(out.read_text())
    assert spec["label"] == {"column": "rating", "threshold": 4}
    assert [j["key"] for j in spec["joins"]] == ["user_id", "item_id"]
    # The sample is the whole file, so the time column gives a time split at its 90th percentile.
    assert spec["split"]["kind"] == "time" and spec["split"]["column"] == "timestamp"
    kinds = {f["name"]: f for f in spec["features"]}
    assert kinds["genres"]["kind"] == "multi_categorical" and kinds["genres"]["separator"] == "|"
    assert kinds["item_id"] == {"name": "item_id", "kind": "categorical", "parse": "int"}
    assert kinds["gender"]["kind"] == "categorical" and kinds["price"]["kind"] == "numeric"
    assert "rating" not in kinds and "timestamp" not in kinds
    p = prepare(load_spec(out), str(tmp_path / "prep"), progress=False)
    assert p.stats["rows"]["train"] + p.stats["rows"]["valid"] == 4000
    assert 0.05 < p.stats["rows"]["valid"] / 4000 < 0.15  # the 90th percentile of the times
    # A sample shorter than the file proposes a random split and says why.
    capsys.readouterr()
    assert inspect.main([files[0], "--rows", "1000"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["split"]["kind"] == "random"
    assert "time column 'timestamp' found" in " ".join(captured.err.split())


def test_inspect_reports_a_file_without_a_label(tmp_path, capsys):
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,x\n2,y\n3,z\n")
    assert inspect.main([str(path)]) == 2
    assert "no label column" in capsys.readouterr().err


def test_help_gives_the_whole_description(capsys):
    with pytest.raises(SystemExit) as e:
        inspect.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "and proposes a spec to edit:" in out
    assert "A sequence spec (``data/tabular/seq_spec.py``), when the first file" in out
    assert "so check cardinalities and the split." in out
