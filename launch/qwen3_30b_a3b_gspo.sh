#!/usr/bin/env bash
# GSPO on Qwen3-30B-A3B (configs/recipe/qwen3_30b_a3b_gspo.yaml), multi-node: run the same command
# on every node. Defaults: 2 x 16 Atlas A3 dies; swap the layout with PARALLEL=<configs/parallel/*.yaml>.
#   MASTER_ADDR=<head ip> MODEL_PATH=... TRAIN_FILE=... VAL_FILE=... bash launch/qwen3_30b_a3b_gspo.sh
# Variables and options: --help; procedure: docs/launch.md.
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_main configs/recipe/qwen3_30b_a3b_gspo.yaml gspo "$@"
