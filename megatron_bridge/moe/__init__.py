"""Expert routing of the MoE layers: tokens per expert counted from megatron's routers
(``routing_stats``)."""
