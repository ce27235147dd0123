"""One training rank: the platform adaptor chosen before megatron is imported (``platform``,
``cpu_adaptor``, and ``megatron_compat`` for megatron without Transformer Engine on every platform),
MindSpeed's features on the NPU (``mindspeed``), the Qwen3-MoE GPTModel build (``model``) with the
compute paths the layout's switches resolve to (``kernels``: core attention on SDPA in
``attention``, grouped-GEMM experts in ``experts``), the Megatron actor (``actor``) with its
optimizer settings (``optim``) and offload (``offload``), its part of a reshardable checkpoint
(``checkpoint``), and the batch contract every pass and the driver share (``batch``)."""
