"""Multi-turn episodes against an environment (``env.name``): the host loop around the jitted
decode segments of :mod:`jaxrlhf.turns`.

Each row of a step is one episode with its own environment instance.  Turn by turn: the policy
acts (one jitted decode segment for the whole batch), the actions are decoded and stepped
through the environments on the host, and the observations of the rows that go on are
tokenised (append-only: a template's suffix, never the conversation again) and prefilled into
the same cache (one jitted prefill).  An episode ends when its environment says done, when it
fails (an exception or a timeout: masked and counted), or at a limit (``env.max_turns``, or the
``rollout.max_new_tokens`` slots its actions and observations share), where ``env.on_limit``
decides its return.

The result is a :class:`~jaxrlhf.rollout.Rollout` in the usual ``prompt | response`` layout,
each row's actions and observations packed together from slot ``P``: ``response_mask_BN`` marks
the policy's tokens only, so observations are outside the loss and the KL, and the behaviour
log-probs are those the decoder recorded.  The per-turn rewards land on the last token of each
action (``turn_rewards_BN``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jaxrlhf import turns
from jaxrlhf.config import ConfigError
from jaxrlhf.data.examples import as_text
from jaxrlhf.envs import EnvRunner, resolve_env
from jaxrlhf.envs.render import ChatFormat, TextFormat
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.types import Rollout


def _bucket(n: int) -> int:
  """Observation blocks are compiled once per width: multiples of 8."""
  return max(8, -(-n // 8) * 8)


@dataclasses.dataclass
class Episodes:
  """What :meth:`EpisodeRunner.run` returns (numpy, rows prompt-major)."""

  tokens: np.ndarray  # [R, P+N] int32: prompt, then the conversation packed from slot P
  mask: np.ndarray  # [R, P+N] bool: real tokens
  policy: np.ndarray  # [R, N] bool: the policy's tokens (what trains)
  logp: np.ndarray  # [R, N] f32: their behaviour log-probs (0 elsewhere)
  turn_rewards: np.ndarray  # [R, N] f32: each turn's reward at its action's last token
  returns: np.ndarray  # [R] f32: the episode's return (after env.on_limit); NaN: failed
  ended: np.ndarray  # [R] bool: the environment ended the episode (not a limit, not a failure)
  truncated: np.ndarray  # [R] bool: cut at a limit
  failed: np.ndarray  # [R] bool: an exception or a timeout
  turns: np.ndarray  # [R] int32: actions taken
  metrics: dict


class EpisodeRunner:
  """Runs a batch of episodes for a stage's policy: one per row, ``n`` rows per example."""

  def __init__(self, stage, *, greedy: bool = False, role: str = "policy"):
    cfg = stage.cfg
    if jax.process_count() > 1:
      # The loop reads every row's tokens on the host and steps the environments there; on
      # several processes each would step every environment (side effects repeated, and
      # diverging answers would desynchronise the processes).
      raise ConfigError(f"env.name={cfg.env.name!r} with {jax.process_count()} processes: "
                        "multi-turn episodes run their environments on one host; run the "
                        "stage as one process (any number of local devices), or set "
                        "env.name=''")
    self.ecfg = ecfg = cfg.env
    self.stage = stage
    self.spec = resolve_env(ecfg.name, "env.name")
    self.runner = EnvRunner(self.spec, workers=ecfg.workers, timeout_s=ecfg.timeout_s,
                            errors=ecfg.errors)
    self.tok = tok = stage.tok
    if ecfg.format == "chat":
      self.fmt = ChatFormat(tok, ecfg.observation_role)
    else:
      self.fmt = TextFormat(tok)
    stops = tuple(dict.fromkeys(tuple(self.spec.stop_strings) + tuple(ecfg.stop_strings)))
    self.stop_seqs = tuple(tuple(tok.encode(s)) for s in stops) + tuple(
        (t,) for t in cfg.rollout.stop_token_ids)
    if any(not s for s in self.stop_seqs):
      raise ConfigError(f"env.stop_strings: a stop string of {self.spec.where} encodes to no "
                        f"tokens; remove it")
    self.P, self.N = stage.P, cfg.rollout.max_new_tokens
    self.S = self.P + self.N
    rollout = dataclasses.replace(cfg.rollout, temperature=0.0) if greedy else cfg.rollout
    model_cfg = stage.model_cfg(role)
    if self.S > model_cfg.max_seq_len:
      raise ConfigError(f"env: data.max_prompt_len={self.P} + rollout.max_new_tokens={self.N} "
                        f"= {self.S} exceeds model.max_seq_len={model_cfg.max_seq_len}; lower "
                        f"rollout.max_new_tokens (the slots a conversation's actions and "
                        f"observations share) or raise model.max_seq_len")
    kern = cfg.kernels
    decode = stage.decode_layout_shardings(role)
    self.role = role

    self._decode = None if decode is None else jax.jit(
        lambda p: jax.lax.with_sharding_constraint(p, decode))
    ro = cfg.rollout
    self.page_size = ro.kv_page_size
    self.kv_pages = ro.kv_pages
    self.shared = ro.prefix_sharing
    self._start = jax.jit(functools.partial(turns.start, cfg=model_cfg, total=self.S,
                                            kernels=kern, page_size=ro.kv_page_size,
                                            kv_pages=ro.kv_pages, shared=self.shared),
                          static_argnames="group")
    self._act = jax.jit(functools.partial(
        turns.act, cfg=model_cfg, rollout=rollout, eos_id=tok.eos_id, pad_id=tok.pad_id,
        kernels=kern, max_tokens=ecfg.max_turn_tokens, stop_seqs=self.stop_seqs))
    self._observe = jax.jit(functools.partial(turns.observe, cfg=model_cfg, kernels=kern))

  # ----------------------------------------------------------------------------- helpers
  def _left(self, ids_rows, width):
    out = np.full((len(ids_rows), width), self.tok.pad_id, np.int32)
    mask = np.zeros((len(ids_rows), width), bool)
    for r, ids in enumerate(ids_rows):
      if ids:
        out[r, width - len(ids):] = ids
        mask[r, width - len(ids):] = True
    return out, mask

  def decode_layout(self, policy):
    """The policy's parameters as the decoder reads them: in the decode layout
    (``rollout.decode_layout``; one reshard per step, not per turn), else as they are."""
    if self._decode is None:
      return policy
    with jax.set_mesh(self.stage.mesh):
      return self._decode(policy)

  # --------------------------------------------------------------------------------- run
  def close(self) -> None:
    """Closes any environment still open and stops the worker threads (a later :meth:`run`
    starts new ones): call it when the stage is done with the runner."""
    self.runner.close()

  def run(self, policy, examples, key, n: int = 1) -> Episodes:
    """``n`` episodes per example (rows prompt-major), sampled with ``key``."""
    records = [ex.record() for ex in examples for _ in range(n)]
    first = self.runner.reset(records)
    tally = _Tally.start(first, self.S, self.ecfg.observation_role)
    conv = self._begin(policy, first, n)
    self._check_pages(conv, "prompts")
    live = ~tally.failed
    for t in range(self.ecfg.max_turns):
      if not live.any():
        break
      conv, live = self._turn(policy, conv, jax.random.fold_in(key, t), t, live, tally)
    tally.truncated |= live  # still going after the last turn
    return self._episodes(conv, tally)

  def _check_pages(self, conv, what: str):
    """ConfigError if the paged pool ran out (nothing was overwritten: the rows it could not
    serve stopped)."""
    if not conv.paged or conv.cache.contiguous or not bool(jax.device_get(conv.starved)):
      return  # (a contiguous pool holds every row's whole buffer: it cannot run out)
    rows = conv.tokens_RS.shape[0]
    full = turns.pool_pages(rows, self.S, self.page_size)
    raise ConfigError(
        f"rollout.kv_pages={self.kv_pages}: the KV page pool ran out during the episodes' "
        f"{what} ({rows} rows, pages of rollout.kv_page_size={self.page_size} slots); raise "
        f"rollout.kv_pages ({full} pages never run out), or set rollout.kv_pages=0 for that")

  def _begin(self, policy, first, n: int = 1) -> turns.Conversation:
    """The conversation after prefilling each episode's first observation (a failed reset:
    a masked placeholder row); with ``rollout.prefix_sharing``, once per example's ``n``
    episodes."""
    prompts = []
    for obs in first:
      if obs is None:
        prompts.append([self.tok.pad_id])  # a placeholder: the row is masked out
        continue
      ids = self.fmt.prompt_ids(obs)
      if len(ids) > self.P:
        raise ConfigError(f"env {self.spec.where}: the first observation of an episode is "
                          f"{len(ids)} tokens, longer than data.max_prompt_len={self.P}; raise "
                          f"data.max_prompt_len (observation: {obs[:60]!r})")
      prompts.append(ids)
    # An example's episodes usually start from the same observation: prefilled once (copied
    # to its rows in lock step, written into each row's pages, or kept once with
    # rollout.prefix_sharing, which requires it).  A failed reset's row (never live) then
    # reads its group's prompt.
    group = 0
    if (self.shared or n > 1) and self._one_prompt_each(prompts, first, n):
      group = n
      for g0 in range(0, len(prompts), n):
        ok = [r for r in range(g0, g0 + n) if first[r] is not None]
        if ok:
          prompts[g0:g0 + n] = [prompts[ok[0]]] * n
    prompt, pmask = self._left(prompts, self.P)
    mesh = self.stage.mesh
    with jax.set_mesh(mesh):
      return self._start(policy, *put_batch(mesh, {"p": prompt, "m": pmask}).values(),
                         group=group)

  def _one_prompt_each(self, prompts, first, n: int) -> bool:
    """Whether each example's ``n`` episodes start from the same observation (a failed
    reset's row aside); with ``rollout.prefix_sharing`` a ConfigError naming the first
    example whose episodes do not."""
    for g0 in range(0, len(prompts), n):
      if len({tuple(prompts[r]) for r in range(g0, g0 + n) if first[r] is not None}) > 1:
        if self.shared:
          raise ConfigError(
              f"rollout.prefix_sharing=true: env {self.spec.where} gave the {n} episodes of "
              f"example {g0 // n} different first observations, so they share no prompt; "
              f"set rollout.prefix_sharing=false")
        return False
    return True

  def _turn(self, policy, conv, key, t: int, live, tally: "_Tally"):
    """One turn: the live rows act, the environments step, and the rows that go on get their
    observations; ``(conversation, rows still live)``."""
    mesh, tok = self.stage.mesh, self.tok
    with jax.set_mesh(mesh):
      conv, reason, start_slot = self._act(policy, conv, key, put_batch(mesh, {"l": live})["l"])
    # Whole buffers to the host and sliced there: a device slice at this turn's slots would
    # compile one program per distinct (start, end).
    self._check_pages(conv, f"turn {t + 1}")
    reason, i0, i1, toks, pol = jax.device_get(
        (reason, start_slot, conv.write_R, conv.tokens_RS, conv.policy_RS))
    # Each row's action: its columns [i0, i1) (the same for every row in lock step).
    col = np.arange(self.S)[None, :]
    pol = pol & (col >= i0[:, None]) & (col < i1[:, None])
    acting = np.nonzero(live)[0]
    actions = [tok.decode(toks[r][pol[r]]) for r in acting]
    results = self.runner.step([int(r) for r in acting], actions)
    last = t + 1 == self.ecfg.max_turns
    going = tally.record(acting, actions, results, pol, reason, last)
    live = np.zeros(len(live), bool)
    room = self.S - i1 - 1  # an observation must leave a slot for the next action
    ids = {}
    for r, obs in going.items():
      got = self.fmt.observation_ids(tally.history[r], obs, bool(reason[r] == turns.EOS))
      tally.history[r].append({"role": self.ecfg.observation_role, "content": obs})
      if len(got) > room[r]:
        tally.truncated[r] = True  # no room left for this observation and an answer
      else:
        ids[r] = got
    if not ids:
      return conv, live
    width = _bucket(max(len(v) for v in ids.values()))
    if not conv.paged:  # the block takes its width of every row's columns
      width = min(width, int(room.min()))
    obs, omask = self._left([ids.get(r, []) for r in range(len(live))], width)
    tally.obs_tokens += int(omask.sum())
    with jax.set_mesh(mesh):
      conv = self._observe(policy, conv, *put_batch(mesh, {"o": obs, "m": omask}).values())
    self._check_pages(conv, f"observations of turn {t + 1}")
    live[list(ids)] = True
    return conv, live

  def _episodes(self, conv, tally: "_Tally") -> Episodes:
    """The finished conversations, compacted into the ``prompt | response`` layout, with
    their returns and the episodes' metrics."""
    ecfg, rows = self.ecfg, len(tally.returns)
    returns = tally.returns
    if ecfg.on_limit == "penalize":
      returns[tally.truncated] = ecfg.limit_penalty
    returns[tally.failed] = np.nan
    (tokens, mask, policy_mask, logp, rew), _ = turns.compact(
        conv.tokens_RS, conv.mask_RS, conv.policy_RS, conv.logp_RS, tally.turn_rewards,
        start=self.P, pad_id=self.tok.pad_id)
    policy_mask = policy_mask[:, self.P:]
    kv_slots, kv_tokens = map(int, jax.device_get((conv.kv_slots(), conv.kv_tokens(self.P))))
    self.runner.end()  # every episode is over: its environment is closed now, not next batch
    ok = ~tally.failed
    solved = ok & (returns >= ecfg.success_reward)
    frac = lambda x: float(np.mean(x)) if rows else 0.0  # noqa: E731
    metrics = {"env/return_mean": float(np.mean(np.where(ok, returns, 0.0))),
               "env/solved": frac(solved), "env/turns_mean": float(np.mean(tally.n_turns)),
               "env/truncated_frac": frac(tally.truncated), "env/ended_frac": frac(tally.ended),
               "env/policy_tokens": float(policy_mask.sum()),
               "env/observation_tokens": float(tally.obs_tokens),
               # Real tokens (prompts, actions, observations) per KV slot held.
               "env/kv_fill": kv_tokens / max(kv_slots, 1),
               **self.runner.metrics()}
    return Episodes(tokens=tokens, mask=mask, policy=policy_mask, logp=logp[:, self.P:],
                    turn_rewards=rew[:, self.P:], returns=returns.astype(np.float32),
                    ended=tally.ended, truncated=tally.truncated, failed=tally.failed,
                    turns=tally.n_turns, metrics=metrics)


@dataclasses.dataclass
class _Tally:
  """The host's bookkeeping of a batch of episodes, row by row: how each ended, its turns,
  its return and each turn's reward at its action's last slot, and its chat history."""

  failed: np.ndarray
  ended: np.ndarray
  truncated: np.ndarray
  n_turns: np.ndarray
  returns: np.ndarray
  turn_rewards: np.ndarray  # [rows, S] f32
  history: list
  obs_tokens: int = 0

  @classmethod
  def start(cls, first: list, slots: int, observation_role: str) -> "_Tally":
    rows = len(first)
    return cls(failed=np.array([o is None for o in first], bool), ended=np.zeros(rows, bool),
               truncated=np.zeros(rows, bool), n_turns=np.zeros(rows, np.int32),
               returns=np.zeros(rows, np.float64),
               turn_rewards=np.zeros((rows, slots), np.float32),
               history=[[{"role": observation_role, "content": o or ""}] for o in first])

  def record(self, acting, actions, results, pol, reason, last: bool) -> dict:
    """The environments' answers to one turn's actions; returns row -> observation of the
    rows that go on (the others ended, failed, or ran out of buffer or turns)."""
    going = {}
    for r, action, (obs, reward, done, bad) in zip(acting, actions, results):
      self.n_turns[r] += 1
      took = np.nonzero(pol[r])[0]
      if took.size:
        self.turn_rewards[r, took[-1]] += reward
      self.returns[r] += reward
      self.history[r].append({"role": "assistant", "content": action})
      if bad:
        self.failed[r] = True
      elif done:
        self.ended[r] = True
      elif reason[r] == turns.BUFFER_FULL or last:
        self.truncated[r] = True
      else:
        going[r] = obs
    return going


class EnvEval:
  """Greedy episodes on the evaluation examples: ``eval/accuracy`` is the fraction solved
  (return >= ``env.success_reward``), so an SFT stage's ``stop_accuracy`` and the reports read
  it as they read exact match.  After each call :attr:`samples` holds the first
  ``logging.samples`` episodes as sample rows: the whole conversation after the prompt
  (actions and observations) as the response, the episode's return as the reward."""

  def __init__(self, stage, role: str = "policy"):
    self.stage = stage
    self.runner = EpisodeRunner(stage, greedy=True, role=role)
    self.examples = None
    self.samples: list[dict] = []

  def close(self) -> None:
    self.runner.close()

  def __call__(self, params) -> dict:
    if self.examples is None:
      self.examples = self.stage.data.eval_examples("prompts")
    ep = self.runner.run(self.runner.decode_layout(params), self.examples, jax.random.key(0))
    m = ep.metrics
    P, tok = self.runner.P, self.stage.tok
    self.samples = [
        {"kind": "eval", "prompt": as_text(ex.prompt),
         "response": tok.decode(ep.tokens[i, P:][ep.mask[i, P:]]), "reward": float(ep.returns[i]),
         **({"answer": ex.answer} if ex.answer else {})}
        for i, ex in enumerate(self.examples[:self.stage.cfg.logging.samples])]
    return {"eval/accuracy": m["env/solved"], "eval/return": m["env/return_mean"],
            "eval/turns": m["env/turns_mean"], "eval/truncated_frac": m["env/truncated_frac"],
            "eval/response_length": float(np.mean(ep.mask[:, self.runner.P:].sum(1)))}


def episode_rollout(stage, runner: EpisodeRunner, weight: float):
  """The host generate phase of an RL step with an environment
  (:class:`~jaxrlhf.train.program.PhasedProgram`'s ``rollout_fn``): the step's episodes as the
  carry's rollout, their returns x ``weight`` (the ``env`` reward source) as host scores."""
  def run(state, frozen, batch, carry, host):
    del batch
    rng, key = jax.random.split(state.rng)
    policy = runner.decode_layout(stage.view(state.params, frozen, "policy", decode=True))
    ep = runner.run(policy, host.examples, key, n=stage.n)
    placed = put_batch(stage.mesh, {
        "tokens": ep.tokens, "mask": ep.mask, "policy": ep.policy, "logp": ep.logp,
        "turn": ep.turn_rewards, "lengths": ep.mask[:, runner.P:].sum(1).astype(np.int32),
        "finished": ~ep.truncated, "score": np.float32(weight) * ep.returns})
    rollout = Rollout(tokens_BT=placed["tokens"], mask_BT=placed["mask"],
                      response_mask_BN=placed["policy"], behaviour_logp_BN=placed["logp"],
                      lengths_B=placed["lengths"], finished_B=placed["finished"],
                      turn_rewards_BN=placed["turn"])
    carry = carry.replace(state=state.replace(rng=rng), rollout=rollout,
                          host_score_B=placed["score"])
    return carry, ep.metrics

  return run
