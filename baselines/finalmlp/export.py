"""``python -m baselines.finalmlp.export --workdir DIR --out MODEL [--precision P] [--platforms ...]``: a
trained run as a serving artifact (``recscale.serving.export``)."""

from __future__ import annotations

from baselines.finalmlp.config import FinalMLPConfig
from baselines.finalmlp.model import build_model
from recscale.train.cli import export_main


def main(argv: list[str] | None = None) -> dict:
    return export_main("finalmlp", FinalMLPConfig, build_model, argv, package="baselines.finalmlp")


if __name__ == "__main__":
    main()
