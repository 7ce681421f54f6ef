"""Trial identity (``sweeps.spec``): a hash of the canonical resolved config minus the fields
whose declared role (``data.roles``) is outside identity, plus the family, the code version and a
fingerprint of the data. Changing a hyperparameter makes a new trial, changing where or how often
it logs does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from data import roles
from recscale import __version__
from recscale import config as config_lib


def semantic_config(
    cdict: dict[str, Any], config_cls: type = config_lib.ExperimentConfig
) -> dict[str, Any]:
    """``cdict`` (a ``config_cls`` as ``to_dict`` writes it) as trial identity sees it: without
    the fields whose role is outside identity (logging, eval and checkpoint cadence, folders;
    where the data is, since the data fingerprint covers what it is), and without the fields
    added after sweeps were recorded while they hold the value that keeps the old behaviour
    (``identity_default``), so adding a field does not orphan recorded results
    (``data.roles``)."""
    return roles.identity_view(config_cls, cdict)


def trial_id(
    family: str,
    cdict: dict[str, Any],
    code_version: str,
    data_fp: str,
    config_cls: type = config_lib.ExperimentConfig,
) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of the semantic config and context."""
    blob = json.dumps(
        {
            "family": family,
            "config": semantic_config(cdict, config_cls),
            "code": code_version,
            "data": data_fp,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def data_fingerprint(data: Any) -> str:
    """What the data is: a generator's config (synthetic CTR data, planted histories), or each
    file's size and the SHA-256 of its first and last MiB (cheap on 100 GB files; a changed file
    almost surely changes it). ``data``: a ``DataConfig``, or a sequential run's
    ``SequenceDataConfig`` (``sequential.run_config``)."""
    if data.kind in ("synthetic", "planted"):
        blob = json.dumps(config_lib.to_dict(getattr(data, data.kind)), sort_keys=True)
        return f"{data.kind}:" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    h = hashlib.sha256()
    paths = [data.sasrec_path] if data.kind == "sasrec" else [data.train_path, data.eval_path]
    if data.kind == "tabular":  # the spec's content and every file it names
        from data.tabular.passes import resolve_inputs
        from data.tabular.spec import load_spec, spec_digest

        spec = load_spec(data.tabular.spec)
        h.update(spec_digest(spec).encode())
        inputs = resolve_inputs(spec)
        paths = [p for p, _ in inputs.files] + [p for side in inputs.sides for p in side]
    for path in paths:
        if not path:
            continue
        p = Path(path).expanduser()
        if not p.is_file():
            h.update(f"missing:{p.name}".encode())  # resolvable for a dry run; training fails
            continue
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read(1 << 20))
    return f"{data.kind}:" + h.hexdigest()[:16]


def current_code_version() -> str:
    """``<version>+<git sha>[.dirty-<hash of the diff of tracked files>]``, or the version alone
    outside a git checkout."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        ).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD", "--", ".")
    except (OSError, subprocess.CalledProcessError):
        return __version__
    version = f"{__version__}+{sha[:12]}"
    if diff:
        version += ".dirty-" + hashlib.sha256(diff.encode()).hexdigest()[:8]
    return version
