"""Multi-turn decoding (jaxrlhf/turns.py): actions and observations in one KV cache, written in
lock step with holes or paged with per-row positions, equal a from-scratch forward over the
compacted conversation; the paged engine samples the lock-step engine's tokens."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, mesh, ragged_batch
from jaxrlhf import model as M
from jaxrlhf import turns
from jaxrlhf.config import KernelsConfig, RolloutConfig
from jaxrlhf.mesh import PARAM_RULES, batch_sharding, tree_shardings

CFG = dataclasses.replace(TINY, n_kv_heads=4, max_seq_len=64)
P, N, ROWS = 6, 40, 4
KERN = KernelsConfig()


def _episode(params, prompt, pmask, *, turns_n=3, live=(True, True, False, True),
             obs_lens=((3, 1, 0, 4), (2, 5, 0, 1), (4, 4, 0, 2)), stop_seqs=((5, 7), (9,)),
             max_tokens=6, temperature=1.0, eos=2, page_size=0, kv_pages=0):
  """Acts and observes ``turns_n`` times; returns the conversation and each turn's reasons
  (``page_size``: the paged engine)."""
  ro = RolloutConfig(temperature=temperature)
  conv = jax.jit(functools.partial(turns.start, cfg=CFG, total=P + N, kernels=KERN,
                                   page_size=page_size, kv_pages=kv_pages))(
      params, prompt, pmask)
  act = jax.jit(functools.partial(turns.act, cfg=CFG, rollout=ro, eos_id=eos, pad_id=0,
                                  kernels=KERN, max_tokens=max_tokens, stop_seqs=stop_seqs))
  observe = jax.jit(functools.partial(turns.observe, cfg=CFG, kernels=KERN))
  live = jnp.asarray(live)
  reasons = []
  rng = np.random.default_rng(0)
  for t in range(turns_n):
    conv, reason, _ = act(params, conv, jax.random.key(10 + t), live)
    reasons.append(np.asarray(reason))
    w = 5
    obs = rng.integers(3, CFG.vocab_size, (ROWS, w))
    omask = np.zeros((ROWS, w), bool)
    for r in range(ROWS):
      k = obs_lens[t][r]
      omask[r, w - k:] = bool(live[r]) and k > 0
    conv = observe(params, conv, jnp.asarray(obs), jnp.asarray(omask))
  return conv, reasons


@pytest.fixture(scope="module")
def params():
  return M.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def prompts():
  return ragged_batch(jax.random.key(1), ROWS, P, CFG.vocab_size)


def _compacted(conv):
  (tok, mask, pol, lp), _ = turns.compact(conv.tokens_RS, conv.mask_RS, conv.policy_RS,
                                          conv.logp_RS, start=P, pad_id=0)
  return tok, mask, pol[:, P:], lp[:, P:]


@pytest.mark.parametrize("page_size", [0, 4], ids=["lock_step", "paged"])
def test_decoded_logprobs_equal_a_forward_over_the_whole_conversation(params, prompts,
                                                                      page_size):
  conv, _ = _episode(params, *prompts, page_size=page_size)
  tok, mask, pol, lp = _compacted(conv)
  ref, _ = M.token_logprobs(params, jnp.asarray(tok), jnp.asarray(mask), cfg=CFG, start=P)
  assert pol.sum() > 20  # the policy wrote tokens in every live row
  assert not pol[2].any() and not mask[2, P:].any()  # the row that never acted
  np.testing.assert_allclose(np.where(pol, lp, 0), np.where(pol, np.asarray(ref), 0), atol=2e-5)


@pytest.mark.parametrize("page_size", [0, 4], ids=["lock_step", "paged"])
def test_sharded_conversation_equals_unsharded(params, prompts, page_size):
  want, _ = _episode(params, *prompts, page_size=page_size)
  m = mesh(dp=2, tp=4)
  with jax.set_mesh(m):
    sp = jax.device_put(params, tree_shardings(m, M.param_axes(CFG), params, PARAM_RULES))
    st = tuple(jax.device_put(x, batch_sharding(m, 2, x.shape)) for x in prompts)
    got, _ = _episode(sp, *st, page_size=page_size)
  np.testing.assert_array_equal(np.asarray(got.tokens_RS), np.asarray(want.tokens_RS))
  np.testing.assert_array_equal(np.asarray(got.mask_RS), np.asarray(want.mask_RS))
  np.testing.assert_allclose(np.asarray(got.logp_RS), np.asarray(want.logp_RS), atol=1e-5)
  tok, mask, pol, lp = _compacted(got)
  ref, _ = M.token_logprobs(params, jnp.asarray(tok), jnp.asarray(mask), cfg=CFG, start=P)
  np.testing.assert_allclose(np.where(pol, lp, 0), np.where(pol, np.asarray(ref), 0), atol=2e-5)


def test_observation_tokens_are_real_but_never_the_policy_s(params, prompts):
  conv, _ = _episode(params, *prompts)
  mask, pol = np.asarray(conv.mask_RS), np.asarray(conv.policy_RS)
  tokens = np.asarray(conv.tokens_RS)
  # Every real response slot is either an action token or an observation token; the observed
  # counts are exactly what was appended (rows 0, 1, 3: 3+2+4, 1+5+4, 4+1+2).
  obs = mask[:, P:] & ~pol[:, P:]
  assert obs.sum(1).tolist() == [9, 10, 0, 7]
  assert not (pol & ~mask).any()
  assert (tokens[~mask] == 0).all()  # holes hold the pad id


def test_an_action_ends_at_eos_a_stop_sequence_or_its_limit(params, prompts):
  # Greedy with the stop sequence set to the token row 0 emits first: it stops after one.
  conv0 = turns.start(params, *prompts, cfg=CFG, total=P + N, kernels=KERN)
  first = int(jnp.argmax(conv0.logits_RV[0]))
  conv, (reason,) = _episode(params, *prompts, turns_n=1, temperature=0.0,
                             stop_seqs=((first,),), eos=-1, max_tokens=5)
  assert reason[0] == turns.STOP
  assert reason[2] == turns.NOT_LIVE
  pol = np.asarray(conv.policy_RS)[:, P:]
  assert pol[0].sum() == 1
  lim = [r for r in (1, 3) if reason[r] == turns.TURN_LIMIT]
  assert all(pol[r].sum() == 5 for r in lim)
  # A two-token stop sequence matches only as a pair, and only within one action.
  t = turns._stop_table(((4, 7), (9,)))[0]
  assert np.asarray(t).tolist() == [[4, 7], [-1, 9]]


def test_the_buffer_end_stops_an_action(params, prompts):
  small = P + 3
  conv = turns.start(params, *prompts, cfg=CFG, total=small, kernels=KERN)
  conv, reason, _ = turns.act(params, conv, jax.random.key(0), jnp.ones(ROWS, bool), cfg=CFG,
                              rollout=RolloutConfig(), eos_id=-1, pad_id=0, kernels=KERN,
                              max_tokens=10)
  assert (np.asarray(reason) == turns.BUFFER_FULL).all()
  assert int(conv.cache.index) == small
  assert np.asarray(conv.policy_RS)[:, P:].all()


def test_compaction_keeps_order_and_moves_per_slot_data():
  tokens = np.array([[0, 5, 6, 0, 7, 0, 8]])
  mask = tokens > 0
  extra = np.array([[0, 1.0, 2.0, 0, 3.0, 0, 4.0]], np.float32)
  (tok, m, ex), _ = turns.compact(tokens, mask, extra, start=2, pad_id=0)
  assert tok.tolist() == [[0, 5, 6, 7, 8, 0, 0]]
  assert m.tolist() == [[False, True, True, True, True, False, False]]
  assert ex.tolist() == [[0, 1.0, 2.0, 3.0, 4.0, 0, 0]]


@pytest.mark.parametrize("kv_pages", [0, turns.pool_pages(ROWS, P + N, 4)],
                         ids=["contiguous", "lazy"])
def test_paged_episodes_sample_the_lock_step_tokens_without_holes(params, prompts, kv_pages):
  want, want_reasons = _episode(params, *prompts)
  got, got_reasons = _episode(params, *prompts, page_size=4, kv_pages=kv_pages)
  for a, b in zip(want_reasons, got_reasons):
    np.testing.assert_array_equal(a, b)
  w_tok, w_mask, w_pol, w_lp = _compacted(want)
  # Paged, the conversation is written compact: no hole to squeeze out.
  mask = np.asarray(got.mask_RS)
  np.testing.assert_array_equal(mask[:, P:], np.sort(mask[:, P:], axis=1)[:, ::-1])
  np.testing.assert_array_equal(np.asarray(got.tokens_RS)[mask], w_tok[w_mask])
  np.testing.assert_array_equal(mask, w_mask)
  np.testing.assert_array_equal(np.asarray(got.policy_RS)[:, P:], w_pol)
  np.testing.assert_allclose(np.asarray(got.logp_RS)[:, P:], w_lp, atol=2e-5)
  # Each row's next column is its own: prompt columns + its real response tokens.
  assert np.asarray(got.write_R).tolist() == (P + mask[:, P:].sum(1)).tolist()
  held = np.asarray(got.cache.held_R())
  if kv_pages:  # pages handed out as tokens need them: what each row's tokens fill, no more
    assert held.tolist() == (-(-mask.sum(1) // 4)).tolist()
    assert int(got.kv_slots()) == 4 * held.sum() < mask.size
  else:  # every row's whole buffer, reserved up front
    assert got.cache.contiguous and (held == -(-(P + N) // 4)).all()


def test_a_paged_pool_that_runs_out_stops_and_says_so(params, prompts):
  # Enough pages for the prompts and a few tokens: the first turn starves.
  conv, _ = _episode(params, *prompts, page_size=4, kv_pages=9, turns_n=1)
  assert bool(conv.starved)
  tables = np.asarray(conv.cache.table_RM)
  used = tables[tables < 9]
  assert sorted(used.tolist()) == list(range(9))  # every page held once, none twice
  # No row wrote past the pages it holds.
  lengths = np.asarray(conv.cache.length_R)
  assert (lengths <= 4 * np.asarray(conv.cache.held_R())).all()
  assert (np.asarray(conv.pos_R) == lengths).all()


@pytest.mark.parametrize("page_size,shared,kv_pages", [(0, False, 0), (8, True, 0),
                                                       (8, False, 0), (4, False, 40)],
                         ids=["lock_step", "shared_pages", "pages", "pages_as_needed"])
def test_a_prompt_prefilled_once_per_group_starts_every_row_as_its_own_would(page_size, shared,
                                                                           kv_pages):
  """``turns.start(group=n)``: rows in groups of ``n`` identical prompts prefill each prompt
  once (lock step copies its cache to the group's rows; ``shared`` keeps one copy; pages
  without sharing get it written into each row's pages) and start every row with the
  logits, and then the same episode, of a prefill of its own."""
  params = M.init_params(CFG, jax.random.key(0))
  tokens, mask = ragged_batch(jax.random.key(1), 2, P, CFG.vocab_size)
  prompt, pmask = jnp.repeat(tokens, 2, axis=0), jnp.repeat(mask, 2, axis=0)
  ro = RolloutConfig(temperature=1.0)
  kw = dict(cfg=CFG, total=P + N, kernels=KERN)
  each = turns.start(params, prompt, pmask, **kw)
  once = turns.start(params, prompt, pmask, group=2, shared=shared, page_size=page_size,
                     kv_pages=kv_pages, **kw)
  assert (once.prefix is not None) == shared
  if page_size and not shared:  # each row's pages hold its prompt, from slot 0
    np.testing.assert_array_equal(once.cache.length_R, np.sum(pmask, axis=1))
    assert not bool(once.starved)
  np.testing.assert_allclose(once.logits_RV, each.logits_RV, atol=2e-5)
  act = functools.partial(turns.act, cfg=CFG, rollout=ro, eos_id=2, pad_id=0, kernels=KERN,
                          max_tokens=8)
  live = jnp.ones((ROWS,), bool)
  a, _, _ = act(params, each, jax.random.key(3), live)
  b, _, _ = act(params, once, jax.random.key(3), live)
  np.testing.assert_array_equal(b.tokens_RS, a.tokens_RS)
  np.testing.assert_allclose(b.logp_RS, a.logp_RS, atol=2e-5)
