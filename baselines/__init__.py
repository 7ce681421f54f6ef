"""Baseline models: comparison points for the scaling studies, not families of the toolkit.

The top level of the repository holds the toolkit's own model families (``dlrm/``,
``wukong/``) beside the shared engine (``recscale/``). Baselines such as DCNv2 are here only so
that sweeps can put published models next to them on the same data, optimizers, trainer and
metrics; gathering them under one package keeps the top level for the main families however
many baselines are added. Each baseline is its own subpackage with the same shape as ``dlrm/``
and ``wukong/`` (``config.py``, ``model.py``, ``presets.py``, ``train.py``, ``evaluate.py``),
uses only ``recscale`` and ``data``, and never imports another model package.
"""
