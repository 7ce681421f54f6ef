"""What a compiled XLA module says about a step: each collective's bytes, read from the HLO
text (per device, after SPMD partitioning). Hand-written: XLA's Python API reports FLOPs and
memory (``cost_analysis``, ``memory_analysis``) but not collective volumes."""

from __future__ import annotations

import math
import re

ENGINE_A2A = "all-to-all (engine)"
"""The embedding engine's exchanges (all-to-alls inside its ``shard_map``); XLA may add
all-to-alls of its own, e.g. to reshard the dense layers' activations."""
_COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 0.5,
    "u4": 0.5,
}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\]")
# One HLO instruction per line: ``%name = RESULT-TYPE op(operands), ...``.
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(-start|-done)?\("
)


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """Bytes of each collective's results in a compiled (SPMD-partitioned, per-device) HLO
    module, summed by kind, counting each op once (ops inside a loop body are counted once; an
    async ``-start`` / ``-done`` pair by its ``-done``'s result)."""
    out = dict.fromkeys((*_COLLECTIVES, ENGINE_A2A), 0.0)
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if m is None:
            continue
        shapes, kind = m.group(1), m.group(2)
        if m.group(3) == "-start":  # an async pair: its -done's result is the output
            continue
        for dtype, dims in _SHAPE.findall(shapes):
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            out[kind] += n * _DTYPE_BYTES[dtype]
            if kind == "all-to-all" and "shard_map/all_to_all" in line:
                out[ENGINE_A2A] += n * _DTYPE_BYTES[dtype]
    return out
