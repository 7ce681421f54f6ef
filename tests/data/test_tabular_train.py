"""Every model family trains and evaluates on feature-spec data through its normal commands."""

from __future__ import annotations

import dataclasses
import json

import pytest

from data.config import TabularConfig
from data.tabular import example
from recscale import families
from recscale.config import get_preset
from recscale.train.cli import evaluate_main
from recscale.train.loop import train

FAMILIES = ("dlrm", "wukong", "dcnv2", "finalmlp", "masknet")

SPEC = """
name: shop
train: [interactions.csv]
joins:
  - {path: users.csv, key: user_id}
  - {path: items.csv, key: item_id}
split: {kind: random, valid_fraction: 0.2, seed: 0}
label: {column: rating, threshold: 4}
features:
  - {name: user_id, kind: categorical}
  - {name: item_id, kind: categorical, parse: int, table: item}
  - {name: last_item, column: item_id, kind: categorical, parse: int, table: item}
  - {name: genres, kind: multi_categorical, separator: "|", max_hotness: 3}
  - {name: gender, kind: categorical, hash_buckets: 8}
  - {name: age, kind: numeric, standardize: true}
  - {name: price, kind: numeric, log: true}
  - {name: age_band, column: age, kind: numeric, boundaries: [25, 35, 50]}
"""


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    d = tmp_path_factory.mktemp("shop")
    example.make(str(d), rows=3000)
    (d / "spec.yaml").write_text(SPEC)
    return d


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_and_evaluates_on_a_feature_spec(family, shop, tmp_path, capsys):
    fam = families.load(family)
    cfg = get_preset(f"{family}/tiny")
    data = dataclasses.replace(
        cfg.data,
        kind="tabular",
        batch_size=64,
        eval_batch_size=256,
        tabular=TabularConfig(spec=str(shop / "spec.yaml"), prepared_dir=str(shop / "prep")),
    )
    cfg = dataclasses.replace(
        cfg,
        data=data,
        train=dataclasses.replace(cfg.train, num_steps=3, log_every=1, progress=False),
    )
    if family == "finalmlp":  # the gates' context features are named by the schema
        cfg = dataclasses.replace(
            cfg,
            model=dataclasses.replace(
                cfg.model, fs1_context=("user_id",), fs2_context=("item_id", "last_item")
            ),
        )
    wd = tmp_path / "run"
    build_model = fam.build_model
    result = train(cfg, build_model, wd)
    assert result["step"] == 3 and 0.0 <= result["auc"] <= 1.0
    stats = json.loads((wd / "data_stats.json").read_text())
    assert stats["kind"] == "tabular" and result["num_examples"] == stats["rows"]["valid"]
    # item_id and last_item read one embedding table (two ids, one set of rows).
    from flax import nnx

    from data.schemas import schema_of

    schema = schema_of(cfg.data)
    model = build_model(cfg, schema, nnx.Rngs(0))
    tables = {t.name: t.num_rows for t in model.embeddings.table_specs}
    assert "item" in tables and "item_id" not in tables and "last_item" not in tables
    assert len(tables) == len(schema.features) - 1
    # evaluate --data-path: a later file of the same spec, some of whose users never appear in
    # training (their id maps to the OOV row and is counted).
    capsys.readouterr()
    got = evaluate_main(fam, ["--workdir", str(wd), "--data-path", str(shop / "new.csv")])
    assert got["num_examples"] == 10_000 and got["step"] == 3
    import pyarrow.csv as pacsv

    seen = set(pacsv.read_csv(shop / "interactions.csv").column("user_id").to_pylist())
    new_users = pacsv.read_csv(shop / "new.csv").column("user_id").to_pylist()
    never = sum(u not in seen for u in new_users)  # OOV for sure (others if only in valid)
    assert never > 0 and got["eval_data"]["oov"]["user_id"] >= never
    assert got["eval_data"]["rows"] == len(new_users)


def test_a_frappe_preset_switched_to_a_spec_reads_only_the_specs_files(shop, tmp_path):
    """``dlrm/frappe --data.kind tabular``: the preset's Frappe files are dropped (evaluation
    reads the spec's valid split), and a network that cannot read the spec's dense columns is a
    one-line error naming the flag that fixes it."""
    from dlrm import train as dlrm_train

    argv = [
        "frappe",
        *("--data.kind", "tabular", "--data.tabular.spec", str(shop / "spec.yaml")),
        *("--data.tabular.prepared-dir", str(shop / "prep")),
        *("--data.batch-size", "64", "--data.eval-batch-size", "256", "--train.num-steps", "2"),
        *("--model.top-mlp", "16", "1"),
    ]
    with pytest.raises(SystemExit, match=r"^error: .*\(age, price.*set --model.bottom-mlp 64 10 "):
        dlrm_train.main([*argv, "--workdir", str(tmp_path / "a")])
    wd = tmp_path / "b"
    result = dlrm_train.main([*argv, "--workdir", str(wd), "--model.bottom-mlp", "64", "10"])
    saved = json.loads((wd / "config.json").read_text())["data"]
    assert (saved["train_path"], saved["eval_path"]) == ("", "")
    stats = json.loads((wd / "data_stats.json").read_text())
    assert stats["eval"] == {"split": "valid"}
    assert result["step"] == 2 and result["num_examples"] == stats["rows"]["valid"]


@pytest.mark.parametrize(
    ("family", "dense", "change", "flag"),
    [
        ("dlrm", True, {"bottom_mlp": ()}, "--model.bottom-mlp 64 8 "),
        ("wukong", False, {"num_dense_embeddings": 2}, "--model.num-dense-embeddings 0"),
        ("wukong", True, {"num_dense_embeddings": 0}, "--model.num-dense-embeddings 1"),
        ("dcnv2", False, {"dense_mlp": (8,)}, "--model.dense-mlp with no sizes"),
        (
            "finalmlp",
            True,
            {"fs2_context": ("f0", "nope")},
            r"unknown features \['nope'\].*--model.fs2-context to some",
        ),
        (
            "masknet",
            True,
            {"model_type": "serial", "dnn_hidden_units": (16, 8), "reduction_ratio": 0.01},
            "--model.reduction-ratio 0.0625 or more",  # masks of Z = 5 * 8 and 16 units
        ),
    ],
)
def test_a_network_that_cannot_read_the_data_names_the_flag(family, dense, change, flag):
    """What train, evaluate and export print as one line (``ConfigError``), from the model and
    from its cost model alike."""
    from flax import nnx

    from data.batch import FeatureInfo, Schema
    from recscale.config import ConfigError

    fam = families.load(family)
    cfg = get_preset(f"{family}/tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **change))
    schema = Schema(
        dense_names=("a", "b") if dense else (),
        features=tuple(FeatureInfo(name=f"f{i}", vocab_size=20, max_hotness=1) for i in range(3)),
    )
    build_model = fam.build_model
    with pytest.raises(ConfigError, match=flag):
        build_model(cfg, schema, nnx.Rngs(0))
    with pytest.raises(ConfigError, match=flag):
        cfg.model.cost(schema)
    if family == "masknet":  # the ratio named is enough for every mask
        fixed = dataclasses.replace(cfg.model, reduction_ratio=0.0625)
        build_model(dataclasses.replace(cfg, model=fixed), schema, nnx.Rngs(0))
