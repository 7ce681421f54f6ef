"""Named HSTU presets. Each docstring states its command and the expected result."""

from __future__ import annotations

from recscale.config import register
from sequential import recipes
from sequential.config import HSTUConfig, LossConfig
from sequential.run_config import HSTURunConfig


@register("hstu/tiny")
def tiny() -> HSTURunConfig:
    """Seconds on CPU; for tests and dry runs (``sequential.recipes.tiny``'s planted data).

    ``python -m sequential.hstu.train hstu/tiny --workdir runs/hstu_tiny`` — 20 steps of a
    16-wide 1-layer HSTU with a 32-negative sampled softmax; the training loss falls.
    """
    return HSTURunConfig(
        model=HSTUConfig(
            n_items=recipes.TINY_PLANTED.n_items,
            d_model=16,
            num_layers=1,
            num_heads=2,
            d_qk=8,
            d_v=8,
            max_seq_len=recipes.TINY_PLANTED.max_len,
            num_buckets=8,
        ),
        loss=LossConfig(num_negatives=32),
        **recipes.tiny(),
    )


@register("hstu/planted")
def planted() -> HSTURunConfig:
    """HSTU (d = 64, 2 layers, 2 heads of 32) with HSTU's sampled softmax (128 negatives,
    cosine / 0.05) on the default planted data (``sequential.recipes.planted``).

    ``python -m sequential.hstu.train hstu/planted --workdir runs/hstu_planted`` — eval rows
    show the model's full-softmax loss beside ``bayes_loss`` (3.56 nats); not yet run to the
    end: no result to quote.
    """
    return HSTURunConfig(
        model=HSTUConfig(
            n_items=10_000, d_model=64, num_layers=2, num_heads=2, d_qk=32, d_v=32, max_seq_len=100
        ),
        loss=LossConfig(num_negatives=128),
        **recipes.planted(),
    )


@register("hstu/games")
def games() -> HSTURunConfig:
    """HSTU on SASRec's Video.txt with SASRec's partition, batching and optimizer
    (``sequential.recipes.games``): d = 50, 2 layers, 1 head of 50, N = 50, dropout 0.2, the
    sampled softmax (128 negatives, cosine / 0.05).

    ``python -m sequential.hstu.train hstu/games --workdir runs/hstu_games
    --data.sasrec-path PATH/Video.txt`` — 3 seeds, test: HR@10 0.1018 and NDCG@10 0.0546 over
    all items, 0.7099 / 0.5272 against 100 sampled negatives, level with
    ``sasrec/games_softmax`` over all items (README "Amazon Games"). About 16 minutes of
    training steps on one CPU core (BENCHMARKS.md, issue 37).
    """
    return HSTURunConfig(
        model=HSTUConfig(
            n_items=recipes.GAMES_ITEMS,
            d_model=50,
            num_layers=2,
            num_heads=1,
            d_qk=50,
            d_v=50,
            max_seq_len=50,
            dropout=0.2,
        ),
        loss=LossConfig(num_negatives=128),
        **recipes.games(),
    )
