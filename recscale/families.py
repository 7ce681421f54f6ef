"""The model families, found through one registry (as big_vision's ``registry.py`` names models).

A family registers itself once, when its package is imported (its ``__init__.py``): its name
(the prefix of its presets, ``dlrm`` of ``dlrm/tiny``), the package that holds its entry points
(``python -m PACKAGE.train``) and its network (``PACKAGE.model.build_model``), and its config
class. Its presets register in
the same import, and its costs come with its config (``cfg.model.cost``, ``recscale.flops``).

Entry points know their family and import it (``dlrm/train.py`` passes ``dlrm.FAMILY`` to
``recscale.train.cli.train_main``). A consumer that has only a name (a preset given on the
command line, a run's ``command.txt``, a sweep's trial) calls :func:`load` or
:func:`by_package`: the name must be a registered family or one of :data:`KNOWN`, the fixed
table of this project's families, and only the package that table names is imported. A name
read from a file is checked against the registry, never turned into a module path.

No jax import here, nor in a family's registration: sweeps resolve families without jax.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

KNOWN: dict[str, str] = {
    "dlrm": "dlrm",
    "wukong": "wukong",
    "dcnv2": "baselines.dcnv2",
    "finalmlp": "baselines.finalmlp",
    "masknet": "baselines.masknet",
    "hstu": "sequential.hstu",
    "sasrec": "sequential.sasrec",
    "bag": "sequential.bag",
}
"""The project's families: name -> the package whose import registers it."""


class UnknownFamilyError(ValueError):
    """A family name (or package) that is neither registered nor one of :data:`KNOWN`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family, as its package registers it."""

    name: str
    """The prefix of its presets (``dcnv2`` of ``dcnv2/tiny``)."""
    package: str
    """The package of its entry points (``baselines.dcnv2``: ``python -m baselines.dcnv2.train``)."""
    config_cls: type
    """Its run config (a ``recscale.config.ExperimentConfig`` with a ``model`` field)."""
    entries: tuple[str, ...] = ("train", "evaluate", "export")
    """Its entry points (``python -m PACKAGE.ENTRY``)."""

    def module(self, entry: str) -> str:
        """The module path of an entry point: ``module("train")`` -> ``dlrm.train``."""
        return f"{self.package}.{entry}"

    def build_model(self, cfg: Any, schema: Any, rngs: Any) -> Any:
        """The trainer's hook: the network of run config ``cfg`` for a dataset schema, built by
        the ``build_model`` of the family's ``PACKAGE.model``. That module (and jax) is imported
        here, on the first build, never at registration; its name is the registered package's
        own, never one read from a file."""
        return importlib.import_module(self.module("model")).build_model(cfg, schema, rngs)


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds ``family`` (once per name); returns it, for ``FAMILY = register(Family(...))``."""
    if family.name in _REGISTRY:
        raise ValueError(f"model family {family.name!r} registered twice")
    _REGISTRY[family.name] = family
    return family


def names() -> list[str]:
    """Every family that is registered or known."""
    return sorted(set(_REGISTRY) | set(KNOWN))


def load(name: str) -> Family:
    """The family ``name``: a registered one, else one of :data:`KNOWN` (importing its package,
    which registers it); anything else is an :class:`UnknownFamilyError`."""
    if name not in _REGISTRY:
        if name not in KNOWN:
            raise UnknownFamilyError(f"unknown model family {name!r}; known: {', '.join(names())}")
        importlib.import_module(KNOWN[name])
        if name not in _REGISTRY:
            raise RuntimeError(f"importing {KNOWN[name]} did not register family {name!r}")
    return _REGISTRY[name]


def by_package(package: str) -> Family:
    """The family whose entry points live in ``package`` (``baselines.dcnv2``), looked up as
    :func:`load` does."""
    for family in _REGISTRY.values():
        if family.package == package:
            return family
    for name, known in KNOWN.items():
        if known == package:
            return load(name)
    packages = sorted({f.package for f in _REGISTRY.values()} | set(KNOWN.values()))
    raise UnknownFamilyError(
        f"no model family has package {package!r}; known: {', '.join(packages)}"
    )


def of_preset(preset: str) -> Family:
    """The family of a preset name (``wukong/frappe`` -> ``wukong``)."""
    return load(preset.split("/", 1)[0])
