"""Our FLOP and parameter counts for the Wukong paper's Criteo models beside its Table 3.

``python benchmarks/paper_table3.py`` (no data, no jax compile; about a second).

The paper (Zhang et al., ICML 2024, arXiv 2403.02545v4, Table 3) lists #Params and MFLOP per
example on Criteo Terabyte: DLRM 26,136,307,201 / 4.62, DCNv2 26,179,364,097 / 262.35, Wukong
26,163,636,001 / 173.73. It does not list the winning configurations, only the search space
(Appendix A: d=128; MLPs of 1-4 layers of 512/1024/2048; Wukong bottom MLP 512-256, l in 1..4,
n_F = n_L in {8, 16}, k = 24; DCNv2 1-4 cross layers, full rank or 512). The sparse parameters
are fixed by the MLPerf-capped Criteo TB tables at d=128 (26,135,627,264 here), so the paper's
dense parameter count is its total minus that. This script searches the space for the
configurations whose dense parameters and FLOPs match, counting FLOPs both ways
(``recscale.flops``: forward, and training = forward + backward), and prints the nearest ones.
Result: the paper's MFLOP are *training* FLOPs (about 3 x forward); see BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import itertools

import baselines.dcnv2.presets  # noqa: F401  (registers presets)
import dlrm.presets  # noqa: F401
import wukong.presets  # noqa: F401
from baselines.dcnv2.config import DCNv2ModelConfig
from data.config import CRITEO_TERABYTE_VOCAB_SIZES
from data.criteo.reader import criteo_schema
from recscale.config import get_preset

PAPER = {  # total params, MFLOP/example (Table 3, Criteo)
    "DLRM": (26_136_307_201, 4.62),
    "DCNv2": (26_179_364_097, 262.35),
    "Wukong": (26_163_636_001, 173.73),
}
WIDTHS = (512, 1024, 2048)
MLPS = [w for n in range(1, 5) for w in itertools.product(WIDTHS, repeat=n)]


def candidates(name: str):
    """(description, model config) over the paper's Appendix A search space."""
    if name == "DLRM":
        base = get_preset("dlrm/criteo-mlperf").model
        for bottom, top in itertools.product([(512, 256, 128), (256, 128), (128,)], MLPS):
            yield (
                f"bottom {bottom}, top {(*top, 1)}",
                dataclasses.replace(base, bottom_mlp=bottom, top_mlp=(*top, 1)),
            )
    elif name == "DCNv2":
        for layers, rank, deep, structure, dense in itertools.product(
            range(1, 5), (0, 512), MLPS, ("stacked", "parallel"), ((), (512, 256), (512, 256, 128))
        ):
            cfg = DCNv2ModelConfig(
                embed_dim=128,
                num_cross_layers=layers,
                cross_rank=rank,
                deep_mlp=deep,
                structure=structure,
                dense_mlp=dense,
            )
            yield (
                f"{layers} cross (rank {rank or 'full'}), {structure}, deep {deep}, dense MLP {dense}",
                cfg,
            )
    else:
        base = get_preset("wukong/criteo-terabyte").model
        for layers, n, depth, width, top in itertools.product(
            range(1, 5), (8, 16), range(1, 5), WIDTHS, MLPS
        ):
            cfg = dataclasses.replace(
                base,
                num_layers=layers,
                n_fmb=n,
                n_lcb=n,
                fmb_rank=24,
                fmb_mlp_depth=depth,
                fmb_mlp_width=width,
                top_mlp=(*top, 1),
            )
            yield f"l={layers}, n_F=n_L={n}, k=24, FMB MLP {depth}x{width}, top {(*top, 1)}", cfg


def main() -> None:
    schema = criteo_schema(CRITEO_TERABYTE_VOCAB_SIZES)
    sparse = sum(f.vocab_size for f in schema.features) * 128
    print(f"Criteo TB sparse parameters at d=128: {sparse:,}\n")
    for name, (total, mflop) in PAPER.items():
        dense = total - sparse
        print(f"== {name}: paper {mflop} MFLOP/example, {dense:,} dense parameters")
        for kind in ("forward", "train"):
            rows = []
            for desc, cfg in candidates(name):
                cost = cfg.cost(schema)
                flop = (cost.forward_flops if kind == "forward" else cost.train_flops) / 1e6
                err = abs(cost.dense_params - dense) / dense + abs(flop - mflop) / mflop
                rows.append(
                    (err, desc, cost.dense_params, cost.forward_flops / 1e6, cost.train_flops / 1e6)
                )
            err, desc, p, fwd, train = min(rows)
            print(
                f"  nearest by {kind:7s} FLOPs: {desc}\n"
                f"      dense params {p:,} ({p / dense - 1:+.3%}), forward {fwd:.3f}, train {train:.3f} "
                f"MFLOP (train/paper {train / mflop:.4f}, forward/paper {fwd / mflop:.4f})"
            )
        print()


if __name__ == "__main__":
    main()
