"""DCNv2 (Wang et al., WWW 2021): deep & cross network with full- or low-rank cross layers.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a model is built.
"""

from baselines.dcnv2 import presets as _presets  # noqa: F401  (registers the presets)
from baselines.dcnv2.config import DCNv2Config
from recscale import families


def build_model(cfg, schema, rngs):
    """The DCNv2 of a ``DCNv2Config`` for a dataset schema:
    ``baselines.dcnv2.model.build_model``."""
    from baselines.dcnv2 import model  # noqa: PLC0415  (jax: only when a model is built)

    return model.build_model(cfg, schema, rngs)


FAMILY = families.register(
    families.Family(name="dcnv2", package=__name__, config_cls=DCNv2Config, build_model=build_model)
)
