"""Checkpoints with orbax (the only module that imports it), verified on restore.

A checkpoint of step ``s`` holds the items ``params``, ``opt_state``, ``rng`` and, for models with
BatchNorm, ``batch_stats`` (pytrees of arrays, restored onto whatever shardings the caller asks
for, so a run can resume on another mesh) and ``meta`` (JSON: the step, the data position, ...).
Evaluation restores the model's items (``params``, ``batch_stats``) alone. Empty trees are not
written.

Orbax writes a step into a temporary directory and renames it when every item is written, so a
process killed mid-save leaves no step that ``latest_step`` reports. Retention would delete old
steps in place, file by file, and a step directory counts as complete by its name alone, so a
kill mid-deletion would leave a half-deleted step listed; old steps are therefore renamed into
``deleted/`` (atomic; orbax's ``todelete_subdir``) and purged from there by ``Checkpointer``
(at construction, before each save once the previous save has finished, and at close: at most
one retired step set waits there). What orbax does not check
is the bytes: a truncated or bit-flipped file can fail deep in tensorstore or, worse, load as
garbage. So ``save`` records a fingerprint of every array (``fingerprints``) and of the meta
itself, and ``restore`` recomputes and compares them: a mismatch, or any error reading the step,
raises ``CheckpointCorruptError`` naming the step, the item's directory and the leaf.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


def _abstract(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for every array of ``tree``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


ARRAY_ITEMS = ("params", "opt_state", "batch_stats", "rng")
"""The pytree items a checkpoint may hold (besides ``meta``)."""

_INTEGRITY_KEYS = ("fingerprints", "meta_crc32")
DELETED = "deleted"
"""Subdirectory retention renames old steps into before they are purged."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step that cannot be read, or whose contents differ from what was saved."""

    def __init__(self, message: str, *, step: int):
        super().__init__(message)
        self.step = step


def _as_uint32(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words, one per element (narrower types zero-extended; 8-byte
    types as a trailing axis of their two halves)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if bits is None:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


def _fingerprint(x: jax.Array) -> jax.Array:
    """uint32 scalar: ``sum_i bits_i * w_i mod 2**32`` with odd weights ``w_i`` hashed from the
    element's (row-major, wrapping) global index. Any change of one element changes it (odd
    weights are invertible mod 2**32), and since integer addition is exact it is the same
    whatever the array's sharding, so a checkpoint restored onto another mesh verifies against
    the saved value. The index is built from per-axis iotas, so no reshape moves a sharded
    array."""
    words = _as_uint32(jnp.asarray(x))
    idx = jnp.zeros(words.shape, jnp.uint32)
    for axis, size in enumerate(words.shape):
        idx = idx * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
    w = (idx * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) ^ (idx >> 16)
    return jnp.sum(words * (w | jnp.uint32(1)), dtype=jnp.uint32)


@jax.jit
def _fingerprints(tree: Any) -> Any:
    return jax.tree.map(_fingerprint, tree)


_HOST_CHUNK = 1 << 22  # elements per numpy pass of ``_fingerprint_host``


def _fingerprint_host(x: np.ndarray) -> int:
    """``_fingerprint`` in numpy, in chunks (uint32 arithmetic wraps as on the device)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        words = x.astype(np.uint32).reshape(-1)
    elif x.dtype.itemsize in (1, 2, 4):
        words = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).reshape(-1)
    else:
        words = x.view(np.uint32).reshape(-1)
    total = np.uint32(0)
    for start in range(0, words.size, _HOST_CHUNK):
        chunk = words[start : start + _HOST_CHUNK].astype(np.uint32)
        idx = (np.arange(start, start + chunk.size, dtype=np.uint64) & 0xFFFFFFFF).astype(np.uint32)
        w = (idx * np.uint32(0x9E3779B1) + np.uint32(0x7F4A7C15)) ^ (idx >> np.uint32(16))
        total += np.sum(chunk * (w | np.uint32(1)), dtype=np.uint32)
    return int(total)


def fingerprints(trees: dict[str, Any]) -> dict[str, dict[str, int]]:
    """``{item: {leaf path: fingerprint}}`` of the arrays of ``trees``.

    On CPU (single process) in numpy on the host, where the arrays already are (no compile per
    state structure); elsewhere on the devices, one program per item and one round trip.
    """
    out = {}
    for item, tree in trees.items():
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        if not flat:
            continue
        leaves = [v for _, v in flat]
        if jax.process_count() == 1 and all(_on_cpu(v) for v in leaves):
            values = [_fingerprint_host(v) for v in leaves]
        else:
            values = jax.device_get(_fingerprints(leaves))
        out[item] = {
            jax.tree_util.keystr(p): int(v) for (p, _), v in zip(flat, values, strict=True)
        }
    return out


def _on_cpu(x: Any) -> bool:
    devices = getattr(x, "devices", None)
    return devices is None or all(d.platform == "cpu" for d in devices())


def _meta_crc(meta: dict) -> int:
    body = {k: v for k, v in meta.items() if k != "meta_crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


class Checkpointer:
    """Saves and restores a run's checkpoints under ``<workdir>/checkpoints``."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        keep_steps: tuple[int, ...] = (),
        read_only: bool = False,
    ):
        """``max_to_keep``: the latest steps kept; ``keep_steps``: steps kept besides them (a
        stable run's branch points, ``train.branch_steps``). ``read_only``: another run's
        checkpoints, read while that run may still be saving (``train.init_from``): nothing is
        written, retired or purged there."""
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        if read_only:  # (retention options would only be overridden, with a warning each)
            options = ocp.CheckpointManagerOptions(
                read_only=True,
                create=False,
                enable_async_checkpointing=False,
                save_interval_steps=0,
            )
        else:
            keep = {"max_to_keep": max_to_keep}
            if keep_steps:
                policies = ocp.checkpoint_managers
                keep = {
                    "preservation_policy": policies.AnyPreservationPolicy(
                        [policies.LatestN(max_to_keep), policies.CustomSteps(list(keep_steps))]
                    )
                }
            options = ocp.CheckpointManagerOptions(
                **keep,
                enable_async_checkpointing=async_save,
                create=True,
                todelete_subdir=DELETED,
            )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_names=(*ARRAY_ITEMS, "meta"),
        )
        self._purge()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def delete(self, step: int) -> None:
        """Deletes ``step`` (after any save in flight; renamed into ``deleted/`` first, as
        retention does, so a kill never leaves it half deleted and listed)."""
        self._manager.wait_until_finished()
        self._manager.delete(step)
        self._purge()

    def save(self, step: int, trees: dict[str, Any], meta: dict, *, force: bool = True) -> None:
        """Starts saving ``step`` (asynchronously if configured); arrays are copied before return.

        ``trees`` maps item names (``ARRAY_ITEMS``) to pytrees; empty ones are skipped. ``meta``
        gets the arrays' fingerprints and its own CRC added.
        """
        unknown = set(trees) - set(ARRAY_ITEMS)
        if unknown:
            raise ValueError(f"unknown checkpoint items {sorted(unknown)}; known: {ARRAY_ITEMS}")
        # The previous asynchronous save's finalization retires old steps into ``deleted/`` in
        # orbax's background thread (mkdir, then rename); purging while it runs can remove the
        # directory between the two. ``CheckpointManager.save`` waits for that thread anyway, so
        # waiting first costs nothing.
        self._manager.wait_until_finished()
        self._purge()
        clash = set(_INTEGRITY_KEYS) & set(meta)
        if clash:
            raise ValueError(f"meta keys {sorted(clash)} are reserved for the checkpoint's checks")
        trees = {k: v for k, v in trees.items() if jax.tree.leaves(v)}
        meta = {**meta, "fingerprints": fingerprints(trees)}
        meta["meta_crc32"] = _meta_crc(meta)
        items = {k: ocp.args.StandardSave(v) for k, v in trees.items()}
        self._manager.save(
            step, args=ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta)), force=force
        )

    def read_meta(self, step: int) -> dict:
        """The verified ``meta`` of ``step`` (without the integrity fields)."""
        self._check_step(step)
        out = self._read(step, {"meta": ocp.args.JsonRestore()})
        return self._verified_meta(step, out["meta"])

    def restore(self, step: int, likes: dict[str, Any]) -> tuple[dict[str, Any], dict]:
        """Restores the items named in ``likes`` onto the shapes, dtypes and shardings of the trees
        there (an empty tree comes back as it is, unread) and verifies them against the
        fingerprints saved with them. Returns ``(trees, meta)``; raises
        ``CheckpointCorruptError`` if the step cannot be read or differs from what was saved."""
        self._check_step(step)
        wanted = {k: v for k, v in likes.items() if jax.tree.leaves(v)}
        out = self._read(
            step,
            {
                **{k: ocp.args.StandardRestore(_abstract(v)) for k, v in wanted.items()},
                "meta": ocp.args.JsonRestore(),
            },
        )
        meta = self._verified_meta(step, out["meta"])
        saved = out["meta"].get("fingerprints")
        if saved is not None:
            got = fingerprints({k: out[k] for k in wanted})
            for item in wanted:
                for leaf, value in got.get(item, {}).items():
                    expected = saved.get(item, {}).get(leaf)
                    if expected != value:
                        raise CheckpointCorruptError(
                            f"checkpoint step {step} is corrupt: {self._item_dir(step, item)} "
                            f"leaf {leaf or '<root>'} reads back with fingerprint {value}, saved "
                            f"{expected}",
                            step=step,
                        )
        trees = {k: (out[k] if k in wanted else v) for k, v in likes.items()}
        return trees, meta

    def restore_latest(
        self, restore: Callable[[int], tuple[dict[str, Any], dict]], *, fallback: bool = False
    ) -> tuple[int, dict[str, Any], dict] | None:
        """``(step, trees, meta)`` of the latest step, read by ``restore(step)`` (e.g. a bound
        ``self.restore`` with the targets, or a re-laying-out restore), or ``None`` without any
        step. A corrupt latest step raises, or with ``fallback`` is reported with a warning and
        the step before it is tried (and so on); corrupt steps are left on disk for
        inspection."""
        steps = self.all_steps()
        for step in reversed(steps):
            try:
                trees, meta = restore(step)
            except CheckpointCorruptError as e:
                if not fallback:
                    raise
                msg = f"{e}; falling back to the previous checkpoint (train.checkpoint_fallback)"
                warnings.warn(msg, stacklevel=2)
                print(f"WARNING: {msg}", file=sys.stderr)
                continue
            return step, trees, meta
        if steps:
            raise CheckpointCorruptError(
                f"every checkpoint in {self.directory} is corrupt (steps {steps})", step=steps[0]
            )
        return None

    def _read(self, step: int, args: dict[str, Any]) -> dict:
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # orbax / tensorstore / json: whatever the damage raised
            raise CheckpointCorruptError(
                f"checkpoint step {step} in {self.directory / str(step)} cannot be read: "
                f"{_describe(e)}",
                step=step,
            ) from e

    def _verified_meta(self, step: int, raw: Any) -> dict:
        meta = dict(raw)
        where = self._item_dir(step, "meta")
        if "meta_crc32" in meta and meta["meta_crc32"] != _meta_crc(meta):
            raise CheckpointCorruptError(
                f"checkpoint step {step} is corrupt: {where} fails its CRC", step=step
            )
        if ("meta_crc32" in meta) != ("fingerprints" in meta):
            raise CheckpointCorruptError(
                f"checkpoint step {step} is corrupt: {where} lacks half of its integrity fields",
                step=step,
            )
        if meta.get("step", step) != step:
            raise CheckpointCorruptError(
                f"checkpoint step {step} is corrupt: {where} says step {meta['step']}", step=step
            )
        return {k: v for k, v in meta.items() if k not in _INTEGRITY_KEYS}

    def _item_dir(self, step: int, item: str) -> Path:
        return self.directory / str(step) / item

    def _check_step(self, step: int) -> None:
        steps = self.all_steps()
        if step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps or 'none'}"
            )

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        self._purge()

    def _purge(self) -> None:
        """Deletes the steps retention has retired into ``deleted/`` (process 0)."""
        if jax.process_index() == 0 and not self.read_only:
            shutil.rmtree(self.directory / DELETED, ignore_errors=True)


def _describe(e: BaseException) -> str:
    """The error's first line, with the file and array a TensorStore read error names (its spec
    holds the item directory's and the array's ``path``), without the spec itself."""
    text = str(e).strip()
    first = (text.splitlines()[0] if text else "").split(" See full TensorStore details")[0]
    paths = re.findall(r"'path': '([^']*)'", text)
    where = f" [file {paths[0]}, array {paths[-1].rstrip('/')}]" if len(paths) >= 2 else ""
    return f"{type(e).__name__}: {first[:500]}{where}"
