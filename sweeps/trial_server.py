"""``python -m sweeps.trial_server WORKER_LOG``: one long-lived Python that runs many trials, one at a time.

A sweep trial is a short run, and a fresh process per trial pays Python start-up, the imports
(jax, flax, orbax: seconds) and JAX's backend start for every one of them. A worker of
``sweeps.runner`` therefore keeps one of these processes and sends it trials: the family's
normal train entry point (``PACKAGE.train.main(argv)``, the same trainer the CLI runs, never a
copy) is called in-process, with file descriptors 1 and 2 pointed at the trial's ``train.log``
for its duration, exactly as a separate process's output would be.

Protocol (one JSON object per line): the worker writes ``{"argv": ["-m", MODULE, ARGS...],
"log": PATH}`` to stdin; the server answers ``{"exit_code": N}`` on its original stdout when
the trial ends: 0, the code of a ``SystemExit`` (a divergence exits with
``recscale.train.DIVERGED_EXIT_CODE``), or 1 for any other exception (its traceback goes to the
trial's log). EOF on stdin ends the server.

Isolation: the worker replaces the server after any trial that did not exit 0, after a
preempted one and after ``max_trials_per_process`` trials, so a failed trial never leaves state
behind for the next one; between trials the server drops JAX's in-memory compilation caches
(the finished trial's programs; repeats come back from the persistent cache). The worker kills
the server (process group, SIGKILL) for a timeout, a lost claim or a stop, exactly as it killed
a per-trial process, and the server is started through ``data._child``, so it dies with its
worker: a killed worker still leaves no orphan and loses no trial (its claim goes stale and the
trial is taken over and resumed from its checkpoints).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import json
import os
import sys
import traceback
from collections.abc import Iterator


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Points fds 1 and 2 (and so every writer: print, logging, C++ code) at ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


_trial_numbers = itertools.count(1)


def run_one(argv: list[str], log: str) -> int:
    """Runs ``argv`` (``["-m", MODULE, ARGS...]``) in this process; returns its exit code."""
    if len(argv) < 2 or argv[0] != "-m":
        raise ValueError(f"trial command must be ['-m', MODULE, ...], got {argv!r}")
    module, args = argv[1], argv[2:]
    with _output_to(log):
        print(
            f"(trial server pid {os.getpid()}, trial {next(_trial_numbers)} in this process)",
            flush=True,
        )
        try:
            importlib.import_module(module).main(args)
            return 0
        except SystemExit as e:
            code = e.code
            if code is None:
                return 0
            if isinstance(code, int):
                return code
            print(code, file=sys.stderr)
            return 1
        except BaseException:  # noqa: BLE001  (reported, and the worker replaces this process)
            traceback.print_exc()
            return 1


def main() -> None:
    # argv[1] (the worker's log, unused here) puts the sweep directory in this process's
    # command line, where ``ps`` and the tests find a sweep's processes.
    # The replies go to the original stdout, kept aside before any trial redirects fd 1.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        code = run_one(request["argv"], request["log"])
        reply.write(json.dumps({"exit_code": code}) + "\n")
        if code == 0:
            # The finished trial's objects go; its compiled programs stay, for the next trial of
            # the same model (``recscale.train.experiment.cached_program`` keeps a bounded number).
            gc.collect()


if __name__ == "__main__":
    main()
