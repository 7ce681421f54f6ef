"""Test setup: 8 simulated CPU devices (set before jax initialises), shared fixtures."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# One persistent compilation cache for the whole suite, its subprocesses and its xdist workers:
# many tests compile the same tiny programs (a dlrm/tiny train step, the same kernel shapes), and
# a hit loads the executable XLA would have built (the cache key is the HLO, the compile options
# and the versions), so results are unchanged and the suite takes far less time. Kept between
# runs under the (git-ignored) .jax_cache/ of the checkout; RECSCALE_TEST_JAX_CACHE=0 turns it off.
if os.environ.get("RECSCALE_TEST_JAX_CACHE", "1") != "0":
    os.environ.setdefault(
        "JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".jax_cache")
    )
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# XLA:CPU's LLVM backend at -O0: the suite's programs are tiny and compiled far more often than
# they run long, and LLVM's optimisation passes are most of each compile (a Wukong train step
# 19 s -> 12 s; the kernel tests' user CPU -40%, interpreted Pallas included). It changes the
# machine code, not the HLO or its float semantics: every comparison in the suite is between
# two programs under the same flags (xdist workers and subprocesses inherit them) or against a
# numpy reference within a tolerance. RECSCALE_TEST_XLA_OPT=1 keeps XLA's default level.
# Likewise XLA:CPU's legacy LLVM IR emitters instead of its MLIR fusion emitters: the same HLO
# and fusions, each fusion emitted straight to LLVM IR without the MLIR pipeline, which is
# most of what is left of a compile at -O0 (measured: the dlrm/tiny and wukong/tiny train and
# eval steps compile in 40% of the time).
if os.environ.get("RECSCALE_TEST_XLA_OPT", "0") != "1":
    for _opt in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
        if _opt.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_opt}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``; tests using it skip with a reason when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it is not redistributed)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def frappe_dir(shared_data: Path) -> Path:
    d = shared_data / "frappe"
    if not (d / "train.csv").is_file():
        pytest.skip(f"{d}/train.csv is absent")
    return d


@pytest.fixture(scope="session")
def criteo_sample(shared_data: Path) -> Path:
    f = shared_data / "criteo_sample" / "train_head1999.tsv"
    if not f.is_file():
        pytest.skip(f"{f} is absent")
    return f


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` / ``tpu`` need that device: skipped elsewhere, with the command."""
    backend = jax.default_backend()
    for item in items:
        for mark in ("gpu", "tpu"):
            if mark in item.keywords and backend != mark:
                item.add_marker(
                    pytest.mark.skip(
                        reason=(
                            f"needs a real {mark.upper()} (backend: {backend}); on one: "
                            f"JAX_PLATFORMS={'cuda' if mark == 'gpu' else 'tpu'} pytest -m {mark}"
                        )
                    )
                )
