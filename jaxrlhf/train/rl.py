"""What PPO and GRPO share: a step made of phases — generate, reference log-probs, reward
(+ guard), values, update — composed into one jitted program by default.

The same phase functions run as separately-jitted, separately-timed programs when
``logging.phase_timing`` is on, and the step splits into exactly two programs around a host
(Python) reward function: generate, then the host reward, then scoring and update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf import model as M
from jaxrlhf import rewards as RW
from jaxrlhf.algorithms import (aggregate, init_kl_controller, kl_estimate, ppo_policy_loss,
                                update_kl_controller)
from jaxrlhf.config import ConfigError
from jaxrlhf.perf import PhaseTimer
from jaxrlhf.rollout import generate
from jaxrlhf.train.common import (accumulate_grads, apply_update, count_skip, jit_step,
                                  shardings_of, skip_counters)
from jaxrlhf.train.evaluate import ExactMatchEval
from jaxrlhf.train.stage import Stage

PHASES = ("generate", "reference", "reward", "values", "update")


class RLStage(Stage):
  """Base of PPO and GRPO.  Subclasses implement ``advantages`` and ``losses``."""

  uses_value = False

  def __init__(self, cfg, mesh, data):
    super().__init__(cfg, mesh, data)
    self.evaluator = ExactMatchEval(self)
    self.n = self.scfg.num_samples
    self.N = cfg.rollout.max_new_tokens
    rcfg = self.scfg.reward
    if len(rcfg.weights) != len(rcfg.sources):
      raise ConfigError(f"{self.name}.reward.weights has {len(rcfg.weights)} entries but "
                        f"{self.name}.reward.sources has {len(rcfg.sources)}; give one weight "
                        f"per source")
    self.host_sources = []
    self.device_sources = []
    for src, w in zip(rcfg.sources, rcfg.weights):
      kind, _, fname = src.partition(":")
      if kind == "model":
        self.device_sources.append(("model", None, w))
      elif kind == "rule" and fname in RW.RULES:
        self.device_sources.append(("rule", fname, w))
      elif kind == "host":
        self.host_sources.append((RW.resolve_host_reward(src, f"{self.name}.reward.sources"), w))
      else:
        raise ConfigError(
            f"{self.name}.reward.sources: {src!r} is not a reward source; use 'model', "
            f"'rule:NAME' ({', '.join(sorted(RW.RULES))}), 'host:NAME' "
            f"({', '.join(sorted(RW.HOST_RULES))}), 'host:path/to/file.py:function' or "
            f"'host:package.module:function'")
    data.check_answers(rcfg.sources, f"{self.name}.reward.sources", rcfg.weights)
    self.uses_reward_model = any(s[0] == "model" for s in self.device_sources)
    if self.scfg.batch_size * self.n % self.scfg.num_minibatches:
      raise ConfigError(f"{self.name}: batch_size*num_samples={self.scfg.batch_size * self.n} "
                        f"must divide into num_minibatches={self.scfg.num_minibatches}")

  # ----------------------------------------------------------------------------- set-up
  def frozen(self):
    out = {}
    if self.scfg.kl.coef > 0 or self.scfg.kl.adaptive:
      out["reference"] = "lm"
    if self.uses_reward_model:
      out["reward"] = "scalar"
    if self.scfg.reward.guard:
      out["guard"] = "scalar"
    return out

  def initial_extras(self):
    return {**skip_counters(), "kl": init_kl_controller(self.scfg.kl.coef),
            "reward_stats": RW.init_running_stats()}

  def init(self, key, roles):
    if self.uses_reward_model and "reward" not in roles and not self.cfg.role_model(
        "reward").hf_path:
      print(f"warning: {self.name} uses a reward model but no earlier stage trained one; "
            f"it starts from random weights (add an 'rm' stage or set reward_model.hf_path)")
    return super().init(key, roles)

  def batch_shapes(self):
    b = self.scfg.batch_size
    return {"prompt": ((b, self.P), jnp.int32), "prompt_mask": ((b, self.P), jnp.bool_),
            "answer": ((b, self.R), jnp.int32), "answer_mask": ((b, self.R), jnp.bool_)}

  def batch(self, step):
    examples = self.data.examples("prompts", step, self.scfg.batch_size)
    batch = self.data.encoder.prompts(examples)
    self._last_examples = examples
    return batch

  def evaluate(self, state, frozen):
    return self.evaluator(state.params["policy"])

  def value_params(self, params):
    """The parameters the value head reads (PPO overrides this for a shared backbone)."""
    return params["value"]

  def outputs(self, state, frozen):
    out = {"policy": state.params["policy"]}
    if "value" in state.params:
      out["value"] = state.params["value"]
    return out

  # ----------------------------------------------------------------------------- phases
  def phase_generate(self, state, batch):
    rng, k = jax.random.split(state.rng)
    tok = self.tok
    ro = generate(state.params["policy"], batch["prompt"], batch["prompt_mask"], k,
                  cfg=self.model_cfg("policy"), rollout=self.cfg.rollout, eos_id=tok.eos_id,
                  pad_id=tok.pad_id, num_samples=self.n, kernels=self.cfg.kernels)
    ro = {"tokens": ro.tokens, "mask": ro.mask, "response_mask": ro.response_mask,
          "old_logp": ro.logprobs, "lengths": ro.lengths, "finished": ro.finished}
    return state.replace(rng=rng), ro

  def phase_reference(self, frozen, ro):
    if "reference" not in frozen:
      return {"ref_logp": ro["old_logp"]}
    logp, _ = M.token_logprobs(frozen["reference"], ro["tokens"], ro["mask"],
                               cfg=self.model_cfg("reference"), start=self.P,
                               kernels=self.cfg.kernels)
    return {"ref_logp": logp}

  def phase_reward(self, frozen, batch, ro, host_scores=None):
    """The raw sequence score (weighted sources) and which rows stay in the update."""
    parts = []
    response = ro["tokens"][:, self.P:]
    for kind, name, w in self.device_sources:
      if kind == "model":
        s = M.sequence_scores(frozen["reward"], ro["tokens"], ro["mask"],
                              cfg=self.model_cfg("reward"), kernels=self.cfg.kernels,
                              start=self.P)
      else:
        s = RW.RULES[name](response, ro["response_mask"], jnp.repeat(batch["answer"], self.n, 0),
                           jnp.repeat(batch["answer_mask"], self.n, 0), eos_id=self.tok.eos_id)
      parts.append((s.astype(jnp.float32), w))
    if host_scores is not None:
      parts.append((host_scores, 1.0))
    score = RW.combine_rewards([p for p, _ in parts], [w for _, w in parts])
    rcfg = self.scfg.reward
    keep = jnp.ones(score.shape, bool)
    metrics = {}
    score, keep_eos = RW.apply_missing_eos(score, ro["finished"], mode=rcfg.missing_eos,
                                           penalty=rcfg.missing_eos_penalty)
    keep &= keep_eos
    if rcfg.guard:
      g = M.sequence_scores(frozen["guard"], ro["tokens"], ro["mask"],
                            cfg=self.model_cfg("guard"), kernels=self.cfg.kernels, start=self.P)
      score, keep_guard, gm = RW.apply_guard(score, jax.nn.sigmoid(g),
                                             threshold=rcfg.guard_threshold,
                                             action=rcfg.guard_action, penalty=rcfg.guard_penalty)
      keep &= keep_guard
      metrics.update(gm)
    return {"score": score, "keep": keep}, metrics

  def phase_values(self, state, ro):
    if not self.uses_value:
      return {}
    v = M.token_scores(self.value_params(state.params), ro["tokens"], ro["mask"],
                       cfg=self.model_cfg("value"), kernels=self.cfg.kernels)
    # The value of the state *before* each response token.
    return {"values": v[:, self.P - 1:self.P - 1 + self.N]}

  def shape_rewards(self, state, ro, kl_coef):
    """Reward normalisation (with the running statistics in ``state.extras``), per-token KL to
    the reference and advantages: everything the update trains on, before any gradient.
    Returns ``(adv, extra, update_mask, kl_tok, reward_stats, metrics)``; the disaggregated
    critic pool calls this too."""
    scfg = self.scfg
    resp_mask = ro["response_mask"]
    raw = ro["score"]
    valid = ro["keep"] & jnp.isfinite(raw)
    score, stats, norm_metrics = RW.normalize_rewards(
        raw, valid, mode=scfg.reward.normalize, stats=state.extras["reward_stats"],
        clip=scfg.reward.clip)
    kl_tok = kl_estimate(ro["old_logp"], ro["ref_logp"], estimator=scfg.kl.estimator,
                         clamp_logr=scfg.kl.clamp_logr, clamp_kl=scfg.kl.clamp_kl)
    kl_tok = jnp.where(resp_mask, kl_tok, 0.0)
    update_mask = resp_mask & valid[:, None]
    adv, extra = self.advantages(ro, score, kl_tok, kl_coef, update_mask)
    finite = jnp.isfinite(raw)
    # The raw score's statistics win over the normaliser's (which describe the normalised one).
    metrics = {**norm_metrics,
               "reward/mean": jnp.mean(jnp.where(finite, raw, 0.0)),
               "reward/std": jnp.std(jnp.where(finite, raw, 0.0)),
               "reward/min": jnp.min(jnp.where(finite, raw, jnp.inf)),
               "reward/max": jnp.max(jnp.where(finite, raw, -jnp.inf))}
    return adv, extra, update_mask, kl_tok, stats, metrics

  def phase_update(self, state, frozen, batch, ro):
    del frozen, batch
    scfg = self.scfg
    resp_mask = ro["response_mask"]
    kl_coef = state.extras["kl"].coef
    adv, extra, update_mask, kl_tok, stats, reward_metrics = self.shape_rewards(
        state, ro, kl_coef)
    data = {"tokens": ro["tokens"], "mask": ro["mask"], "resp_mask": update_mask,
            "old_logp": ro["old_logp"], "ref_logp": ro["ref_logp"], "adv": adv,
            "rollout_logp": ro["old_logp"], **extra}
    state, upd_metrics = self._epochs(state, data, kl_coef)
    seq_kl = jnp.sum(kl_tok, axis=-1)
    n_rows = resp_mask.shape[0]
    new_kl = update_kl_controller(state.extras["kl"], jnp.mean(seq_kl), n_rows,
                                  target=scfg.kl.target, horizon=scfg.kl.horizon,
                                  adaptive=scfg.kl.adaptive)
    state = state.replace(step=state.step + 1,
                          extras={**state.extras, "kl": new_kl, "reward_stats": stats})
    lengths = ro["lengths"].astype(jnp.float32)
    metrics = {
        **reward_metrics, **upd_metrics,
        "kl/mean": jnp.mean(seq_kl), "kl/coef": kl_coef,
        "response_length/mean": jnp.mean(lengths),
        "rollout/tokens": jnp.sum(lengths),
        "rollout/finished_frac": jnp.mean(ro["finished"].astype(jnp.float32)),
        "skips/total": state.extras["skips/total"],
    }
    return state, metrics

  def _epochs(self, state, data, kl_coef):
    """``ppo_epochs`` passes over the batch in ``num_minibatches`` shuffled minibatches:
    one ``lax.scan`` over (epoch, minibatch)."""
    scfg = self.scfg
    rows = data["tokens"].shape[0]
    n_mb = scfg.num_minibatches
    rng, k = jax.random.split(state.rng)
    if n_mb == 1 and scfg.ppo_epochs == 1:
      perms = jnp.arange(rows)[None]  # one pass over the whole batch: no shuffle, no gather
    else:
      perms = jnp.stack([jax.random.permutation(jax.random.fold_in(k, e), rows)
                         for e in range(scfg.ppo_epochs)])

    def minibatches(perm):
      return jax.tree.map(lambda x: x[perm].reshape((n_mb, rows // n_mb) + x.shape[1:]), data)

    mbs = jax.vmap(minibatches)(perms)
    mbs = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), mbs)
    first = jnp.arange(scfg.ppo_epochs * n_mb) == 0

    def body(carry, xs):
      params, opt_state, extras = carry
      mb, is_first = xs
      n_micro = self.opt_accum()
      denom = jnp.maximum(jnp.sum(mb["resp_mask"]), 1).astype(jnp.float32)
      n_seq = jnp.maximum(jnp.sum(jnp.any(mb["resp_mask"], axis=-1)), 1).astype(jnp.float32)

      def loss_fn(p, micro):
        return self.losses(p, micro, denom=denom, n_seq=n_seq, kl_coef=kl_coef)

      loss, grads, aux = accumulate_grads(loss_fn, params, mb, n_micro)
      new_params, new_opt, finites, norms = {}, {}, [], {}
      for role in params:
        new_params[role], new_opt[role], fin, norms[role] = apply_update(
            params[role], opt_state[role], grads[role], loss, self.opt[role])
        finites.append(fin)
      finite = jnp.all(jnp.stack(finites))
      if len(params) > 1:
        # All roles skip together: a half-applied PPO update would desynchronise policy/value.
        # (One role: apply_update has already kept its old state on a non-finite step.)
        new_params = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_params, params)
        new_opt = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt, opt_state)
      extras = count_skip(extras, finite)
      aux = {**aux, "loss": loss, "grad_norm": norms["policy"],
             "rollout/logprob_mismatch": jnp.where(is_first, aux["_mismatch"], 0.0)}
      return (new_params, new_opt, extras), aux

    (params, opt_state, extras), aux = jax.lax.scan(
        body, (state.params, state.opt_state, state.extras), (mbs, first))
    metrics = {k: jnp.mean(v) for k, v in aux.items() if not k.startswith("_")}
    metrics["rollout/logprob_mismatch"] = jnp.sum(aux["rollout/logprob_mismatch"])
    return state.replace(rng=rng, params=params, opt_state=opt_state, extras=extras), metrics

  def opt_accum(self) -> int:
    return self.scfg.optim.grad_accum

  def policy_terms(self, params, mb, *, denom, n_seq):
    """Policy loss pieces shared by PPO and GRPO: clipped surrogate, entropy, the new log-probs
    and the rollout/trainer log-prob mismatch."""
    scfg = self.scfg
    logp, ent = M.token_logprobs(params["policy"], mb["tokens"], mb["mask"],
                                 cfg=self.model_cfg("policy"), start=self.P,
                                 kernels=self.cfg.kernels)
    mask = mb["resp_mask"]
    agg = dict(agg=scfg.loss_agg, denom=denom if scfg.loss_agg == "token_mean" else n_seq,
               max_len=self.N)
    pg, pm = ppo_policy_loss(logp, mb["old_logp"], mb["adv"], mask, clip_low=scfg.clip_low,
                             clip_high=scfg.clip_high, dual_clip=scfg.dual_clip, **agg)
    entropy = aggregate(ent, mask, mode=scfg.loss_agg, denom=agg["denom"], max_len=self.N)
    mismatch = jnp.sum(jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logp) - mb["rollout_logp"]),
                                 0.0)) / denom
    metrics = {"policy/loss": pg, "policy/clip_frac": pm["clip_frac"],
               "policy/approx_kl": pm["approx_kl"], "entropy/mean": entropy,
               "_mismatch": mismatch}
    return logp, pg - scfg.entropy_coef * entropy, metrics

  # ------------------------------------------------------------------------- the program
  def step(self, state, frozen, batch):
    state, ro = self.phase_generate(state, batch)
    ro.update(self.phase_reference(frozen, ro))
    scored, rmetrics = self.phase_reward(frozen, batch, ro)
    ro.update(scored)
    ro.update(self.phase_values(state, ro))
    state, metrics = self.phase_update(state, frozen, batch, ro)
    return state, {**metrics, **rmetrics}

  def make_step_fn(self, state, frozen, batch):
    """One jitted program, unless phases must be separate (phase timing or a host reward)."""
    if not self.host_sources and not self.cfg.logging.phase_timing:
      return jit_step(self.step, self.mesh, state, frozen, batch)
    return PhasedStep(self, state, frozen, batch)

  def host_scores(self, ro_host) -> tuple[np.ndarray, dict]:
    """Runs the host reward functions on decoded responses (the split point of the step):
    the weighted scores (NaN where a function failed: masked) and failure counts."""
    tokens = ro_host["tokens"][:, self.P:]
    responses = [self.tok.decode(t) for t in tokens]
    examples = [ex.record() for ex in self._last_examples]
    total = np.zeros(len(responses), np.float32)
    metrics = {}
    for reward, w in self.host_sources:
      if w == 0:  # switched off: its NaN must not poison the sum (0 * NaN = NaN)
        continue
      got = RW.score_host(reward, responses, examples, self.n, self.scfg.reward.host_errors)
      total += np.float32(w) * got.scores
      for k, v in got.metrics().items():
        metrics[k] = metrics.get(k, 0.0) + v
    return total, metrics


class PhasedStep:
  """The RL step as separately-jitted phases with host timing between them.

  With a host reward, generation and everything after it are the two programs around the
  host call; with ``logging.phase_timing`` each phase is its own program and is timed.
  """

  def __init__(self, stage: RLStage, state, frozen, batch):
    self.stage = stage
    s = stage
    self.timed = stage.cfg.logging.phase_timing
    state_sh = shardings_of(state)
    # Generation returns the state with a new RNG key: donate the old one (no parameter copy).
    self.gen = jax.jit(s.phase_generate, out_shardings=(state_sh, None), donate_argnums=(0,))
    self.ref = jax.jit(s.phase_reference)
    self.rew = jax.jit(s.phase_reward)
    self.val = jax.jit(s.phase_values)
    self.upd = jax.jit(s.phase_update, out_shardings=(state_sh, None), donate_argnums=(0,))

    def after_generate(state, frozen, batch, ro, host):
      ro = {**ro, **s.phase_reference(frozen, ro)}
      scored, rm = s.phase_reward(frozen, batch, ro, host)
      ro.update(scored)
      ro.update(s.phase_values(state, ro))
      state, m = s.phase_update(state, frozen, batch, ro)
      return state, {**m, **rm}

    self.rest = jax.jit(after_generate, out_shardings=(state_sh, None), donate_argnums=(0,))
    self.timer = PhaseTimer()

  def __call__(self, state, frozen, batch):
    s = self.stage
    timer = self.timer
    timer.start_step()
    state, ro = timer.run("generate", self.gen, state, batch)
    host, host_metrics = None, {}
    if s.host_sources:
      with timer.phase("host_reward"):
        host, host_metrics = s.host_scores(jax.device_get(ro))
        host = jnp.asarray(host)
    if not self.timed:
      state, metrics = timer.run("score_and_update", self.rest, state, frozen, batch, ro, host)
    else:
      ro = {**ro, **timer.run("reference", self.ref, frozen, ro)}
      scored, rm = timer.run("reward", self.rew, frozen, batch, ro, host)
      ro.update(scored)
      ro.update(timer.run("values", self.val, state, ro))
      state, metrics = timer.run("update", self.upd, state, frozen, batch, ro)
      metrics = {**metrics, **rm}
    return state, {**metrics, **host_metrics, **timer.end_step()}

