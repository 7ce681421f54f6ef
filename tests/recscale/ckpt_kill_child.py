"""Child process of ``test_checkpoint_kills.py``: the real trainer, SIGKILLed at a chosen point
of a checkpoint write.

``python tests/recscale/ckpt_kill_child.py CLI_ARGS...`` runs ``python -m dlrm.train CLI_ARGS``
(the same ``main``) after installing one fault-injection hook, chosen by the JSON object in
``$CKPT_KILL``:

- ``phase``: where to kill (below); ``step``: the checkpoint step whose save is hit;
  ``marker``: a file the hook writes just before the kill (what it hit, and the checkpoint
  directory's files at that moment), so the test can tell that the kill landed where it meant;
  plus per-phase fields.
- ``mid_write``: the save's array items are written one at a time: ``first`` (``params`` or
  ``opt_state``) goes through orbax's array write (its OCDBT transaction committed, its files
  on disk), every other item waits, and ``delay`` seconds later the process dies.
- ``before_commit``: every item is written and finalised; the process dies on the step
  directory's commit, ``at`` ``finalize`` (entering ``AtomicRenameTemporaryPath.finalize``) or
  ``rename`` (``commit_success.txt`` written, the atomic rename of the temporary directory next).
- ``async_inflight``: the save's array writes are stalled; ``Checkpointer.save`` returns,
  training goes on, and the process dies once ``after_steps`` more steps have logged.
- ``keep1_after_save``: the writes are stalled and the process dies ``settle`` seconds after
  ``Checkpointer.save`` returns (with ``--train.max-checkpoints 1``).
- ``keep1_mid_delete``: the save commits; retention retires the previous step (``old_step``)
  into ``deleted/``, and the process dies once half of its files are purged from there.

If the run ends without reaching the point it exits with ``NOT_KILLED_EXIT_CODE``. Only this
process is patched: the test relaunches with the plain CLI.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the checkout's packages, whatever the working directory

from orbax.checkpoint._src.path import atomicity  # noqa: E402
from orbax.checkpoint._src.serialization import jax_array_handlers  # noqa: E402

import dlrm.train  # noqa: E402
from recscale.train import checkpoint as checkpoint_lib  # noqa: E402
from recscale.train import run_files  # noqa: E402

NOT_KILLED_EXIT_CODE = 3
TMP_SUFFIX = atomicity.TMP_DIR_SUFFIX  # "<name>.orbax-checkpoint-tmp": not yet committed
COMMIT_FILE = atomicity.COMMIT_SUCCESS_FILE  # written into a directory just before its commit
STALL_S = 600.0  # "forever": a stalled write is still waiting when the process dies

SPEC: dict = json.loads(os.environ["CKPT_KILL"])
_lock = threading.Lock()


def _files(directory: Path) -> list[str]:
    """Files under ``directory``, relative (``os.walk`` skips what vanishes meanwhile)."""
    return sorted(
        os.path.relpath(os.path.join(root, f), directory)
        for root, _, files in os.walk(directory)
        for f in files
    )


def _kill(ckpt_dir: Path, **hit) -> None:
    """Writes the marker (what was hit, the checkpoint files now), then SIGKILLs the process."""
    with _lock:  # one thread writes the marker; any other waits here for the signal
        record = {**SPEC, **hit, "entries": sorted(os.listdir(ckpt_dir)), "files": _files(ckpt_dir)}
        marker = Path(SPEC["marker"])
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, marker)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(STALL_S)  # not reached: SIGKILL cannot be caught


def _patch(owner, name: str, make):
    """Replaces ``owner.name`` by ``make(original)``; fails loudly if orbax moved it."""
    original = getattr(owner, name)  # AttributeError: the hook point moved in this orbax
    setattr(owner, name, make(original))


def _step_of(path: Path) -> tuple[int, Path]:
    """(step, checkpoints directory) of ``<ckpt_dir>/<step>[.tmp suffix]/...`` item paths."""
    step_dir = path.parent
    return int(step_dir.name.removesuffix(TMP_SUFFIX)), step_dir.parent


def _hook_array_writes(on_write) -> None:
    """``on_write(item, step, ckpt_dir, write)`` wraps orbax's write of one item's arrays
    (``jax_array_handlers._async_serialize_replica_slices``: it writes them in one OCDBT
    transaction and returns once that transaction is committed to disk). Asynchronous saves
    run it in a background thread, after ``save`` has returned."""

    def make(original):
        async def wrapped(values, infos, args, **kwargs):
            await infos[0].await_path_creation()  # the item's (temporary) directory
            item_dir = Path(infos[0].parent_dir)
            step, ckpt_dir = _step_of(item_dir)
            item = item_dir.name.removesuffix(TMP_SUFFIX)
            return await on_write(
                item, step, ckpt_dir, lambda: original(values, infos, args, **kwargs)
            )

        return wrapped

    _patch(jax_array_handlers, "_async_serialize_replica_slices", make)


def _stall_writes_of_target_step() -> None:
    async def on_write(item, step, ckpt_dir, write):
        if step == SPEC["step"]:
            await asyncio.sleep(STALL_S)
        return await write()

    _hook_array_writes(on_write)


def _on_save_returned(callback) -> None:
    """``callback(ckpt_dir)`` right after ``Checkpointer.save`` of the target step returns."""

    def make(original):
        def save(self, step, *args, **kwargs):
            out = original(self, step, *args, **kwargs)
            if step == SPEC["step"]:
                callback(Path(self.directory))
            return out

        return save

    _patch(checkpoint_lib.Checkpointer, "save", make)


def install_mid_write() -> None:
    async def on_write(item, step, ckpt_dir, write):
        if step != SPEC["step"]:
            return await write()
        if item != SPEC["first"]:
            await asyncio.sleep(STALL_S)  # the other items wait: none of their files exist
        out = await write()
        await asyncio.sleep(SPEC["delay"])
        _kill(ckpt_dir, written_item=item)
        return out

    _hook_array_writes(on_write)


def install_before_commit() -> None:
    def is_target(final: Path) -> bool:
        return final.name == str(SPEC["step"])  # the step directory (items are below it)

    if SPEC["at"] == "finalize":

        def make(original):
            async def finalize(self, *args, **kwargs):
                final = Path(self.get_final())
                if is_target(final):
                    _kill(final.parent, commit_file=(Path(self.get()) / COMMIT_FILE).exists())
                return await original(self, *args, **kwargs)

            return finalize

        _patch(atomicity.AtomicRenameTemporaryPath, "finalize", make)
    else:
        # ``finalize`` calls ``async_path.rename(tmp, final)`` last: a stand-in module whose
        # ``rename`` dies first, for the step directory only.
        real = atomicity.async_path

        class AsyncPath:
            def __getattr__(self, name):
                return getattr(real, name)

            async def rename(self, src, dst):
                if is_target(Path(dst)):
                    _kill(Path(dst).parent, commit_file=(Path(src) / COMMIT_FILE).exists())
                return await real.rename(src, dst)

        _patch(atomicity, "async_path", lambda _: AsyncPath())


def install_async_inflight() -> None:
    _stall_writes_of_target_step()
    state: dict = {}
    _on_save_returned(lambda ckpt_dir: state.setdefault("ckpt_dir", ckpt_dir))

    def make(original):
        def write(self, row):
            original(self, row)
            last = SPEC["step"] + SPEC["after_steps"]
            if "ckpt_dir" in state and row.get("split") == "train" and row["step"] == last:
                _kill(state["ckpt_dir"], steps_after_save=row["step"] - SPEC["step"])

        return write

    _patch(run_files.MetricsWriter, "write", make)


def install_keep1_after_save() -> None:
    _stall_writes_of_target_step()

    def settle_and_kill(ckpt_dir: Path) -> None:
        # The step cannot commit (its writes are held); ``settle`` seconds let the background
        # finalisation do whatever it would do before the commit (deleting the old step would
        # be the bug) before the kill.
        time.sleep(SPEC["settle"])
        _kill(ckpt_dir)

    _on_save_returned(settle_and_kill)


def install_keep1_mid_delete() -> None:
    def make(original):
        def purge(self):
            old = Path(self.directory) / checkpoint_lib.DELETED / str(SPEC["old_step"])
            if not old.is_dir():
                return original(self)
            ckpt_dir = Path(self.directory)
            total = len(_files(old))
            unlinked = [0]
            real_unlink = os.unlink

            # shutil.rmtree unlinks file by file: die halfway through the retired step.
            def unlink(*args, **kw):
                real_unlink(*args, **kw)
                with _lock:
                    unlinked[0] += 1
                    half = unlinked[0] >= total // 2
                if half:
                    _kill(ckpt_dir, unlinked=unlinked[0], of=total)

            os.unlink = unlink
            return original(self)

        return purge

    _patch(checkpoint_lib.Checkpointer, "_purge", make)


INSTALL = {
    "mid_write": install_mid_write,
    "before_commit": install_before_commit,
    "async_inflight": install_async_inflight,
    "keep1_after_save": install_keep1_after_save,
    "keep1_mid_delete": install_keep1_mid_delete,
}

if __name__ == "__main__":
    INSTALL[SPEC["phase"]]()
    dlrm.train.main(sys.argv[1:])
    print(f"the run ended without reaching the kill point {SPEC}", file=sys.stderr)
    sys.exit(NOT_KILLED_EXIT_CODE)
