"""The alignment math as pure array functions: KL (``kl``), advantages (``advantages``) and the
losses of every algorithm (``losses``).  No configs inside: hyper-parameters are plain keyword
arguments, so the training steps close over them from the frozen config.  The conventions are
written once in docs/conventions.md and pinned by tests/test_algorithms.py."""

from jaxrlhf.algorithms.advantages import GROUP_METHODS, gae, group_advantages, whiten
from jaxrlhf.algorithms.kl import (ESTIMATORS, KLControllerState, init_kl_controller,
                                   kl_estimate, kl_penalty_loss, kl_shaped_rewards,
                                   update_kl_controller)
from jaxrlhf.algorithms.losses import (AGG_MODES, DPO_LOSSES, agg_count, aggregate,
                                       bradley_terry_loss, dpo_loss, entropy_bonus,
                                       masked_token_mean, ppo_policy_loss, sft_loss, value_loss)
from jaxrlhf.algorithms.stats import masked_moments, masked_zscore

__all__ = [
    "AGG_MODES", "DPO_LOSSES", "ESTIMATORS", "GROUP_METHODS", "KLControllerState", "agg_count",
    "aggregate", "bradley_terry_loss", "dpo_loss", "entropy_bonus", "gae", "group_advantages",
    "init_kl_controller", "kl_estimate", "kl_penalty_loss", "kl_shaped_rewards",
    "masked_moments", "masked_token_mean", "masked_zscore", "ppo_policy_loss", "sft_loss",
    "update_kl_controller", "value_loss", "whiten",
]
