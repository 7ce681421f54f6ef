"""``python -m recscale.plan``: a preset's train step planned and compiled for a machine, the
HLO's collective bytes, and the planner's all-to-all accounting."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.experimental.topologies
import jax.numpy as jnp
import pytest

import dlrm.presets  # noqa: F401
import tpu_gpu_configs
from dlrm.model import build_model
from recscale import hlo, plan
from recscale.config import get_preset, parse_preset_cli
from recscale.embeddings import planner
from tpu_gpu_configs.profiles import get_profile

HLO = """
ENTRY %main {
  %all-reduce.21 = (f32[512]{0:T(512)}, f32[]{:T(128)}, /*index=2*/bf16[4,8]{1,0}) all-reduce(%a, %b, %c), channel_id=4
  %ags = (s32[4,2]{1,0}, s32[16,2]{1,0}) all-gather-start(%y), dimensions={0}
  %agd = s32[16,2]{1,0} all-gather-done(%ags)
  %ars = (f32[2,3]{1,0}, f32[2,3]{1,0}) all-reduce-start(%p0, %p1), to_apply=%add
  %ard = (f32[2,3]{1,0}, f32[2,3]{1,0}) all-reduce-done(%ars)
  %ars2 = (f32[4]{0}, f32[4]{0}, u32[], u32[]) all-reduce-start(%p2), to_apply=%add
  %ard2 = f32[4]{0} all-reduce-done(%ars2)
  ROOT %a2a = f32[8,4]{1,0:T(8,128)} all-to-all(%z), dimensions={0}
  %e = bf16[2,4]{1,0} all-to-all(%w), metadata={op_name="jit(step)/shard_map/all_to_all"}
  %not = f32[99] add(%all-to-all.1, %q)
}
"""


def test_collectives_know_their_groups_and_what_they_send():
    """Replica groups listed or as an iota, an async pair's from its start; the wire bytes of a
    ring algorithm per kind."""
    text = """
  %ar = f32[1024]{0} all-reduce(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ags = (f32[256]{0}, f32[2048]{0}) all-gather-start(%y), replica_groups=[1,8]<=[8], dimensions={0}
  %agd = f32[2048]{0} all-gather-done(%ags)
  %rs = f32[128]{0} reduce-scatter(%z), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}
  %cp = f32[64]{0} collective-permute(%w), source_target_pairs={{0,1},{1,0}}
  %a2a = f32[512]{0} all-to-all(%v), replica_groups={}, dimensions={0}
"""
    got = {c.kind: c for c in hlo.collectives(text)}
    assert {k: c.group for k, c in got.items()} == {
        "all-reduce": 4,
        "all-gather": 8,
        "reduce-scatter": 4,
        "collective-permute": 0,
        "all-to-all": 0,
    }
    wire = {k: c.wire_bytes(num_devices=8) for k, c in got.items()}
    # XLA's mesh form of the groups; a loop body's collectives count once per trip
    looped = """
%body.3 (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ag = f32[16]{0} all-gather(%x), replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}
  %inner = (s32[]) while(%t), condition=%c2, body=%body.9, backend_config={"known_trip_count":{"n":"3"}}
}
%body.9 (p: (s32[])) -> (s32[]) {
  %ar = f32[2]{0} all-reduce(%y), replica_groups=mesh['a'=2,'b'=4] {'a','b'}, to_apply=%add
}
ENTRY %main (p: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t0), condition=%c1, body=%body.3, backend_config={"known_trip_count":{"n":"7"}}
  %rs = f32[4]{0} reduce-scatter(%z), replica_groups=mesh['a'=2,'b'=4] {'a'}, dimensions={0}
}
"""
    loop = {c.kind: c for c in hlo.collectives(looped)}
    assert loop["all-gather"].group == 4 and loop["all-gather"].bytes == 64 * 7
    assert loop["all-reduce"].group == 8 and loop["all-reduce"].bytes == 8 * 7 * 3
    assert loop["reduce-scatter"].group == 2 and loop["reduce-scatter"].bytes == 16
    assert wire["all-reduce"] == 4096 * 2 * 3 / 4
    assert wire["all-gather"] == 8192 * 7 / 8
    assert wire["reduce-scatter"] == 512 * 3
    assert wire["collective-permute"] == 256
    assert wire["all-to-all"] == 2048 * 7 / 8  # no groups: every device of the module


def test_collective_bytes_reads_tuples_async_pairs_and_layouts():
    got = hlo.collective_bytes(hlo.collectives(HLO))
    # async pairs count once, by their -done's result (a -start's tuple mixes operands,
    # outputs and context)
    assert got["all-reduce"] == (512 * 4 + 4 + 4 * 8 * 2) + 2 * 6 * 4 + 4 * 4
    assert got["all-gather"] == 16 * 2 * 4
    assert got["all-to-all"] == 8 * 4 * 4 + 2 * 4 * 2
    assert got[hlo.ENGINE_A2A] == 2 * 4 * 2  # the engine's, by its shard_map
    assert got["reduce-scatter"] == got["collective-permute"] == 0


LOOP = """
%cond (p: (s32[], f32[4])) -> pred[] {
  %p = (s32[], f32[4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4] get-tuple-element(%p), index=1
  %ar = f32[4] all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  ROOT %t = (s32[], f32[4]) tuple(%i, %ar)
}

ENTRY %main (a: f32[4]) -> (s32[], f32[4]) {
  %a = f32[4] parameter(0)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %init = (s32[], f32[4]) tuple(%start, %a)
  ROOT %w = (s32[], f32[4]) while(%init), condition=%cond, body=%body
}
"""


def test_loops_without_a_stated_trip_count_are_counted_from_their_condition():
    """XLA:TPU states no ``known_trip_count``: ``i < 7`` from ``i = 2`` runs 5 times, and the
    body's all-reduce counts 5 times."""
    (ar,) = hlo.collectives(LOOP)
    assert ar.bytes == 5 * 4 * 4


def _hbm(fn, *args, **jit_kw) -> tuple[float, float]:
    """(``hlo.hbm_bytes``, XLA's bytes accessed) of ``fn`` compiled on this host."""
    c = jax.jit(fn, **jit_kw).lower(*args).compile()
    cost = c.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return hlo.hbm_bytes(c.as_text()), float(cost["bytes accessed"])


def test_hbm_bytes_count_slices_updates_and_loop_trips():
    """Op by op: a gather of 64 rows reads 64 rows, not the 51 MB table XLA charges; a scatter
    into a donated table writes its rows in place (XLA's count of that varies with the flags);
    a dense step is XLA's count; a 10-step scan counts its body 10 times (XLA: once)."""
    sds = jax.ShapeDtypeStruct
    table, ids = sds((100_000, 128), jnp.float32), sds((64,), jnp.int32)
    table_bytes, rows_bytes = 100_000 * 128 * 4, 64 * 128 * 4
    got, xla = _hbm(lambda t, i: t[i] * 2.0, table, ids)
    assert xla >= table_bytes and 2 * rows_bytes <= got < 2 * rows_bytes + 4096
    got, _ = _hbm(
        lambda t, i, u: t.at[i].add(u), table, ids, sds((64, 128), jnp.float32), donate_argnums=0
    )
    assert got < 4 * rows_bytes + 4096
    a, b = sds((256, 512), jnp.float32), sds((512, 384), jnp.float32)
    got, xla = _hbm(lambda a, b: jnp.tanh(a @ b + 1), a, b)
    assert got == xla >= (256 * 512 + 512 * 384 + 256 * 384) * 4
    w, x = sds((10, 256, 256), jnp.float32), sds((64, 256), jnp.float32)
    got, xla = _hbm(
        lambda w, x: jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0], w, x
    )
    assert got >= 10 * 256 * 256 * 4 > xla


def test_planner_counts_the_exchange_as_the_engine_sends_it():
    """Every device exchanges as many slots as the fullest device holds (the all-to-all's
    fixed shape), each the whole batch's pooled outputs forward and their gradients back."""
    profile = get_profile("tpu-v5p")
    b, d, n = 1024, 16, 8
    t = planner.PlannerTable(name="t", num_rows=10_000, dim=d, allowed=("column_wise",))
    p = planner.plan([t], profile, n, batch_size=b)
    (tp,) = p.tables
    k = len(tp.shards)
    assert 1 < k < n and len({s.device for s in tp.shards}) == k
    assert p.all_to_all_bytes == n * 1 * b * (d // k) * (4 + 4)  # 1 slot per device
    # two whole tables on one device: every device exchanges 2 slots
    two = [
        planner.PlannerTable(name=f"t{i}", num_rows=100, dim=d, allowed=("table_wise",))
        for i in range(2)
    ]
    p2 = planner.plan(two, profile, 2, batch_size=b, memory_fraction=1.0)
    per_device = [sum(s.device == dev for tp in p2.tables for s in tp.shards) for dev in (0, 1)]
    assert p2.all_to_all_bytes == 2 * max(per_device) * b * d * 8
    # calibrated for TPU (the compile table's finding): the forward exchange of slots at least
    # 32 wide in bfloat16; narrower ones, and every exchange elsewhere, in float32
    cm = planner.CostModel.for_profile(profile)
    assert (cm.exchange_bytes_at(32), cm.exchange_bytes_at(16)) == (2 + 4, 4 + 4)
    assert planner.CostModel.for_profile(get_profile("gpu-h100")).exchange_bytes_at(128) == 8
    assert planner.CostModel.for_profile(profile, 2).exchange_bytes_at(128) == 4  # bf16 comm
    wide = planner.PlannerTable(name="w", num_rows=10_000, dim=128, allowed=("table_wise",))
    p = planner.plan([wide], profile, n, batch_size=b, cost_model=cm)
    assert p.all_to_all_bytes == n * b * 128 * 6
    p = planner.plan([t], profile, n, batch_size=b, cost_model=cm)  # 16 wide or less
    assert p.all_to_all_bytes == n * b * (d // len(p.tables[0].shards)) * 8
    rw = planner.PlannerTable(name="r", num_rows=10_000, dim=128, allowed=("row_wise",))
    p = planner.plan([rw], profile, n, batch_size=b, cost_model=cm)  # partial sums: float32
    assert p.all_to_all_bytes == n * b * 128 * 8
    dp = planner.PlannerTable(name="t", num_rows=100, dim=d, allowed=("data_parallel",))
    assert planner.plan([dp], profile, n, batch_size=b).all_to_all_bytes == 0


def test_compiled_step_on_this_host_matches_the_prediction():
    """dlrm/tiny with the engine, tensor parallelism and FSDP, compiled for 8 CPU devices: the
    step's argument bytes per device are the predicted state and batch (CPU pads nothing);
    the HLO holds the engine's all-to-all and FSDP's gathers."""
    _, cfg = parse_preset_cli(
        "dlrm/",
        [
            "dlrm/tiny",
            "--workdir",
            "-",
            "--embeddings.sharding",
            "auto",
            "--mesh.model-parallel",
            "2",
            "--mesh.fsdp",
            "--mesh.fsdp-min-bytes",
            "0",
        ],
    )
    hw = tpu_gpu_configs.get("cpu-local-2proc")  # 8 devices
    r = plan.plan_step(cfg, build_model, hw, preset="dlrm/tiny", compile=True)
    assert r.chips == 8 and r.mesh == {"data": 4, "model": 2}
    assert r.compiled["argument_bytes"] > 0 and not r.error
    assert abs(r.errors()["arguments"]) < 1e-9, (r.predicted, r.compiled)
    assert r.collectives["all-to-all"] > 0 and r.collectives["all-gather"] > 0
    # the planner's exchange, per chip of every model replica, is the engine's all-to-alls
    assert abs(r.errors()["all_to_all"]) < 1e-9, (r.predicted, r.collectives)
    assert "fsdp" in r.layout and "tp=2" in r.layout
    # The roofline: each term at the profile's peaks (memory: the op-by-op count, beside
    # XLA's), collectives on the wire
    t, prof = r.step_time, get_profile("cpu-2core")
    assert t["compute"] > 0 and t["memory"] > 0 and t["all-to-all"] > 0 and t["all-gather"] > 0
    assert 0 < t["memory (XLA)"]
    not_comm = ("compute", "memory", "memory (XLA)", "serial", "overlapped")
    comm = sum(v for k, v in t.items() if k not in not_comm)
    assert t["serial"] == pytest.approx(max(t["compute"], t["memory"]) + comm)
    assert t["overlapped"] == pytest.approx(max(t["compute"], t["memory"], comm))
    assert r.peak_flops == prof.flops and r.model_flops_per_chip > 0
    assert 0 < r.mfu("serial") <= r.mfu("overlapped") <= 1
    assert r.planner_step_s() > 0
    text = plan.render(r)
    assert "predicted per chip" in text and "predicted step per chip (roofline" in text


def test_gpu_presets_lower_the_step_for_cuda_with_the_triton_kernels():
    _, cfg = parse_preset_cli(
        "dlrm/",
        [
            "dlrm/tiny",
            "--workdir",
            "-",
            "--embeddings.sharding",
            "row_wise",
            "--kernels.embedding-bag",
            "pallas_gpu",
            "--kernels.embedding-update",
            "pallas_gpu",
            "--kernels.dot-interaction",
            "pallas_gpu",
        ],
    )
    hw = tpu_gpu_configs.get("gpu-h100x8")
    r = plan.plan_step(cfg, build_model, hw, preset="dlrm/tiny", compile=True)
    assert r.chips == 8 and not r.compiled and not r.fallbacks
    # the bag and update kernels, and the interaction's forward and backward
    assert r.lowered["triton_kernels"] >= 4 and r.lowered["stablehlo_bytes"] > 0
    assert "lowered for CUDA" in plan.render(r)


def test_the_report_shows_the_embedding_plan_and_its_step_time_by_device(tmp_path, capsys):
    """``python -m recscale.plan``: each table's placement and each device's predicted time by
    term, in the text and in ``--json``; a preset measuring its skew is planned with it."""
    out = tmp_path / "r.jsonl"
    argv = ["dlrm/tiny", "--hardware", "cpu-local-2proc", "--json", str(out)]
    plan.main([*argv, "--embeddings.per-table", "f0=row_wise", "--embeddings.measure-skew", "64"])
    captured = capsys.readouterr()
    text = captured.out
    assert "embedding plan (analytic): 4 tables on 8 devices" in text
    assert "│ f0    │ row_wise" in text and "memory/shard" in text
    assert "predicted embedding step time per device" in text
    assert "communication" in text and "│      7 │" in text  # every one of the 8 devices
    assert "both planners, each plan predicted by both models" in text
    assert "embeddings.measure_skew: Zipf exponents over 64 batches" in captured.err
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    (p,) = row["plans"].values()
    assert [t["table"] for t in p["tables"]] == ["f0", "f1", "f2", "f3"]
    assert p["tables"][0]["sharding"] == "row_wise" and len(p["tables"][0]["shards"]) == 8
    assert len(p["devices"]) == 8
    (both,) = row["planners"].values()  # the learned planner beside the analytic one
    for name in ("analytic", "learned"):
        assert both[name]["analytic_model_s"] > 0 and both[name]["learned_model_s"] > 0
    assert both["learned"]["kinds"]["row_wise"] == 1  # the pin holds in both
    for d in p["devices"]:
        total = d["lookup_s"] + d["comm_s"] + d["compute_s"]
        assert d["time_s"] > 0 and total == pytest.approx(d["time_s"], rel=1e-12)
    # the skew moves the row-wise table's busiest shard: a hotter first row than uniform ids
    plan.main([*argv, "--embeddings.per-table", "f0=row_wise"])
    capsys.readouterr()
    uniform = json.loads(out.read_text().splitlines()[1])
    (u,) = uniform["plans"].values()
    busiest = max(s["lookup_s"] for s in p["tables"][0]["shards"])
    assert busiest > max(s["lookup_s"] for s in u["tables"][0]["shards"])


def test_cli_errors_are_one_line(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "recscale.plan", *args],
            capture_output=True,
            text=True,
            timeout=120,
        )

    p = run("dlrm/tiny", "--hardware", "tpu-v9-1")
    assert p.returncode != 0 and "unknown hardware preset 'tpu-v9-1'" in p.stderr
    assert "Traceback" not in p.stderr
    p = run("nosuch/x", "--hardware", "cpu-local")
    assert p.returncode != 0 and "unknown model family 'nosuch'" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="needs the TPU compiler: pip install -e '.[tpu-aot]'",
)
def test_compiles_for_a_tpu_slice_without_a_tpu():
    cfg = get_preset("dlrm/tiny")
    hw = tpu_gpu_configs.get("tpu-v5p-8")
    r = plan.plan_step(cfg, build_model, hw, preset="dlrm/tiny", compile=True)
    assert r.chips == 4 and r.topology == "v5p:2x2x1"
    assert r.compiled["peak_bytes"] > 0 and not r.error


def test_plans_a_tpu_slice_without_libtpu_and_says_which_meshes_fit(monkeypatch, tmp_path, capsys):
    """Without ``--compile`` a TPU slice is planned on an abstract mesh (no libtpu: the
    topology is never asked for); a layout whose state overflows the chip says so and what the
    other meshes would hold per chip, or why the planner cannot place them."""
    import wukong.presets  # noqa: F401, PLC0415

    monkeypatch.setattr(plan, "topology_devices", lambda hw: pytest.fail("asked for devices"))
    out = tmp_path / "r.jsonl"
    plan.main(["wukong/table5-7", "--hardware", "tpu-v5p-8", "--json", str(out)])
    text = capsys.readouterr().out
    assert "tpu-v5p-8 (v5p:2x2x1, 4 chips, mesh {'data': 4}" in text
    assert "DOES NOT FIT: the state alone needs 205.2 GiB per chip, a chip holds 95.0 GiB" in text
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    alts = {a["flags"]: a for a in row["alternatives"]}
    assert set(alts) == {
        "--mesh.fsdp",
        "--mesh.model-parallel 2",
        "--mesh.model-parallel 4",
        "--mesh.fsdp --mesh.model-parallel 4",
    }  # 8-way tensor parallelism does not divide 4 chips
    fsdp = alts["--mesh.fsdp"]
    # FSDP shards the 180 GiB of dense state 4 ways (45 GiB) beside 25.1 GiB of tables
    assert fsdp["fits"] and 69 * 2**30 < fsdp["state_bytes_per_chip"] < 71 * 2**30
    assert "    --mesh.fsdp: 70.1 GiB (fits)" in text
    tp4 = alts["--mesh.model-parallel 4"]  # one data replica: the tables' rows on 1 chip
    assert not tp4["fits"] and "table 'C21' (40,000,000 rows x 128) does not fit" in tp4["error"]
    assert "    --mesh.model-parallel 4: cannot be planned: table 'C21'" in text


def test_libtpu_is_told_the_slice_so_it_starts_quietly(monkeypatch):
    """Off a TPU VM libtpu warns (five lines on stderr, with a spurious INVALID_ARGUMENT) unless
    told the slice and its workers: ``topology_devices`` names them before libtpu loads,
    without overriding a user's own setting."""
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "")  # recorded, so the test's setting is undone
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "10.0.0.7")
    monkeypatch.setattr(jax.experimental.topologies, "get_topology_desc", _no_libtpu)
    with pytest.raises(SystemExit, match="cannot describe TPU topology 'v5p:4x4x4'"):
        plan.topology_devices(tpu_gpu_configs.get("tpu-v5p-128"))
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-128"
    assert os.environ["TPU_WORKER_HOSTNAMES"] == "10.0.0.7"


def _no_libtpu(*args, **kwargs):
    raise RuntimeError("JAX TPU support not installed")
