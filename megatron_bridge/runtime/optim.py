"""The actor's optimizer settings, apart from the actor so that a config can name them without
importing megatron or the model build."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from loss.rules import Rule, at_least, check_fields, greater_than, one_of

LR_DECAY_STYLES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimConfig:
    """Adam with linear warmup, then a constant or cosine LR (verl's ``actor.optim`` keys)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None  # cosine: optimizer steps from start to min_lr
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8

    # Each field's rule, declared once: checked here, and by the recipe's config under its keys.
    FIELD_RULES: ClassVar[dict[str, Rule]] = {
        "lr": greater_than(0),
        "lr_warmup_steps": at_least(0),
        "lr_decay_style": one_of(LR_DECAY_STYLES),
        "lr_decay_steps": at_least(1),
        "weight_decay": at_least(0),
        "clip_grad": greater_than(0),
    }

    def __post_init__(self):
        check_fields(self, self.FIELD_RULES)
        if self.lr_decay_style == "cosine" and not self.lr_decay_steps:
            raise ValueError("lr_decay_style='cosine' needs lr_decay_steps (the number of optimizer steps)")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")
