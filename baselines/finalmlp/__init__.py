"""FinalMLP (Mao et al., AAAI 2023): two gated MLP streams fused by multi-head bilinear aggregation.

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a
model is built: ``FAMILY.build_model`` imports ``baselines.finalmlp.model.build_model``.
"""

from baselines.finalmlp import presets as _presets  # noqa: F401  (registers the presets)
from baselines.finalmlp.config import FinalMLPConfig
from recscale import families

FAMILY = families.register(
    families.Family(name="finalmlp", package=__name__, config_cls=FinalMLPConfig)
)
