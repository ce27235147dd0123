#!/usr/bin/env bash
# The main job on one GPU, in one go (docs/bench_device.md, "The main job on one GPU"): where a
# step's time goes (phases, the workers' share, torch.profiler's tables of one step), the gpu-marked tests (the
# main job learning, resuming and exporting on the GPU among them), the engine's weights kept on the
# device against moved to the host each step, one micro-batch a pass (the README's command) against
# 16 of 8 rows (the command the first H100 run measured), and the long-response task.
#
#   bash bench/device_recipe.sh pack    # here (network, megatron-core 0.12.1 installed): writes build/device/
#                                       # megatron-core as a tarball, Ray as a trimmed wheel and the small
#                                       # wheels Ray and the package need (git ignores build/)
#   bash bench/device_recipe.sh run     # on the GPU machine, build/device carried there: unpacks what its
#                                       # Python lacks onto PYTHONPATH, runs everything, writes to $OUT
#
# A fresh GPU machine has torch, transformers, safetensors, pyarrow and pytest but no package
# registry. megatron-core is pure Python and travels as files; Ray's wheel is 79 MB, 42 MB without
# ray/jars and the libraries the package does not use (rllib, tune, serve, data, train, llm), and
# unzipping a wheel drops the executable bit of its gcs_server and raylet, which run() restores.
# Settings, from the environment: PY_VERSION (the GPU machine's Python, for pack: 3.12), OUT (run:
# build/device/out_recipe), STEPS (8), TOTAL_TIMEOUT (seconds for everything, 540). The CPU twin of
# run(), to try the script: PLATFORM=cpu OUT=/tmp/recipe_out bash bench/device_recipe.sh run
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=build/device/wheels
# what Ray and the package import, by module, and the distribution that carries it
SMALL_WHEELS=(jsonschema:jsonschema referencing:referencing jsonschema_specifications:jsonschema-specifications
              rpds:rpds-py attrs:attrs click:click msgpack:msgpack google.protobuf:protobuf einops:einops psutil:psutil)

pack() {
  local py=${PY_VERSION:-3.12} ray_version trim
  [ -f build/device/megatron_core-0.12.1.tar.gz ] || bash bench/device_kernels.sh pack
  ray_version=$(python -c "import ray; print(ray.__version__)")
  mkdir -p "$WHEELS"
  local -a dists=()
  for entry in "${SMALL_WHEELS[@]}"; do dists+=("${entry#*:}"); done
  pip download --quiet --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$WHEELS" "ray==$ray_version" "${dists[@]}"
  trim=$(mktemp -d /tmp/ray_trim.XXXXXX)
  unzip -q "$WHEELS"/ray-"$ray_version"-*.whl -d "$trim"
  rm -rf "$trim"/ray/{jars,rllib,tune,serve,data,train,llm} "$WHEELS"/ray-"$ray_version"-*.whl
  find "$trim" -name __pycache__ -prune -exec rm -rf {} +
  rm -f "$WHEELS/ray-trimmed.zip"
  (cd "$trim" && zip -q -r -9 - .) >"$WHEELS/ray-trimmed.zip"
  rm -rf "$trim"
  echo "wrote $WHEELS ($(du -sh "$WHEELS" | cut -f1)) and build/device/megatron_core-0.12.1.tar.gz; carry build/device"
}

# unpack onto $1 each carried package this Python cannot import; print what was unpacked
unpack_missing() {
  local site=$1 entry module
  tar -xzf build/device/megatron_core-0.12.1.tar.gz -C "$site"
  echo "megatron-core 0.12.1 (files)"
  if ! python -c "import ray" 2>/dev/null; then
    python -m zipfile -e "$WHEELS/ray-trimmed.zip" "$site"
    chmod +x "$site/ray/core/src/ray/gcs/gcs_server" "$site/ray/core/src/ray/raylet/raylet"
    echo "ray (trimmed wheel)"
  fi
  for entry in "${SMALL_WHEELS[@]}"; do
    module=${entry%%:*}
    if ! python -c "import $module" 2>/dev/null; then
      python -m zipfile -e "$(ls "$WHEELS"/"$(echo "${entry#*:}" | tr - _)"-*.whl | head -1)" "$site"
      echo "${entry#*:} (wheel)"
    fi
  done
}

run() {
  local out=${OUT:-build/device/out_recipe} platform=${PLATFORM:-cuda} steps=${STEPS:-8} site
  local deadline=$((SECONDS + ${TOTAL_TIMEOUT:-540}))
  local -a one=("trainer.device=$platform" "trainer.n_gpus_per_node=1" "actor_rollout_ref.actor.megatron.expert_model_parallel_size=1")
  mkdir -p "$out"
  site=$(mktemp -d /tmp/site.XXXXXX)
  {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    echo "unpacked onto PYTHONPATH:"; unpack_missing "$site" | sed 's/^/  /'
  } | tee "$out/env.txt"
  export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  python -c "import sys, torch, transformers, ray, pyarrow, megatron.core as m; print('Python', sys.version.split()[0],
'| torch', torch.__version__, '| CUDA', torch.version.cuda, '| transformers', transformers.__version__, '| ray', ray.__version__,
'| pyarrow', pyarrow.__version__, '| megatron-core', m.__version__)" | tee -a "$out/env.txt"

  # one item: its name, seconds allowed (cut to what is left), the command; its output to $out/NAME.txt
  item() {
    local name=$1 limit=$2 left=$((deadline - SECONDS)) rc=0
    shift 2
    [ "$left" -gt 30 ] || { echo "== $name: skipped, ${left}s left" | tee -a "$out/summary.txt"; return 0; }
    [ "$limit" -lt "$left" ] || limit=$left
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1 || rc=$?
    echo "== $name: exit $rc in $((SECONDS - start))s (limit ${limit}s)" | tee -a "$out/summary.txt"
    grep -v '^\s*$' "$out/$name.txt" | grep -E '^(\||- |Command|[0-9]+ (passed|failed)|FAILED|ERROR|error)' | tail -25 || true
  }
  item phases 150 python bench/recipe_phases.py --steps "$steps" "${one[@]}"
  item gpu_tests 300 python -m pytest -o addopts=-ra -p no:cacheprovider -m gpu -q -s --durations=5 tests/
  item phases_free_cache_engine 150 python bench/recipe_phases.py --steps 6 "${one[@]}" \
    actor_rollout_ref.rollout.free_cache_engine=true
  item phases_micro8 150 python bench/recipe_phases.py --steps 6 "${one[@]}" actor_rollout_ref.actor.use_dynamic_bsz=false
  item phases_long 150 python bench/recipe_phases.py --config configs/recipe/tiny_long.yaml --steps 4 "${one[@]}" \
    actor_rollout_ref.actor.use_dynamic_bsz=true
  # last: on an H100 the steps after a profiled one took 2.9-3.2 s against 2.2 s in an unprofiled
  # run (torch.profiler's CUDA tracing may stay attached to the worker), so it runs after the rest
  item profile 150 python bench/recipe_phases.py --steps 3 --profile "$out/profile.txt" "${one[@]}"
  cat "$out/summary.txt"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: bash bench/device_recipe.sh pack | run" >&2; exit 2 ;;
esac
