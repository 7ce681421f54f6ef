"""``python -m baselines.dcnv2.export --workdir DIR --out MODEL [--precision P] [--platforms ...]``: a
trained run as a serving artifact (``recscale.serving.export``)."""

from __future__ import annotations

from baselines.dcnv2.config import DCNv2Config
from baselines.dcnv2.model import build_model
from recscale.train.cli import export_main


def main(argv: list[str] | None = None) -> dict:
    return export_main("dcnv2", DCNv2Config, build_model, argv, package="baselines.dcnv2")


if __name__ == "__main__":
    main()
