"""Weights in and out of the Megatron shards: HF safetensors read slice by slice
(``hf_checkpoint``), the HF <-> megatron name and shape table (``hf_mapping``), loading
(``load``), the bucketed, EP-aware weight stream to the rollout engine (``export``), mbridge as
an optional loader (``mbridge_backend``), the actor's torch_dist checkpoint read back as
Hub-named tensors (``dist_checkpoint``) and written as a HF model directory (``hf_export``)."""
