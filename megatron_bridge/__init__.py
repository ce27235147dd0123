"""Megatron-Core side of the package: platforms, Qwen3-MoE model build, parallelism validation
and planning. Importing this package does not import megatron (the platform must be chosen first)."""
