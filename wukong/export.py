"""``python -m wukong.export --workdir DIR --out MODEL [--precision P] [--platforms ...]``: a
trained run as a serving artifact (``recscale.serving.export``)."""

from __future__ import annotations

from recscale.train.cli import export_main
from wukong.config import WukongConfig
from wukong.model import build_model


def main(argv: list[str] | None = None) -> dict:
    return export_main("wukong", WukongConfig, build_model, argv)


if __name__ == "__main__":
    main()
