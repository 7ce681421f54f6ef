"""Transitional: the field roles declared on the config classes give exactly the hand-kept lists
they replace (deleted in the next commit, with this test)."""

from data import roles
from recscale import config as config_lib
from recscale.embeddings import relayout
from recscale.train import loop
from sweeps import spec as spec_lib

EXP = config_lib.ExperimentConfig


def test_derived_sets_equal_the_hand_kept_lists():
    non_semantic = roles.paths(EXP, identity=False, resume_free=True)
    assert non_semantic == config_lib.NON_SEMANTIC_FIELDS
    layout = roles.paths(EXP, identity=True, resume_free=True)
    assert layout == config_lib.LAYOUT_FIELDS
    assert roles.paths(EXP, program=False) == set(loop._PROGRAM_FREE_FIELDS)
    assert len(loop._PROGRAM_FREE_FIELDS) == len(set(loop._PROGRAM_FREE_FIELDS))
    assert set(roles.plan_inputs(EXP)) == set(relayout._PLAN_FIELDS)
    # The identity-free paths: the non-semantic fields and the data locations semantic_config
    # drops by name.
    located = {
        "data.train_path",
        "data.eval_path",
        "data.tfds_data_dir",
        "data.tabular.spec",
        "data.tabular.prepared_dir",
        "data.tabular.workers",
    }
    assert roles.paths(EXP, identity=False) == non_semantic | located


def test_identity_defaults_equal_the_hand_kept_list():
    declared = {}
    for path in roles.roles(EXP):
        *parents, leaf = path.split(".")
        cls = EXP
        for p in parents:
            cls = roles._sections(cls)[p]
        f = {f.name: f for f in __import__("dataclasses").fields(cls)}[leaf]
        if "identity_default" in f.metadata:
            declared[path] = f.metadata["identity_default"]
    assert declared == spec_lib._ADDED_AT_DEFAULT


def test_plan_inputs_name_the_fields_saved_config_sets():
    assert roles.plan_inputs(EXP) == {
        "batch_size": "data.batch_size",
        "optimizer": "embedding_optim.name",
        "sharding": "embeddings.sharding",
        "per_table": "embeddings.per_table",
        "profile": "embeddings.profile",
        "host_size": "embeddings.host_size",
        "storage_dtype": "embeddings.storage_dtype",
        "comm_dtype": "embeddings.comm_dtype",
        "bound_scales": "embeddings.comm_error_bound_tables",
    }
