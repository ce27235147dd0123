"""``python -m recipe.main_gspo``: ``recipe.main`` with ``algo=gspo``."""

import sys

from recipe.main import main

if __name__ == "__main__":
    sys.exit(main(algo="gspo"))
