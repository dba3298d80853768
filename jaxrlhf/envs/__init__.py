"""Environments for multi-turn rollouts (``env.name``): the policy's actions alternate with an
environment's observations, with rewards.

- :class:`Env` the interface (one instance per rollout row), :func:`register_env` /
  :data:`ENVS` the built-ins, :func:`resolve_env` ``env.name`` -> :class:`EnvSpec`;
- :class:`EnvRunner` steps a batch on the host (threads, timeouts, failures masked or raised);
- :mod:`jaxrlhf.envs.render`: the token layout (text, or chat rendered append-only);
- the built-ins ``calculator`` and ``guess`` (their data: data.task of the same names).
"""

from jaxrlhf.envs.base import (  # noqa: F401
    ENV_INTERFACE, ENVS, Env, EnvSpec, register_env, resolve_env)
from jaxrlhf.envs.runner import (  # noqa: F401
    ENV_ERROR_POLICIES, EnvError, EnvRunner)
from jaxrlhf.envs.render import (  # noqa: F401
    ChatFormat, TextFormat, make_format)
from jaxrlhf.envs import builtin  # noqa: F401  (registers calculator and guess)
from jaxrlhf.envs.builtin import (  # noqa: F401
    CalculatorEnv, GuessEnv, evaluate)
