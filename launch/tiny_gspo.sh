#!/usr/bin/env bash
# The local variant: the tiny CPU recipe (configs/recipe/tiny_gspo.yaml) through the same launcher on
# one machine (NNODES=1): a real Ray head, `ray job submit`, the job followed to its end.
#   bash launch/tiny_gspo.sh [trainer.total_training_steps=5 ...]
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
launch_main configs/recipe/tiny_gspo.yaml gspo "$@"
