"""The kernel choice: ``auto`` keeps XLA until a kernel is verified on hardware, a named kernel
runs (or falls back, counted), unknown names are errors, and ``target_backend`` chooses and
compiles for a GPU/TPU from this CPU host."""

from __future__ import annotations

import pytest

from recscale.kernels import common

BOTH = {"pallas_gpu": None, "pallas_tpu": None}


def test_auto_keeps_xla_until_the_kernel_is_verified_on_hardware(monkeypatch):
    assert common.resolve("dot_interaction", "auto", BOTH) == "xla"  # CPU
    monkeypatch.setattr(common, "HARDWARE_VERIFIED", frozenset())
    with common.target_backend("gpu"):
        assert common.resolve("dot_interaction", "auto", BOTH) == "xla"
        monkeypatch.setattr(
            common, "HARDWARE_VERIFIED", frozenset({("dot_interaction", "pallas_gpu")})
        )
        assert common.resolve("dot_interaction", "auto", BOTH) == "pallas_gpu"
        assert common.resolve("fm_interaction", "auto", BOTH) == "xla"  # another op
    with common.target_backend("tpu"):
        assert common.resolve("dot_interaction", "auto", BOTH) == "xla"


def test_a_named_kernel_runs_or_falls_back_with_a_counted_reason():
    common.FALLBACKS.clear()
    assert common.resolve("op", "pallas_tpu", BOTH) == "pallas_tpu"
    why = {"pallas_gpu": None, "pallas_tpu": "float16: no float16 vector unit"}
    assert common.resolve("op", "pallas_tpu", why) == "xla"
    assert common.resolve("op", "pallas_tpu", why) == "xla"
    assert common.FALLBACKS == {("op", "pallas_tpu", "float16: no float16 vector unit"): 2}
    with pytest.raises(ValueError, match="unknown implementation 'cuda_magic'"):
        common.resolve("op", "cuda_magic", BOTH)


def test_target_backend_compiles_instead_of_interpreting():
    assert common.interpret_for("pallas_gpu") is True
    assert common.interpret_for("pallas_tpu") is not False  # InterpretParams on CPU
    with common.target_backend("gpu"):
        assert common.default_backend() == "gpu"
        assert common.interpret_for("pallas_gpu") is False
    with common.target_backend("tpu"):
        assert common.interpret_for("pallas_tpu") is False
    assert common.default_backend() == "cpu"
    with pytest.raises(ValueError, match="expected gpu or tpu"):
        with common.target_backend("npu"):
            pass


def test_auto_keeps_xla_for_the_dtypes_where_the_verified_kernel_is_slower(monkeypatch):
    monkeypatch.setattr(common, "HARDWARE_VERIFIED", frozenset({("dot_interaction", "pallas_gpu")}))
    monkeypatch.setattr(
        common, "AUTO_KEEPS_XLA", {("dot_interaction", "pallas_gpu"): frozenset({"float32"})}
    )
    with common.target_backend("gpu"):
        assert common.resolve("dot_interaction", "auto", BOTH, dtype="float32") == "xla"
        assert common.resolve("dot_interaction", "auto", BOTH, dtype="bfloat16") == "pallas_gpu"
        assert common.resolve("dot_interaction", "auto", BOTH) == "pallas_gpu"  # dtype unknown
        # a named kernel runs whatever the dtype
        assert common.resolve("dot_interaction", "pallas_gpu", BOTH, dtype="float32") == (
            "pallas_gpu"
        )
