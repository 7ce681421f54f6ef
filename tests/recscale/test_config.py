"""Config machinery: JSON round trip, typo errors, presets, the CLI."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dlrm.presets  # noqa: F401
from dlrm.config import DLRMConfig, DLRMModelConfig
from recscale import config as config_lib
from recscale.config import from_dict, get_preset, parse_preset_cli, preset_names, to_dict


def test_every_dlrm_preset_round_trips_through_json(tmp_path):
    names = preset_names("dlrm/")
    assert {
        "dlrm/tiny",
        "dlrm/synthetic",
        "dlrm/frappe",
        "dlrm/criteo-kaggle",
        "dlrm/criteo-terabyte",
    } <= set(names)
    for name in names:
        cfg = get_preset(name)
        path = tmp_path / f"{name.replace('/', '_')}.json"
        config_lib.save_json(cfg, path)
        assert config_lib.load_json(DLRMConfig, path) == cfg, name


def test_a_retired_field_still_loads_and_keeps_trial_ids():
    """``mesh.rules`` is gone (``MeshConfig.RETIRED``): a config.json written with it loads,
    and a trial recorded with it has the id the config without it gets now."""
    from sweeps import identity

    d = to_dict(get_preset("dlrm/tiny"))
    assert "rules" not in d["mesh"]
    old = json.loads(json.dumps(d))
    old["mesh"]["rules"] = "row_sharded"
    assert from_dict(DLRMConfig, old) == get_preset("dlrm/tiny")
    ids = [identity.trial_id("dlrm", x, "v1", "data", DLRMConfig) for x in (d, old)]
    assert ids[0] == ids[1]
    old["mesh"]["rules"] = "replicated"  # another layout was another trial, and stays one
    assert identity.trial_id("dlrm", old, "v1", "data", DLRMConfig) != ids[0]


def test_configs_are_frozen_and_keyword_only():
    cfg = get_preset("dlrm/tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = None  # type: ignore[misc]
    with pytest.raises(TypeError):
        DLRMModelConfig(16)  # type: ignore[misc]


def test_misspelt_field_is_an_error_naming_it():
    d = to_dict(get_preset("dlrm/tiny"))
    d["train"]["num_stepz"] = 3
    with pytest.raises(TypeError, match=r"config\.train.*num_stepz"):
        from_dict(DLRMConfig, d)
    with pytest.raises(TypeError):
        dataclasses.replace(get_preset("dlrm/tiny").train, num_stepz=3)


def test_bad_literal_and_invariants_raise():
    d = to_dict(get_preset("dlrm/tiny"))
    d["model"]["interaction"] = "outer"
    with pytest.raises(ValueError, match="interaction"):
        from_dict(DLRMConfig, d)
    with pytest.raises(ValueError, match="top_mlp"):
        DLRMModelConfig(top_mlp=(16, 2))
    with pytest.raises(ValueError, match="embed_dim"):
        DLRMModelConfig(embed_dim=8, bottom_mlp=(16, 4))


def test_cli_overrides_typed_fields():
    workdir, cfg = parse_preset_cli(
        "dlrm/",
        ["tiny", "--workdir", "/tmp/x", "--train.num-steps", "7", "--model.top-mlp", "32", "1"],
    )
    assert workdir == "/tmp/x"
    assert cfg.train.num_steps == 7
    assert cfg.model.top_mlp == (32, 1)
    assert cfg.data == get_preset("dlrm/tiny").data


def test_cli_rejects_unknown_preset_and_flag():
    with pytest.raises(SystemExit, match="unknown preset"):
        parse_preset_cli("dlrm/", ["nope", "--workdir", "/tmp/x"])
    with pytest.raises(SystemExit):
        parse_preset_cli("dlrm/", ["tiny", "--workdir", "/tmp/x", "--train.num-stepz", "3"])


def test_cli_switching_data_kind_drops_the_presets_files():
    frappe = get_preset("dlrm/frappe").data
    assert frappe.train_path and frappe.eval_path  # what must not leak into another kind
    argv = ["frappe", "--workdir", "/tmp/x", "--data.kind", "tabular"]
    _, cfg = parse_preset_cli("dlrm/", [*argv, "--data.tabular.spec", "s.yaml"])
    assert cfg.data.kind == "tabular" and cfg.data.tabular.spec == "s.yaml"
    assert (cfg.data.train_path, cfg.data.eval_path, cfg.data.tfds_data_dir) == ("", "", "")
    # A file given with the switch is kept (either spelling of the flag).
    for flag in (["--data.eval-path", "new.csv"], ["--data.eval_path=new.csv"]):
        _, cfg = parse_preset_cli("dlrm/", [*argv, "--data.tabular.spec", "s.yaml", *flag])
        assert (cfg.data.train_path, cfg.data.eval_path) == ("", "new.csv")
    # The same kind keeps the preset's files; another kind that needs files says so.
    _, cfg = parse_preset_cli("dlrm/", ["frappe", "--workdir", "/tmp/x", "--data.kind", "frappe"])
    assert cfg.data == frappe
    with pytest.raises(SystemExit, match=r"^error: .*needs data.train_path.*frappe files"):
        parse_preset_cli("dlrm/", ["frappe", "--workdir", "/tmp/x", "--data.kind", "criteo"])


def test_cli_config_file_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"top_mlp": [3]}}))
    with pytest.raises(SystemExit, match=r"^error: .*bad\.json\.model: top_mlp must end in 1"):
        parse_preset_cli("dlrm/", [str(bad), "--workdir", "/tmp/x"])
    bad.write_text('{"model": ')
    with pytest.raises(SystemExit, match=r"^error: .*bad\.json: not a JSON config"):
        parse_preset_cli("dlrm/", [str(bad), "--workdir", "/tmp/x"])


def test_config_modules_do_not_import_jax():
    code = (
        "import sys, json; import recscale.config, dlrm.config, dlrm.presets, data.config; "
        "print(json.dumps('jax' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) is False


def test_project_packages_resolve_inside_the_repo():
    import data
    import dlrm
    import recscale

    for mod in (data, dlrm, recscale):
        assert Path(mod.__file__).resolve().parents[1] == Path(__file__).resolve().parents[2]
