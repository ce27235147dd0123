"""The workers, one Ray actor per device (``rank``: ``Rank``, with the roles of its pool): the
actor role (``actor``: Megatron shard, log-probs, update, offload, checkpoint shard, weight
export) and the rollout role (``rollout``: engine, generation, sleep), both on one device
(colocated) or one each, the rollout on devices of its own; what a rank is built from
(``settings``); their placement and the calls to all of them (``group``)."""
