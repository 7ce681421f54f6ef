"""``python -m baselines.finalmlp.export --workdir DIR --out MODEL [--precision P] [--platforms ...]``: a
trained run as a serving artifact (``recscale.serving.export``)."""

from __future__ import annotations

from baselines.finalmlp import FAMILY
from recscale.export import export_main


def main(argv: list[str] | None = None) -> dict:
    return export_main(FAMILY, argv)


if __name__ == "__main__":
    main()
