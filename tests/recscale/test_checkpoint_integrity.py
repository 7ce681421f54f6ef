"""Checkpoint contents under damage (issue 7, items 3 and 7).

- An asynchronous save holds the values at save time, even when the arrays' buffers are donated
  and overwritten while the write is still in flight.
- A truncated or byte-flipped checkpoint file never loads: restoring raises
  ``CheckpointCorruptError`` naming the step and the item directory (orbax on its own loads a
  flipped byte in compressed array data as garbage: shown below), and ``checkpoint_fallback``
  resumes from the step before with a warning, bitwise as the uninterrupted run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import dlrm.presets  # noqa: F401
from dlrm.model import build_model
from recscale.config import get_preset
from recscale.train import checkpoint
from recscale.train.checkpoint import CheckpointCorruptError, Checkpointer, fingerprints
from recscale.train.loop import train

# When one array's read fails, orbax abandons the other reads' coroutines, which complain when
# garbage collected (during whichever test runs then) that their event loop is closed: orbax's
# noise, not an error of these tests.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# ------------------------------------------------------------------------------------------------
# Item 3: values at save time.


def test_async_save_holds_the_values_at_save_time_though_the_buffers_are_overwritten(
    tmp_path, monkeypatch
):
    from orbax.checkpoint._src.serialization import jax_array_handlers  # noqa: PLC0415

    # Hold every item's array write (orbax runs it in the background after ``save`` returns)
    # until the buffers have been overwritten, so the test cannot pass by the write having
    # finished first.
    mutated = threading.Event()
    original = jax_array_handlers._async_serialize_replica_slices

    async def held(*args, **kwargs):
        while not mutated.is_set():
            await asyncio.sleep(0.01)
        return await original(*args, **kwargs)

    monkeypatch.setattr(jax_array_handlers, "_async_serialize_replica_slices", held)

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    tree = {
        "table": jax.device_put(
            jnp.arange(8 * 4096 * 16, dtype=jnp.float32).reshape(-1, 16),
            NamedSharding(mesh, PartitionSpec("data")),
        ),
        "bias": jax.device_put(jnp.full((16,), 0.5), NamedSharding(mesh, PartitionSpec())),
    }
    expected = jax.tree.map(lambda x: np.array(x, copy=True), tree)

    ckpt = Checkpointer(tmp_path, async_save=True)
    try:
        ckpt.save(1, {"params": tree}, {"step": 1})
        assert not (tmp_path / "1").exists()  # not committed: the arrays are not written yet
        # As the trainer's next step does: donate the buffers and write new values into them.
        overwrite = jax.jit(lambda t: jax.tree.map(lambda x: -x - 1, t), donate_argnums=0)
        new = overwrite(tree)
        jax.block_until_ready(new)
        # Donation reuses a buffer in place where nothing else holds it (here ``bias``); while
        # orbax still holds a shard for the write (``table``), JAX copies instead. The first
        # case is the one that could corrupt a checkpoint; make sure it happened.
        assert tree["bias"].is_deleted()
    finally:
        mutated.set()  # never leave the write (and the test) hanging
    ckpt.wait()

    restored, meta = ckpt.restore(1, {"params": new})
    assert meta["step"] == 1
    for got, want, other in zip(
        *(jax.tree.leaves(t) for t in (restored["params"], expected, new)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert not np.array_equal(np.asarray(got), np.asarray(other))
    ckpt.close()


def test_retiring_a_step_in_the_background_survives_the_next_save(tmp_path, monkeypatch):
    """Retention runs in orbax's finalize thread after an asynchronous save: it makes
    ``deleted/`` and then renames the old step into it. The next ``save`` purges ``deleted/``;
    it must not do so between the two (a CI run died of exactly that, ``FileNotFoundError`` on
    the rename). The rename is held here until the purge would have happened."""
    from etils import epath  # noqa: PLC0415

    path_type = type(epath.Path(tmp_path))
    original = path_type.replace

    def slow_replace(self, target):
        if epath.Path(target).parent.name == checkpoint.DELETED:
            time.sleep(0.5)  # ``deleted/`` exists now; the step is not in it yet
        return original(self, target)

    monkeypatch.setattr(path_type, "replace", slow_replace)
    ckpt = Checkpointer(tmp_path, max_to_keep=1, async_save=True)
    tree = {"w": jnp.arange(16.0)}
    ckpt.save(0, {"params": tree}, {"step": 0})
    ckpt.save(1, {"params": tree}, {"step": 1})  # its finalization retires step 0
    deadline = time.monotonic() + 10
    while not (tmp_path / checkpoint.DELETED).exists():  # the rename has begun
        assert time.monotonic() < deadline, "orbax never retired step 0"
        time.sleep(0.005)
    ckpt.save(2, {"params": tree}, {"step": 2})
    ckpt.close()
    assert ckpt.all_steps() == [2]
    assert not (tmp_path / checkpoint.DELETED).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2"]


# ------------------------------------------------------------------------------------------------
# Item 7: damaged files.

STEPS, EVERY = 6, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished tiny run with synchronous checkpoints at steps 2, 4 and 6."""
    cfg = get_preset("dlrm/tiny")
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train,
            num_steps=STEPS,
            checkpoint_every=EVERY,
            max_checkpoints=5,
            log_every=1,
            progress=False,
            async_checkpoint=False,
        ),
    )
    wd = tmp_path_factory.mktemp("run")
    train(cfg, build_model, wd)
    return cfg, wd


def _copy(wd: Path, dest: Path) -> Path:
    shutil.copytree(wd, dest)
    return dest


def _data_files(item: Path) -> list[Path]:
    """The item's OCDBT data files (compressed array chunks and b-tree nodes): which of them a
    read uses depends on the layout (the per-process files, or the merged copy), so the damage
    goes to every one."""
    return [f for f in item.glob("**/d/*") if f.is_file()]


def _flip_byte(f: Path, offset: int) -> None:
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x10
    f.write_bytes(bytes(data))


def _damage(item: Path, how: str) -> None:
    for f in _data_files(item):
        size = f.stat().st_size
        if how == "byte flipped":
            _flip_byte(f, size // 2)
        else:
            f.write_bytes(f.read_bytes()[: size // 2])


def _raw_params(wd: Path, step: int, *, root: Path | None = None):
    """The params item read by orbax alone (no checks)."""
    root = wd / "checkpoints" if root is None else root
    with ocp.StandardCheckpointer() as c:
        return c.restore((root / str(step) / "params").absolute())


@pytest.mark.parametrize("damage", ["byte flipped", "truncated"])
def test_a_damaged_checkpoint_file_raises_naming_step_and_file(run, tmp_path, damage):
    cfg, wd = run
    wd = _copy(wd, tmp_path / "run")
    item = wd / "checkpoints" / str(STEPS) / "params"
    _damage(item, damage)

    # The trainer's resume stops with the error rather than resuming from garbage.
    with pytest.raises(CheckpointCorruptError, match=f"checkpoint step {STEPS}") as err:
        train(cfg, build_model, wd)
    assert err.value.step == STEPS
    assert str(item) in str(err.value)  # the item directory holding the damaged files


def test_a_damaged_meta_fails_its_crc(run, tmp_path):
    _, wd = run
    wd = _copy(wd, tmp_path / "run")
    meta_file = wd / "checkpoints" / str(STEPS) / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["data_position"] += 1  # a flipped digit: well-formed JSON, wrong value
    meta_file.write_text(json.dumps(meta))
    ckpt = Checkpointer(wd / "checkpoints", async_save=False)
    with pytest.raises(
        CheckpointCorruptError, match=f"step {STEPS} is corrupt: .*meta fails its CRC"
    ):
        ckpt.read_meta(STEPS)
    ckpt.close()


def test_fallback_resumes_from_the_previous_step_with_a_warning(run, tmp_path):
    cfg, full = run
    wd = _copy(full, tmp_path / "run")
    # As if the run had stopped after step 4 and its latest checkpoint were...
    shutil.rmtree(wd / "checkpoints" / str(STEPS))
    lines = (wd / "metrics.jsonl").read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln)["step"] <= STEPS - EVERY]
    (wd / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    last = STEPS - EVERY
    _damage(wd / "checkpoints" / str(last) / "params", "byte flipped")  # ...and damaged

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint_fallback=True))
    with pytest.warns(UserWarning, match=f"checkpoint step {last} .*falling back"):
        train(cfg, build_model, wd)

    def rows(d):
        out = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in out if r["split"] == "train"]

    # Steps 3..6 ran again from checkpoint 2, bitwise as the first time.
    resumed = rows(wd)[len([r for r in rows(full) if r[0] <= last]) :]
    assert resumed == [r for r in rows(full) if r[0] > STEPS - 2 * EVERY]
    for a, b in zip(
        jax.tree.leaves(_raw_params(full, STEPS)),
        jax.tree.leaves(_raw_params(wd, STEPS)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_orbax_alone_loads_a_flipped_byte_as_garbage_the_checkpointer_refuses(tmp_path):
    """Why the fingerprints exist: a bit flip inside compressed array data decompresses to other
    numbers, and orbax returns them."""
    tree = {"w": jnp.arange(4096, dtype=jnp.float32) * 1.5}
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"params": tree}, {"step": 1})
    ckpt.close()
    big = max(_data_files(tmp_path / "1" / "params"), key=lambda f: f.stat().st_size)
    _flip_byte(big, big.stat().st_size // 2)
    garbage = _raw_params(tmp_path, 1, root=tmp_path)
    assert not np.array_equal(np.asarray(garbage["w"]), np.asarray(tree["w"]))
    ckpt = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointCorruptError, match=r"step 1 is corrupt: .*params leaf \['w'\]"):
        ckpt.restore(1, {"params": tree})
    ckpt.close()


def test_fingerprints_change_with_any_one_element_and_not_with_the_sharding():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.arange(64 * 8, dtype=jnp.float32).reshape(64, 8) / 7
    base = fingerprints({"a": {"x": x}})["a"]
    for spec in (PartitionSpec("data"), PartitionSpec(None, "data"), PartitionSpec()):
        sharded = jax.device_put(x, NamedSharding(mesh, spec))
        assert fingerprints({"a": {"x": sharded}})["a"] == base
    rng = np.random.default_rng(0)
    for _ in range(20):
        i, j = rng.integers(64), rng.integers(8)
        bits = np.asarray(x).view(np.uint32).copy()
        bits[i, j] ^= np.uint32(1) << np.uint32(rng.integers(32))
        assert fingerprints({"a": {"x": jnp.asarray(bits.view(np.float32))}})["a"] != base
    # The host path (numpy, used on CPU) and the device path (jit, elsewhere) agree.
    for a in (x, jnp.arange(10, dtype=jnp.int32), jnp.ones((3, 5), jnp.bfloat16), jnp.array(True)):
        assert checkpoint._fingerprint_host(np.asarray(a)) == int(checkpoint._fingerprints([a])[0])
    # Two elements swapped (the same values, elsewhere) change it too.
    swapped = np.asarray(x).copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert fingerprints({"a": {"x": jnp.asarray(swapped)}})["a"] != base
