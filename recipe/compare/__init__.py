"""Comparing GRPO, GRPO with routing replay and GSPO on the same prompts, seeds and initial weights:
the variants by name (``variants``), their runs (``runs``, the ``python -m recipe.compare`` command)
and the report on finished runs (``report``)."""
