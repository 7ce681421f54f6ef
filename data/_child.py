"""``python -m data._child PARENT_PID PROGRAM ARGS...``: exec PROGRAM, killed when PARENT dies.

Sets ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux; it survives ``execv``) and then replaces
itself with the command, so a process killed with SIGKILL takes its child down with it instead
of leaving an orphan that keeps writing where a relaunch takes over: a sweep worker's trial
(``sweeps/runner.py``), a tabular preparation's workers (``data/tabular/prepare.py``). It lives
in ``data``, the lowest layer, so both can use it. Elsewhere it just execs (a sweep's heartbeat
timeout still guards take-overs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def command(*program: str) -> list[str]:
    """The argv that runs ``program`` (its own argv) through this trampoline, killed when the
    calling process dies."""
    return [sys.executable, "-m", "data._child", str(os.getpid()), *program]


def main() -> None:
    parent = int(sys.argv[1])  # the worker's pid, passed in: getppid() here could already be 1
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the worker died before prctl took effect
            os._exit(1)
    os.execvp(sys.argv[2], sys.argv[2:])


if __name__ == "__main__":
    main()
