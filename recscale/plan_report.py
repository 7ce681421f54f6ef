"""What ``python -m recscale.plan`` reports (:class:`StepReport`) and how it prints it."""

from __future__ import annotations

import dataclasses
from typing import Any

from recscale import hlo


@dataclasses.dataclass
class StepReport:
    preset: str
    hardware: str
    topology: str
    chips: int
    mesh: dict[str, int]
    global_batch: int
    layout: str
    dense_params: int
    table_rows: int
    predicted: dict[str, float]
    compiled: dict[str, float] = dataclasses.field(default_factory=dict)
    collectives: dict[str, float] = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    """The compiler's refusal (e.g. the step does not fit the chip's memory), if it refused."""
    memory_bytes: float = 0.0
    """The chip's memory (the hardware profile's)."""
    lowered: dict[str, int] = dataclasses.field(default_factory=dict)
    """GPU presets: the step lowered for CUDA (no compiler here): its StableHLO's size and
    the Pallas (Triton) kernel calls in it."""
    plans: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The embedding plan of each engine collection (``Plan.to_dict``: per table its sharding
    and shards, per device its memory and predicted step time by term)."""
    plan_text: str = ""
    """Those plans rendered (``Plan.render``)."""
    planners: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per engine collection, both planners' plans predicted by both models
    (``learned_planner.side_by_side``), or why the learned one is not shown."""
    step_time: dict[str, float] = dataclasses.field(default_factory=dict)
    """With ``--compile``: the compiled step's roofline per chip in seconds
    (``hlo.step_time``: compute, memory, each collective, serial, overlapped)."""
    model_flops_per_chip: float = 0.0
    """The model's training FLOPs (``recscale.flops``) per step per chip: the MFU's numerator."""
    xla_flops_per_chip: float = 0.0
    """XLA's own FLOP count of the compiled step per chip (``cost_analysis``; a loop body once)."""
    peak_flops: float = 0.0
    """The chip's peak FLOP/s (the hardware profile's)."""
    alternatives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """When the state does not fit a chip: other meshes' predicted state per chip
    (:func:`alternative_meshes`)."""

    def mfu(self, key: str = "serial") -> float:
        """Model FLOPs utilisation at the predicted ``serial`` or ``overlapped`` step time."""
        t = self.step_time.get(key, 0.0)
        return self.model_flops_per_chip / (t * self.peak_flops) if t and self.peak_flops else 0.0

    def planner_step_s(self) -> float:
        """The embedding planner's own step time: its slowest device (0: no engine tables)."""
        times = [d["time_s"] for p in self.plans.values() for d in p.get("devices", [])]
        return max(times, default=0.0)

    def state_fits(self) -> bool | None:
        """Whether the predicted state and batch fit the chip's memory (None: unknown)."""
        if not self.memory_bytes:
            return None
        p = self.predicted
        return p["state_bytes_per_chip"] + p["batch_bytes_per_chip"] <= self.memory_bytes

    def errors(self) -> dict[str, float]:
        """Relative error of each prediction against the compiler, where both exist."""
        out = {}
        p, c = self.predicted, self.compiled
        if c.get("argument_bytes"):  # the step's arguments: the state and the batch
            want = p["state_bytes_per_chip"] + p["batch_bytes_per_chip"]
            out["arguments"] = want / c["argument_bytes"] - 1
        if self.collectives.get(hlo.ENGINE_A2A) and p.get("all_to_all_bytes_per_chip"):
            out["all_to_all"] = (
                p["all_to_all_bytes_per_chip"] / self.collectives[hlo.ENGINE_A2A] - 1
            )
        return out


def _gib(x: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}" if unit != "B" else f"{x:.0f} B"
        x /= 1024
    return ""


def _dur(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    return f"{1e3 * seconds:.3g} ms" if seconds >= 1e-3 else f"{1e6 * seconds:.3g} us"


def render(r: StepReport) -> str:
    lines = [
        f"{r.preset} on {r.hardware} ({r.topology}, {r.chips} chips, mesh {r.mesh}, "
        f"batch {r.global_batch}, {r.layout})",
        f"  dense parameters {r.dense_params / 1e6:,.1f}M, table rows {r.table_rows / 1e6:,.1f}M",
        "  predicted per chip: "
        + ", ".join(f"{k.removesuffix('_per_chip')} {_gib(v)}" for k, v in r.predicted.items()),
    ]
    if r.state_fits() is False:
        p = r.predicted
        lines.append(
            f"  DOES NOT FIT: the state alone needs "
            f"{_gib(p['state_bytes_per_chip'] + p['batch_bytes_per_chip'])} per chip, a chip "
            f"holds {_gib(r.memory_bytes)}"
            + (": other meshes, predicted (add --compile to check one):" if r.alternatives else "")
        )
        for a in r.alternatives:
            verdict = "fits" if a["fits"] else "does not fit"
            if "error" in a:
                lines.append(f"    {a['flags']}: cannot be planned: {a['error']}")
            else:
                lines.append(f"    {a['flags']}: {_gib(a['state_bytes_per_chip'])} ({verdict})")
    if r.error:
        lines.append(f"  the compiler refused: {r.error}")
    if r.lowered:
        lines.append(
            f"  lowered for CUDA ({r.compile_s:.1f} s): {r.lowered['stablehlo_bytes']:,} bytes "
            f"of StableHLO, {r.lowered['triton_kernels']} Pallas (Triton) kernel calls"
        )
        lines.extend(f"  kernel fallback: {f}" for f in r.fallbacks)
    if r.compiled:
        fits = r.compiled["peak_bytes"] <= r.memory_bytes if r.memory_bytes else None
        verdict = "" if fits is None else f"; fits {_gib(r.memory_bytes)}: {fits}"
        lines.append(
            "  compiled per chip: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in r.compiled.items())
            + f" ({r.compile_s:.1f} s{verdict})"
        )
        lines.append(
            "  collectives per chip: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in r.collectives.items() if v)
        )
        lines.append(
            "  prediction error: " + ", ".join(f"{k} {v:+.1%}" for k, v in r.errors().items())
        )
        for f in r.fallbacks:
            lines.append(f"  kernel fallback: {f}")
    if r.step_time:
        t = r.step_time
        parts = ", ".join(
            f"{k} {_dur(v)}" for k, v in t.items() if k not in ("serial", "overlapped")
        )
        lines.append(
            f"  predicted step per chip (roofline of the compiled HLO at peak rates): {parts}; "
            f"serial {_dur(t['serial'])} (MFU {r.mfu('serial'):.1%}), overlapped "
            f"{_dur(t['overlapped'])} (MFU {r.mfu('overlapped'):.1%}); the embedding "
            f"planner's step {_dur(r.planner_step_s())}"
        )
    if r.plan_text:
        lines.append(r.plan_text.rstrip())
    return "\n".join(lines)
