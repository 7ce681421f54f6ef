"""The bag family, a DLRM-style baseline that sees the history as a bag:
``python -m sequential.bag.train bag/tiny --workdir DIR``, then
``python -m sequential.bag.evaluate --workdir DIR``; ``python -m recscale.export --workdir DIR
--out MODEL`` and ``python -m recscale.serve MODEL`` serve it (``sequential.serving``).

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a model is built (``sequential.bag.model``)
or trained (``sequential.task``, the trainer's hooks of every sequential run).
"""

from recscale import families
from sequential.bag import presets as _presets  # noqa: F401  (registers the presets)
from sequential.run_config import BagRunConfig

FAMILY = families.register(families.Family(name="bag", package=__name__, config_cls=BagRunConfig))
