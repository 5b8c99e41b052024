#!/usr/bin/env bash
# One call on a lent GPU (issue 59), run from the repository root by the device tool:
#   ROSETTA_COMMIT=<commit> bash benchmarks/gpu_session.sh 1|2
# Prints the machine and versions, runs the call's commands each under its own timeout (a command that
# runs long is stopped and the next one still runs), writes every results file and the whole log to $OUT.
set -u
stage=${1:?usage: gpu_session.sh 1 or 2}
out=${OUT:?OUT: the folder whose files come back}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # PyTorch and JAX share the card
exec > >(tee -a "$out/gpu-session_call$stage.log") 2>&1
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 -c "import torch, jax, flax, optax; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
echo "commit ${ROSETTA_COMMIT:-unknown}, $(nproc) CPU cores"
step() {  # step SECONDS COMMAND...: one command under its timeout, its exit status and time printed
  local limit=$1; shift
  echo "== [$((SECONDS - t0)) s] $* (timeout $limit s)"
  timeout --signal=INT --kill-after=10 "$limit" "$@"
  echo "== rc=$? at $((SECONDS - t0)) s"
}
case $stage in
  1)  # issue 59, run 1: where a step goes in both frameworks, then the correctness groups
    # perf_hints: inductor says whether and why it skipped CUDA graphs (compilation.CUDA_GRAPHS)
    TORCH_LOGS=perf_hints step 340 python3 -m benchmarks.profile_step --out-dir "$out"
    step 150 python3 -m benchmarks.gpu_check --only parity attention decode --out-dir "$out" ;;
  2)  # issue 59, run 2: the suite's rows the profile says matter
    step 300 python3 -m benchmarks.run --suite gpu --presets base --dtypes bfloat16 --out-dir "$out" ;;
  *) echo "no stage $stage"; exit 2 ;;
esac
echo "== call $stage done at $((SECONDS - t0)) s"
