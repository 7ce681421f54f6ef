"""The timing of both PyTorch sides of ``benchmarks/torchrec_vs_recscale.py`` (``_torch_dlrm.py``,
``_torchrec_dlrm.py``; it runs in either venv): train and inference examples/s, each the best of
``windows`` timed windows after ``warmup`` steps (a noisy shared machine), printed as one JSON
line."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch


def report(
    step: Callable[[int], torch.Tensor],
    model: torch.nn.Module,
    batches: list,
    a: dict,
    *,
    sync: Callable[[], None] = lambda: None,
    **extra,
) -> None:
    """Times ``step(i)`` (one training step on batch ``i``, returning its loss) and the forward
    ``model(*batches[i][:2])`` for ``a["steps"]`` steps of ``a["batch"]``; ``sync`` waits for the
    device; ``extra`` joins the JSON line."""
    for i in range(a["warmup"]):
        step(i)
    sync()
    train_s = float("inf")
    for _ in range(a.get("windows", 1)):
        t0 = time.perf_counter()
        for i in range(a["steps"]):
            loss = step(i)
        sync()
        train_s = min(train_s, time.perf_counter() - t0)
    with torch.no_grad():
        for i in range(a["warmup"]):
            model(*batches[i % len(batches)][:2])
        sync()
        infer_s = float("inf")
        for _ in range(a.get("windows", 1)):
            t0 = time.perf_counter()
            for i in range(a["steps"]):
                model(*batches[i % len(batches)][:2])
            sync()
            infer_s = min(infer_s, time.perf_counter() - t0)
    examples = a["steps"] * a["batch"]
    print(
        json.dumps(
            {
                "train_examples_per_s": examples / train_s,
                "infer_examples_per_s": examples / infer_s,
                "final_loss": float(loss.detach()),
                "torch": torch.__version__,
                **extra,
            }
        )
    )
