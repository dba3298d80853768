"""jaxrlhf: a JAX/XLA trainer that aligns language models with feedback (SFT, reward models,
PPO, GRPO, DPO), every model sharded over a named ``dp`` x ``fsdp`` x ``tp`` mesh.

Entry point: ``python -m jaxrlhf.main --experiment=NAME``.  Importing the package does not
start JAX (planning sets up simulated devices before JAX initialises).
"""

__version__ = "0.1.0"
