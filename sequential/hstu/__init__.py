"""The HSTU family: ``python -m sequential.hstu.train hstu/tiny --workdir DIR``, then
``python -m sequential.hstu.evaluate --workdir DIR``; ``python -m recscale.export --workdir DIR
--out MODEL`` and ``python -m recscale.serve MODEL`` serve it (``sequential.serving``).

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a model is built (``sequential.hstu.model``)
or trained (``sequential.task``, the trainer's hooks of every sequential run).
"""

from recscale import families
from sequential.hstu import presets as _presets  # noqa: F401  (registers the presets)
from sequential.run_config import HSTURunConfig

FAMILY = families.register(families.Family(name="hstu", package=__name__, config_cls=HSTURunConfig))
