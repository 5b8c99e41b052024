#!/usr/bin/env bash
# One call on a lent GPU (issue 59), run from the repository root by the device tool:
#   ROSETTA_COMMIT=<commit> bash benchmarks/gpu_session.sh 1|2|3
# Prints the machine and versions, runs the call's commands each under its own timeout (a command that
# runs long is stopped and the next one still runs), writes every results file and the whole log to $OUT.
set -u
stage=${1:?usage: gpu_session.sh 1, 2 or 3}
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
    # +cudagraphs: whether and why inductor partitioned a graph or skipped its CUDA graphs (CUDA_GRAPHS)
    TORCH_LOGS=perf_hints,+cudagraphs step 340 python3 -m benchmarks.profile_step --out-dir "$out"
    step 150 python3 -m benchmarks.gpu_check --only parity attention decode --out-dir "$out" ;;
  2)  # issue 59, run 2: base bfloat16 training, bucketed and packed, compiled PyTorch, JAX and the peer
    # (each compile took 40-90 s on the H100 and H200 runs of 2026-11-22/27; this stage as a whole: not yet run)
    TORCH_LOGS=perf_hints,+cudagraphs step 420 python3 -m benchmarks.run --suite gpu --presets base --dtypes bfloat16 \
      --tasks train --impls torch.compile jax peer --out-dir "$out" ;;
  3)  # issue 59, run 2's decoding: greedy and beam 4 at 64 sentences, beam 4 at 256, both frameworks
    step 240 python3 -m benchmarks.run --suite gpu --presets base --dtypes bfloat16 --tasks decode \
      --out-dir "$out" ;;
  *) echo "no stage $stage"; exit 2 ;;
esac
echo "== call $stage done at $((SECONDS - t0)) s"
