"""MaskNet (Wang et al., DLP-KDD 2021): instance-guided masks in serial or parallel MaskBlocks.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a
model is built: ``FAMILY.build_model`` imports ``baselines.masknet.model.build_model``.
"""

from baselines.masknet import presets as _presets  # noqa: F401  (registers the presets)
from baselines.masknet.config import MaskNetConfig
from recscale import families

FAMILY = families.register(
    families.Family(name="masknet", package=__name__, config_cls=MaskNetConfig)
)
