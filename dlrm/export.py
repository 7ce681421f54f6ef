"""``python -m dlrm.export --workdir DIR --out MODEL [--precision P] [--platforms ...]``: a
trained run as a serving artifact (``recscale.serving.export``)."""

from __future__ import annotations

from dlrm.config import DLRMConfig
from dlrm.model import build_model
from recscale.train.cli import export_main


def main(argv: list[str] | None = None) -> dict:
    return export_main("dlrm", DLRMConfig, build_model, argv)


if __name__ == "__main__":
    main()
