"""DCNv2 (Wang et al., WWW 2021): deep & cross network with full- or low-rank cross layers.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a
model is built: ``FAMILY.build_model`` imports ``baselines.dcnv2.model.build_model``.
"""

from baselines.dcnv2 import presets as _presets  # noqa: F401  (registers the presets)
from baselines.dcnv2.config import DCNv2Config
from recscale import families

FAMILY = families.register(families.Family(name="dcnv2", package=__name__, config_cls=DCNv2Config))
