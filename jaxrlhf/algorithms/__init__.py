"""The alignment math as pure array functions: KL (``kl``), advantages (``advantages``), the
losses of every algorithm (``losses``) and the rollout-side shaping (``shaping``: overlong
penalty, dynamic-sampling group selection, off-policy importance weights).  No configs inside: hyper-parameters are plain keyword
arguments, so the training steps close over them from the frozen config.  The conventions are
written once in docs/conventions.md and pinned by tests/test_algorithms.py."""

from jaxrlhf.algorithms.advantages import GROUP_METHODS, gae, group_advantages, whiten
from jaxrlhf.algorithms.kl import (ESTIMATORS, KLControllerState, init_kl_controller,
                                   kl_estimate, kl_penalty_loss, kl_shaped_rewards,
                                   update_kl_controller)
from jaxrlhf.algorithms.losses import (AGG_MODES, DPO_LOSSES, POLICY_LOSSES, PREFERENCE_LOSSES,
                                       REFERENCE_FREE_LOSSES, agg_count, aggregate,
                                       bradley_terry_loss, cispo_policy_loss, dpo_loss,
                                       entropy_bonus, gspo_policy_loss, kto_loss,
                                       masked_token_mean, orpo_loss, ppo_policy_loss,
                                       preference_metrics,
                                       simpo_loss, sft_loss, value_loss)
from jaxrlhf.algorithms.shaping import (OFF_POLICY_MODES, off_policy_weights, overlong_penalty,
                                        select_groups)
from jaxrlhf.algorithms.stats import masked_moments, masked_zscore

__all__ = [
    "AGG_MODES", "DPO_LOSSES", "ESTIMATORS", "GROUP_METHODS", "KLControllerState",
    "OFF_POLICY_MODES", "POLICY_LOSSES", "PREFERENCE_LOSSES", "REFERENCE_FREE_LOSSES",
    "agg_count", "aggregate", "bradley_terry_loss", "cispo_policy_loss", "dpo_loss",
    "entropy_bonus", "gae", "group_advantages", "gspo_policy_loss", "init_kl_controller",
    "kl_estimate", "kl_penalty_loss", "kl_shaped_rewards", "kto_loss", "masked_moments",
    "masked_token_mean", "masked_zscore", "off_policy_weights", "orpo_loss", "overlong_penalty",
    "ppo_policy_loss", "preference_metrics", "select_groups", "sft_loss", "simpo_loss", "update_kl_controller",
    "value_loss", "whiten",
]
