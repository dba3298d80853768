"""Multi-turn episodes through the RL step (jaxrlhf/train/episodes.py): the token accounting
(observations in the context, never in the loss or the KL), failures counted and masked, the
``env`` reward source, and a GRPO step with an environment on a sharded mesh."""

import dataclasses
import textwrap

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import turns
from jaxrlhf.config import (ConfigError, DataConfig, EnvConfig, ExperimentConfig, GRPOConfig,
                            ModelConfig, OptimizerConfig, RewardConfig, RolloutConfig, SFTConfig,
                            validate)
from jaxrlhf.data import DataSource
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.episodes import EpisodeRunner
from jaxrlhf.train import spec
from jaxrlhf.train.spec import build_stage

MODEL = ModelConfig(vocab_size=51, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, max_seq_len=64)
OPT = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant")

# A user's environment, as docs/environments.md shows one: echo the digits of the prompt back, one
# turn per digit, "ok " or "no " after each.
ECHO = textwrap.dedent('''
    class Echo:
      stop_strings = (" ",)

      def reset(self, example):
        self.want = [c for c in example["prompt"] if c.isdigit()]
        self.turn = 0
        return example["prompt"]

      def step(self, action):
        good = action.strip() == self.want[self.turn]
        self.turn += 1
        done = self.turn == len(self.want)
        return ("ok " if good else "no "), float(good), done
    ''')

FLAKY = textwrap.dedent('''
    import time

    class Flaky:
      stop_strings = (" ",)

      def reset(self, example):
        self.row = int(example["prompt"][:1]) % 3
        self.turn = 0
        return example["prompt"]

      def step(self, action):
        self.turn += 1
        if self.row == 1 and self.turn == 2:
          raise ValueError("the tool crashed")
        if self.row == 2 and self.turn == 2:
          time.sleep(2.0)
        return "ok ", 1.0, self.turn == 3
    ''')


def _cfg(tmp_path, env_src, cls, **env):
  path = tmp_path / "user_env.py"
  path.write_text(env_src)
  return ExperimentConfig(
      model=MODEL,
      data=DataConfig(task="addition", digits=1, max_prompt_len=6, max_response_len=3,
                      eval_size=8, tokenizer="char_tools"),
      rollout=RolloutConfig(max_new_tokens=40),
      env=EnvConfig(name=f"{path}:{cls}", max_turns=3, max_turn_tokens=4, **env),
      sft=SFTConfig(steps=1, batch_size=4, optim=OPT, eval_every=0),
      grpo=GRPOConfig(steps=2, batch_size=4, num_samples=2, optim=OPT, eval_every=0,
                      reward=RewardConfig(sources=("env",))))


def _stage(cfg, m):
  stage = build_stage("grpo", cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  return stage, state, frozen


def test_observations_are_in_the_context_but_never_the_policy_s(tmp_path):
  cfg = _cfg(tmp_path, ECHO, "Echo")
  m = mesh()
  stage, state, frozen = _stage(cfg, m)
  runner = EpisodeRunner(stage)
  examples = stage.data.examples("prompts", 0, 4)
  ep = runner.run(stage.view(state.params, frozen, "policy"), examples, jax.random.key(3), n=2)
  tok = stage.tok
  P = stage.P
  for r in range(8):
    resp, pol = ep.tokens[r, P:], ep.policy[r]
    real = ep.mask[r, P:]
    assert not (pol & ~real).any()
    # The real response is the actions and the observations, in order, with no hole; every
    # stretch not sampled by the policy is exactly an observation the environment gave.
    n = int(real.sum())
    assert real[:n].all() and not real[n:].any()
    spans, cur = [], [bool(pol[0]), []]
    for i in range(n):
      if bool(pol[i]) != cur[0]:
        spans.append(cur)
        cur = [bool(pol[i]), []]
      cur[1].append(int(resp[i]))
    spans.append(cur)
    observed = [tok.decode(ids) for is_pol, ids in spans if not is_pol]
    assert all(o in ("ok ", "no ") for o in observed), observed
    assert spans[0][0]  # the policy speaks first
    # One observation between each two actions: none after the last (the episode ended, or
    # was cut at max_turns or at the slots before its observation went in).
    assert len(observed) == ep.turns[r] - 1, (r, observed, ep.turns[r])
  # Rewards land on each action's last token and sum to the return.
  np.testing.assert_allclose(ep.turn_rewards.sum(1), ep.returns, atol=1e-6)
  assert not (ep.turn_rewards[~ep.policy] != 0).any()
  assert ep.metrics["env/observation_tokens"] == float((ep.mask[:, P:] & ~ep.policy).sum())


def test_failures_are_counted_and_masked_never_a_crash(tmp_path):
  cfg = _cfg(tmp_path, FLAKY, "Flaky", workers=2, timeout_s=0.5)
  m = mesh()
  stage, state, frozen = _stage(cfg, m)
  batch = put_batch(m, stage.batch(0))
  examples = batch["host"].examples
  rows = np.repeat([int(ex.prompt[:1]) % 3 for ex in examples], 2)
  with jax.set_mesh(m):
    fn = stage.make_step_fn(state, frozen, batch)
    state, metrics = fn(state, frozen, batch)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  assert metrics["env/errors"] == float((rows == 1).sum())
  assert metrics["env/timeouts"] == float((rows == 2).sum())
  assert np.isfinite(metrics["policy/loss"])


def test_errors_raise_stops_with_the_environment_named(tmp_path):
  cfg = _cfg(tmp_path, FLAKY, "Flaky", errors="raise")
  m = mesh()
  stage, state, frozen = _stage(cfg, m)
  # A batch with a row that crashes (prompt digit 1, 4 or 7).
  step = next(s for s in range(50) if any(int(ex.prompt[:1]) % 3 == 1
                                         for ex in stage.data.examples("prompts", s, 4)))
  batch = put_batch(m, stage.batch(step))
  with jax.set_mesh(m), pytest.raises(Exception, match="Flaky"):
    stage.make_step_fn(state, frozen, batch)(state, frozen, batch)


def test_the_env_source_and_the_environment_go_together(tmp_path):
  cfg = _cfg(tmp_path, ECHO, "Echo")
  check = lambda c: spec.get("grpo").validate(c, DataSource(c.data, c.seed))
  check(cfg)
  no_source = dataclasses.replace(
      cfg, grpo=dataclasses.replace(cfg.grpo, reward=RewardConfig(sources=("rule:exact_match",))))
  with pytest.raises(ConfigError, match="add 'env'"):
    check(no_source)
  no_env = dataclasses.replace(cfg, env=EnvConfig())
  with pytest.raises(ConfigError, match="needs an environment"):
    check(no_env)
  missing = dataclasses.replace(cfg, env=EnvConfig(name=str(tmp_path / "nope.py:Echo")))
  with pytest.raises(ConfigError, match="file not found"):
    check(missing)
  bad = dataclasses.replace(cfg, stages=("grpo",), env=dataclasses.replace(
      cfg.env, max_turns=0, max_turn_tokens=99, timeout_s=0.0))
  with pytest.raises(ConfigError) as e:
    validate(bad)
  for field in ("env.max_turns=0", "env.max_turn_tokens=99", "env.timeout_s=0.0"):
    assert field in str(e.value)


def test_grpo_step_with_an_environment_on_dp2_tp2_equals_single_device(tmp_path):
  cfg = _cfg(tmp_path, ECHO, "Echo")
  out = []
  for m in (mesh(), mesh(dp=2, tp=2)):
    stage, state, frozen = _stage(cfg, m)
    fn, got = None, []
    for step in range(2):
      batch = put_batch(m, stage.batch(step))
      with jax.set_mesh(m):
        fn = fn or stage.make_step_fn(state, frozen, batch)
        state, metrics = fn(state, frozen, batch)
      got.append({k: float(v) for k, v in jax.device_get(metrics).items()
                  if not k.startswith(("time/", "memory/", "perf/", "throughput/"))})
    out.append(got)
  for a, b in zip(*out):
    assert a.keys() == b.keys()
    assert a["env/turns_mean"] > 1  # several turns really happened
    for k in a:
      np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=2e-5, err_msg=k)
  # The policy's log-probs in the update are those the decoder recorded.
  assert out[0][0]["rollout/logprob_mismatch"] < 1e-4


def test_ppo_puts_each_turn_s_reward_where_its_action_ends():
  """Per-token rewards with turn boundaries: with gamma = lam = 1 and zero values, the advantage
  of an action token is the sum of the rewards from its own turn on (GAE skips the observation
  tokens between actions); the other sources' score lands on the last token."""
  import types
  import jax.numpy as jnp
  from jaxrlhf.config import PPOConfig
  from jaxrlhf.train import ppo
  from jaxrlhf.train.types import Rollout, Scored
  # One row: action (slots 0-1), observation (2-3), action (4-5), observation (6), action (7).
  pol = jnp.array([[1, 1, 0, 0, 1, 1, 0, 1]], bool)
  turn = jnp.array([[0, 0.5, 0, 0, 0, 0.25, 0, 1.0]], jnp.float32)
  scfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False,
                   reward=RewardConfig(sources=("env", "rule:exact_match")))
  stage = types.SimpleNamespace(scfg=scfg, env_weight=2.0)
  other = 0.125  # the rule's part of the score
  score = jnp.array([other + 2.0 * (0.5 + 0.25 + 1.0)])
  carry = types.SimpleNamespace(
      rollout=Rollout(tokens_BT=None, mask_BT=None, response_mask_BN=pol, behaviour_logp_BN=None,
                      lengths_B=None, finished_B=None, turn_rewards_BN=turn),
      scored=Scored(score_B=score, keep_B=None, values_BN=jnp.zeros((1, 8))))
  adv, _ = ppo.advantages(stage, carry, score, jnp.zeros((1, 8)), 0.0, pol)
  want = [3.625, 3.625, 0, 0, 2.625, 2.625, 0, 2.125]  # 2 x (0.5+0.25+1) + 0.125, then on
  np.testing.assert_allclose(np.asarray(adv)[0], want, atol=1e-6)
  # Normalised scores are no sum over turns: the whole return stays at the last token.
  carry.rollout = carry.rollout.replace(turn_rewards_BN=turn)
  stage.scfg = dataclasses.replace(scfg, reward=dataclasses.replace(scfg.reward,
                                                                    normalize="batch"))
  adv, _ = ppo.advantages(stage, carry, score, jnp.zeros((1, 8)), 0.0, pol)
  np.testing.assert_allclose(np.asarray(adv)[0], np.where(np.asarray(pol[0]), 3.625, 0),
                             atol=1e-6)


def test_the_documented_user_environment_works_as_written(tmp_path):
  """The example in docs/environments.md, saved as the file it says, resolves and
  plays the calculator's demonstrations to a full reward."""
  import os
  import re
  from jaxrlhf.data.tasks import CalculatorTask
  from jaxrlhf.envs import resolve_env
  doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                          "environments.md")).read()
  code = re.search(r"```python\n(# calc_env.py.*?)```", doc, re.S).group(1)
  (tmp_path / "calc_env.py").write_text(code)
  spec = resolve_env(f"{tmp_path / 'calc_env.py'}:Calc")
  assert spec.stop_strings == ("</calc>",)
  for ex in CalculatorTask().sample(np.random.default_rng(0), 20, "train"):
    env = spec.cls()
    assert env.reset(ex.record()) == ex.prompt
    call = ex.response[:ex.response.index("</calc>") + len("</calc>")]
    obs, r, done = env.step(call)
    assert ex.response == call + obs + ex.answer and (r, done) == (0.0, False)
    assert env.step(ex.answer) == ("", 1.0, True)
  assert spec.cls().step("<calc>1+</calc>")[0] == "<result>error</result>"


def test_an_episode_cut_at_a_limit_earns_what_env_on_limit_says(tmp_path):
  base = _cfg(tmp_path, ECHO, "Echo")
  m = mesh()
  got = {}
  for mode in ("truncate", "penalize"):
    cfg = dataclasses.replace(base, env=dataclasses.replace(
        base.env, max_turns=1, on_limit=mode, limit_penalty=-0.5))
    stage, state, frozen = _stage(cfg, m)
    ep = EpisodeRunner(stage).run(stage.view(state.params, frozen, "policy"),
                                  stage.data.examples("prompts", 0, 4), jax.random.key(3), n=2)
    # "a+b=" has two digits to echo: one turn never ends the episode.
    assert ep.truncated.all() and not ep.ended.any() and (ep.turns == 1).all()
    got[mode] = ep.returns
  np.testing.assert_array_equal(got["penalize"], np.full(8, -0.5, np.float32))
  assert set(np.unique(got["truncate"])) <= {0.0, 1.0}  # what the one turn earned


SEVENS = textwrap.dedent('''
    class Sevens:
      """Two turns; each action earns the fraction of its characters that are "7"."""
      stop_strings = (" ",)

      def reset(self, example):
        self.turn = 0
        return example["prompt"]

      def step(self, action):
        self.turn += 1
        text = action.strip()
        return "ok ", (text.count("7") / len(text) if text else 0.0), self.turn == 2
    ''')


def test_the_environment_evaluation_records_its_episodes_as_samples(tmp_path):
  """With env.name the evaluation is greedy episodes; its sample rows are the first
  logging.samples episodes: the conversation after the prompt, the return as the reward."""
  cfg = _cfg(tmp_path, ECHO, "Echo")
  m = mesh()
  stage, state, frozen = _stage(cfg, m)
  ev = stage.evaluation(frozen)
  out = ev(state)
  rows = ev.take_samples()
  assert len(rows) == min(cfg.logging.samples, cfg.data.eval_size) and not ev.take_samples()
  examples = stage.data.eval_examples("prompts")
  ep = ev.generation.runner.run(ev.generation.runner.decode_layout(
      stage.view(state.params, frozen, "policy", decode=True)), examples, jax.random.key(0))
  for i, r in enumerate(rows):
    assert r["kind"] == "eval" and r["prompt"] == examples[i].prompt
    assert r["reward"] == float(ep.returns[i])
    # Each observation the environment gave ("ok " / "no ") is in the recorded conversation.
    assert r["response"].count("ok ") + r["response"].count("no ") >= ep.turns[i] - 1
  assert out["eval/return"] == pytest.approx(float(np.mean(ep.returns)))


def test_grpo_against_an_environment_raises_its_return(tmp_path):
  """A fast learning check (the built-in environments' runs are the README's claims, checked by
  tests/test_learning.py's slow test): from a
  random policy, 25 GRPO steps against a two-turn environment raise the mean return."""
  cfg = _cfg(tmp_path, SEVENS, "Sevens")
  cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_turns=2, max_turn_tokens=3),
                            rollout=RolloutConfig(max_new_tokens=16),
                            grpo=dataclasses.replace(
                                cfg.grpo, steps=25, batch_size=8, num_samples=8,
                                optim=OptimizerConfig(lr=3e-3, warmup_steps=0,
                                                      schedule="constant")))
  m = mesh()
  stage, state, frozen = _stage(cfg, m)
  fn, returns = None, []
  for step in range(25):
    batch = put_batch(m, stage.batch(step))
    with jax.set_mesh(m):
      fn = fn or stage.make_step_fn(state, frozen, batch)
      state, metrics = fn(state, frozen, batch)
    returns.append(float(jax.device_get(metrics["env/return_mean"])))
  first, last = np.mean(returns[:5]), np.mean(returns[-5:])
  assert last > first + 0.2, returns



def test_chat_episodes_are_what_the_template_renders_for_the_whole_conversation(tmp_path):
  """env.format=chat: each row's tokens (prompt, actions, observations) equal the tokenizer's
  chat template applied to the whole conversation, for every row whose actions re-tokenise
  to themselves (the policy's tokens are never re-tokenised; random ids may not round-trip)."""
  from byo_helpers import FAMILY_TEMPLATE, family_model
  folder = family_model(tmp_path / "tok", "qwen3", FAMILY_TEMPLATE)
  cfg = _cfg(tmp_path, ECHO, "Echo", format="chat")
  cfg = dataclasses.replace(
      cfg, model=dataclasses.replace(MODEL, vocab_size=100, max_seq_len=128),
      data=dataclasses.replace(cfg.data, tokenizer=folder, max_prompt_len=28),
      rollout=RolloutConfig(max_new_tokens=96))
  m = mesh()
  stage, state, frozen = _stage(cfg, m)
  runner = EpisodeRunner(stage)
  examples = stage.data.examples("prompts", 0, 8)
  ep = runner.run(stage.view(state.params, frozen, "policy"), examples, jax.random.key(5), n=2)
  tok, P = stage.tok, stage.P
  checked = 0
  for r in range(16):
    row = ep.tokens[r][ep.mask[r]].tolist()
    pol = np.concatenate([np.zeros(int(ep.mask[r, :P].sum()), bool),
                          ep.policy[r][ep.mask[r, P:]]])
    # The actions: runs of policy tokens.
    actions, cur = [], []
    for t, p in zip(row, pol):
      if p:
        cur.append(t)
      elif cur:
        actions.append(cur)
        cur = []
    if cur:
      actions.append(cur)
    texts = [tok.decode(a) for a in actions]
    strip = lambda a: a[:-1] if a and a[-1] == tok.eos_id else a
    if any(strip(a) != tok.encode(t) for a, t in zip(actions, texts)):
      continue  # a random id that does not round-trip (a special token in the middle)
    prompt = examples[r // 2].prompt
    msgs = [{"role": "user", "content": prompt}]
    for i, t in enumerate(texts):
      msgs.append({"role": "assistant", "content": t})
      if i < len(texts) - 1:
        want = [c for c in prompt if c.isdigit()]
        msgs.append({"role": "user", "content": "ok " if t.strip() == want[i] else "no "})
    whole = tok.chat(msgs, False)
    assert row == whole[:len(row)], (r, texts)
    checked += 1
  assert checked >= 4


def test_a_ppo_step_with_an_environment_trains_the_value_on_the_actions(tmp_path):
  """PPO (policy, value model, reference) against the environment: per-turn rewards, GAE
  over the actions, a finite update of both trained roles."""
  from jaxrlhf.config import PPOConfig
  cfg = _cfg(tmp_path, ECHO, "Echo")
  cfg = dataclasses.replace(cfg, ppo=PPOConfig(
      steps=2, batch_size=8, optim=OPT, value_optim=OPT, eval_every=0,
      reward=RewardConfig(sources=("env",))))
  m = mesh()
  stage = build_stage("ppo", cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  before = jax.device_get(state.params)
  batch = put_batch(m, stage.batch(0))
  with jax.set_mesh(m):
    state, metrics = stage.make_step_fn(state, frozen, batch)(state, frozen, batch)
  metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
  assert metrics["env/turns_mean"] > 1
  assert np.isfinite(metrics["value/loss"]) and np.isfinite(metrics["policy/loss"])
  after = jax.device_get(state.params)
  for role in ("policy", "value"):
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), before[role], after[role])
    assert any(jax.tree.leaves(moved)), role


def test_episodes_on_several_processes_are_refused_with_the_fix(tmp_path, monkeypatch):
  """Each process would step every environment (repeated side effects, diverging answers):
  refused by name instead of a crash reading the rows of another process."""
  cfg = _cfg(tmp_path, ECHO, "Echo")
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ConfigError, match=r"env.name=.* with 2 processes: .*run the stage as one "
                                        r"process"):
    _stage(cfg, mesh())


def test_each_batch_closes_its_environments_when_its_episodes_end(tmp_path):
  """An environment holding a resource (a process, a file) gets its close() when its
  episode batch ends, the last batch of a run included (it used to wait for the next
  reset, which the last batch never gets)."""
  src = ECHO.replace("class Echo:", "class Echo:\n  closed = []\n") + (
      "\n  def close(self):\n    type(self).closed.append(self.want)\n")
  stage, state, frozen = _stage(_cfg(tmp_path, src, "Echo"), mesh())
  runner = EpisodeRunner(stage)
  cls = runner.runner.spec.cls
  ep = runner.run(stage.view(state.params, frozen, "policy"),
                  stage.data.examples("prompts", 0, 4), jax.random.key(3), n=2)
  assert len(cls.closed) == 8  # 4 examples x 2 episodes, each closed once
  assert ep.metrics["env/errors"] == 0


def test_a_finished_stage_leaves_no_environment_threads_behind(tmp_path):
  """The worker threads of a stage's episodes and of its environment evaluation end with the
  stage (they used to idle until the process exited: a sweep in one process gathered them)."""
  import threading
  from jaxrlhf.train import pipeline
  cfg = _cfg(tmp_path, ECHO, "Echo", workers=2)
  cfg = dataclasses.replace(cfg, stages=("grpo",),
                            grpo=dataclasses.replace(cfg.grpo, steps=1, eval_every=1))
  before = set(threading.enumerate())
  assert pipeline.run(cfg, str(tmp_path / "run"), resume="none") == 0
  alive = lambda: [t.name for t in set(threading.enumerate()) - before  # noqa: E731
                   if t.name.startswith("jaxrlhf-env") and t.is_alive()]
  for _ in range(100):  # an idle thread exits when it takes the pool's stop from its queue
    if not alive():
      break
    threading.Event().wait(0.05)
  assert alive() == []


def test_paged_episodes_equal_lock_step_in_less_kv_and_running_out_is_an_error(tmp_path,
                                                                                monkeypatch):
  base = _cfg(tmp_path, ECHO, "Echo")
  paged = lambda **kw: dataclasses.replace(  # noqa: E731
      base, rollout=dataclasses.replace(base.rollout, kv_page_size=8, **kw))
  m = mesh()
  eps = []
  prefilled = []  # rows each episode batch's first prefill ran over (recorded when traced)
  real_prefill = turns._prefill

  def prefill(params, tokens, *a, **kw):
    prefilled.append(tokens.shape[0])
    return real_prefill(params, tokens, *a, **kw)

  monkeypatch.setattr(turns, "_prefill", prefill)
  for cfg in (base, paged(kv_pages=48), paged()):
    stage, state, frozen = _stage(cfg, m)
    del prefilled[:]
    ep = EpisodeRunner(stage).run(stage.view(state.params, frozen, "policy"),
                                  stage.data.examples("prompts", 0, 4), jax.random.key(3), n=2)
    # Each example's prompt prefilled once, then copied to (or written into the pages of)
    # its 2 episodes' rows.
    assert prefilled[0] == 4, (cfg.rollout.kv_page_size, prefilled)
    eps.append(ep)
  lock, pg, whole = eps  # lock step; pages as needed (48: never runs out); all up front
  assert lock.metrics["env/turns_mean"] > 1
  for ep in (pg, whole):
    for f in ("tokens", "mask", "policy", "turns", "returns", "truncated"):
      np.testing.assert_array_equal(getattr(ep, f), getattr(lock, f), err_msg=f)
    np.testing.assert_allclose(ep.logp, lock.logp, atol=2e-5)
  # Real tokens per KV slot held: the whole buffer in lock step, the filled pages when paged.
  real = lock.mask.sum()
  assert lock.metrics["env/kv_fill"] == pytest.approx(real / lock.mask.size)
  assert pg.metrics["env/kv_fill"] > 2 * lock.metrics["env/kv_fill"]
  assert pg.metrics["env/kv_fill"] > 0.7
  # A pool too small for the episodes stops them with the setting to raise.
  stage, state, frozen = _stage(paged(kv_pages=10), m)
  with pytest.raises(ConfigError, match=r"rollout.kv_pages=10: the KV page pool ran out .* "
                                        r"raise rollout.kv_pages \(48 pages never run out\)"):
    EpisodeRunner(stage).run(stage.view(state.params, frozen, "policy"),
                             stage.data.examples("prompts", 0, 4), jax.random.key(3), n=2)


def test_episodes_with_shared_prompts_equal_lock_step(tmp_path):
  """rollout.prefix_sharing: an example's episodes read its first observation from one copy
  (prefilled once), the rows' pages holding the rest: the same episodes as lock step, on one
  device and dp2 x tp2, with pages as needed or all up front; a row whose reset failed shares
  its group's prompt and never acts; different first observations in a group are refused."""
  base = _cfg(tmp_path, ECHO, "Echo")
  shared = lambda **kw: dataclasses.replace(  # noqa: E731
      base, rollout=dataclasses.replace(base.rollout, prefix_sharing=True, **kw))
  got = []
  for cfg, m in ((base, mesh()), (shared(), mesh()), (shared(kv_page_size=8, kv_pages=40),
                                                      mesh()), (shared(), mesh(dp=2, tp=2))):
    stage, state, frozen = _stage(cfg, m)
    got.append(EpisodeRunner(stage).run(stage.view(state.params, frozen, "policy"),
                                        stage.data.examples("prompts", 0, 4),
                                        jax.random.key(3), n=2))
  lock = got[0]
  assert lock.metrics["env/turns_mean"] > 1
  for ep in got[1:]:
    for f in ("tokens", "mask", "policy", "turns", "returns", "truncated"):
      np.testing.assert_array_equal(getattr(ep, f), getattr(lock, f), err_msg=f)
    np.testing.assert_allclose(ep.logp, lock.logp, atol=2e-5)
  # The prompt held once per group: more real tokens per slot than each row's own copy.
  assert got[2].metrics["env/kv_fill"] > 0.7

  stage, state, frozen = _stage(shared(), mesh())
  runner = EpisodeRunner(stage)
  with pytest.raises(ConfigError, match=r"rollout.prefix_sharing=true: env .* gave the 2 "
                                        r"episodes of example 0 different first observations"):
    runner._begin(stage.view(state.params, frozen, "policy"), ["12+3=", "45+6="], n=2)
  conv = runner._begin(stage.view(state.params, frozen, "policy"), [None, "12+3="], n=2)
  assert conv.prefix is not None


def test_the_paged_cache_is_refused_without_an_environment_or_refill():
  cfg = ExperimentConfig(stages=("grpo",), rollout=RolloutConfig(kv_page_size=16))
  with pytest.raises(ConfigError, match=r"rollout.kv_page_size=16: the paged KV cache runs "
                                        r"multi-turn episodes \(env.name\) and in-flight "
                                        r"refill \(rollout.refill\) only"):
    validate(cfg)
