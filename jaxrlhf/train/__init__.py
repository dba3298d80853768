"""Training: each algorithm's spec and step, the RL phases and their composer, the loop.

Importing this package registers every algorithm (train/spec.py), one module each, in the
order a pipeline usually runs them.
"""

# Each module registers its spec on import.
from jaxrlhf.train import sft  # noqa: F401  isort: skip
from jaxrlhf.train import rm  # noqa: F401  isort: skip
from jaxrlhf.train import ppo  # noqa: F401  isort: skip
from jaxrlhf.train import grpo  # noqa: F401  isort: skip
from jaxrlhf.train import dpo  # noqa: F401  isort: skip
from jaxrlhf.train import kto  # noqa: F401  isort: skip
