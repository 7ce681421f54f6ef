"""Wukong (Zhang et al., ICML 2024): stacked factorization machines with linear compression.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a
model is built: ``FAMILY.build_model`` imports ``wukong.model.build_model``.
"""

from recscale import families
from wukong import presets as _presets  # noqa: F401  (registers the presets)
from wukong.config import WukongConfig

FAMILY = families.register(
    families.Family(name="wukong", package=__name__, config_cls=WukongConfig)
)
