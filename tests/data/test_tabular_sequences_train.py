"""``--data.kind tabular`` of the sequential families: sasrec/tiny trains on the example event
log through its sequence spec (``data.tabular.example.SEQUENCE_SPEC``) and evaluates either
split, a wrong item count is one line naming the flag to set, and the packs carry the spec's
side column."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from data.tabular import example
from recscale.config import get_preset
from sequential.run_config import SequenceTabularConfig
from sequential.sasrec import evaluate as sasrec_evaluate
from sequential.sasrec import train as sasrec_train
from sequential.source import SequenceSource


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("events")
    example.make_events(str(d))
    (d / "spec.yaml").write_text(example.SEQUENCE_SPEC)
    return d / "spec.yaml"


def test_sasrec_tiny_trains_on_an_event_log(spec, tmp_path):
    flags = ["sasrec/tiny", "--data.kind", "tabular", "--data.tabular.spec", str(spec)]
    flags += ["--data.tabular.prepared-dir", str(tmp_path / "prep"), "--train.num-steps", "3"]
    with pytest.raises(
        SystemExit,
        match=r"^error: model.n_items=200 but the data has 300 items: set --model.n-items 300$",
    ):
        sasrec_train.main([*flags, "--workdir", str(tmp_path / "wrong")])
    run = tmp_path / "run"
    flags += ["--model.n-items", "300", "--workdir", str(run)]
    result = sasrec_train.main(flags)
    assert result["step"] == 3 and np.isfinite(result["loss"])
    assert result["num_examples"] == 400  # every user has 3+ events: a validation item each
    assert 0 <= result["hr@10"] <= 1
    stats = json.loads((run / "data_stats.json").read_text())
    assert stats["kind"] == "tabular" and stats["train_users"] == stats["eval_users"] == 400
    assert stats["preparation"]["items"] == 300 and stats["preparation"]["ties"] > 0
    assert json.loads((run / "config.json").read_text())["data"]["tabular"]["spec"] == str(spec)
    # The run evaluated the validation items; --eval-split test scores each user's last item.
    valid = sasrec_evaluate.main(["--workdir", str(run), "--eval-split", "valid"])
    assert valid["loss"] == pytest.approx(result["loss"], rel=1e-6)
    test = sasrec_evaluate.main(["--workdir", str(run), "--eval-split", "test"])
    assert test["eval_split"] == "test" and test["num_examples"] == 400
    assert test["loss"] != valid["loss"]  # the same model on other targets


def test_packs_carry_the_side_column_aligned_with_the_items(spec, tmp_path):
    cfg = get_preset("sasrec/tiny")
    tabular = SequenceTabularConfig(spec=str(spec), prepared_dir=str(tmp_path / "prep"))
    cfg = dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, kind="tabular", tabular=tabular),
        model=dataclasses.replace(cfg.model, n_items=300),
    )
    batch = SequenceSource(cfg).train_batch(0)
    action = batch.side["action"]
    assert action.shape == batch.values.shape
    real = batch.values > 0
    assert (action[real] >= 1).all() and (action[real] <= 3).all() and (action[~real] == 0).all()
