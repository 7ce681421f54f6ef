"""Named bag presets. Each docstring states its command and the expected result."""

from __future__ import annotations

from recscale.config import register
from sequential import recipes
from sequential.config import BagConfig, LossConfig
from sequential.run_config import BagRunConfig


@register("bag/tiny")
def tiny() -> BagRunConfig:
    """Seconds on CPU; for tests and dry runs (``sequential.recipes.tiny``'s planted data).

    ``python -m sequential.bag.train bag/tiny --workdir runs/bag_tiny`` — 20 steps of a
    16-wide bag with one hidden layer of 64 and the full softmax; the training loss falls.
    """
    return BagRunConfig(
        model=BagConfig(
            n_items=recipes.TINY_PLANTED.n_items,
            d_model=16,
            num_layers=1,
            max_seq_len=recipes.TINY_PLANTED.max_len,
        ),
        loss=LossConfig(kind="full_softmax"),
        **recipes.tiny(),
    )


@register("bag/planted")
def planted() -> BagRunConfig:
    """The bag (d = 64, 2 hidden layers of 256, N = 100) with the full softmax (cosine / 0.05,
    as ``sasrec/planted``) on the default planted data (``sequential.recipes.planted``).

    ``python -m sequential.bag.train bag/planted --workdir runs/bag_planted`` — eval rows show
    the model's loss beside ``bayes_loss`` (3.56 nats); the generator's taste-from-the-bag
    baseline is 5.96 (``data.sequences.planted``), which a bag model passes: it can also weigh
    the successors of every item it holds. Not run to the end; a shorter run of packs of 2,048
    tokens (64 histories), 1,500 steps (3.0M tokens), Adam 3e-3 with 75 warmup steps and cosine
    decay on both optimizers (9 minutes on a shared 2-core CPU) reached 5.84 / 5.71 / 5.67 nats
    at steps 500 / 1,000 / 1,500.
    """
    return BagRunConfig(
        model=BagConfig(n_items=10_000, d_model=64, num_layers=2, max_seq_len=100),
        loss=LossConfig(kind="full_softmax"),
        **recipes.planted(),
    )
