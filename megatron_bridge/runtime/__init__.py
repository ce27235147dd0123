"""One training rank: the platform adaptor chosen before megatron is imported (``platform``,
``cpu_adaptor``, and ``megatron_compat`` for megatron without Transformer Engine on every platform),
the Qwen3-MoE GPTModel build (``model``), the Megatron actor (``actor``) with its
optimizer settings (``optim``) and offload (``offload``), and the batch contract every pass and
the driver share (``batch``)."""
