"""SASRec's ``data/Video.txt`` for tests, read in place: from a snapshot of github:kang205/SASRec
(a bare git directory, ``RECSCALE_SASREC_REPO``, default ``/work/.mirror/kang205+SASRec/repo``)
or from a plain file named by ``RECSCALE_SASREC_VIDEO``; a test skips when neither is there. The
data is never copied into the project."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SASREC_REPO = Path(os.environ.get("RECSCALE_SASREC_REPO", "/work/.mirror/kang205+SASRec/repo"))


def video_txt() -> tuple[bytes, str]:
    """``(the file's bytes, a name for it)``, or a skip with the reason."""
    plain = os.environ.get("RECSCALE_SASREC_VIDEO")
    if plain:
        if not Path(plain).is_file():
            pytest.skip(f"RECSCALE_SASREC_VIDEO={plain} is not a file")
        return Path(plain).read_bytes(), plain
    if not SASREC_REPO.is_dir():
        pytest.skip(
            f"no SASRec snapshot at {SASREC_REPO} (set RECSCALE_SASREC_REPO to a clone of "
            "github:kang205/SASRec, or RECSCALE_SASREC_VIDEO to its data/Video.txt)"
        )
    if shutil.which("git") is None:
        pytest.skip("git is not installed (needed to read Video.txt from the bare snapshot)")
    out = subprocess.run(
        ["git", "-C", str(SASREC_REPO), "show", "HEAD:data/Video.txt"],
        capture_output=True,
        check=False,
    )
    if out.returncode != 0:
        pytest.skip(f"{SASREC_REPO} has no data/Video.txt: {out.stderr.decode()[:200]}")
    return out.stdout, f"{SASREC_REPO}:data/Video.txt"


def video_path(tmp_dir: Path) -> str:
    """A path to Video.txt: ``RECSCALE_SASREC_VIDEO``'s, or the snapshot's bytes written into
    ``tmp_dir`` (a test's temporary folder, outside the project)."""
    plain = os.environ.get("RECSCALE_SASREC_VIDEO")
    data, _ = video_txt()
    if plain:
        return plain
    path = Path(tmp_dir) / "Video.txt"
    path.write_bytes(data)
    return str(path)
