"""Reward sources and reward post-processing.

Sources come in two kinds (DESIGN.md): jittable rule functions over token arrays (:data:`RULES`,
run inside the step program, like the learned reward model's scalar head) and host functions
over decoded strings (arbitrary Python, run between two programs): registered ones
(:data:`HOST_RULES`, e.g. the math verifier) or the user's own, ``host:path/to/file.py:function``
and ``host:package.module:function`` (:func:`resolve_host_reward`, :func:`score_host`).  Several
sources combine with weights (:func:`combine_rewards`).  Then, in this order: missing-EOS
handling, the reward-hacking guard, and normalisation with non-finite rewards masked out and
counted.  Every jittable function here is a pure array function; configs stay outside.
"""

from jaxrlhf.rewards.shaping import (  # noqa: F401
    GUARD_ACTIONS, MISSING_EOS_MODES, NORMALIZE_MODES, RunningStats, apply_guard,
    apply_missing_eos, combine_rewards, finite_rewards, has_eos, init_running_stats, is_eos,
    normalize_rewards, update_running_stats)
from jaxrlhf.rewards.rules import (  # noqa: F401
    RULES, RuleFn, exact_match, get_rule, is_user_host_source, reads_answer, register_rule,
    token_accuracy)
from jaxrlhf.rewards.host import (  # noqa: F401
    HOST_ERROR_POLICIES, HOST_RULES, HOST_SIGNATURE, TRL_SIGNATURE, HostFn, HostReward,
    HostScores, get_host_reward, host_exact_match, register_host_reward, resolve_host_reward,
    score_host)
from jaxrlhf.rewards.verify import (  # noqa: F401
    boxed_answers, math_format_reward, math_verify_reward)
