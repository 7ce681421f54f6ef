"""Named SASRec presets. Each docstring states its command and the expected result."""

from __future__ import annotations

import dataclasses

from recscale.config import register
from sequential import recipes
from sequential.config import LossConfig, SASRecConfig
from sequential.run_config import SASRecRunConfig

SASREC_BCE = LossConfig(kind="bce", l2_norm=False, temperature=1.0)
"""SASRec's own loss: one negative per position, raw dot products."""


@register("sasrec/tiny")
def tiny() -> SASRecRunConfig:
    """Seconds on CPU; for tests and dry runs (``sequential.recipes.tiny``'s planted data).

    ``python -m sequential.sasrec.train sasrec/tiny --workdir runs/sasrec_tiny`` — 20 steps of
    a 16-wide 1-block SASRec with SASRec's BCE loss; the training loss falls.
    """
    return SASRecRunConfig(
        model=SASRecConfig(
            n_items=recipes.TINY_PLANTED.n_items,
            d_model=16,
            num_layers=1,
            num_heads=2,
            max_seq_len=recipes.TINY_PLANTED.max_len,
        ),
        loss=SASREC_BCE,
        **recipes.tiny(),
    )


@register("sasrec/planted")
def planted() -> SASRecRunConfig:
    """SASRec (d = 64, 2 blocks, 2 heads, N = 100) with the full softmax (cosine / 0.05, so its
    eval loss is comparable with ``bayes_loss``) on the default planted data
    (``sequential.recipes.planted``).

    ``python -m sequential.sasrec.train sasrec/planted --workdir runs/sasrec_planted`` — eval
    rows show the model's loss beside ``bayes_loss`` (3.56 nats); not yet run to the end: no
    result to quote.
    """
    return SASRecRunConfig(
        model=SASRecConfig(
            n_items=10_000, d_model=64, num_layers=2, num_heads=2, max_seq_len=100, dropout=0.2
        ),
        loss=LossConfig(kind="full_softmax"),
        **recipes.planted(),
    )


@register("sasrec/games")
def games() -> SASRecRunConfig:
    """SASRec as its paper on Amazon Games (github:kang205/SASRec ``main.py`` defaults for
    ``--dataset=Video``): maxlen 50, 50 hidden units, 2 blocks, 1 head, dropout 0.5, its BCE
    loss, and ``sequential.recipes.games``' data and optimizer.

    ``python -m sequential.sasrec.train sasrec/games --workdir runs/sasrec_games
    --data.sasrec-path PATH/Video.txt``, then ``python -m sequential.sasrec.evaluate --workdir
    runs/sasrec_games --eval-split test``: ``sampled_hr@10``, ``sampled_ndcg@10`` compare with
    the paper's Table III (test HR@10 and NDCG@10 under the sampled protocol): 0.7377 and
    0.5313, mean of 3 seeds, against the paper's 0.7410 and 0.5360 (README "Amazon Games").
    About 15 minutes of training steps on one CPU core (BENCHMARKS.md, issue 37).
    """
    return SASRecRunConfig(
        model=SASRecConfig(
            n_items=recipes.GAMES_ITEMS,
            d_model=50,
            num_layers=2,
            num_heads=1,
            max_seq_len=50,
            dropout=0.5,
        ),
        loss=SASREC_BCE,
        **recipes.games(),
    )


@register("sasrec/games_softmax")
def games_softmax() -> SASRecRunConfig:
    """``sasrec/games`` with ``hstu/games``' loss and dropout (the sampled softmax of 128
    negatives, cosine / 0.05; dropout 0.2): the baseline HSTU is compared with, so that the two
    differ only in their layers (same size, data, optimizer and steps).

    ``python -m sequential.sasrec.train sasrec/games_softmax --workdir runs/sasrec_games_softmax
    --data.sasrec-path PATH/Video.txt`` — 3 seeds, test: HR@10 0.1021 and NDCG@10 0.0552 over
    all items, 0.7176 / 0.5371 against 100 sampled negatives (README "Amazon Games", beside
    HSTU's).
    """
    cfg = games()
    hstu_like = dataclasses.replace(cfg.model, dropout=0.2)
    return dataclasses.replace(cfg, model=hstu_like, loss=LossConfig(num_negatives=128))
