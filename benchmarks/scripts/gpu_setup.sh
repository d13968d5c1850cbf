# Sourced by the GPU scripts (gpu_check.sh, gpu_selection.sh) with their OUTDIR as $1: makes
# "$out", records the commit, installs the wheels in .whl/ when present (a GPU machine may have no index to
# install from), puts the repository on PYTHONPATH and records the GPU and the versions.
out=${1:?usage: bash benchmarks/scripts/<script>.sh OUTDIR}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
git rev-parse HEAD > "$out/commit.txt" 2>/dev/null || echo "no git: commit unknown" > "$out/commit.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import jax, jaxlib, optax, flax; print('jax', jax.__version__, 'optax', optax.__version__, 'flax', flax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
