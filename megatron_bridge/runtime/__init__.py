"""One training rank: the platform adaptor chosen before megatron is imported (``platform``,
``cpu_adaptor``), the Qwen3-MoE GPTModel build (``model``) and the Megatron actor (``actor``)."""
