"""``python -m megatron_bridge.plan check|search``: see ``megatron_bridge.plan.cli``."""

import sys

from megatron_bridge.plan.cli import main

sys.exit(main())
