"""The pure phases of an RL step, each ``fn(statics, frozen, batch, carry) -> carry``.

``statics`` is the step's :class:`~jaxrlhf.train.statics.StepStatics` (configs, sizes, the
algorithm's spec, the reward sources it computes, how each role's parameters are read: no
host side, nothing mutable); ``carry`` a :class:`~jaxrlhf.train.types.StepCarry`.
:data:`RL_PHASES` is the list every RL algorithm composes (train/program.py); an algorithm
changes the step through its spec's advantage function and loss terms, not here.

Pools: the actor runs generation, the reference and the policy's training; the critic the
reward, the values, reward shaping (normalisation and advantages) and the value's training.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrlhf import rewards as RW
from jaxrlhf.algorithms import (POLICY_LOSSES, aggregate, entropy_bonus, kl_estimate,
                                kl_penalty_loss, masked_token_mean, off_policy_weights,
                                overlong_penalty,
                                select_groups, update_kl_controller)
from jaxrlhf.config import KLConfig
from jaxrlhf.rollout import carry_queue, carry_take, empty_partial
from jaxrlhf.rollout import generate as sample
from jaxrlhf.rollout import generate_refill as sample_refill
from jaxrlhf.train import packed as PK
from jaxrlhf.train.common import (accumulate_grads, apply_update, count_skip, minibatch_perms,
                                  rounding_key)
from jaxrlhf.train.program import HOST, Phase
from jaxrlhf.train.types import Carried, Rollout, Scored, Shaped, StepCarry, UpdateBatch


def kl_of(kl: KLConfig, logp_BN, ref_logp_BN):
  """Per-token KL(policy || reference) with the configured estimator and clamps."""
  return kl_estimate(logp_BN, ref_logp_BN, estimator=kl.estimator, clamp_logr=kl.clamp_logr,
                     clamp_kl=kl.clamp_kl)


def kl_coef_of(carry: StepCarry):
  """The KL coefficient of this step: the one a critic pool received with the rollout, else
  the controller's (kept in the state)."""
  if carry.kl_coef is not None:
    return carry.kl_coef
  return carry.state.extras.kl.coef


# ------------------------------------------------------------------------------ phases


def packed_rows(c: StepCarry):
  """The whole batch's packed layout (``rollout.pack``), or None: the forwards then run on the
  rollout's own rows."""
  return None if c.packing is None else c.packing.rows


def generate(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """Samples the rollout.  With a decode layout (``rollout.decode_layout=tp`` on a mesh with
  fsdp) the policy is resharded into it first, inside this program: one all-gather per step
  instead of one per decoded token; the copy lives only while this phase runs."""
  rng, k = jax.random.split(c.state.rng)
  policy = statics.view(c.state.params, frozen, "policy", decode=True)
  if statics.decode_shardings is not None:
    policy = jax.lax.with_sharding_constraint(policy, statics.decode_shardings)
  kw = dict(cfg=statics.model_cfg("policy"), rollout=statics.cfg.rollout, eos_id=statics.eos_id,
            pad_id=statics.pad_id, num_samples=statics.n, kernels=statics.cfg.kernels)
  if statics.cfg.rollout.refill and statics.cfg.rollout.refill_leftover != "drop":
    return _refill_carry(statics, batch, c.replace(state=c.state.replace(rng=rng)), policy, k,
                         kw)
  if statics.cfg.rollout.refill:
    return _refill(statics, batch, c.replace(state=c.state.replace(rng=rng)),
                   *sample_refill(policy, batch["prompt"], batch["prompt_mask"], k,
                                  num_groups=statics.scfg.batch_size, **kw))
  ro = sample(policy, batch["prompt"], batch["prompt_mask"], k, **kw)
  rollout = ro.replace(sample_logp_BN=None)  # the step trains on the policy's own
  # The loop's sampling steps: it runs until its longest response ends (refill reports its
  # own); a prompt bucket's columns (rollout.prompt_buckets), for the work accounting.
  metrics = {"rollout/decode_steps": jnp.max(rollout.lengths_B).astype(jnp.float32)}
  if rollout.prompt_len != statics.P:
    metrics["rollout/prompt_width"] = jnp.float32(rollout.prompt_len)
  return c.replace(state=c.state.replace(rng=rng), rollout=rollout,
                   metrics={**c.metrics, **metrics})


def _refill(statics, batch, c: StepCarry, ro: Rollout, refill) -> StepCarry:
  """The refilled rollout (``rollout.refill``): the first ``batch_size`` groups to complete,
  each row with its prompt's index in the step's queue (answers and host examples follow
  it), and the counts: prompts started, groups completed, groups dropped (started but not
  trained: unfinished, or finished past the quota; :func:`_refill_carry` counts them as
  carried instead), sampling steps, and the share of the decode passes' row-slots that fed a
  running response's token."""
  rows = statics.scfg.batch_size * statics.n
  st = {k: v.astype(jnp.float32) for k, v in refill.stats.items()}
  metrics = {"rollout/started": st["started"], "rollout/completed": st["completed"],
             "rollout/dropped": st["started"] - statics.scfg.batch_size,
             "rollout/queued": jnp.float32(batch["prompt"].shape[0]),
             "rollout/decode_steps": st["steps"],
             "rollout/busy_frac": st["busy"] / (rows * jnp.maximum(st["steps"] - 1, 1))}
  if "kv_peak" in st:  # a pool handed out by live tokens (rollout.kv_pages)
    metrics.update({"rollout/kv_peak_frac": st["kv_peak"] / st["kv_pages"],
                    "rollout/kv_waits": st["kv_waits"]})
    if "kv_preempted" in st:  # groups put back for pages (rollout.kv_admit=live)
      metrics["rollout/kv_preempted"] = st["kv_preempted"]
  index_B = ro.prompt_index_B
  rollout = ro.replace(sample_logp_BN=None, answer_BR=batch["answer"][index_B],
                       answer_mask_BR=batch["answer_mask"][index_B])
  return c.replace(rollout=rollout, metrics={**c.metrics, **metrics})


def initial_carry(batch_size: int, prompt_len: int, answer_len: int, *, rows: int = 0,
                  n_new: int = 0, pad_id: int = 0, kv=None) -> Carried:
  """The empty carry-over buffers kept in ``state.extras.carry`` (and so checkpointed);
  ``rows`` > 0: with the partial responses of that many rows of ``n_new`` slots
  (``rollout.refill_leftover=continue``); ``kv`` = ``(model_cfg, slots)``: and their keys
  and values (``rollout.continue_kv=keep``)."""
  b = batch_size
  return Carried(prompt=jnp.zeros((b, prompt_len), jnp.int32),
                 prompt_mask=jnp.zeros((b, prompt_len), bool),
                 answer=jnp.zeros((b, answer_len), jnp.int32),
                 answer_mask=jnp.zeros((b, answer_len), bool), count=jnp.zeros((), jnp.int32),
                 partial=empty_partial(rows, n_new, pad_id, kv) if rows else None)


def _refill_carry(statics, batch, c: StepCarry, policy, key, kw) -> StepCarry:
  """Refill with carry-over (``rollout.refill_leftover=carry`` or ``continue``): the queue is
  last step's carried prompts, then this batch's; the groups started but not trained go into
  ``state.extras.carry`` for the next step (with ``continue``, their rows' partial responses
  too, which this step's loop went on from).  :func:`_refill` takes each row's answer from
  the queue."""
  carried = c.state.extras.carry
  new = {"prompt": batch["prompt"].astype(jnp.int32),
         "prompt_mask": batch["prompt_mask"].astype(bool),
         "answer": batch["answer"].astype(jnp.int32),
         "answer_mask": batch["answer_mask"].astype(bool)}
  queue = carry_queue(carried.queue(), carried.count, new)
  ro, refill = sample_refill(policy, queue["prompt"], queue["prompt_mask"], key,
                             carried.count, carried.partial,
                             num_groups=statics.scfg.batch_size, **kw)
  left = carry_take(queue, refill.leftover_index_G, refill.stats["carried_out"])
  extras = c.state.extras.replace(carry=Carried(**left, count=refill.stats["carried_out"],
                                                partial=refill.partial))
  c = _refill(statics, queue, c.replace(state=c.state.replace(extras=extras)), ro, refill)
  st = {k: v.astype(jnp.float32) for k, v in refill.stats.items()}
  metrics = {"rollout/carried_in": st["carried_in"], "rollout/carried_out": st["carried_out"],
             "rollout/dropped": st["started"] - st["trained"] - st["carried_out"]}
  if "continued" in st:  # tokens carried in and gone on from, not decoded again
    metrics["rollout/continued_tokens"] = st["continued"]
  return c.replace(metrics={**c.metrics, **metrics})


def reference(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """Reference log-probs (the behaviour log-probs when no reference is needed) and the
  per-token KL of the rollout to them.

  The KL's policy side is the sampler's log-probs (one model definition samples and trains),
  except while the policy's weights are the reference's (the first step; :func:`same_weights`):
  then it is the reference's own, so the KL is exactly 0 where the sampler's log-probs differ
  from a forward pass by float rounding (0.03 per token in bf16) and that noise would be the
  KL.  One forward pass, the reference's."""
  del batch
  ro = c.rollout
  if "reference" not in frozen:
    ref = policy = ro.behaviour_logp_BN
  else:
    ref, _ = PK.token_logprobs(statics, frozen["reference"], ro.tokens_BT, ro.mask_BT,
                               packed_rows(c), role="reference", start=ro.prompt_len)
    same = same_weights(statics.view(c.state.params, frozen, "policy"), frozen["reference"])
    policy = jnp.where(same, ref, ro.behaviour_logp_BN)
  kl = jnp.where(ro.response_mask_BN, kl_of(statics.scfg.kl, policy, ref), 0.0)
  return c.replace(rollout=ro.replace(ref_logp_BN=ref, kl_BN=kl))


def reward(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """The raw sequence score (weighted sources, host scores included), missing-EOS handling,
  the guard, and which rows stay in the update."""
  ro = c.rollout
  parts = []
  response = ro.tokens_BT[:, ro.prompt_len:]
  for kind, name, w in statics.device_sources:
    if kind == "model":
      s = PK.sequence_scores(statics, frozen["reward"], ro.tokens_BT, ro.mask_BT,
                             packed_rows(c), role="reward", start=ro.prompt_len)
    else:
      if ro.answer_BR is not None:  # refill: the answers came with the rows
        answer, answer_mask = ro.answer_BR, ro.answer_mask_BR
      else:
        answer = jnp.repeat(batch["answer"], statics.n, 0)
        answer_mask = jnp.repeat(batch["answer_mask"], statics.n, 0)
      s = RW.RULES[name](response, ro.response_mask_BN, answer, answer_mask,
                         eos_id=statics.eos_id)
    parts.append((s.astype(jnp.float32), w))
  if c.host_score_B is not None:
    parts.append((c.host_score_B, 1.0))
  score = RW.combine_rewards([p for p, _ in parts], [w for _, w in parts])
  rcfg = statics.scfg.reward
  keep = jnp.ones(score.shape, bool)
  metrics = {}
  score, keep_eos = RW.apply_missing_eos(score, ro.finished_B, mode=rcfg.missing_eos,
                                         penalty=rcfg.missing_eos_penalty)
  keep &= keep_eos
  if rcfg.overlong_buffer:
    score = score + overlong_penalty(ro.lengths_B, max_len=statics.N, buffer=rcfg.overlong_buffer,
                                     penalty=rcfg.overlong_penalty)
  if rcfg.guard:
    g = PK.sequence_scores(statics, frozen["guard"], ro.tokens_BT, ro.mask_BT, packed_rows(c),
                           role="guard", start=ro.prompt_len)
    score, keep_guard, gm = RW.apply_guard(score, jax.nn.sigmoid(g),
                                           threshold=rcfg.guard_threshold,
                                           action=rcfg.guard_action, penalty=rcfg.guard_penalty)
    keep &= keep_guard
    metrics.update(gm)
  return c.replace(scored=Scored(score_B=score, keep_B=keep), metrics={**c.metrics, **metrics})


def values(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """The value of the state *before* each response token (algorithms with a value role)."""
  del batch
  ro = c.rollout
  v = PK.token_scores(statics, statics.value_params(statics.views(c.state.params, frozen)),
                      ro.tokens_BT, ro.mask_BT, packed_rows(c), role="value")
  n, p = ro.response_mask_BN.shape[1], ro.prompt_len  # each its bucket's width, if any
  return c.replace(scored=c.scored.replace(values_BN=v[:, p - 1:p - 1 + n]))


def shape(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """Reward normalisation (running statistics kept in the state) and the algorithm's
  advantages: everything the update trains on, before any gradient."""
  del frozen, batch
  scfg = statics.scfg
  ro, sc = c.rollout, c.scored
  resp_mask = ro.response_mask_BN
  raw = sc.score_B
  valid = sc.keep_B & jnp.isfinite(raw)
  score, stats, norm_metrics = RW.normalize_rewards(
      raw, valid, mode=scfg.reward.normalize, stats=c.state.extras.reward_stats,
      clip=scfg.reward.clip)
  kl_tok = ro.kl_BN
  update_mask = resp_mask & valid[:, None]
  adv, returns = statics.spec.advantages(statics, c, score, kl_tok, kl_coef_of(c), update_mask)
  finite = jnp.isfinite(raw)
  # The raw score's statistics win over the normaliser's (which describe the normalised one).
  metrics = {**norm_metrics,
             "reward/mean": jnp.mean(jnp.where(finite, raw, 0.0)),
             "reward/std": jnp.std(jnp.where(finite, raw, 0.0)),
             "reward/min": jnp.min(jnp.where(finite, raw, jnp.inf)),
             "reward/max": jnp.max(jnp.where(finite, raw, -jnp.inf))}
  state = c.state.replace(extras=c.state.extras.replace(reward_stats=stats))
  shaped = Shaped(adv_BN=adv, update_mask_BN=update_mask, returns_BN=returns)
  return c.replace(state=state, shaped=shaped, metrics={**c.metrics, **metrics})


def train(statics, frozen, batch, c: StepCarry, *, roles, terms) -> StepCarry:
  """The update of ``roles`` on the sum of the algorithm's loss ``terms`` (the colocated step
  trains every role on every term; each pool its own)."""
  del batch
  ro, sh = c.rollout, c.shaped
  policy = "policy" in terms
  old = sh.old_logp_BN if sh.old_logp_BN is not None else ro.behaviour_logp_BN
  # What the terms read, no more: each field is gathered per minibatch.
  ub = UpdateBatch(tokens_BT=ro.tokens_BT, mask_BT=ro.mask_BT, update_mask_BN=sh.update_mask_BN,
                   old_logp_BN=old if policy else None,
                   behaviour_logp_BN=ro.behaviour_logp_BN if policy else None,
                   ref_logp_BN=ro.ref_logp_BN if policy else None,
                   adv_BN=sh.adv_BN if policy else None,
                   values_BN=c.scored.values_BN if "value" in terms else None,
                   returns_BN=sh.returns_BN if "value" in terms else None)
  state, metrics = epochs(statics, frozen, c.state, ub, kl_coef_of(c), roles=roles, terms=terms,
                          packing=c.packing)
  return c.replace(state=state, metrics={**c.metrics, **metrics})


def finish(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """The KL controller, the step counter and the rollout's metrics."""
  del frozen, batch
  scfg = statics.scfg
  ro, state = c.rollout, c.state
  kl_coef = kl_coef_of(c)
  kl_tok = ro.kl_BN
  seq_kl = jnp.sum(kl_tok, axis=-1)
  new_kl = update_kl_controller(state.extras.kl, jnp.mean(seq_kl), kl_tok.shape[0],
                                target=scfg.kl.target, horizon=scfg.kl.horizon,
                                adaptive=scfg.kl.adaptive)
  state = state.replace(step=state.step + 1, extras=state.extras.replace(kl=new_kl))
  lengths = ro.lengths_B.astype(jnp.float32)
  # kl/mean per response token; kl/seq_sum per sequence (what the controller reads).
  metrics = {"kl/mean": masked_token_mean(kl_tok, ro.response_mask_BN),
             "kl/seq_sum": jnp.mean(seq_kl), "kl/coef": kl_coef,
             "response_length/mean": jnp.mean(lengths),
             "rollout/tokens": jnp.sum(lengths),
             "rollout/finished_frac": jnp.mean(ro.finished_B.astype(jnp.float32)),
             "skips/total": state.extras.skips.total}
  return c.replace(state=state, metrics={**c.metrics, **metrics})


def select(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """Dynamic sampling (``grpo.dynamic_sampling``): of the over-sampled groups, the first
  ``batch_size`` whose rewards differ, the rollout and the scores gathered down to them (the
  rest of the step runs at the trained batch's fixed shape); short of them, uninformative
  groups fill the batch, masked."""
  del frozen, batch
  sc = c.scored
  rows, valid, metrics = select_groups(
      sc.score_B, sc.keep_B & jnp.isfinite(sc.score_B), group_size=statics.n,
      num_groups=statics.scfg.batch_size)
  return c.replace(rollout=take_rows(c.rollout, rows, statics.n),
                   scored=jax.tree.map(lambda x: x[rows], sc).replace(keep_B=valid),
                   metrics={**c.metrics, **metrics})


def take_rows(ro: Rollout, rows, n: int) -> Rollout:
  """The rollout's ``rows`` (whole groups of ``n``, dynamic sampling's selection), each one's
  prompt (its index among the step's prompts) in ``prompt_index_B``: what the sample rows and
  the actor pool (:func:`selected_rows`) read."""
  out = jax.tree.map(lambda x: x[rows], ro.replace(prompt_index_B=None))
  return out.replace(prompt_index_B=rows // n)


def selected_rows(ro: Rollout, n: int):
  """The rows of the generated rollout that :func:`take_rows` took (from the groups' prompt
  indices: a group's ``n`` rows are consecutive)."""
  k = ro.prompt_index_B.shape[0]
  return (ro.prompt_index_B * n + jnp.arange(k) % n).astype(jnp.int32)


def off_policy(statics, frozen, batch, c: StepCarry) -> StepCarry:
  """The rollout/trainer mismatch (``{rl}.off_policy``): the trainer's own log-probs of the
  rollout become the ratio's denominator, and the advantages are weighted by the truncated
  (or masked) importance weight pi_trainer / pi_behaviour."""
  del batch
  ro, sh = c.rollout, c.shaped
  trainer, _ = PK.token_logprobs(statics, statics.view(c.state.params, frozen, "policy"),
                                 ro.tokens_BT, ro.mask_BT, packed_rows(c), role="policy",
                                 start=ro.prompt_len)
  trainer = jax.lax.stop_gradient(trainer)
  w, keep, m = off_policy_weights(trainer, ro.behaviour_logp_BN, sh.update_mask_BN,
                                  mode=statics.scfg.off_policy, cap=statics.scfg.off_policy_cap)
  shaped = sh.replace(adv_BN=jnp.where(keep, sh.adv_BN * w, 0.0), update_mask_BN=keep,
                      old_logp_BN=trainer)
  return c.replace(shaped=shaped,
                   metrics={**c.metrics, **{f"off_policy/{k}": v for k, v in m.items()}})


def rl_phases(roles, terms, scfg=None) -> tuple[Phase, ...]:
  """The RL step training ``roles`` on loss ``terms`` (the values phase only when a value term
  reads its estimates; dynamic sampling's selection and the off-policy correction only when
  ``scfg`` asks for them).  Timing groups: generation, reference, reward, selection, values,
  then the update (shaping, correction, training, bookkeeping)."""
  dynamic = getattr(scfg, "dynamic_sampling", False)
  correct = getattr(scfg, "off_policy", "none") != "none"
  return (
      Phase("generate", generate, pool="actor"),
      Phase(HOST, None, pool="critic"),
      Phase("reference", reference, pool="actor"),
      Phase("reward", reward, pool="critic"),
      *((Phase("select", select, pool="critic"),) if dynamic else ()),
      *((Phase("values", values, pool="critic"),) if "value" in terms else ()),
      Phase("shape", shape, pool="critic", group="update"),
      *((Phase("off_policy", off_policy, pool="actor", group="update"),) if correct else ()),
      Phase("train", functools.partial(train, roles=tuple(roles), terms=tuple(terms)),
            pool="both", group="update"),
      Phase("finish", finish, pool="actor", group="update"),
  )


# ----------------------------------------------------------------------------- updating


def epochs(statics, frozen, state, ub: UpdateBatch, kl_coef, *, roles, terms, packing=None):
  """``ppo_epochs`` passes over the batch in ``num_minibatches`` shuffled minibatches (one
  ``lax.scan`` over (epoch, minibatch)), training ``roles`` on the sum of the loss ``terms``.
  All roles skip a non-finite step together: a half-applied update would desynchronise them.
  With ``packing`` (``rollout.pack``) the shuffles are the ones the host drew with the same
  key and packed each minibatch for (:mod:`jaxrlhf.train.packed`)."""
  scfg = statics.scfg
  rows = ub.tokens_BT.shape[0]
  n_mb = scfg.num_minibatches
  rng, k = jax.random.split(state.rng)
  perms = (minibatch_perms(k, rows, n_mb, scfg.ppo_epochs) if packing is None
           else packing.perms)

  def minibatches(perm):
    return jax.tree.map(lambda x: x[perm].reshape((n_mb, rows // n_mb) + x.shape[1:]), ub)

  mbs = jax.vmap(minibatches)(perms)
  mbs = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), mbs)
  if packing is not None:
    mbs = mbs.replace(packed=packing.update)  # already one per (epoch, minibatch)
  first = jnp.arange(scfg.ppo_epochs * n_mb) == 0
  params0 = {r: state.params[r] for r in roles}
  opt0 = {r: state.opt_state[r] for r in roles}

  def body(carry, xs):
    params, opt_state, extras = carry
    mb, is_first, index = xs
    denom = jnp.maximum(jnp.sum(mb.update_mask_BN), 1).astype(jnp.float32)
    n_seq = jnp.maximum(jnp.sum(jnp.any(mb.update_mask_BN, axis=-1)), 1).astype(jnp.float32)

    def loss_fn(p, micro):
      total, metrics = 0.0, {}
      p = statics.views(p, frozen)  # LoRA roles: adapters over their frozen bases
      if "reference" in frozen:  # read, never trained: same_weights in the KL term
        p = {**p, "reference": frozen["reference"]}
      for term in terms:
        loss, m = statics.spec.terms[term](statics, p, micro, denom=denom, n_seq=n_seq,
                                         kl_coef=kl_coef)
        total = total + loss
        metrics.update(m)
      return total, metrics

    prec = statics.precision
    loss, grads, aux = accumulate_grads(
        loss_fn, {r: prec[r].differentiable(x) for r, x in params.items()}, mb,
        scfg.optim.grad_accum)
    new_params, new_opt, finites, norms = {}, {}, [], {}
    for i, role in enumerate(params):
      new_params[role], new_opt[role], fin, norms[role] = apply_update(
          params[role], opt_state[role], grads[role], loss, statics.opt[role], prec[role],
          rounding_key(state.rng, state.step, index * len(params) + i))
      finites.append(fin)
    finite = jnp.all(jnp.stack(finites))
    if len(params) > 1:
      # (One role: apply_update has already kept its old state on a non-finite step.)
      new_params = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_params, params)
      new_opt = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_opt, opt_state)
    extras = count_skip(extras, finite)
    aux = {**aux, "loss": loss, "grad_norm": norms[roles[0]],
           # Updates left out for an exactly zero gradient (apply_update), as a fraction.
           "skips/zero_grad": (norms[roles[0]] == 0).astype(jnp.float32)}
    if "_mismatch" in aux:
      aux["rollout/logprob_mismatch"] = jnp.where(is_first, aux["_mismatch"], 0.0)
    return (new_params, new_opt, extras), aux

  (params, opt_state, extras), aux = jax.lax.scan(body, (params0, opt0, state.extras),
                                                  (mbs, first, jnp.arange(first.shape[0])))
  metrics = {k: jnp.mean(v) for k, v in aux.items() if not k.startswith("_")}
  if "rollout/logprob_mismatch" in aux:
    metrics["rollout/logprob_mismatch"] = jnp.sum(aux["rollout/logprob_mismatch"])
  state = state.replace(rng=rng, params={**state.params, **params},
                        opt_state={**state.opt_state, **opt_state}, extras=extras)
  return state, metrics


def same_weights(a, b) -> jax.Array:
  """Whether two parameter trees hold the same values (a traced bool; False when their
  structure or shapes differ).  A float32 master ``a`` is compared rounded to ``b``'s 16-bit
  dtype (the reference's): with a 16-bit ``compute_dtype`` the model reads it so rounded,
  and the two compute alike.  A LoRA view (``a["layers"]["lora"]``, :func:`jaxrlhf.model.lora.view`)
  is the same as ``b`` while every adapter's ``b`` is zero (its function is its base's, as at
  initialisation) and its base is ``b``.  Reads both once (cheap beside a forward pass),
  except leaves that are one traced value in both (a LoRA view's base that is ``b`` itself)."""
  adapters = a.get("layers", {}).get("lora") if isinstance(a, dict) else None
  if adapters is not None:
    base = {**a, "layers": {k: v for k, v in a["layers"].items() if k != "lora"}}
    idle = jnp.all(jnp.stack([jnp.all(ab["b"] == 0) for ab in adapters.values()]))
    return idle & same_weights(base, b)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  if jax.tree.structure(a) != jax.tree.structure(b) or any(
      x.shape != y.shape or (x.dtype != y.dtype and not (
          jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(y.dtype, jnp.floating)))
      for x, y in zip(la, lb)):
    return jnp.asarray(False)
  return jnp.all(jnp.stack([jnp.asarray(True)] + [
      jnp.array_equal(x.astype(y.dtype), y) for x, y in zip(la, lb) if x is not y]))


def policy_term(statics, params, mb: UpdateBatch, *, denom, n_seq, kl_coef):
  """The policy's loss: the surrogate ``policy_loss`` names (PPO's clipped one, GSPO, CISPO),
  entropy bonus and (``kl.placement=loss``) the KL to the reference, each aggregated as
  ``loss_agg`` says; reads ``params["policy"]`` only."""
  scfg = statics.scfg
  logp, ent = PK.token_logprobs(statics, params["policy"], mb.tokens_BT, mb.mask_BT, mb.packed,
                                role="policy", start=mb.prompt_len)
  mask = mb.update_mask_BN
  agg = dict(agg=scfg.loss_agg, denom=denom if scfg.loss_agg == "token_mean" else n_seq,
             max_len=statics.N)
  pg, pm = POLICY_LOSSES[scfg.policy_loss](logp, mb.old_logp_BN, mb.adv_BN, mask,
                                           clip_low=scfg.clip_low, clip_high=scfg.clip_high,
                                           dual_clip=scfg.dual_clip, **agg)
  # The metric is the entropy as the loss aggregates it.
  entropy = aggregate(ent, mask, mode=scfg.loss_agg, denom=agg["denom"], max_len=statics.N)
  bonus, _ = entropy_bonus(ent, mask, coef=scfg.entropy_coef, **agg)
  mismatch = jnp.sum(jnp.where(mask, jnp.abs(jax.lax.stop_gradient(logp)
                                             - mb.behaviour_logp_BN), 0.0)) / denom
  metrics = {"policy/loss": pg, "policy/clip_frac": pm["clip_frac"],
             "policy/approx_kl": pm["approx_kl"], "entropy/mean": entropy,
             "_mismatch": mismatch}
  loss = pg + bonus
  if scfg.kl.placement == "loss" and (scfg.kl.coef > 0 or scfg.kl.adaptive):
    # The KL to the reference aggregated like the policy loss (docs/conventions.md).  While
    # the policy's weights are the reference's (the first minibatch of the first step) the
    # reference's log-probs are the policy's own: the reference phase's come from another
    # program at other shapes (and even the same forward, differentiated, compiles apart: on
    # SmolLM2-135M the two differ by ~1e-6 per token), and that rounding would be the KL and
    # its gradient, which Adam scales to a full step.
    ref = jnp.where(same_weights(params["policy"], params["reference"]), logp,
                    mb.ref_logp_BN)
    kl = kl_of(scfg.kl, logp, jax.lax.stop_gradient(ref))
    penalty, _ = kl_penalty_loss(kl, mask, coef=kl_coef, **agg)
    loss = loss + penalty
    metrics["kl/loss"] = aggregate(kl, mask, mode=scfg.loss_agg, denom=agg["denom"],
                                   max_len=statics.N)
  return loss, metrics
