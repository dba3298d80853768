"""Frozen, typed configuration for every part of a run, and dotted-name overrides.

An experiment (``experiments/NAME.py``) builds one :class:`ExperimentConfig`; the command line
changes fields with ``--set=section.field=value``.  Types drive parsing, and ``Literal`` types
list the valid choices, so a typo fails with a one-line message naming what would work.
"""

from jaxrlhf.config.sections import (  # noqa: F401
    CheckpointConfig, ConfigError, DataConfig, DistributedConfig, EnvConfig, KLConfig, KernelsConfig,
    LoggingConfig, LoraConfig, LORA_TARGETS, MeshConfig, ModelConfig, OptimizerConfig, PlanConfig, PoolsConfig,
    PRECISIONS, RewardConfig, RolloutConfig, SINK_PACKAGES, Sink, one_line)
from jaxrlhf.config.stages import (  # noqa: F401
    DPOConfig, GRPOConfig, KTOConfig, PPOConfig, RLConfig, RMConfig, SFTConfig, StageConfig)
from jaxrlhf.config.experiment import (  # noqa: F401
    ExperimentConfig, STAGE_NAMES, Stage, sink_problems, validate)
from jaxrlhf.config.overrides import (  # noqa: F401
    apply_overrides, diff, from_dict, load_config_file, set_field, to_dict, to_json)
