# Sourced by the GPU check scripts (benchmarks/gpu_checks.sh, benchmarks/gpu_issue19.sh) after
# they set OUT: creates it, installs the Python packages the GPU image lacks (grain,
# array_record, tyro and their small dependencies, carried as wheels in .whl/; see
# /work/.library/device/README.md) to /tmp/site, sets the environment, and records the
# machine in $OUT/env.txt.
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=3
{
  nvidia-smi -L
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, jaxlib.__version__, jax.devices())'
} 2>&1 | tee "$OUT/env.txt"
