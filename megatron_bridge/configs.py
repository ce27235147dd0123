"""Where the shipped YAMLs live (``configs/`` at the top of the repository)."""

import os

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
