"""Model-size ladders of a sweep (``sweeps.spec.FamilySpec.ladder``): a rung is a name and the
model fields it sets on the family's base preset. Specs import these from ``sweeps.spec``."""

from __future__ import annotations

import dataclasses
from typing import Any

from wukong.presets import TABLE5


@dataclasses.dataclass(frozen=True)
class Rung:
    """One model size: a name and the model-config fields it sets on the family's base preset."""

    name: str
    model: dict[str, Any]
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other config fields this rung sets, by dotted path, after everything else (e.g.
    ``{"data.max_table_rows": 1000}`` for a grid over embedding capacity)."""


def wukong_ladder(rows: tuple[tuple[int, int, int, int, int, int], ...], prefix: str = "w"):
    """Wukong rungs from ``(l, n_F, n_L, k, FMB MLP depth, FMB MLP width)`` rows, as the
    paper's Table 5 grows them: layers first, then n_F/n_L and k, then the FMB MLP width."""
    return tuple(
        Rung(
            f"{prefix}{i + 1}",
            dict(
                num_layers=nl_, n_fmb=nf, n_lcb=nl, fmb_rank=k, fmb_mlp_depth=dep, fmb_mlp_width=w
            ),
        )
        for i, (nl_, nf, nl, k, dep, w) in enumerate(rows)
    )


def wukong_rung(name, d, layers, n, k, depth, width, dense, top) -> Rung:
    """A Wukong rung that also sets d, the dense-feature MLP and the top MLP: ``(name, d, l,
    n_F = n_L, k, FMB MLP depth, FMB MLP width, dense MLP, top MLP)``."""
    return Rung(
        name,
        dict(
            embed_dim=d,
            num_layers=layers,
            n_fmb=n,
            n_lcb=n,
            fmb_rank=k,
            fmb_mlp_depth=depth,
            fmb_mlp_width=width,
            dense_mlp=dense,
            top_mlp=top,
        ),
    )


def dlrm_ladder(rows: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], prefix="d"):
    """DLRM rungs from ``(embed_dim, bottom MLP, top MLP)`` rows (MLP widths and embedding
    dim; the bottom MLP must end in ``embed_dim``, the top MLP in 1)."""
    return tuple(
        Rung(f"{prefix}{i + 1}", dict(embed_dim=d, bottom_mlp=bot, top_mlp=top))
        for i, (d, bot, top) in enumerate(rows)
    )


# The paper's Table 5 (arXiv 2403.02545v4; rows kept in wukong/presets.py), for accelerator
# sweeps on Criteo-scale data.
WUKONG_TABLE5_LADDER = wukong_ladder(TABLE5, prefix="table5-")
