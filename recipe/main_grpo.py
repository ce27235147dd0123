"""``python -m recipe.main_grpo``: ``recipe.main`` with ``algo=grpo``."""

import sys

from recipe.main import main

if __name__ == "__main__":
    sys.exit(main(algo="grpo"))
