"""The workers, one Ray actor per device: the actor role (``actor``: Megatron shard, log-probs,
update, offload, checkpoint shard, weight export) and the rollout role (``rollout``: engine,
generation, sleep), composed on one device (``colocated``) or apart, the rollout on devices of its
own (``separate``); their placement and the calls to all of them (``group``)."""
