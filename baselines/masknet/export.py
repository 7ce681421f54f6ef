"""``python -m baselines.masknet.export --workdir DIR --out MODEL [--precision P] [--platforms ...]``: a
trained run as a serving artifact (``recscale.serving.export``)."""

from __future__ import annotations

from baselines.masknet.config import MaskNetConfig
from baselines.masknet.model import build_model
from recscale.train.cli import export_main


def main(argv: list[str] | None = None) -> dict:
    return export_main("masknet", MaskNetConfig, build_model, argv, package="baselines.masknet")


if __name__ == "__main__":
    main()
