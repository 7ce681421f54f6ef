"""MaskNet (Wang et al., DLP-KDD 2021): instance-guided masks in serial or parallel MaskBlocks.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a model is built.
"""

from baselines.masknet import presets as _presets  # noqa: F401  (registers the presets)
from baselines.masknet.config import MaskNetConfig
from recscale import families


def build_model(cfg, schema, rngs):
    """The MaskNet of a ``MaskNetConfig`` for a dataset schema:
    ``baselines.masknet.model.build_model``."""
    from baselines.masknet import model  # noqa: PLC0415  (jax: only when a model is built)

    return model.build_model(cfg, schema, rngs)


FAMILY = families.register(
    families.Family(
        name="masknet", package=__name__, config_cls=MaskNetConfig, build_model=build_model
    )
)
