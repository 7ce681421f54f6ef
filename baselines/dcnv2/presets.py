"""Named DCNv2 presets. Each docstring states its command and the expected result."""

from __future__ import annotations

from baselines.dcnv2.config import DCNv2Config, DCNv2ModelConfig
from recscale import recipes
from recscale.config import register


@register("dcnv2/tiny")
def tiny() -> DCNv2Config:
    """Seconds on CPU; for tests, notebooks and dry runs (the */tiny data): d=8, 2 low-rank
    (r=4) cross layers in parallel with a 16-16 deep MLP; dense features fed as they are.

    ``python -m baselines.dcnv2.train dcnv2/tiny --workdir runs/dcnv2_tiny`` — 20 steps, finite
    loss, AUC above 0.5.
    """
    return DCNv2Config(
        model=DCNv2ModelConfig(
            embed_dim=8,
            num_cross_layers=2,
            cross_rank=4,
            structure="parallel",
            deep_mlp=(16, 16),
        ),
        **recipes.tiny(),
    )


@register("dcnv2/synthetic")
def synthetic() -> DCNv2Config:
    """dlrm/synthetic's data and optimizers (Adam 1e-3 with 50 warmup steps, row-wise Adagrad
    0.05 on the tables, batch 1,024) with a small DCNv2: d=16, 3 low-rank (r=16) cross layers
    in parallel with a 256-128 deep MLP. The base of ``sweeps.specs.showcase``'s DCNv2 ladder.

    ``python -m baselines.dcnv2.train dcnv2/synthetic --workdir runs/dcnv2_synthetic`` — 3,000
    steps in a few minutes on 2 CPU cores; eval AUC well above 0.5 (the teacher reaches ~0.86).
    """
    return DCNv2Config(
        model=DCNv2ModelConfig(
            embed_dim=16,
            num_cross_layers=3,
            cross_rank=16,
            structure="parallel",
            deep_mlp=(256, 128),
        ),
        **recipes.synthetic(),
    )


@register("dcnv2/frappe")
def frappe() -> DCNv2Config:
    """Frappe (BARS Frappe_x1) from ``../shared/data/frappe``, BARS-like DCNv2: d=10 (x_0 of
    10 x 10 = 100), 3 full-rank cross layers in parallel with a 400-400-400 deep MLP with
    BatchNorm and dropout 0.2; dlrm/frappe's optimizers (Adam 1e-3 on the dense part; Adam 1e-2
    with L2 0.02 on the tables; cosine decay; batch 4,096); 2,000 steps (about 40 epochs), as
    dlrm/frappe (a first run without BatchNorm, 1,200 steps, was still rising at 0.9782).

    ``python -m baselines.dcnv2.train dcnv2/frappe --workdir runs/dcnv2_frappe --train.no-progress``
    — validation AUC 0.9848 ± 0.0001, logloss 0.145 over 3 seeds, 5.5 minutes alone on 2 CPU
    cores (BENCHMARKS.md, ``benchmarks/frappe_table.py``); BARS reports
    DCNv2 test AUC 0.9845 on Frappe_x1, the Wukong paper 0.9774.
    """
    return DCNv2Config(
        model=DCNv2ModelConfig(
            embed_dim=10,
            num_cross_layers=3,
            cross_rank=0,
            structure="parallel",
            deep_mlp=(400, 400, 400),
            dropout=0.2,
            batch_norm=True,
            embedding_init="normal",
            embedding_init_scale=0.01,
        ),
        **recipes.frappe(num_steps=2000),
    )


@register("dcnv2/criteo-terabyte")
def criteo_terabyte() -> DCNv2Config:
    """The DCNv2 of the Wukong paper's Criteo Terabyte comparison: d=128, dense features through
    a 512-256-128 MLP, 2 full-rank cross layers stacked with a 4x2048 deep MLP, and
    wukong/criteo-terabyte's data and optimizers (Adam 1e-3 dense, row-wise Adagrad 0.1 on the
    tables, 10% warmup, batch 131,072, one epoch). The paper lists only its search space; this is
    the configuration of that space whose dense parameters (43,737,217) and training FLOPs (262.33
    MFLOP/example) match its Table 3 (43,736,833 and 262.35): ``benchmarks/paper_table3.py``.

    ``python -m baselines.dcnv2.train dcnv2/criteo-terabyte --workdir runs/dcnv2_tb
    --data.train-path ... --data.eval-path ...`` — needs accelerators and the raw day files.
    """
    return DCNv2Config(
        model=DCNv2ModelConfig(
            embed_dim=128,
            dense_mlp=(512, 256, 128),
            num_cross_layers=2,
            cross_rank=0,
            structure="stacked",
            deep_mlp=(2048, 2048, 2048, 2048),
        ),
        **recipes.criteo_terabyte(),
    )
