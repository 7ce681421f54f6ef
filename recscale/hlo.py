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


def _trips(hlo_text: str, comps: dict[str, list[_Instr]] | None = None) -> dict[str, int]:
    """How many times each computation runs per call of the entry: a while loop's body its trip
    count times its parent's count (nested loops multiply). The trip count is XLA's
    ``known_trip_count`` where it states one (XLA:CPU does), else read from the loop itself
    (XLA:TPU states none): a condition ``counter < N`` (or ``N > counter``) on a tuple element
    whose initial value is a constant ``c`` (through copies and bitcasts) runs ``N - c`` times;
    a loop of another shape counts once. ``comps``: the module's :func:`_computations`, if
    already parsed."""
    comps = _computations(hlo_text) if comps is None else comps
    entry = next(
        (
            m.group(1)
            for line in hlo_text.splitlines()
            if line.startswith("ENTRY") and (m := _HEADER.match(line))
        ),
        None,
    )
    loops = []
    for parent, instrs in comps.items():
        by_name = {i.name: i for i in instrs}
        for ins in instrs:
            if ins.op == "while" and (body := re.search(r"\bbody=%([^,\s]+)", ins.attrs)):
                loops.append((parent, body.group(1), _trip_count(comps, by_name, ins)))
    count = {entry: 1} if entry else {}
    for _ in range(len(loops) + 1):  # propagate down nested loops (few levels)
        for up, body, n in loops:
            if up in count:
                count[body] = count[up] * n
    return count


def _trip_count(comps: dict[str, list[_Instr]], parent: dict[str, _Instr], loop: _Instr) -> int:
    if t := _TRIPS.search(loop.attrs):
        return int(t.group(1))
    cond = re.search(r"\bcondition=%([^,\s]+)", loop.attrs)
    instrs = comps.get(cond.group(1), []) if cond else []
    by_name = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.root), None)
    direction = re.search(r"direction=(\w+)", root.attrs) if root is not None else None
    if root is None or root.op != "compare" or not direction or len(root.operands) < 2:
        return 1
    counter, bound = root.operands[:2]
    if direction.group(1) == "GT":
        counter, bound = bound, counter
    elif direction.group(1) != "LT":
        return 1
    counter_i, bound_i = by_name.get(counter), by_name.get(bound)
    index = re.search(r"\bindex=(\d+)", counter_i.attrs) if counter_i is not None else None
    if index is None or counter_i.op != "get-tuple-element" or bound_i is None:
        return 1
    if bound_i.op != "constant" or not loop.operands:
        return 1
    init = parent.get(loop.operands[0])
    if init is None or init.op != "tuple" or len(init.operands) <= int(index.group(1)):
        return 1
    start = parent.get(init.operands[int(index.group(1))])
    while start is not None and start.op in ("copy", "bitcast", "convert") and start.operands:
        start = parent.get(start.operands[0])
    if start is None or start.op != "constant":
        return 1
    return max(int(bound_i.literal) - int(start.literal), 1)


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
    memory_bytes: float | None = None,
) -> dict[str, float]:
    """A roofline of one compiled step on one device, in seconds: ``compute`` (XLA's
    ``cost_analysis`` FLOPs, or the model's own ``model_flops`` per device if more, at the
    peak ``flops``), ``memory`` (``memory_bytes``, the op-by-op count :func:`hbm_bytes`, else
    XLA's bytes accessed, at ``memory_bandwidth``; ``memory (XLA)`` keeps XLA's), each
    collective kind (:meth:`Collective.wire_bytes`, loop trips counted, at
    ``interconnect_bandwidth``), then ``serial`` (compute or memory, whichever bounds, plus
    every collective: nothing overlaps) and ``overlapped`` (the largest of the three: all
    overlaps). Assumptions: peaks are reached; XLA's cost analysis counts a loop body once, so
    a scanned layer stack's FLOPs come from ``model_flops``; one ICI link's bandwidth carries
    each collective, whatever the torus offers."""
    xla_bytes = float(cost.get("bytes accessed", 0.0))
    out = {
        "compute": max(float(cost.get("flops", 0.0)), model_flops) / flops,
        "memory": (xla_bytes if memory_bytes is None else memory_bytes) / memory_bandwidth,
        "memory (XLA)": xla_bytes / memory_bandwidth,
    }
    comm = dict.fromkeys(_COLLECTIVES, 0.0)
    for c in colls:
        comm[c.kind] += c.wire_bytes(num_devices) / interconnect_bandwidth
    out.update({k: v for k, v in comm.items() if v})
    total_comm = sum(comm.values())
    out["serial"] = max(out["compute"], out["memory"]) + total_comm
    out["overlapped"] = max(out["compute"], out["memory"], total_comm)
    return out


# ------------------------------------------------------------------------------------------------
# HBM traffic, op by op.

_INSTR = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*(.+?)\s([a-z][a-z0-9-]*)\((.*)$")
_CALLS = re.compile(r"\bcalls=%([^,\s)]+)")
_COST = re.compile(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"')
_FREE = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "while",
    "conditional",
    "call",
    "after-all",
    "partition-id",
    "replica-id",
    "copy-start",
    "opt-barrier",
}
_SLICES = {"gather": 0, "dynamic-slice": 0}  # reads only the slice it returns of operand 0
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}  # writes operand (index) into operand 0


@dataclasses.dataclass
class _Instr:
    name: str
    bytes: float
    op: str
    operands: list[str]
    attrs: str
    root: bool
    param: int = -1
    """A parameter's number (-1: not a parameter)."""
    literal: str = ""
    """A constant's value as written."""


def _shape_bytes(text: str) -> float:
    return sum(
        math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
        for dtype, dims in _SHAPE.findall(text)
    )


def _split_operands(rest: str) -> tuple[list[str], str]:
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return re.findall(r"%([\w.-]+)", rest[:i]), rest[i + 1 :]
            depth -= 1
    return re.findall(r"%([\w.-]+)", rest), ""


def _computations(hlo_text: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    current = None
    for line in hlo_text.splitlines():
        if h := _HEADER.match(line):
            current = comps.setdefault(h.group(1), [])
            continue
        if current is None or not (m := _INSTR.match(line)):
            continue
        root, name, shape, op, rest = m.groups()
        operands, attrs = _split_operands(rest)
        param = int(rest.split(")")[0]) if op == "parameter" else -1
        literal = rest.split(")")[0] if op == "constant" else ""
        current.append(
            _Instr(name, _shape_bytes(shape), op, operands, attrs, bool(root), param, literal)
        )
    return comps


def _fusion_bytes(fused: list[_Instr], operand_bytes: list[float], out_bytes: float) -> float:
    """A fusion's HBM traffic: each operand read whole unless the fused computation only slices
    it (a gather or dynamic slice: those bytes) or updates it in place (nothing read), and its
    output written whole unless it is such an in-place update (the update's bytes)."""
    root = next((i for i in fused if i.root), None)
    if root is None:  # its computation not in the text: every operand and the output whole
        return sum(operand_bytes) + out_bytes
    by_name = {i.name: i for i in fused}
    users: dict[str, list[tuple[_Instr, int]]] = {}
    for ins in fused:
        for k, o in enumerate(ins.operands):
            users.setdefault(o, []).append((ins, k))

    def read(name: str) -> float | None:
        """Bytes read of ``name`` if every use only slices or updates it in place, else None."""
        total = 0.0
        for user, k in users.get(name, []):
            if user.op == "bitcast":
                sub = read(user.name)
                if sub is None:
                    return None
                total += sub
            elif user.op in _SLICES and k == _SLICES[user.op]:
                total += user.bytes
            elif user.op in _IN_PLACE and k == 0:
                continue
            else:
                return None
        return total

    total = 0.0
    for p in fused:
        if 0 <= p.param < len(operand_bytes):
            part = read(p.name)
            total += operand_bytes[p.param] if part is None else part
    outs = [root] if root.op != "tuple" else [by_name[o] for o in root.operands]
    for out in outs:
        if out.op in _IN_PLACE and len(out.operands) > _IN_PLACE[out.op]:
            total += by_name[out.operands[_IN_PLACE[out.op]]].bytes
        else:
            total += out.bytes
    return total


def hbm_bytes(hlo_text: str) -> float:
    """The bytes a compiled (per-device) step reads and writes in device memory, op by op: each
    top-level op of the entry and of its loop bodies (times their trips) reads its operands and
    writes its result, except that a gather or dynamic slice reads only its slice, a scatter or
    dynamic update writes only its update in place (inside fusions too: a fusion's operand that
    is only sliced costs the slices), a Pallas kernel costs its own ``CostEstimate``, and
    bitcasts, tuples and collectives (costed on the interconnect) cost nothing. XLA's
    ``bytes accessed`` charges a gather its whole operand and a loop body once; this is the
    traffic an embedding-bound or scanned step actually has, to the roofline's accuracy."""
    comps = _computations(hlo_text)
    trips = _trips(hlo_text, comps)
    sizes = {i.name: i.bytes for instrs in comps.values() for i in instrs}
    total = 0.0
    for comp, n in trips.items():
        for ins in comps.get(comp, []):
            op = ins.op
            if op in _FREE or op.startswith(_COLLECTIVES):
                continue
            operand_bytes = [sizes.get(o, 0.0) for o in ins.operands]
            if op == "fusion" and (called := _CALLS.search(ins.attrs)):
                b = _fusion_bytes(comps.get(called.group(1), []), operand_bytes, ins.bytes)
            elif op == "custom-call" and (cost := _COST.search(ins.attrs)):
                b = float(cost.group(1))
            elif op in _SLICES:
                b = 2 * ins.bytes + sum(operand_bytes[1:])
            elif op in _IN_PLACE and len(operand_bytes) > _IN_PLACE[op]:
                # reads its indices and update, writes the update: operand 0 is not read
                b = sum(operand_bytes[1:]) + operand_bytes[_IN_PLACE[op]]
            elif op == "copy-done":
                b = ins.bytes
            else:
                b = sum(operand_bytes) + ins.bytes
            total += n * b
    return total
