"""The whole experiment: which stages run, every section, and :func:`validate`, which collects
every problem of a config (each stage's ``check``, the data settings, the sinks) before any work."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
from typing import Literal, Optional

from jaxrlhf.config.sections import (CheckpointConfig, ConfigError, DataConfig, DistributedConfig,
                                     EnvConfig, KernelsConfig, LoggingConfig, MeshConfig, ModelConfig,
                                     PlanConfig, PoolsConfig, RolloutConfig, SINK_PACKAGES, Sink)
from jaxrlhf.config.stages import (DPOConfig, GRPOConfig, KTOConfig, PPOConfig, RMConfig, SFTConfig,
                                   _Checks)


# The stages an experiment can run; each has a config field of the same name here and an
# AlgorithmSpec registered under that name (jaxrlhf/train/spec.py).
Stage = Literal["sft", "rm", "ppo", "grpo", "dpo", "kto"]


STAGE_NAMES: tuple[str, ...] = typing.get_args(Stage)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  # The run's name (a registered experiment's own); the default workdir is runs/NAME.
  name: str = "unnamed"
  # One line about the experiment, shown by --list.
  description: str = ""
  # Dotted fields the command line must set before the experiment can run (templates for the
  # user's model and data), e.g. ("model.hf_path", "data.tokenizer"); see validate().
  required: tuple[str, ...] = ()
  # The run's seed: initialisation, sampling and (with data.seed) the batches.
  seed: int = 0
  # The stages run in order; each later stage starts from the earlier stages' results.
  stages: tuple[Stage, ...] = ("sft",)
  # The policy's model (the reference is its frozen copy); with hf_path, the architecture is
  # read from the checkpoint.
  model: ModelConfig = ModelConfig()
  # Reward / value / guard models; None means "same shape as model".
  reward_model: Optional[ModelConfig] = None
  # The value model (PPO); None: the shape of model.
  value_model: Optional[ModelConfig] = None
  # The guard classifier (STAGE.reward.guard); None: the shape of model.
  guard_model: Optional[ModelConfig] = None
  # How the devices are split: dp x fsdp x tp.
  mesh: MeshConfig = MeshConfig()
  # Multi-process (multi-host) start-up.
  distributed: DistributedConfig = DistributedConfig()
  # Generation: the RL steps' rollouts and the evaluations' answers.
  rollout: RolloutConfig = RolloutConfig()
  # Multi-turn episodes against an environment (off unless env.name is set).
  env: EnvConfig = EnvConfig()
  # Supervised fine-tuning (stage "sft").
  sft: SFTConfig = SFTConfig()
  # Reward-model training (stage "rm").
  rm: RMConfig = RMConfig()
  # PPO (stage "ppo").
  ppo: PPOConfig = PPOConfig()
  # GRPO and its variants: GSPO, CISPO, DAPO's settings (stage "grpo").
  grpo: GRPOConfig = GRPOConfig()
  # DPO and the other pairwise losses: IPO, cDPO, SimPO, ORPO (stage "dpo").
  dpo: DPOConfig = DPOConfig()
  # KTO on unpaired examples (stage "kto").
  kto: KTOConfig = KTOConfig()
  # The training and evaluation data and the tokenizer.
  data: DataConfig = DataConfig()
  # Step checkpoints and their retention (docs/checkpointing.md).
  checkpoint: CheckpointConfig = CheckpointConfig()
  # Metrics, samples, the console and the trackers (docs/observability.md).
  logging: LoggingConfig = LoggingConfig()
  # Which implementation each hot op uses.
  kernels: KernelsConfig = KernelsConfig()
  # The cluster --plan sizes the run for (docs/plan.md).
  plan: PlanConfig = PlanConfig()
  # Disaggregated RL's actor and critic pools (--role, docs/pools.md).
  pools: PoolsConfig = PoolsConfig()

  def role_model(self, role: str) -> ModelConfig:
    """The model config of a role: policy, reference, reward, value or guard."""
    if role in ("policy", "reference"):
      return self.model
    other = {"reward": self.reward_model, "value": self.value_model,
             "guard": self.guard_model}.get(role, "missing")
    if other == "missing":
      raise ConfigError(f"unknown role {role!r}; valid: policy, reference, reward, value, guard")
    return other if other is not None else self.model


def validate(cfg: "ExperimentConfig", required: bool = True) -> "ExperimentConfig":
  """Raises ConfigError for values no run can use, naming the field and the fix; returns
  ``cfg``.  Checked before any work, so a bad setting of a late stage (PPO after SFT and the
  reward model) stops the run at once instead of after the earlier stages have trained.  Checks
  that need the data or the mesh stay with the code that has them.  ``required=False`` skips
  :attr:`ExperimentConfig.required` (to print a template's config)."""
  problems, missing = [], []
  for field in cfg.required if required else ():
    value = cfg
    for part in field.split("."):
      value = getattr(value, part, None)
    if value in (None, "", ()):
      missing.append(field)
  if missing:
    problems.append("this experiment is a template for your model and data; set "
                    + " ".join(f"--set={f}=..." for f in missing)
                    + f" ({', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set)")

  c = _Checks()
  c.problems = problems
  for role, m in (("model", cfg.model), ("reward_model", cfg.reward_model),
                  ("value_model", cfg.value_model), ("guard_model", cfg.guard_model)):
    if m is None:
      continue
    c.at_least(m, role, ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                         "head_dim", "mlp_dim", "max_seq_len"), 1)
    if m.n_heads >= 1 and m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads:
      problems.append(f"{role}.n_heads={m.n_heads} is not a multiple of {role}.n_kv_heads="
                      f"{m.n_kv_heads}: each key/value head serves a whole group of query heads; "
                      f"pick n_kv_heads dividing n_heads")
    problems += m.architecture_problems(role)
  c.at_least(cfg.data, "data", ("max_prompt_len", "max_response_len", "eval_size",
                                "eval_batch_size"), 1)
  c.at_least(cfg.logging, "logging", ("samples", "samples_every"), 0)
  _validate_data(cfg, problems)
  if cfg.env.name:
    c.at_least(cfg.env, "env", ("max_turns", "max_turn_tokens"), 1)
    c.at_least(cfg.env, "env", ("workers",), 0)
    c.finite(cfg.env, "env", "timeout_s", 1e-9, "must be a number of seconds > 0")
    c.need(all(isinstance(x, str) and x for x in cfg.env.stop_strings), "env.stop_strings",
           cfg.env.stop_strings, "each stop string must be a non-empty string")
    c.need(cfg.env.max_turn_tokens <= cfg.rollout.max_new_tokens, "env.max_turn_tokens",
           cfg.env.max_turn_tokens, f"an action cannot be longer than the "
           f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} slots a whole episode shares")
  for name in cfg.stages:
    getattr(cfg, name).check(name, cfg, c)
  problems += sink_problems(cfg.logging.sinks)
  problems = list(dict.fromkeys(problems))  # rollout checks repeat for PPO and GRPO
  if problems:
    raise ConfigError(f"{cfg.name}: " + "; ".join(problems))
  return cfg


def sink_problems(sinks) -> list[str]:
  """What stops ``logging.sinks`` from working here: an unknown sink, or one whose package is
  not installed (checked without importing it, before any work)."""
  problems = []
  valid = typing.get_args(Sink)
  for name in sinks:
    if name not in valid:
      problems.append(f"logging.sinks: unknown sink {name!r}; choose from {', '.join(valid)}")
    elif name in SINK_PACKAGES and importlib.util.find_spec(SINK_PACKAGES[name][0]) is None:
      module, extra = SINK_PACKAGES[name]
      problems.append(f"logging.sinks has {name!r} but the {module} package is not installed: "
                      f"pip install -e '.[{extra}]' (or drop {name} from logging.sinks)")
  return problems


def _validate_data(cfg: "ExperimentConfig", problems: list) -> None:
  d = cfg.data
  targets = []
  for item in d.fields:
    src, sep, dst = item.partition(":")
    if not sep or not src.strip() or not dst.strip() or ":" in dst:
      problems.append(f"data.fields: {item!r} is not SOURCE:TARGET; write e.g. "
                      f"data.fields=question:prompt,solution:answer")
    else:
      targets.append(dst.strip())
  for dup in sorted({t for t in targets if targets.count(t) > 1}):
    problems.append(f"data.fields: two columns are renamed to {dup!r}; keep one")
  if not (math.isfinite(d.eval_split) and 0.0 <= d.eval_split < 1.0):
    problems.append(f"data.eval_split={d.eval_split!r}: must be in [0, 1) (e.g. 0.05 holds out "
                    f"5% of each training file; 0 turns it off)")
  seq_len = d.max_prompt_len + d.max_response_len
  if d.pack_length and d.pack_length < seq_len:
    problems.append(f"data.pack_length={d.pack_length}: a packed row must hold the longest "
                    f"sequence, data.max_prompt_len + data.max_response_len = {seq_len}; set "
                    f"data.pack_length={seq_len} or more (0: exactly that)")
  if d.pack_length < 0:
    problems.append(f"data.pack_length={d.pack_length}: must be 0 (the sequence length) or a "
                    f"row length >= {seq_len}")
  if d.pack_buckets < 1:
    problems.append(f"data.pack_buckets={d.pack_buckets}: must be >= 1 (the number of row "
                    f"counts a packed batch is rounded up to; 8 is the default)")
  # The kind of held-out data each stage evaluates on (its config type's eval_data).
  kinds = sorted({type(getattr(cfg, s)).eval_data for s in cfg.stages})
  if d.task == "jsonl" and d.eval_path and len(kinds) > 1:
    problems.append(f"data.eval_path={d.eval_path!r} serves every stage, but the stages "
                    f"({', '.join(cfg.stages)}) read different kinds of data ({', '.join(kinds)}); "
                    f"give each its own: " + " ".join(f"--set=data.{k}_eval_path=FILE"
                                                      for k in kinds)
                    + " (or --set=data.eval_split=0.05 to hold out part of each training file)")
