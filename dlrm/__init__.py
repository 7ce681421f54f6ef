"""DLRM (Naumov et al., 2019): bottom MLP, pooled embeddings, dot/cat interaction, top MLP.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a
model is built: ``FAMILY.build_model`` imports ``dlrm.model.build_model``.
"""

from dlrm import presets as _presets  # noqa: F401  (registers the presets)
from dlrm.config import DLRMConfig
from recscale import families

FAMILY = families.register(families.Family(name="dlrm", package=__name__, config_cls=DLRMConfig))
