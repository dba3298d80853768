"""In-flight refill (rollout.refill, issue 25): each refilled response equals the same prompt
decoded without refill under per-response keys; the quota stops the loop early; groups stay
together and their prompts' answers and host examples follow them; a GRPO step with refill on
a dp=2 x tp=2 mesh equals one device; the settings it cannot honour are refused.  Carry-over
(rollout.refill_leftover=carry): the groups left unfinished lead the next queue, are trained
there and equal a plain decode of it; the trainer's counts add up and answers follow."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, mesh, ragged_batch, set_lengths, with_length_model
from test_paged import _check_accounting
from benchmarks.lengths import length_params  # (helpers puts the repository root on the path)
from jaxrlhf import model as M
from jaxrlhf import results
from jaxrlhf import rewards as RW
from jaxrlhf import rollout as R
from jaxrlhf.config import (ConfigError, DataConfig, EnvConfig, ExperimentConfig, GRPOConfig,
                            KernelsConfig, ModelConfig, OptimizerConfig, PPOConfig,
                            RewardConfig, RolloutConfig, validate)
from jaxrlhf.data import DataSource
from jaxrlhf.train import phases
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.spec import build_stage
from jaxrlhf.train.types import StepCarry

CFG = dataclasses.replace(TINY, init_std=0.3)
P, N, n, G, Q = 8, 12, 2, 3, 8
EOS = 5
# A length per prompt (0: none, to the limit): short and long mixed, so groups finish at
# different loop steps and the queue's later prompts start in refilled slots.  The policy is
# benchmarks/lengths.py's decoder: a prompt's last token sets its responses' length.
STOP_AT = (3, 12, 1, 5, 0, 7, 2, 4)
PARAMS, LEVELS = length_params(CFG, jax.random.key(0), eos_id=EOS, max_len=N, reserved=(0, 7))


@pytest.fixture(scope="module")
def params():
  return PARAMS


def _prompts(key, lengths):
  """Ragged prompts whose responses are ``lengths`` long."""
  tokens, mask = ragged_batch(key, Q, P, CFG.vocab_size)
  return jnp.asarray(set_lengths({"prompt": tokens}, LEVELS, lengths)["prompt"]), mask


@pytest.fixture(scope="module")
def prompts():
  return _prompts(jax.random.key(1), STOP_AT)


def _ro(**kw):
  return RolloutConfig(max_new_tokens=N, row_keys=True, stop_token_ids=(7,), **kw)


def _plain(params, prompts, key=3, **kw):
  """No refill, per-response keys: (rollout, loop steps)."""
  fn = jax.jit(lambda p, t, m, k: R._generate(
      p, t, m, k, cfg=CFG, rollout=_ro(**kw), eos_id=EOS, pad_id=0, num_samples=n,
      kernels=KernelsConfig()))
  return fn(params, *prompts, jax.random.key(key))


def _refill(params, prompts, groups=G, **kw):
  return R.generate_refill(params, *prompts, jax.random.key(3), cfg=CFG,
                           rollout=_ro(**kw), eos_id=EOS, num_samples=n, num_groups=groups)


def _groups_match(got, index, ref):
  """Each group ``g`` of ``got`` (queue prompt ``index[g]``) is that prompt's responses in
  ``ref``: tokens, masks, ends, log-probs within 2e-5."""
  for g, q in enumerate(index):
    a, b = slice(g * n, (g + 1) * n), slice(q * n, (q + 1) * n)
    np.testing.assert_array_equal(got.tokens_BT[a], ref.tokens_BT[b])
    np.testing.assert_array_equal(got.mask_BT[a], ref.mask_BT[b])
    np.testing.assert_array_equal(got.finished_B[a], ref.finished_B[b])
    np.testing.assert_allclose(got.behaviour_logp_BN[a], ref.behaviour_logp_BN[b], atol=2e-5)


def test_the_policy_s_lengths_are_the_prompts(params, prompts):
  """The length model answers each prompt with exactly its length (0: to the limit)."""
  ro, _ = _plain(params, prompts, top_k=8, top_p=0.9)
  want = np.repeat([x or N for x in STOP_AT], n)
  np.testing.assert_array_equal(ro.lengths_B, want)
  np.testing.assert_array_equal(ro.finished_B, np.repeat([x > 0 for x in STOP_AT], n))


@pytest.mark.parametrize("sampling", [{}, {"top_k": 8, "top_p": 0.9}])
def test_each_refilled_response_equals_its_prompt_decoded_without_refill(params, prompts,
                                                                         sampling):
  ref, _ = _plain(params, prompts, **sampling)
  got, info = _refill(params, prompts, **sampling)
  index = np.asarray(info.prompt_index_G)
  assert len(set(index)) == G and index.max() >= G, index  # at least one refilled group
  _groups_match(got, index, ref)
  for g, q in enumerate(index):
    a, b = slice(g * n, (g + 1) * n), slice(q * n, (q + 1) * n)
    np.testing.assert_array_equal(got.lengths_B[a], ref.lengths_B[b])
    np.testing.assert_allclose(got.sample_logp_BN[a], ref.sample_logp_BN[b], atol=2e-5)
  # And the log-probs are the policy's own, teacher-forced.
  h, _ = M.forward(params, got.tokens_BT, M.positions_from_mask(got.mask_BT), got.mask_BT, cfg=CFG)
  logp = jax.nn.log_softmax(M.lm_logits(params, h, CFG)[:, P - 1:-1].astype(jnp.float32))
  want = jnp.take_along_axis(logp, got.tokens_BT[:, P:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(got.behaviour_logp_BN, jnp.where(got.response_mask_BN, want, 0.0), atol=5e-5)


def test_row_keys_make_a_response_independent_of_its_batch(params, prompts):
  """Per-response keys: prompt q's responses are the same decoded alone or in the batch."""
  ref, _ = _plain(params, prompts)
  q = 5
  one, _ = jax.jit(lambda p, t, m, k: R._generate(
      p, t, m, k, cfg=CFG, rollout=_ro(), eos_id=EOS, pad_id=0, num_samples=n,
      kernels=KernelsConfig()))(params, prompts[0][q:q + 1], prompts[1][q:q + 1],
                                jax.random.key(3))
  # Response ids count from the batch's first prompt: alone, prompt q is response 0..n-1, so
  # compare against a batch whose prompt 0 is q.
  perm = jnp.asarray([q] + [i for i in range(Q) if i != q])
  moved, _ = _plain(params, (prompts[0][perm], prompts[1][perm]))
  np.testing.assert_array_equal(one.tokens_BT, moved.tokens_BT[:n])
  assert not np.array_equal(np.asarray(ref.tokens_BT[:n]), np.asarray(moved.tokens_BT[:n]))


def test_the_quota_stops_the_loop_before_the_slowest_row(params, prompts):
  """One prompt runs to the limit, the rest stop early: without refill the loop runs N steps;
  with refill it stops once G groups are complete."""
  prompts = _prompts(jax.random.key(1), (N, 2, 3, 2, 1, 3, 2, 2))
  _, plain_steps = _plain(params, prompts)
  got, info = _refill(params, prompts)
  st = {k: int(v) for k, v in info.stats.items()}
  assert int(plain_steps) == N
  assert st["steps"] < N // 2, st
  assert 0 not in np.asarray(info.prompt_index_G)  # the long group did not finish in time
  assert st["completed"] >= G and G < st["started"] <= Q
  assert 0 < st["busy"] <= (st["steps"] - 1) * G * n


def test_groups_stay_together_in_completion_order(params, prompts):
  got, info = _refill(params, prompts)
  tokens, mask = np.asarray(got.tokens_BT), np.asarray(got.mask_BT)
  ptok, pmask = np.asarray(prompts[0]), np.asarray(prompts[1])
  for g, q in enumerate(np.asarray(info.prompt_index_G)):
    for s in range(n):
      row = g * n + s
      np.testing.assert_array_equal(mask[row, :P], pmask[q])
      np.testing.assert_array_equal(tokens[row, :P], np.where(pmask[q], ptok[q], 0))
  # The first groups to complete, in order: prompt 2 (1 token) ends at the first step,
  # prompt 0 (3 tokens) at the third, before the refilled prompts and the long prompt 1.
  assert list(np.asarray(info.prompt_index_G)[:2]) == [2, 0]


# ------------------------------------------------------------------------- carry-over

LONG_TAIL = (N, 2, 3, 2, 1, 3, 2, 2)  # prompt 0 runs to the limit: unfinished at the quota


def _refill_carry(params, queue, count, key):
  return R.generate_refill(params, queue["prompt"], queue["prompt_mask"], key, count, cfg=CFG,
                           rollout=_ro(), eos_id=EOS, num_samples=n, num_groups=G)


def _queue(key, lengths):
  tokens, mask = _prompts(key, lengths)
  return {"prompt": tokens, "prompt_mask": mask}


def test_carry_over_restarts_unfinished_groups_first_in_the_next_queue(params, prompts):
  """Step 1 stops at the quota with prompt 0 unfinished; its prompt (and every other started,
  untrained one) leads step 2's queue, is trained in step 2, and each of its responses equals
  a plain decode of step 2's queue under step 2's key: restarted, on-policy."""
  q1 = _queue(jax.random.key(1), LONG_TAIL)
  prompts = (q1["prompt"], q1["prompt_mask"])
  ro1, info1 = _refill_carry(params, q1, jnp.int32(0), jax.random.key(3))
  st1 = {k: int(v) for k, v in info1.stats.items()}
  assert st1["carried_in"] == 0 and st1["trained"] == G
  assert st1["steps"] < N // 2, st1  # the quota stopped the loop before prompt 0 ended
  index1 = set(np.asarray(info1.prompt_index_G).tolist())
  left = [q for q in range(st1["started"]) if q not in index1]
  assert 0 in left and st1["carried_out"] == len(left) <= G
  assert st1["started"] == st1["trained"] + st1["carried_out"]  # nothing dropped
  np.testing.assert_array_equal(np.asarray(info1.leftover_index_G)[:len(left)], left)

  # Step 2: the carried prompts first, then a new batch with short responses.
  count = info1.stats["carried_out"]
  carried = R.carry_take(q1, info1.leftover_index_G, count)
  new = _queue(jax.random.key(7), (2, 1, 3, 2, 1, 2, 1, 3))
  q2 = R.carry_queue(carried, count, new)
  c = len(left)
  for k in q2:
    np.testing.assert_array_equal(q2[k][:c], np.asarray(q1[k])[left], err_msg=k)
    np.testing.assert_array_equal(q2[k][c:], np.asarray(new[k])[:Q - c], err_msg=k)
  ro2, info2 = _refill_carry(params, q2, count, jax.random.key(4))
  st2 = {k: int(v) for k, v in info2.stats.items()}
  index2 = np.asarray(info2.prompt_index_G)
  assert st2["carried_in"] == c and set(range(c)) <= set(index2.tolist())
  assert st2["steps"] == N  # the loop waits for the carried long group
  assert st2["started"] == st2["trained"] + st2["carried_out"]
  ref, _ = _plain(params, (q2["prompt"], q2["prompt_mask"]), key=4)
  ptok = np.asarray(prompts[0])
  _groups_match(ro2, index2, ref)
  for g, q in enumerate(index2):
    a = slice(g * n, (g + 1) * n)
    if q < c:  # a carried group: step 1's prompt, its response run to the end this time
      pm = np.asarray(prompts[1])[left[q]]
      np.testing.assert_array_equal(np.asarray(ro2.tokens_BT)[a, :P],
                                    np.broadcast_to(np.where(pm, ptok[left[q]], 0), (n, P)))
  g0 = list(index2).index(left.index(0))
  assert int(ro2.lengths_B[g0 * n]) == N  # prompt 0's response, whole


def test_carry_over_with_nothing_carried_trains_what_drop_trains(params, prompts):
  """Carry mode with an empty carry trains the same groups as drop mode (only the leftovers
  are kept instead of thrown away)."""
  drop, drop_info = _refill(params, prompts)
  carry, carry_info = _refill_carry(params, {"prompt": prompts[0], "prompt_mask": prompts[1]},
                                    jnp.int32(0), jax.random.key(3))
  np.testing.assert_array_equal(carry_info.prompt_index_G, drop_info.prompt_index_G)
  np.testing.assert_array_equal(carry.tokens_BT, drop.tokens_BT)
  assert int(carry_info.stats["steps"]) == int(drop_info.stats["steps"])
  assert int(carry_info.stats["carried_out"]) == int(drop_info.stats["started"]) - G


def test_refill_queue_shorter_than_the_groups_is_refused(params, prompts):
  with pytest.raises(ConfigError, match="num_groups"):
    _refill(params, (prompts[0][:2], prompts[1][:2]), groups=3)


# ------------------------------------------------------------------------- the trainer

MODEL = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    mlp_dim=64, max_seq_len=16)
DATA = DataConfig(task="addition", digits=1, max_prompt_len=5, max_response_len=3, eval_size=8)
OPT = OptimizerConfig(lr=1e-3, warmup_steps=0, schedule="constant", eps=1e-3)
TRAIN_STOP_AT = np.asarray([1, 4, 2, 1, 3, 1, 2, 1], np.int32)  # one per queued prompt


def config(sources=("rule:exact_match",), leftover="drop", **grpo):
  return ExperimentConfig(
      model=MODEL, data=DATA,
      rollout=RolloutConfig(max_new_tokens=4, refill=True, refill_leftover=leftover),
      grpo=GRPOConfig(steps=2, batch_size=4, num_samples=4, optim=OPT, eval_every=0,
                      reward=RewardConfig(sources=sources), **grpo))


def _setup(cfg, m):
  """The stage, its state and frozen roles, the policy (and reference) the length model."""
  stage = build_stage("grpo", cfg, m, DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  state, frozen, levels = with_length_model(stage, state, frozen, cfg.rollout.max_new_tokens)
  return stage, state, frozen, levels


def _host_batch(stage, levels, step):
  """Step ``step``'s batch, its prompts ending so that groups end at different steps."""
  return set_lengths(stage.batch(step), levels, TRAIN_STOP_AT)


def _batch(stage, levels, m, step):
  return put_batch(m, _host_batch(stage, levels, step))


def run_steps(cfg, m, steps=1):
  stage, state, frozen, levels = _setup(cfg, m)
  out, fn = [], None
  for step in range(steps):
    batch = _batch(stage, levels, m, step)
    with jax.set_mesh(m):
      fn = fn or stage.make_step_fn(state, frozen, batch)
      state, metrics = fn(state, frozen, batch)
    out.append({k: float(v) for k, v in jax.device_get(metrics).items()})
  return stage, state, frozen, out


def test_grpo_step_with_refill_on_dp2_tp2_equals_single_device_and_counts():
  cfg = config()
  _, s1, _, m1 = run_steps(cfg, mesh())
  _, s2, _, m2 = run_steps(cfg, mesh(dp=2, tp=2))
  keys = [k for k in m1[0] if not k.startswith(("time/", "memory/"))]
  for k in keys:
    np.testing.assert_allclose(m2[0][k], m1[0][k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))
  m = m1[0]
  assert m["rollout/queued"] == 8
  assert 4 < m["rollout/started"] <= 8
  assert m["rollout/completed"] >= 4
  assert m["rollout/dropped"] == m["rollout/started"] - 4
  assert m["rollout/decode_steps"] < 4  # the slowest prompt (4 tokens) is not waited for
  assert 0 < m["rollout/busy_frac"] <= 1


def test_answers_and_host_examples_follow_their_groups(tmp_path, monkeypatch):
  """A rule that scores each row with its answer's first token, and a host reward that
  returns the example's answer: both see the answer of the row's own prompt."""
  monkeypatch.setitem(RW.RULES, "answer_token",
                      lambda r, rm, a, am, *, eos_id: a[:, 0].astype(jnp.float32))
  cfg = config(sources=("rule:answer_token",))
  m = mesh()
  stage, state, frozen, levels = _setup(cfg, m)
  host_batch = _host_batch(stage, levels, 0)
  batch = _batch(stage, levels, m, 0)
  c = jax.jit(lambda st, fr, b: phases.reward(stage.statics, fr, b, phases.generate(
      stage.statics, fr, b, StepCarry(state=st))))(state, frozen, batch)
  index = np.asarray(c.rollout.prompt_index_B)
  assert index.max() >= 4 and len(set(index)) == 4  # refilled groups, each of n rows
  assert (index.reshape(4, 4) == index[::4, None]).all()
  np.testing.assert_array_equal(c.scored.score_B, np.asarray(host_batch["answer"])[index, 0])
  np.testing.assert_array_equal(np.asarray(c.rollout.tokens_BT)[:, :stage.P],
                                np.where(host_batch["prompt_mask"], host_batch["prompt"],
                                         stage.tok.pad_id)[index])

  reward_file = tmp_path / "answer_reward.py"
  reward_file.write_text("def score(responses, examples):\n"
                         "  return [float(ex['answer']) for ex in examples]\n")
  hcfg = config(sources=(f"host:{reward_file}:score",))
  _, _, _, metrics = run_steps(hcfg, m)
  examples = host_batch["host"].examples if "host" in host_batch else None
  answers = [float(ex.answer) for ex in stage.data.examples("prompts", 0, 8)]
  assert examples is None  # the rule stage carries no host inputs
  np.testing.assert_allclose(metrics[0]["reward/mean"], np.mean([answers[i] for i in index]),
                             rtol=1e-6)


@pytest.mark.parametrize("leftover", ["carry", "continue",
                                      pytest.param("continue_keep", marks=pytest.mark.slow)])
def test_grpo_steps_with_carry_over_count_every_started_group(leftover):
  """Every prompt started is trained this step or carried to the next: started = trained +
  carried_out (+ dropped, 0), and what one step carries out the next carries in; with
  ``continue`` the next step goes on from the carried responses' tokens (with
  ``continue_kv=keep``, from their keys and values, kept in the state)."""
  cfg = config(leftover=leftover.split("_")[0])
  if leftover == "continue_keep":
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                               continue_kv="keep"))
  _, state, _, ms = run_steps(cfg, mesh(), steps=3)
  if leftover == "continue_keep":
    assert state.extras.carry.partial["k"].shape[2] == 4 * 4  # batch x samples rows
    assert int(state.extras.carry.partial["kv_len"].max()) > 0
  if leftover.startswith("continue"):
    assert ms[0]["rollout/continued_tokens"] == 0
    assert any(m["rollout/continued_tokens"] > 0 for m in ms[1:])
  assert ms[0]["rollout/carried_in"] == 0 and ms[0]["rollout/carried_out"] > 0
  for k, m in enumerate(ms):
    assert m["rollout/dropped"] == 0, (k, m)
    assert m["rollout/started"] == 4 + m["rollout/carried_out"] + m["rollout/dropped"], (k, m)
    assert m["rollout/carried_out"] <= 4 and m["rollout/completed"] >= 4
    if k:
      assert m["rollout/carried_in"] == ms[k - 1]["rollout/carried_out"], k
  assert int(state.extras.carry.count) == ms[-1]["rollout/carried_out"]


def test_carried_prompts_bring_their_answers(monkeypatch):
  """Step 2's queue starts with step 1's leftovers: each row's answer (the rule reads it) and
  prompt are those of the prompt the row answers, carried or new."""
  monkeypatch.setitem(RW.RULES, "answer_token",
                      lambda r, rm, a, am, *, eos_id: a[:, 0].astype(jnp.float32))
  cfg = config(sources=("rule:answer_token",), leftover="carry")
  m = mesh()
  stage, state, frozen, levels = _setup(cfg, m)
  gen = jax.jit(lambda st, fr, b: phases.reward(stage.statics, fr, b, phases.generate(
      stage.statics, fr, b, StepCarry(state=st))))
  c1 = gen(state, frozen, _batch(stage, levels, m, 0))
  carry = jax.device_get(c1.state.extras.carry)
  count = int(carry.count)
  assert count == c1.metrics["rollout/carried_out"] > 0
  host0, host1 = _host_batch(stage, levels, 0), _host_batch(stage, levels, 1)
  index1 = set(np.asarray(c1.rollout.prompt_index_B).tolist())
  left = [q for q in range(int(c1.metrics["rollout/started"])) if q not in index1]
  np.testing.assert_array_equal(carry.answer[:count], host0["answer"][left])
  np.testing.assert_array_equal(carry.prompt[:count], host0["prompt"][left])

  c2 = gen(c1.state, frozen, _batch(stage, levels, m, 1))
  queue = {k: np.concatenate([getattr(carry, k)[:count], host1[k][:8 - count]])
           for k in ("prompt", "prompt_mask", "answer")}
  index2 = np.asarray(c2.rollout.prompt_index_B)
  assert set(range(count)) <= set(index2.tolist())  # every carried group trained
  np.testing.assert_array_equal(c2.scored.score_B, queue["answer"][index2, 0])
  np.testing.assert_array_equal(np.asarray(c2.rollout.answer_BR), queue["answer"][index2])
  np.testing.assert_array_equal(np.asarray(c2.rollout.tokens_BT)[:, :stage.P],
                                np.where(queue["prompt_mask"], queue["prompt"],
                                         stage.tok.pad_id)[index2])


@pytest.mark.parametrize("change, match", [
    (dict(ppo=PPOConfig(steps=1, batch_size=4), stages=("ppo",)), "grpo only"),
    (dict(env=EnvConfig(name="calculator")), "env.name"),
    (dict(grpo=GRPOConfig(steps=1, batch_size=4, dynamic_sampling=True)), "dynamic_sampling"),
    (dict(rollout=RolloutConfig(max_new_tokens=4, refill=True, refill_queue=0.5)),
     "refill_queue"),
    (dict(rollout=RolloutConfig(max_new_tokens=4, refill=True, refill_leftover="carry"),
          grpo=GRPOConfig(steps=1, batch_size=4,
                          reward=RewardConfig(sources=("rule:exact_match", "host:math_verify"),
                                              weights=(1.0, 1.0)))),
     r"refill_leftover=carry with host reward sources \['host:math_verify'\].*"
     r"refill_leftover=drop"),
    (dict(rollout=RolloutConfig(max_new_tokens=4, refill_leftover="carry")),
     "refill_leftover='carry' applies to in-flight refill only"),
    (dict(rollout=RolloutConfig(max_new_tokens=4, refill=True, refill_leftover="carry",
                                continue_kv="keep")),
     r"rollout.continue_kv='keep' applies to partial rollouts only; set .*"
     r"rollout.refill_leftover=continue"),
])
def test_settings_refill_cannot_honour_are_refused_with_the_fix(change, match):
  cfg = dataclasses.replace(config(), stages=("grpo",))
  cfg = dataclasses.replace(cfg, **change)
  with pytest.raises(ConfigError, match=match):
    validate(cfg, required=False)


# tiny_grpo with refill on, as a newcomer runs it (its own process, seed 0): 3.5 minutes on
# the shared 2-core CPU (load about 4).  Measured: SFT 51.7% (step 210), GRPO 72.8% (+21.1;
# the default's seed 0 AVX-512 run: 75.2%, +23.5), 0.14 groups dropped per step.
@pytest.mark.slow
def test_tiny_grpo_with_refill_still_learns(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  wd = str(tmp_path / "tiny_grpo_refill")
  proc = subprocess.run([sys.executable, "-m", "jaxrlhf.main", "--experiment=tiny_grpo",
                         "--set=rollout.refill=true", f"--workdir={wd}"], cwd=root,
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  with open(os.path.join(wd, "summary.json")) as f:
    m = results.measure(json.load(f))
  failed = [f"{metric} {value:.3f} < {needed:.3f} ({rule})"
            for metric, value, needed, rule, ok in results.check_claims("tiny_grpo", m)
            if not ok]
  assert not failed, failed


# ------------------------------------------------------------------ partial rollouts


def _refill_continue(params, queue, count, partial, key):
  return R.generate_refill(params, queue["prompt"], queue["prompt_mask"], key, count, partial,
                           cfg=CFG, rollout=_ro(), eos_id=EOS, num_samples=n, num_groups=G)


def test_with_nothing_carried_continue_decodes_what_carry_decodes(params, prompts):
  """The paged, per-row cache of partial rollouts decodes the same tokens as the shared-index
  cache of carry-over, log-probs within 2e-5, and reports the leftovers' rows."""
  queue = {"prompt": prompts[0], "prompt_mask": prompts[1]}
  want, want_info = _refill_carry(params, queue, jnp.int32(0), jax.random.key(3))
  got, info = _refill_continue(params, queue, jnp.int32(0), R.empty_partial(G * n, N),
                               jax.random.key(3))
  np.testing.assert_array_equal(info.prompt_index_G, want_info.prompt_index_G)
  np.testing.assert_array_equal(got.tokens_BT, want.tokens_BT)
  np.testing.assert_array_equal(got.response_mask_BN, want.response_mask_BN)
  np.testing.assert_allclose(got.behaviour_logp_BN, want.behaviour_logp_BN, atol=2e-5)
  assert int(info.stats["carried_out"]) == int(want_info.stats["carried_out"])
  assert int(info.stats["continued"]) == 0


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_continued_response_equals_one_decoded_in_one_go(params, kv):
  """Step 1 stops at the quota with prompt 0's group unfinished; step 2 continues its rows
  from their last token instead of restarting them.  With the same weights in both steps,
  each continued response keeps step 1's tokens and log-probs, runs to its end, and every
  token's recorded log-prob is what a forward pass over the whole response gives (the KV of
  the carried part recomputed, or with ``keep`` kept from step 1 and its last token fed
  first, the rest decoded): one response, decoded in two steps."""
  q1 = _queue(jax.random.key(1), LONG_TAIL)
  keep = (CFG, R.partial_kv_slots(_ro(), P)) if kv == "keep" else None
  empty = R.empty_partial(G * n, N, kv=keep)
  ro1, info1 = _refill_continue(params, q1, jnp.int32(0), empty, jax.random.key(3))
  count = info1.stats["carried_out"]
  c = int(count)
  left = np.asarray(info1.leftover_index_G)[:c].tolist()
  assert 0 in left
  part = jax.device_get(info1.partial)
  if keep:  # each leftover row's page: its prompt and all its tokens but the last
    plen = np.asarray(q1["prompt_mask"]).sum(1)[np.asarray(left)]
    want = np.repeat(plen, n) + part["rmask"][:c * n].sum(1) - 1
    np.testing.assert_array_equal(part["kv_len"][:c * n], want)
    assert (part["kv_len"][c * n:] == 0).all()
  g0 = left.index(0)
  rows0 = slice(g0 * n, (g0 + 1) * n)
  k0 = part["rmask"][rows0].sum(1)
  assert (k0 > 0).all() and (k0 < N).all() and not part["done"][rows0].any()
  assert int(part["rmask"][c * n:].sum()) == 0  # nothing past the leftovers

  carried = R.carry_take(q1, info1.leftover_index_G, count)
  q2 = R.carry_queue(carried, count, _queue(jax.random.key(7), (2, 1, 3, 2, 1, 2, 1, 3)))
  ro2, info2 = _refill_continue(params, q2, count, info1.partial, jax.random.key(4))
  assert int(info2.stats["continued"]) == int(part["rmask"].sum())
  index2 = np.asarray(info2.prompt_index_G).tolist()
  g = index2.index(g0)  # prompt 0's group in step 2's batch
  rows = slice(g * n, (g + 1) * n)
  resp = np.asarray(ro2.tokens_BT)[rows, P:]
  lp = np.asarray(ro2.behaviour_logp_BN)[rows]
  for r in range(n):  # step 1's tokens and log-probs kept, then decoded to the limit
    k = int(k0[r])
    np.testing.assert_array_equal(resp[r, :k], part["resp"][g0 * n + r, :k])
    np.testing.assert_array_equal(lp[r, :k], part["lp"][g0 * n + r, :k])
  assert (np.asarray(ro2.lengths_B)[rows] == N).all()  # prompt 0 runs to the limit
  ref, _ = M.token_logprobs(params, ro2.tokens_BT, ro2.mask_BT, cfg=CFG, start=P)
  rm = np.asarray(ro2.response_mask_BN)
  np.testing.assert_allclose(np.where(rm, np.asarray(ro2.behaviour_logp_BN), 0),
                             np.where(rm, np.asarray(ref), 0), atol=2e-5)
  # Nothing lost, nothing twice: each of step 1's started prompts trained in step 1 or 2.
  st1 = {k: int(v) for k, v in info1.stats.items()}
  assert st1["started"] == st1["trained"] + c
  assert set(range(c)) <= set(index2)


# ------------------------------------------------------------ shared prompts with refill


def _same(got, want, info, want_info):
  np.testing.assert_array_equal(info.prompt_index_G, want_info.prompt_index_G)
  np.testing.assert_array_equal(got.tokens_BT, want.tokens_BT)
  np.testing.assert_array_equal(got.response_mask_BN, want.response_mask_BN)
  np.testing.assert_array_equal(got.finished_B, want.finished_B)
  np.testing.assert_allclose(got.behaviour_logp_BN, want.behaviour_logp_BN, atol=2e-5)
  np.testing.assert_allclose(got.sample_logp_BN, want.sample_logp_BN, atol=2e-5)
  for k in ("started", "completed", "steps"):
    assert int(info.stats[k]) == int(want_info.stats[k]), k


def _refill_modes(params, queue, key, count=None, partial=None, cfg=CFG, **ro):
  return R.generate_refill(params, queue["prompt"], queue["prompt_mask"], key, count, partial,
                           cfg=cfg, rollout=_ro(**ro), eos_id=EOS, num_samples=n,
                           num_groups=G)


@pytest.mark.parametrize("mode", ["drop", "carry", "continue"])
def test_shared_prompts_with_refill_decode_todays_tokens(params, mode):
  """rollout.prefix_sharing with refill: each group's prompt written once (refilled groups'
  too), its rows' own pages holding their responses; the same groups, tokens and counts as
  the whole cache per row, log-probs within 2e-5.  With ``continue``, over two steps: the
  carried partial responses go on to the same ends."""
  q1 = _queue(jax.random.key(1), LONG_TAIL)
  count = None if mode == "drop" else jnp.int32(0)
  partial = R.empty_partial(G * n, N) if mode == "continue" else None
  outs = [_refill_modes(params, q1, jax.random.key(3), count, partial, prefix_sharing=s)
          for s in (False, True)]
  (want, want_info), (got, info) = outs
  _same(got, want, info, want_info)
  assert int(want_info.stats["started"]) > G  # refilled groups
  if mode == "drop":
    return
  c = want_info.stats["carried_out"]
  assert int(c) > 0
  q2 = R.carry_queue(R.carry_take(q1, want_info.leftover_index_G, c), c,
                     _queue(jax.random.key(7), (2, 1, 3, 2, 1, 2, 1, 3)))
  outs = [_refill_modes(params, q2, jax.random.key(4), c,
                        None if partial is None else i.partial, prefix_sharing=s)
          for s, (_, i) in zip((False, True), outs)]
  (want, want_info), (got, info) = outs
  _same(got, want, info, want_info)
  if mode == "continue":
    assert int(info.stats["continued"]) == int(want_info.stats["continued"]) > 0


def test_shared_prompts_with_refill_on_sliding_window_layers_and_dp2_tp2():
  """Ragged prompts, a sliding window shorter than prompt + response (counted in tokens, the
  prompt's included) and soft-capping, on one device and on dp=2 x tp=2.  (A vocabulary of 8
  with two stop tokens: groups end at mixed steps and are refilled.)"""
  cfg = dataclasses.replace(TINY, vocab_size=8, sliding_window=6, layer_types=("sliding", "full"),
                            attn_softcap=20.0, max_seq_len=32)
  prm = M.init_params(cfg, jax.random.key(5))
  tokens, mask = ragged_batch(jax.random.key(6), Q, P, cfg.vocab_size)
  queue = {"prompt": tokens, "prompt_mask": mask}
  got = {}
  for name, m in (("one", mesh()), ("dp2tp2", mesh(dp=2, tp=2))):
    for s in (False, True):
      with jax.set_mesh(m):
        got[name, s] = jax.device_get(_refill_modes(prm, queue, jax.random.key(3), cfg=cfg,
                                                    prefix_sharing=s))
  want, want_info = got["one", False]
  assert int(want_info.stats["started"]) > G and want.response_mask_BN.sum() > G * n * 3
  for key in (("one", True), ("dp2tp2", True), ("dp2tp2", False)):
    _same(*got[key][:1], want, got[key][1], want_info)


@pytest.mark.slow  # (fast siblings: test_shared_prompts_with_refill_decode_todays_tokens)
def test_grpo_steps_with_shared_prompts_and_partial_rollouts_equal_without():
  """The trainer with refill, partial rollouts and rollout.prefix_sharing takes the same
  steps as without sharing (metrics and weights to float rounding) over three steps, the
  carried responses continued on top of shared prompts."""
  cfg = config(leftover="continue")
  shared = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                prefix_sharing=True))
  _, s1, _, m1 = run_steps(cfg, mesh(), steps=3)
  _, s2, _, m2 = run_steps(shared, mesh(), steps=3)
  assert any(m["rollout/continued_tokens"] > 0 for m in m2[1:])
  for a, b in zip(m1, m2):
    for k in a:
      if not k.startswith(("time/", "memory/", "perf/")):
        np.testing.assert_allclose(b[k], a[k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))


@pytest.mark.parametrize("kv", ["recompute", "keep"])
@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_continued_responses_of_a_random_model_keep_their_context(kv, shared):
  """A random model reads every token of its context (the length model above reads few), so
  a carried row whose keys and values were misplaced, cut or fed twice would change the
  log-probs.  Two steps with the same weights: every response of step 2, continued or not,
  has the log-probs of a teacher-forced forward over its prompt and whole response."""
  cfg = dataclasses.replace(TINY, vocab_size=8, max_seq_len=32)
  prm = M.init_params(cfg, jax.random.key(5))
  ro = _ro(prefix_sharing=shared)
  keep = (cfg, R.partial_kv_slots(ro, P)) if kv == "keep" else None
  tokens, mask = ragged_batch(jax.random.key(6), Q, P, cfg.vocab_size)
  q1 = {"prompt": tokens, "prompt_mask": mask}

  def step(queue, count, partial, key):
    return R.generate_refill(prm, queue["prompt"], queue["prompt_mask"], key, count, partial,
                             cfg=cfg, rollout=ro, eos_id=EOS, num_samples=n, num_groups=G)

  _, info1 = step(q1, jnp.int32(0), R.empty_partial(G * n, N, kv=keep), jax.random.key(3))
  c = info1.stats["carried_out"]
  q2 = R.carry_queue(R.carry_take(q1, info1.leftover_index_G, c), c, _queue(
      jax.random.key(7), (2, 1, 3, 2, 1, 2, 1, 3)))
  ro2, info2 = step(q2, c, info1.partial, jax.random.key(4))
  assert int(info2.stats["continued"]) > 0
  ref, _ = M.token_logprobs(prm, ro2.tokens_BT, ro2.mask_BT, cfg=cfg, start=P)
  rm = np.asarray(ro2.response_mask_BN)
  np.testing.assert_allclose(np.where(rm, np.asarray(ro2.behaviour_logp_BN), 0),
                             np.where(rm, np.asarray(ref), 0), atol=2e-5)


# ------------------------------------------ a refill pool sized by live tokens (kv_pages)

# Pages of 4 slots: a row of a prompt of 8 and 12 response slots may hold 5, a group of 2
# rows 10; the 3 groups at once 30.  TWO_LONG's first two prompts run to the limit: two
# groups admitted on their prompts' pages outgrow a pool of 12 (or 6 with shared prompts),
# and the younger is put back.
TWO_LONG = (0, 0, 1, 5, 0, 7, 2, 4)
POOLS = [(0, False, "live", STOP_AT), (30, False, "live", STOP_AT),
         (10, False, "worst", STOP_AT), (12, False, "live", TWO_LONG),
         (12, True, "worst", STOP_AT), (6, True, "live", TWO_LONG)]


@pytest.mark.parametrize("pages,shared,admit,lengths", POOLS)
@pytest.mark.parametrize("mode", ["drop", "carry"])
def test_a_pool_by_live_tokens_decodes_each_prompt_s_own_responses(params, pages, shared,
                                                                   admit, lengths, mode):
  """rollout.kv_page_size=4 with refill: pages reserved up front (0), or handed out as
  tokens need them and returned when a row ends.  Every trained group's responses equal its
  prompt decoded alone (tokens, masks; log-probs within 2e-5), whatever the pool, including
  a group put back for pages and restarted; a pool that holds every group at once gives
  today's batch; a smaller one runs fewer groups at a time and never holds more than it has.
  "worst" never makes a row wait; "live" puts a group back when rows outgrow the pool."""
  prompts = _prompts(jax.random.key(1), lengths)
  ref, _ = _plain(params, prompts)
  count = None if mode == "drop" else jnp.int32(0)
  queue = {"prompt": prompts[0], "prompt_mask": prompts[1]}
  want, want_info = _refill_modes(params, queue, jax.random.key(3), count, prefix_sharing=shared)
  got, info = _refill_modes(params, queue, jax.random.key(3), count, prefix_sharing=shared,
                            kv_page_size=4, kv_pages=pages, kv_admit=admit)
  st = {k: int(v) for k, v in info.stats.items()}
  index = np.asarray(info.prompt_index_G)
  assert st["completed"] >= G and len(set(index)) == G
  _groups_match(got, index, ref)
  full = G * n * (-(-(N + (0 if shared else P)) // 4))
  if pages in (0, full):  # room for every group at once: today's batch, step for step
    _same(got, want, info, want_info)
  if not pages:
    assert "kv_peak" not in st
    return
  assert 0 < st["kv_peak"] <= pages, st
  if pages < full:  # a refill waited for pages, so the loop took more steps
    assert st["kv_waits"] > 0 and st["steps"] > int(want_info.stats["steps"]), st
  if admit == "worst":
    assert st["kv_deferred"] == 0 and "kv_preempted" not in st, st
  elif lengths == TWO_LONG:
    assert st["kv_preempted"] > 0 and st["kv_deferred"] > 0, st
  if mode == "carry":  # a full batch trained; the groups started and not trained carried
    assert st["trained"] == G and st["carried_out"] == st["started"] - G, st


@pytest.mark.parametrize("shared", [False, True], ids=["whole-prompts", "shared"])
@pytest.mark.parametrize("room", ["every-group", "one-group"])
def test_partial_rollouts_go_on_over_a_pool_by_live_tokens(params, shared, room):
  """refill_leftover=continue on a pool handed out by live tokens: the carried responses
  take pages again at the next step's start. With room for every group it is the reserved
  pool's two steps, token for token (the carried responses going on alike); with room for
  one group a carried group that does not fit starts later from its prompt, and still no
  prompt is lost or trained twice."""
  full = G * n * (-(-(N + (0 if shared else P)) // 4))
  pages = full if room == "every-group" else full // G
  q1 = _queue(jax.random.key(1), LONG_TAIL)
  q2_tail = _queue(jax.random.key(7), (2, 1, 3, 2, 1, 2, 1, 3))
  runs = {}
  for name, kv in (("reserved", {}), ("live", dict(kv_page_size=4, kv_pages=pages))):
    out1, info1 = _refill_modes(params, q1, jax.random.key(3), jnp.int32(0),
                                R.empty_partial(G * n, N), prefix_sharing=shared,
                                refill_leftover="continue", **kv)
    c = info1.stats["carried_out"]
    q2 = R.carry_queue(R.carry_take(q1, info1.leftover_index_G, c), c, q2_tail)
    out2, info2 = _refill_modes(params, q2, jax.random.key(4), c, info1.partial,
                                prefix_sharing=shared, refill_leftover="continue", **kv)
    runs[name] = (out1, info1, out2, info2, int(c))
  want1, want_info1, want2, want_info2, c_want = runs["reserved"]
  got1, info1, got2, info2, c = runs["live"]
  assert c_want > 0 and int(want_info2.stats["continued"]) > 0
  if room == "every-group":
    _same(got1, want1, info1, want_info1)
    _same(got2, want2, info2, want_info2)
    assert int(info2.stats["continued"]) == int(want_info2.stats["continued"])
    return
  st1 = {k: int(v) for k, v in info1.stats.items()}
  st2 = {k: int(v) for k, v in info2.stats.items()}
  assert 0 < st1["kv_peak"] <= pages and 0 < st2["kv_peak"] <= pages
  # Nothing lost, nothing twice: step 1's started prompts trained in step 1 or carried into
  # step 2, where each carried one is trained (first places) and none twice.
  assert st1["started"] == st1["trained"] + c
  index2 = np.asarray(info2.prompt_index_G)
  assert set(range(c)) <= set(index2) and len(set(index2)) == len(index2) == G


def test_a_carried_group_the_live_pool_cannot_hold_starts_again_from_its_prompt(params):
  """A carried response of 11 tokens after an 8-token prompt needs 6 pages a row (and one
  more for its next token) where the pool holds 10: its group does not start where it
  stopped but later, from its prompt, and its responses are the prompt's own (tokens, ends,
  log-probs), as they are when the reserved pool continues them."""
  tokens, _ = _prompts(jax.random.key(1), LONG_TAIL)
  mask = jnp.ones_like(tokens, bool)  # prompt 0 (to the limit) of 8 real tokens
  ref, _ = _plain(params, (tokens, mask))
  partial = R.empty_partial(G * n, N)
  k = 11
  partial.update(resp=partial["resp"].at[:n, :k].set(ref.tokens_BT[:n, P:P + k]),
                 rmask=partial["rmask"].at[:n, :k].set(True),
                 lp=partial["lp"].at[:n, :k].set(ref.behaviour_logp_BN[:n, :k]),
                 slp=partial["slp"].at[:n, :k].set(ref.sample_logp_BN[:n, :k]))
  queue = {"prompt": tokens, "prompt_mask": mask}
  for kv, continued in (({}, n * k), (dict(kv_page_size=4, kv_pages=10), 0)):
    got, info = _refill_modes(params, queue, jax.random.key(3), jnp.int32(1), partial,
                              refill_leftover="continue", **kv)
    index = np.asarray(info.prompt_index_G)
    assert int(info.stats["continued"]) == continued and 0 in index, (kv, info.stats)
    _groups_match(got, index, ref)


@pytest.mark.parametrize("shared,admit", [(False, "worst"), (True, "worst"), (False, "live"),
                                          (True, "live")])
def test_refill_pages_are_never_lost_or_shared_and_return_when_rows_end(params, shared,
                                                                        admit):
  """The loop's pool step by step: every page free or held by exactly one row, each row
  holding the pages of its length, ended rows (and rows put back) none; "worst": never
  fewer free pages than the running rows may still take."""
  prompts = _prompts(jax.random.key(1), TWO_LONG if admit == "live" else STOP_AT)
  ro = _ro(kv_page_size=4, kv_pages=(6 if shared else 12) if admit == "live" else
           (12 if shared else 20), prefix_sharing=shared, kv_admit=admit)
  loop = R._RefillLoop(params, *prompts, jax.random.key(3), None, None, cfg=CFG, rollout=ro,
                       eos_id=EOS, pad_id=0, n=n, g_n=G, kernels=KernelsConfig())
  body = jax.jit(loop.body)
  state, steps, peak = loop.init(), 0, 0
  put_back, restarted = {}, 0  # slot -> the prompt put back there; restarts seen
  while bool(loop.cond(state)):
    before = state[-1]
    state = body(state)
    steps += 1
    _, cache, slots, _, _, _, group = state
    if admit == "live":  # a group put back restarts in its slot, before any new prompt
      parked, prompt = np.asarray(group["parked"]), np.asarray(group["prompt"])
      for g in list(put_back):
        if not parked[g]:
          assert prompt[g] == put_back.pop(g), (g, prompt)
          restarted += 1
      if np.asarray(before["parked"]).any():
        assert int(group["next"]) == int(before["next"])
      put_back.update({g: prompt[g] for g in np.flatnonzero(parked) if g not in put_back})
    pg, _ = loop._split(cache)
    _check_accounting(pg)
    held, length = np.asarray(pg.held_R()), np.asarray(pg.length_R)
    done = np.asarray(slots["done"])
    assert (held[done] == 0).all(), (held, done)
    np.testing.assert_array_equal(held[~done], -(-length[~done] // 4))
    if admit == "worst":
      assert int(loop._room(cache, slots)) >= 0
    else:
      assert (held.reshape(G, n)[np.asarray(group["parked"])] == 0).all()
    assert int(pg.in_use()) == held.sum() <= ro.kv_pages
    peak = max(peak, int(pg.in_use()))
  assert steps > 0 and int(group["kv_peak"]) >= peak
  assert int(group["kv_deferred"]) == 0 if admit == "worst" else restarted > 0


def test_grpo_steps_with_partial_rollouts_on_a_pool_by_live_tokens():
  """The trainer with refill_leftover=continue on a pool by live tokens (recompute) that holds
  every group: accepted by validate, and the same two steps as the reserved pool (metrics,
  weights), carried tokens continued in the second."""
  base = config(leftover="continue")
  live = dataclasses.replace(base, rollout=dataclasses.replace(
      base.rollout, kv_page_size=4, kv_pages=4 * 4 * 3))
  validate(live, required=False)
  _, s1, _, m1 = run_steps(base, mesh(), steps=2)
  _, s2, _, m2 = run_steps(live, mesh(), steps=2)
  assert m2[1]["rollout/continued_tokens"] > 0
  for a, b in zip(m1, m2):
    for k in (k for k in a if not k.startswith(("time/", "memory/", "perf/"))):
      np.testing.assert_allclose(b[k], a[k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))


def test_grpo_steps_with_a_refill_pool_by_live_tokens_on_dp2_tp2():
  """Two GRPO steps with pages handed out by live tokens, one group's worth beyond half the
  batch: on dp=2 x tp=2 as on one device, and the pool's figures among the metrics."""
  base = config()
  cfg = dataclasses.replace(base, rollout=dataclasses.replace(
      base.rollout, kv_page_size=4, kv_pages=3 * 4 * 3))
  validate(cfg, required=False)
  _, s1, _, m1 = run_steps(cfg, mesh(), steps=2)
  _, s2, _, m2 = run_steps(cfg, mesh(dp=2, tp=2), steps=2)
  for a, b in zip(m1, m2):
    for k in (k for k in a if not k.startswith(("time/", "memory/"))):
      np.testing.assert_allclose(b[k], a[k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))
  for m in m1:
    assert 0 < m["rollout/kv_peak_frac"] <= 1 and m["rollout/kv_waits"] >= 0
    assert m["rollout/completed"] >= 4


@pytest.mark.parametrize("change,match", [
    (dict(kv_pages=8), r"rollout.kv_pages=8 cannot hold one group's responses \(4 x "
                       r"\(data.max_prompt_len \+ rollout.max_new_tokens\) slots in pages of "
                       r"rollout.kv_page_size=4: \d+ pages\); raise rollout.kv_pages to at "
                       r"least \d+ \(48 run every group at once\)"),
    (dict(kv_pages=200, refill_leftover="continue", continue_kv="keep"),
     r"rollout.kv_pages=200 with rollout.continue_kv=keep: .* set rollout.kv_pages=0 .* or "
     r"rollout.continue_kv=recompute"),
])
def test_a_refill_pool_it_cannot_run_is_refused_with_the_fix(change, match):
  base = dataclasses.replace(config(), stages=("grpo",))
  cfg = dataclasses.replace(base, rollout=dataclasses.replace(base.rollout, kv_page_size=4,
                                                              **change))
  with pytest.raises(ConfigError, match=match):
    validate(cfg, required=False)


@pytest.mark.parametrize("share", [True, False], ids=["shared", "whole-prompts"])
def test_the_refill_pool_is_split_over_the_data_shards(share):
  """Per-row positions with each row's pages reserved (kv_pages=0): the pool lies split over
  the data axes as the rows are, so on dp=2 each device holds half of it. The compiled
  loop's working memory per device drops by at least 90% of half the pool's bytes (with
  the pool whole on every device, as before, it dropped by a quarter of that, or rose)."""
  cfg = dataclasses.replace(TINY, max_seq_len=128)
  prm = M.init_params(cfg, jax.random.key(0))
  n_g, samples, new, p = 4, 4, 48, 16
  tokens, mask = ragged_batch(jax.random.key(1), 8, p, cfg.vocab_size)
  ro = RolloutConfig(max_new_tokens=new, row_keys=True, refill=True, prefix_sharing=share,
                     kv_page_size=0 if share else 16)
  temp = {}
  for dp in (1, 2):
    with jax.set_mesh(mesh(dp=dp)):
      fn = jax.jit(lambda prm, t, m, k: R.generate_refill(
          prm, t, m, k, None, None, cfg=cfg, rollout=ro, eos_id=EOS, num_samples=samples,
          num_groups=n_g))
      compiled = fn.lower(prm, tokens, mask, jax.random.key(2)).compile()
      temp[dp] = compiled.memory_analysis().temp_size_in_bytes
  page, pages, _ = ro.refill_pages(p, n_g * samples, samples)
  pool = 2 * cfg.n_layers * cfg.n_kv_heads * pages * page * cfg.head_dim * 4
  assert temp[1] - temp[2] >= 0.9 * pool / 2, (temp, pool)
