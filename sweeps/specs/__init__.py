"""Ready-made sweep specs: ``tiny`` (tests, notebooks), ``showcase`` (``make run``), and the
ladder builders the baselines' rungs share (DLRM's and Wukong's are in ``sweeps.spec``)."""

from __future__ import annotations

from sweeps.spec import Rung


def dcnv2_ladder(rows: tuple[tuple[int, int, int, tuple[int, ...]], ...]) -> tuple[Rung, ...]:
    """DCNv2 rungs ``c1, c2, ...`` from ``(embed_dim, cross layers, cross rank (0: full), deep
    MLP)`` rows."""
    return tuple(
        Rung(f"c{i + 1}", dict(embed_dim=d, num_cross_layers=n, cross_rank=r, deep_mlp=mlp))
        for i, (d, n, r, mlp) in enumerate(rows)
    )


def finalmlp_ladder(
    rows: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int], ...],
) -> tuple[Rung, ...]:
    """FinalMLP rungs ``f1, f2, ...`` from ``(embed_dim, stream 1 MLP, stream 2 MLP, gate
    hidden units, fusion heads)`` rows."""
    return tuple(
        Rung(f"f{i + 1}", dict(embed_dim=d, mlp1=m1, mlp2=m2, fs_hidden_units=fs, num_heads=h))
        for i, (d, m1, m2, fs, h) in enumerate(rows)
    )
