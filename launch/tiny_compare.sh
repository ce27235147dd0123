#!/usr/bin/env bash
# The local variant of the comparison launcher: the tiny stability preset
# (configs/recipe/tiny_stability.yaml) through the same bring-up on one machine (NNODES=1).
#   VARIANTS=grpo,gspo bash launch/tiny_compare.sh [trainer.total_training_steps=5 ...]
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_compare configs/recipe/tiny_stability.yaml "$@"
