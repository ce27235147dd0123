#!/usr/bin/env bash
# GRPO vs GRPO with routing replay vs GSPO on Qwen3-30B-A3B (configs/recipe/qwen3_30b_a3b_gspo.yaml with
# each variant's algorithm and replay), multi-node: run the same command on every node. One Ray
# cluster, one job per variant one after another, all on the same prompts, seeds and checkpoint,
# then the report on the head (COMPARE_DIR/report/report.md).
#   MASTER_ADDR=<head ip> MODEL_PATH=... TRAIN_FILE=... VAL_FILE=... [VARIANTS=grpo,grpo_r2,gspo] [SEEDS=1] \
#     [COMPARE_DIR=/shared/runs/compare/qwen3_30b] bash launch/qwen3_30b_a3b_compare.sh
# Variables and options: --help; procedure: docs/launch.md; the report: docs/stability.md.
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_compare configs/recipe/qwen3_30b_a3b_gspo.yaml "$@"
