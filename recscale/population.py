"""``python -m recscale.population --package P --configs C... --workdirs W...``: runs of one
model size that differ only in their seeds (or learning rates) trained as one vmapped
population (``recscale.train.population``), each member in its own run folder; sweeps with
``populations=True`` run their seeds this way."""

from __future__ import annotations

import sys

from recscale.train.cli import population_main


def main(argv: list[str] | None = None) -> list[dict]:
    return population_main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
