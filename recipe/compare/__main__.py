"""``python -m recipe.compare``: see ``recipe.compare.runs``."""

import sys

from recipe.compare.runs import main

if __name__ == "__main__":
    sys.exit(main())
