"""Rollout engines behind one interface (recipe.rollout.base): vLLM / vLLM-Ascend, and transformers on the CPU."""
