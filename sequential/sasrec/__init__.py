"""The SASRec family: ``python -m sequential.sasrec.train sasrec/tiny --workdir DIR``, then
``python -m sequential.sasrec.evaluate --workdir DIR``; ``python -m recscale.export --workdir DIR
--out MODEL`` and ``python -m recscale.serve MODEL`` serve it (``sequential.serving``).

Importing the package registers the family in ``recscale.families`` (and its presets in
``recscale.config``); jax is imported only when a model is built (``sequential.sasrec.model``)
or trained (``sequential.task``, the trainer's hooks of every sequential run).
"""

from recscale import families
from sequential.run_config import SASRecRunConfig
from sequential.sasrec import presets as _presets  # noqa: F401  (registers the presets)

FAMILY = families.register(
    families.Family(name="sasrec", package=__name__, config_cls=SASRecRunConfig)
)
