"""The host side of every RL algorithm (PPO, GRPO, ...): reward sources, batches of prompts,
the host reward between the two programs it splits the step into, evaluation, and which
program(s) run the step.  The step itself is the phase list of train/phases.py, composed by
train/program.py; an algorithm brings its spec (advantages and loss terms) and nothing else.
"""

from __future__ import annotations

import math

import numpy as np

from jaxrlhf import rewards as RW
from jaxrlhf.algorithms import init_kl_controller
from jaxrlhf.config import ConfigError
from jaxrlhf.train import program
from jaxrlhf.train.types import Extras, Skips
from jaxrlhf.envs import resolve_env
from jaxrlhf.train.episodes import EpisodeRunner, episode_rollout
from jaxrlhf.rollout import partial_kv_slots
from jaxrlhf.train.phases import initial_carry, rl_phases
from jaxrlhf.train.spec import Role
from jaxrlhf.train.types import HostInputs
from jaxrlhf.train.stage import Stage


def rl_roles(cfg, name: str, value_head: bool) -> dict:
  """The roles of an RL stage: the policy (with the value head on it for a shared backbone,
  or a separate value model), a reference when a KL term needs one, the reward model when a
  source reads it, and the guard."""
  scfg = getattr(cfg, name)
  shared = value_head and getattr(scfg, "shared_backbone", False)
  roles = {"policy": Role("lm+scalar" if shared else "lm", True)}
  if value_head and not shared:
    roles["value"] = Role("scalar", True)
  if scfg.kl.coef > 0 or scfg.kl.adaptive:
    roles["reference"] = Role("lm", False)
  if "model" in scfg.reward.sources:
    roles["reward"] = Role("scalar", False)
  if scfg.reward.guard:
    roles["guard"] = Role("scalar", False)
  return roles


def rl_validate(cfg, name: str, data) -> None:
  """Reward sources that exist, and answers wherever a source reads them."""
  r = getattr(cfg, name).reward
  if cfg.env.name:
    resolve_env(cfg.env.name, "env.name")  # the file, the class, the fix
    if "env" not in r.sources:
      raise ConfigError(f"env.name={cfg.env.name!r} is set but {name}.reward.sources "
                        f"{tuple(r.sources)} does not read it; add 'env' (the episode's "
                        f"return) to {name}.reward.sources, with a weight in {name}.reward.weights")
  for src in r.sources:
    kind, _, fname = src.partition(":")
    if src == "env":
      if not cfg.env.name:
        raise ConfigError(f"{name}.reward.sources: 'env' (an environment's return) needs an "
                          f"environment; set env.name (calculator, guess, "
                          f"path/to/file.py:Class)")
    elif kind == "host":
      RW.resolve_host_reward(src, f"{name}.reward.sources")  # the file, the function, the fix
    elif not (src == "model" or (kind == "rule" and fname in RW.RULES)):
      raise ConfigError(
          f"{name}.reward.sources: {src!r} is not a reward source; use 'model', 'env', "
          f"'rule:NAME' ({', '.join(sorted(RW.RULES))}), 'host:NAME' "
          f"({', '.join(sorted(RW.HOST_RULES))}), 'host:path/to/file.py:function' or "
          f"'host:package.module:function'")
  data.check_answers(r.sources, f"{name}.reward.sources", r.weights)


class RLStage(Stage):
  """An RL stage (the spec says which algorithm).  Reward sources are parsed here, once."""

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    self.n = self.scfg.num_samples
    self.N = cfg.rollout.max_new_tokens
    self.decode_shardings = self.decode_layout_shardings("policy")
    # rollout.prompt_buckets: each batch's prompts cut to its bucket (refill's queues and the
    # episodes' layout keep max_prompt_len: their carried prompts have a fixed width).
    ro = cfg.rollout
    self.prompt_widths = () if ro.refill or cfg.env.name else program.bucket_widths(
        self.P, ro.prompt_buckets)
    # logging.samples_every: the rollout's rows come to the host on those steps (the step
    # then runs as a PhasedProgram, which hands them over).
    self.rollout_samples = bool(cfg.logging.samples and cfg.logging.samples_every)
    rcfg = self.scfg.reward
    self.host_sources = []
    self.device_sources = []
    self.episodes = None  # multi-turn episodes (env.name): the host generate phase
    self.episode_runner = None
    self.env_weight = 0.0  # the weight of the 'env' source (the episodes' returns)
    for src, w in zip(rcfg.sources, rcfg.weights):
      kind, _, fname = src.partition(":")
      if src == "env":
        self.env_weight = w
        self.episode_runner = EpisodeRunner(self)
        self.episodes = episode_rollout(self, self.episode_runner, w)
      elif kind == "host":
        # Resolved once (a user's file is imported here); rl_validate has checked it.
        self.host_sources.append((RW.resolve_host_reward(src, f"{self.name}.reward.sources"), w))
      else:
        self.device_sources.append((kind, fname or None, w))

  def close(self) -> None:
    if self.episode_runner is not None:
      self.episode_runner.close()

  # ----------------------------------------------------------------------------- set-up
  def initial_extras(self):
    carry = None
    ro = self.cfg.rollout
    if ro.refill and ro.refill_leftover != "drop":
      # The prompts started but not trained, for the next step's queue (docs/rollout.md),
      # and with "continue" their partial responses.
      kv = None
      if ro.refill_leftover == "continue" and ro.continue_kv == "keep":
        kv = (self.model_cfg("policy"), partial_kv_slots(ro, self.P))
      carry = initial_carry(self.scfg.batch_size, self.P, self.R,
                            rows=self.scfg.batch_size * self.n if
                            ro.refill_leftover == "continue" else 0,
                            n_new=self.N, pad_id=self.tok.pad_id, kv=kv)
    return Extras(skips=Skips.zeros(), kl=init_kl_controller(self.scfg.kl.coef),
                  reward_stats=RW.init_running_stats(), carry=carry)

  def init(self, key, roles, **kw):
    # (A pool, ``only=...``, warns in its own log: jaxrlhf.pools.critic.)
    if "reward" in self.frozen() and "reward" not in roles and not self.cfg.role_model(
        "reward").hf_path and kw.get("only") is None:
      print(f"warning: {self.name} uses a reward model but no earlier stage trained one; "
            f"it starts from random weights (add an 'rm' stage or set reward_model.hf_path)")
    return super().init(key, roles, **kw)

  @property
  def prompts_per_step(self) -> int:
    """Prompts generated per step: the batch, or more for dynamic sampling to select from,
    or the refill queue (``rollout.refill``: at most this many start)."""
    if self.cfg.rollout.refill:
      return math.ceil(self.scfg.batch_size * self.cfg.rollout.refill_queue)
    return getattr(self.scfg, "prompts_per_step", self.scfg.batch_size)

  @property
  def decode_prompts(self) -> int:
    """Groups decoded side by side (the refill loop's groups; else every generated prompt)."""
    return self.scfg.batch_size if self.cfg.rollout.refill else self.prompts_per_step

  def batch_shapes(self):
    b = self.prompts_per_step
    return {"prompt": ((b, self.P), np.int32), "prompt_mask": ((b, self.P), np.bool_),
            "answer": ((b, self.R), np.int32), "answer_mask": ((b, self.R), np.bool_)}

  def batch(self, step):
    examples = self.data.examples("prompts", step, self.prompts_per_step)
    batch = program.trim_prompts(self.data.encoder.prompts(examples), self.prompt_widths)
    if self.host_sources or self.episodes or self.rollout_samples:
      batch["host"] = HostInputs(tuple(examples))
    return batch

  def evaluate(self, state, ev):
    return ev.generation(self.view(state.params, ev.frozen, "policy", decode=True))

  def outputs(self, state, frozen):
    return {r: self.merged(state.params, frozen, r) for r in self.outputs_roles()}

  def outputs_roles(self):
    return ("policy",) + (("value",) if "value" in self.trainable else ())

  # ---------------------------------------------------------------------------- the step
  def phases(self, roles=None, terms=None):
    """The step's phase list, training ``roles`` (default: every trained role) on loss
    ``terms`` (default: every term of the algorithm)."""
    return rl_phases(roles or tuple(self.trainable), terms or tuple(self.spec.terms), self.scfg)

  def step(self, state, frozen, batch):
    return program.step_fn(self, self.phases())(state, frozen, batch)

  def make_step_fn(self, state, frozen, batch):
    """One jitted program, unless phases must be separate (phase timing, a host reward,
    episodes, length buckets or packing)."""
    if not (self.host_sources or self.episodes or self.cfg.logging.phase_timing
            or program.cuts_at_host(self) or self.rollout_samples):
      return super().make_step_fn(state, frozen, batch)
    return program.PhasedProgram(self, self.phases(), state, timed=self.cfg.logging.phase_timing,
                                 host_fn=self.host_scores if self.host_sources else None,
                                 rollout_fn=self.episodes)

  def host_scores(self, responses_BN, host: HostInputs) -> tuple[np.ndarray, dict]:
    """The host reward functions on the decoded responses (the split point of the step;
    ``responses_BN``: the rollout's response columns): the weighted scores, float32 ``[B]``
    (NaN where a function failed: masked), and the failure counts.  Each function gets every
    field of the examples behind the batch's prompts."""
    examples = [ex.record() for ex in host.examples]
    tokens = np.asarray(responses_BN)
    responses = [self.tok.decode(t) for t in tokens]
    ids = None
    if any(reward.style == "trl" for reward, _ in self.host_sources):
      ids = [completion_ids(t[:self.N], self.tok.eos_id) for t in tokens]
    total = np.zeros(len(responses), np.float32)
    metrics: dict = {}
    for reward, w in self.host_sources:
      if w == 0:  # switched off: its NaN must not poison the sum (0 * NaN = NaN)
        continue
      got = RW.score_host(reward, responses, examples, self.n, self.scfg.reward.host_errors,
                          completion_ids=ids, timeout_s=self.scfg.reward.timeout_s)
      total += np.float32(w) * got.scores
      for k, v in got.metrics().items():
        metrics[k] = metrics.get(k, 0.0) + v
    return total, metrics


def completion_ids(row, eos_id: int) -> list[int]:
  """A response's token ids up to and including its first EOS (all of them without one): what
  TRL passes a reward function as ``completion_ids``."""
  row = [int(t) for t in row]
  return row[:row.index(eos_id) + 1] if eos_id in row else row
