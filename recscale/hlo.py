"""What a compiled XLA module says about a step: each collective's bytes, read from the HLO
text (per device, after SPMD partitioning). Hand-written: XLA's Python API reports FLOPs and
memory (``cost_analysis``, ``memory_analysis``) but not collective volumes."""

from __future__ import annotations

import dataclasses
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
# One HLO instruction per line: ``%name = RESULT-TYPE op(operands), attributes``.
_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(-start|-done)?\((.*)$"
)
_GROUPS = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
# XLA's mesh form: ``replica_groups=mesh['x'=2,'y'=4] {'y'}``: groups along the named axes.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s+\(.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*body=%([^,\s]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled (per-device) module."""

    kind: str
    bytes: float
    """Its result's bytes on one device (an async pair's: the ``-done``'s), times the trips
    of the loops it runs in (1 outside loops and where XLA states no trip count)."""
    group: int
    """Devices in each of its replica groups (0: not stated, every device of the module)."""
    engine: bool
    """An all-to-all of the embedding engine's ``shard_map``."""

    def wire_bytes(self, num_devices: int) -> float:
        """Bytes one device sends for it with the bandwidth-optimal (ring) algorithm: an
        all-gather or all-to-all ``(n-1)/n`` of its result, an all-reduce twice that, a
        reduce-scatter ``n-1`` times its result (the shard), a permute its result."""
        n = self.group or num_devices
        if self.kind == "collective-permute":
            return self.bytes
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1.0}
        return self.bytes * factor.get(self.kind, (n - 1) / n)


def _group_size(attrs: str) -> int:
    if m := _GROUPS.search(attrs):
        return len([x for x in m.group(1).split(",") if x])
    if m := _IOTA_GROUPS.search(attrs):
        return int(m.group(2))
    if m := _MESH_GROUPS.search(attrs):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    return 0


def _trips(hlo_text: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry: a while loop's body its
    ``known_trip_count`` times its parent's count (nested loops multiply)."""
    parent, loops, current = {}, [], None
    for line in hlo_text.splitlines():
        if m := _HEADER.match(line):
            current = m.group(1)
            if line.startswith("ENTRY"):
                parent[current] = None
            continue
        if current and (m := _WHILE.search(line)):
            t = _TRIPS.search(line)
            loops.append((current, m.group(1), int(t.group(1)) if t else 1))
    count = {name: 1 for name, up in parent.items() if up is None}
    for _ in range(len(loops) + 1):  # propagate down nested loops (few levels)
        for up, body, n in loops:
            if up in count:
                count[body] = count[up] * n
    return count


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled (SPMD-partitioned, per-device) HLO module, each with the
    bytes it moves per call of the step: its result's times its loop trips (an async
    ``-start`` / ``-done`` pair by its ``-done``'s result, with the ``-start``'s replica
    groups)."""
    out, groups, trips, current = [], {}, _trips(hlo_text), None
    for line in hlo_text.splitlines():
        if h := _HEADER.match(line):
            current = h.group(1)
            continue
        m = _OP.match(line)
        if m is None:
            continue
        name, shapes, kind, phase, rest = m.groups()
        if phase == "-start":  # an async pair: its -done's result is the output
            groups[name] = _group_size(rest)
            continue
        group = _group_size(rest)
        if phase == "-done":
            operand = re.match(r"\s*%(\S+?)[),]", rest)
            group = groups.get(operand.group(1), 0) if operand else 0
        n = 0.0
        for dtype, dims in _SHAPE.findall(shapes):
            n += math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
        engine = kind == "all-to-all" and "shard_map/all_to_all" in line
        n *= trips.get(current, 1)
        out.append(Collective(kind=kind, bytes=n, group=group, engine=engine))
    return out


def collective_bytes(colls: list[Collective]) -> dict[str, float]:
    """The bytes of a module's :func:`collectives`, summed by kind, and the engine's
    all-to-alls apart."""
    out = dict.fromkeys((*_COLLECTIVES, ENGINE_A2A), 0.0)
    for c in colls:
        out[c.kind] += c.bytes
        if c.engine:
            out[ENGINE_A2A] += c.bytes
    return out


def step_time(
    cost: dict[str, float],
    colls: list[Collective],
    *,
    num_devices: int,
    flops: float,
    memory_bandwidth: float,
    interconnect_bandwidth: float,
    model_flops: float = 0.0,
) -> dict[str, float]:
    """A roofline of one compiled step on one device, in seconds: ``compute`` (XLA's
    ``cost_analysis`` FLOPs, or the model's own ``model_flops`` per device if more, at the
    peak ``flops``), ``memory`` (its bytes accessed at ``memory_bandwidth``), each collective
    kind (:meth:`Collective.wire_bytes`, loop trips counted, at ``interconnect_bandwidth``),
    then ``serial`` (compute or memory, whichever bounds, plus every collective: nothing
    overlaps) and ``overlapped`` (the largest of the three: all overlaps). Assumptions: peaks
    are reached; XLA's cost analysis counts a loop body once, so a scanned layer stack's FLOPs
    come from ``model_flops`` and its bytes are a lower bound; one ICI link's bandwidth carries
    each collective, whatever the torus offers."""
    out = {
        "compute": max(float(cost.get("flops", 0.0)), model_flops) / flops,
        "memory": float(cost.get("bytes accessed", 0.0)) / memory_bandwidth,
    }
    comm = dict.fromkeys(_COLLECTIVES, 0.0)
    for c in colls:
        comm[c.kind] += c.wire_bytes(num_devices) / interconnect_bandwidth
    out.update({k: v for k, v in comm.items() if v})
    total_comm = sum(comm.values())
    out["serial"] = max(out["compute"], out["memory"]) + total_comm
    out["overlapped"] = max(out["compute"], out["memory"], total_comm)
    return out
