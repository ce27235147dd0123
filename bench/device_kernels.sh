#!/usr/bin/env bash
# The actor's fast paths against sequence length on one GPU, in one go (docs/bench_device.md,
# "Kernels on a GPU"): the Qwen3-30B-A3B slice, each fast path on and off, 2k-32k tokens.
#
#   bash bench/device_kernels.sh pack    # here, where megatron-core 0.12.1 is installed: writes
#                                        # build/device/megatron_core-0.12.1.tar.gz (git ignores build/)
#   bash bench/device_kernels.sh run     # on the GPU machine (carry build/device there): unpacks
#                                        # megatron onto PYTHONPATH, runs the sweep, writes to $OUT
#   bash bench/device_kernels.sh run --experts 16   # extra arguments go to bench/actor_throughput.py
#
# run writes into $OUT (default build/device/out): bench_device.md (a copy of docs/bench_device.md
# with its generated block filled in: copy it back over the doc), sweep.md (the same block alone),
# sweep.log (progress, one line per variant and length, and any traceback), env.txt, and
# adam_step.md / adam_step.log (bench/adam_step.py: the optimizer step, fused against multi-tensor).
# Settings, from the environment: PLATFORM (cuda), DTYPE (bf16), LAYERS (2), SEQ_LENS
# ("2048 8192 16384 32768"), STEPS (3), VARIANTS (all six), RUN_TIMEOUT (seconds per variant, 80),
# TOTAL_TIMEOUT (seconds for the whole sweep, 540), ADAM_TIMEOUT (seconds for the optimizer step,
# 180). A fresh GPU machine has torch, transformers, safetensors and pyyaml but no package
# registry; megatron-core is pure Python and travels as the tarball. The CPU path, to try the script before a GPU run:
#   PLATFORM=cpu DTYPE=fp32 LAYERS=1 SEQ_LENS="128 256" STEPS=1 OUT=/tmp/kernels \
#       bash bench/device_kernels.sh run --experts 8 --vocab 4096
set -euo pipefail
cd "$(dirname "$0")/.."

MEGATRON_VERSION=0.12.1
TARBALL=build/device/megatron_core-${MEGATRON_VERSION}.tar.gz

pack() {
  local site version
  version=$(python -c "import megatron.core; print(megatron.core.__version__)") ||
    { echo "error: megatron.core is not importable here; install megatron-core==${MEGATRON_VERSION}" >&2; exit 1; }
  if [ "$version" != "$MEGATRON_VERSION" ]; then
    echo "error: megatron-core $version is installed here, the package pins $MEGATRON_VERSION" >&2
    exit 1
  fi
  # the folder that holds the megatron package (site-packages)
  site=$(python -c "import megatron.core, os; print(os.path.dirname(os.path.dirname(os.path.dirname(megatron.core.__file__))))")
  mkdir -p "$(dirname "$TARBALL")"
  tar -czf "$TARBALL" -C "$site" --exclude=__pycache__ --exclude='*.so' megatron
  echo "wrote $TARBALL ($(du -h "$TARBALL" | cut -f1)); carry build/device to the GPU machine"
}

run() {
  local out=${OUT:-build/device/out} platform=${PLATFORM:-cuda} rc=0
  local -a seq_lens variants=()
  read -r -a seq_lens <<<"${SEQ_LENS:-2048 8192 16384 32768}"
  [ -z "${VARIANTS:-}" ] || read -r -a variants <<<"$VARIANTS"
  mkdir -p "$out"
  if [ -f "$TARBALL" ]; then
    local site
    site=$(mktemp -d /tmp/megatron_core.XXXXXX)
    tar -xzf "$TARBALL" -C "$site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python -c "import sys, torch, megatron.core as m; print('Python', sys.version.split()[0], '| torch', torch.__version__,
'| CUDA', torch.version.cuda, '| GPU', torch.cuda.get_device_name() if torch.cuda.is_available() else None,
'| megatron-core', m.__version__, 'from', m.__file__)"
  } | tee "$out/env.txt" || {
    echo "error: python cannot import torch and megatron.core (no $TARBALL? run 'bash bench/device_kernels.sh pack' where megatron-core is installed and carry build/device)" >&2
    exit 1
  }
  cp docs/bench_device.md "$out/bench_device.md"
  # Fragmentation aside: an OOM here means the memory is not there.
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  export PYTHONUNBUFFERED=1
  timeout "${TOTAL_TIMEOUT:-540}" python bench/actor_throughput.py \
    --platform "$platform" --dtype "${DTYPE:-bf16}" --model qwen3_30b_a3b --layers "${LAYERS:-2}" \
    --seq-lens "${seq_lens[@]}" --steps "${STEPS:-3}" --run-timeout "${RUN_TIMEOUT:-80}" \
    ${variants[@]+--variants "${variants[@]}"} --out "$out/bench_device.md" "$@" \
    >"$out/sweep.md" 2> >(tee "$out/sweep.log" >&2) || rc=$?
  cat "$out/sweep.md"
  if [ "$rc" -ne 0 ]; then
    echo "error: the sweep ended with exit status $rc (124: past TOTAL_TIMEOUT); what it measured is in $out/sweep.log" >&2
  fi
  # The optimizer step alone, fused against multi-tensor, on the same model (--experts / --vocab
  # given to run apply to it too) into adam_step.md: the block of docs/kernels.md's optimizer section.
  local -a cut=()
  local -a rest=("$@")
  local i
  for ((i = 0; i < ${#rest[@]}; i++)); do
    case "${rest[i]}" in --experts | --vocab) cut+=("${rest[i]}" "${rest[i + 1]:-}") ;; esac
  done
  timeout "${ADAM_TIMEOUT:-180}" python bench/adam_step.py --platform "$platform" --model qwen3_30b_a3b \
    --layers "${LAYERS:-2}" ${cut[@]+"${cut[@]}"} >"$out/adam_step.md" 2> >(tee "$out/adam_step.log" >&2) || {
    local adam_rc=$?
    echo "error: bench/adam_step.py ended with exit status $adam_rc; see $out/adam_step.log" >&2
    [ "$rc" -ne 0 ] || rc=$adam_rc
  }
  cat "$out/adam_step.md"
  return "$rc"
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash bench/device_kernels.sh pack | run [arguments for bench/actor_throughput.py]" >&2; exit 2 ;;
esac
