"""Wukong (Zhang et al., ICML 2024): stacked factorization machines with linear compression.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a model is built.
"""

from recscale import families
from wukong import presets as _presets  # noqa: F401  (registers the presets)
from wukong.config import WukongConfig


def build_model(cfg, schema, rngs):
    """The Wukong of a ``WukongConfig`` for a dataset schema (``wukong.model.build_model``)."""
    from wukong import model  # noqa: PLC0415  (jax: only when a model is built)

    return model.build_model(cfg, schema, rngs)


FAMILY = families.register(
    families.Family(
        name="wukong", package=__name__, config_cls=WukongConfig, build_model=build_model
    )
)
