"""The alignment math against slow numpy references written from the formulas, each convention
pinned by a hand-computed case, edge cases (empty rows, single-sample groups, equal rewards,
extreme log-ratios, NaN under the mask), and the aggregation contract: the same loss and
gradient on 1 device, on 4 data-parallel devices, and summed over micro-batches."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import mesh
from jaxrlhf.algorithms import (POLICY_LOSSES, agg_count, aggregate, bradley_terry_loss,
                                cispo_policy_loss, dpo_loss, entropy_bonus, gae,
                                group_advantages, gspo_policy_loss, init_kl_controller,
                                kl_estimate, kl_penalty_loss, kl_shaped_rewards, kto_loss,
                                off_policy_weights, orpo_loss, overlong_penalty,
                                ppo_policy_loss, select_groups, sft_loss, simpo_loss,
                                update_kl_controller, value_loss, whiten)

RNG = np.random.default_rng(0)


def _masks(b=6, t=7):
  """Right-padded, left-padded, holed, empty and full rows."""
  m = np.ones((b, t), bool)
  m[0, 4:] = False  # right padding
  m[1, :3] = False  # left padding
  m[2, [1, 4]] = False  # holes
  m[3, :] = False  # empty row
  m[4, 1:] = False  # one token
  return m


def _close(a, b, **kw):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **{"rtol": 1e-5, "atol": 1e-6, **kw})


# ------------------------------------------------------------------------------------- KL


def _np_kl(logp, ref, est, cl, ck):
  out = np.zeros_like(logp)
  for idx in np.ndindex(logp.shape):
    lr = min(max(ref[idx] - logp[idx], -cl), cl)
    k = {"k1": -lr, "k2": lr * lr / 2, "k3": math.exp(lr) - 1 - lr}[est]
    out[idx] = min(max(k, -ck), ck)
  return out


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference_and_clamps(est):
  logp = RNG.normal(size=(3, 5)).astype(np.float32) * 3
  ref = RNG.normal(size=(3, 5)).astype(np.float32) * 3
  ref[0, 0], logp[0, 1] = 200.0, 300.0  # extreme log-ratios hit both clamps
  got = kl_estimate(logp, ref, estimator=est, clamp_logr=20.0, clamp_kl=10.0)
  _close(got, _np_kl(logp, ref, est, 20.0, 10.0), rtol=2e-5)
  assert np.all(np.isfinite(got))


def test_kl_hand_case_and_clamp_off():
  # logr = ref - logp = -1: k1 = 1, k2 = 1/2, k3 = e^-1 - 1 + 1 = e^-1.
  logp, ref = jnp.array([[-1.0]]), jnp.array([[-2.0]])
  assert float(kl_estimate(logp, ref, estimator="k1")[0, 0]) == pytest.approx(1.0)
  assert float(kl_estimate(logp, ref, estimator="k2")[0, 0]) == pytest.approx(0.5)
  assert float(kl_estimate(logp, ref, estimator="k3")[0, 0]) == pytest.approx(math.exp(-1))
  # clamps <= 0 are off: logr = 30 gives k2 = 450 unclamped
  assert float(kl_estimate(jnp.zeros((1, 1)), jnp.full((1, 1), 30.0), estimator="k2",
                           clamp_logr=0, clamp_kl=0)[0, 0]) == pytest.approx(450.0)
  with pytest.raises(ValueError, match="k1"):
    kl_estimate(logp, ref, estimator="k4")


def test_kl_shaped_rewards_put_score_at_last_valid_token():
  m = _masks()
  kl = RNG.normal(size=m.shape).astype(np.float32)
  kl[~m] = np.nan  # garbage under the mask must not leak
  score = RNG.normal(size=m.shape[0]).astype(np.float32)
  got = np.asarray(kl_shaped_rewards(score, kl, m, coef=0.1))
  want = np.where(m, -0.1 * np.nan_to_num(kl), 0.0)
  for i in range(m.shape[0]):
    idx = np.nonzero(m[i])[0]
    if len(idx):
      want[i, idx[-1]] += score[i]
  _close(got, want)
  assert np.all(got[3] == 0)  # empty row: the score lands nowhere
  # hand case: coef 0.5, kl [1, 2, pad], score 3 -> [-0.5, -1 + 3, 0]
  _close(kl_shaped_rewards(jnp.array([3.0]), jnp.array([[1.0, 2.0, 9.0]]),
                           jnp.array([[True, True, False]]), coef=0.5), [[-0.5, 2.0, 0.0]])


def test_kl_penalty_loss_is_coef_times_aggregate():
  m = _masks()
  kl = RNG.random(m.shape).astype(np.float32)
  loss, met = kl_penalty_loss(kl, m, coef=0.04)
  _close(loss, 0.04 * kl[m].mean())
  _close(met["kl"], kl[m].mean())


def test_kl_controller_ziegler_hand_case():
  s = init_kl_controller(0.1)
  up = update_kl_controller(s, 12.0, 256, target=6.0, horizon=10000, adaptive=True)
  # e = clip(12/6 - 1, -.2, .2) = .2; coef = .1 * (1 + .2 * 256 / 10000)
  assert float(up.coef) == pytest.approx(0.1 * 1.00512, rel=1e-6)
  down = jax.jit(lambda s, k: update_kl_controller(s, k, 100, target=6.0, horizon=1000,
                                                   adaptive=True))(s, jnp.float32(5.4))
  # e = 5.4/6 - 1 = -.1 (inside the clip); coef = .1 * (1 - .1 * 100 / 1000)
  assert float(down.coef) == pytest.approx(0.1 * 0.99, rel=1e-5)
  fixed = update_kl_controller(s, 12.0, 256, target=6.0, horizon=10000, adaptive=False)
  assert float(fixed.coef) == pytest.approx(0.1)
  nan = update_kl_controller(s, jnp.nan, 256, target=6.0, horizon=10000, adaptive=True)
  assert float(nan.coef) == pytest.approx(0.1)


# ------------------------------------------------------------------------------ advantages


def _np_gae(r, v, m, gamma, lam):
  adv = np.zeros_like(r)
  for i in range(r.shape[0]):
    idx = np.nonzero(m[i])[0]  # the valid tokens, as one contiguous episode
    a_next = 0.0
    for k in reversed(range(len(idx))):
      v_next = v[i, idx[k + 1]] if k + 1 < len(idx) else 0.0
      delta = r[i, idx[k]] + gamma * v_next - v[i, idx[k]]
      a_next = delta + gamma * lam * a_next
      adv[i, idx[k]] = a_next
  return adv, np.where(m, adv + v, 0.0)


def test_gae_matches_reference_with_padding_and_holes():
  m = _masks()
  r = RNG.normal(size=m.shape).astype(np.float32)
  v = RNG.normal(size=m.shape).astype(np.float32)
  r[~m], v[~m] = np.nan, np.nan
  adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
  want_adv, want_ret = _np_gae(np.nan_to_num(r), np.nan_to_num(v), m, 0.9, 0.8)
  _close(adv, want_adv, atol=1e-5)
  _close(ret, want_ret, atol=1e-5)


def test_gae_hand_case():
  # gamma=lam=1, V=0: advantage = reward-to-go.  gamma=.5, lam=1, r=[0,0,1], V=[.2,.4,.6]:
  # d = [0+.5*.4-.2, 0+.5*.6-.4, 1-.6] = [0, -.1, .4]; A = [0 + .5*(-.1 + .5*.4), -.1+.2, .4]
  adv, _ = gae(jnp.array([[1.0, 2.0, 3.0]]), jnp.zeros((1, 3)), jnp.ones((1, 3), bool),
               gamma=1.0, lam=1.0)
  _close(adv, [[6.0, 5.0, 3.0]])
  adv, ret = gae(jnp.array([[0.0, 0.0, 1.0]]), jnp.array([[0.2, 0.4, 0.6]]),
                 jnp.ones((1, 3), bool), gamma=0.5, lam=1.0)
  _close(adv, [[0.05, 0.1, 0.4]])
  _close(ret, [[0.25, 0.5, 1.0]])


def test_whiten_matches_reference_and_edge_cases():
  m = _masks()
  x = RNG.normal(size=m.shape).astype(np.float32) * 3 + 1
  x[~m] = np.nan
  vals = x[m].astype(np.float64)
  mean, std = vals.mean(), vals.std(ddof=1)
  _close(whiten(x, m), np.where(m, (np.nan_to_num(x) - mean) / (std + 1e-8), 0), atol=1e-5)
  _close(whiten(x, m, shift_mean=False),
         np.where(m, (np.nan_to_num(x) - mean) / (std + 1e-8) + mean, 0), atol=1e-5)
  # hand case: [1, 3] -> mean 2, unbiased std sqrt(2) -> -+ 1/sqrt(2)
  _close(whiten(jnp.array([[1.0, 3.0]]), jnp.ones((1, 2), bool)), [[-2 ** -0.5, 2 ** -0.5]])
  # equal values -> exactly 0; all masked -> 0, never NaN
  assert np.all(np.asarray(whiten(jnp.full((3, 7), 0.1), jnp.ones((3, 7), bool))) == 0)
  assert np.all(np.asarray(whiten(jnp.full((2, 3), jnp.nan), jnp.zeros((2, 3), bool))) == 0)


def _np_group(s, n, method, eps, valid):
  out = np.zeros_like(s, dtype=np.float64)
  if method == "reinforce_pp":
    c = s.astype(np.float64).copy()
    if n > 1:
      for g in range(len(s) // n):
        sl = slice(g * n, (g + 1) * n)
        c[sl] = s[sl] - s[sl][valid[sl]].mean() if valid[sl].any() else 0.0
    vals = c[valid]
    std = vals.std(ddof=1) if len(vals) > 1 else 0.0
    return np.where(valid, (c - vals.mean()) / (std + eps), 0.0)
  for g in range(len(s) // n):
    for i in range(g * n, (g + 1) * n):
      if not valid[i]:
        continue
      others = [s[j] for j in range(g * n, (g + 1) * n) if valid[j] and j != i]
      if not others:
        continue
      members = np.array(others + [s[i]], np.float64)
      if method == "grpo":
        out[i] = (s[i] - members.mean()) / (members.std(ddof=1) + eps)
      elif method == "drgrpo":
        out[i] = s[i] - members.mean()
      else:
        out[i] = s[i] - np.mean(others)
  return out


@pytest.mark.parametrize("method", ["grpo", "drgrpo", "rloo", "reinforce_pp"])
def test_group_advantages_match_reference(method):
  s = RNG.normal(size=16).astype(np.float32)
  valid = np.ones(16, bool)
  valid[[1, 9, 10, 11]] = False  # group 2 keeps one member: nothing to compare with
  s[1] = np.nan  # a NaN reward in an invalid row must not leak into its group
  got = group_advantages(s, group_size=4, method=method, valid_B=valid)
  _close(got, _np_group(np.nan_to_num(s), 4, method, 1e-6, valid), atol=2e-5)
  if method != "reinforce_pp":
    assert np.all(np.asarray(got)[8:12] == 0)


def test_group_advantage_conventions_hand_cases():
  s = jnp.array([1.0, 2.0, 3.0])
  # grpo: unbiased std of [1,2,3] is 1 -> (r - 2) / (1 + 1e-6)
  _close(group_advantages(s, group_size=3), np.array([-1, 0, 1]) / (1 + 1e-6))
  _close(group_advantages(s, group_size=3, method="drgrpo"), [-1, 0, 1])
  # rloo: 1 - (2+3)/2, 2 - (1+3)/2, 3 - (1+2)/2
  _close(group_advantages(s, group_size=3, method="rloo"), [-1.5, 0, 1.5])
  # equal rewards -> exactly 0 for every method, even for values like 0.1 that do not sum
  # exactly; single-sample groups -> 0
  eq = jnp.array([0.1] * 7 + [3.3] * 7)
  for method in ("grpo", "drgrpo", "rloo", "reinforce_pp"):
    assert np.all(np.asarray(group_advantages(eq, group_size=7, method=method)) == 0), method
    if method != "reinforce_pp":
      assert np.all(np.asarray(group_advantages(s, group_size=1, method=method)) == 0)
  # reinforce_pp with groups of one is plain global whitening
  _close(group_advantages(s, group_size=1, method="reinforce_pp"), np.array([-1, 0, 1]) / (1 + 1e-6))
  with pytest.raises(ValueError, match="divide the batch"):
    group_advantages(s, group_size=2)
  with pytest.raises(ValueError, match="grpo"):
    group_advantages(s, group_size=3, method="ppo")


def test_advantages_are_global_over_dp_shards():
  """Group statistics, whitening and GAE give the same numbers on 4 data-parallel devices."""
  s = RNG.normal(size=16).astype(np.float32)
  valid = RNG.random(16) > 0.2
  m = np.tile(_masks(6, 5)[2:], (4, 1))  # 16 rows incl. holes and empty rows
  x = RNG.normal(size=m.shape).astype(np.float32)

  @jax.jit
  def f(s, valid, x, m):
    groups = [group_advantages(s, group_size=4, method=k, valid_B=valid)
              for k in ("grpo", "drgrpo", "rloo", "reinforce_pp")]
    return groups, whiten(x, m), gae(x, x * 0.5, m, gamma=0.9, lam=0.95)

  want = f(s, valid, x, m)
  m4 = mesh(dp=4)
  got = f(*(jax.device_put(a, NamedSharding(m4, P("dp"))) for a in (s, valid, x, m)))
  jax.tree.map(lambda a, b: _close(a, b, atol=1e-5), got, want)


# ------------------------------------------------------------------------------- losses


def _np_agg(x, m, mode, denom=None, max_len=None):
  x = np.where(m, x, 0.0).astype(np.float64)
  nonempty = m.any(-1)
  if mode == "token_mean":
    return x.sum() / max(denom if denom is not None else m.sum(), 1)
  d = max(denom if denom is not None else nonempty.sum(), 1)
  if mode == "seq_mean_token_mean":
    return sum(x[i][m[i]].mean() for i in range(len(x)) if nonempty[i]) / d
  return x.sum() / (max_len or m.shape[-1]) / d


def test_aggregate_hand_cases():
  # row 0: [1, 2] valid, row 1: [3] valid, row 2: empty; T = 4
  x = jnp.array([[1.0, 2.0, 9.0, 9.0], [3.0, 9.0, 9.0, 9.0], [9.0] * 4])
  m = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  assert float(aggregate(x, m)) == pytest.approx(2.0)  # (1+2+3)/3 tokens
  assert float(aggregate(x, m, mode="seq_mean_token_mean")) == pytest.approx(2.25)  # (1.5+3)/2
  assert float(aggregate(x, m, mode="seq_mean_token_sum_norm")) == pytest.approx(0.75)  # (3/4+3/4)/2
  assert float(aggregate(x, m, mode="seq_mean_token_sum_norm", max_len=2)) == pytest.approx(1.5)
  assert float(aggregate(x, m, denom=6.0)) == pytest.approx(1.0)
  assert float(agg_count(m)) == 3 and float(agg_count(m, mode="seq_mean_token_mean")) == 2
  assert float(aggregate(x, jnp.zeros_like(m))) == 0.0  # all masked: 0, not NaN
  with pytest.raises(ValueError, match="token_mean"):
    aggregate(x, m, mode="sum")


def _np_ppo(logp, old, adv, m, cl, ch, dual, clamp):
  lr = np.clip(logp - old, -clamp, clamp)
  ratio = np.exp(lr)
  l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - cl, 1 + ch)
  pg = np.maximum(l1, l2)
  if dual:
    pg = np.where(adv < 0, np.minimum(pg, -adv * dual), pg)
  return pg, (l2 > l1), ratio - 1 - lr, ratio


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_ppo_policy_loss_matches_reference(agg):
  m = _masks()
  logp = RNG.normal(size=m.shape).astype(np.float32) * 0.3
  old = logp + RNG.normal(size=m.shape).astype(np.float32) * 0.3
  adv = RNG.normal(size=m.shape).astype(np.float32)
  logp[~m], old[~m], adv[~m] = np.nan, np.inf, np.nan
  loss, met = ppo_policy_loss(logp, old, adv, m, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                              agg=agg)
  z = lambda a: np.where(m, a, 0.0)
  pg, clipped, k3, ratio = _np_ppo(z(logp), z(old), z(adv), m, 0.2, 0.28, 3.0, 20.0)
  _close(loss, _np_agg(pg, m, agg), atol=1e-5)
  _close(met["clip_frac"], clipped[m].mean())
  _close(met["approx_kl"], k3[m].mean(), atol=1e-5)
  _close(met["ratio_mean"], ratio[m].mean())
  assert set(met) >= {"clip_frac", "approx_kl", "ratio_mean"}
  assert all(v.dtype == jnp.float32 and v.shape == () for v in met.values())
  grad = jax.grad(lambda lp: ppo_policy_loss(lp, old, adv, m, clip_low=0.2, clip_high=0.28,
                                             agg=agg)[0])(logp)
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~m] == 0)


def test_ppo_clip_higher_dual_clip_and_extreme_ratios_hand_cases():
  one = jnp.ones((1, 1), bool)
  f = lambda lr, a, **kw: float(ppo_policy_loss(jnp.full((1, 1), lr), jnp.zeros((1, 1)),
                                                jnp.full((1, 1), a), one, **kw)[0])
  # ratio e^0.5 = 1.65, A = +1: clipped at 1 + clip_high -> loss -1.28 (clip-higher: not -1.2)
  assert f(0.5, 1.0, clip_low=0.2, clip_high=0.28) == pytest.approx(-1.28)
  # ratio e^-0.5 = 0.61, A = -1: clipped at 1 - clip_low -> max(0.61, 0.8) = 0.8
  assert f(-0.5, -1.0, clip_low=0.2, clip_high=0.28) == pytest.approx(0.8)
  # ratio e^2 = 7.39, A = -1: unclipped loss 7.39, dual clip c = 3 bounds it at 3
  assert f(2.0, -1.0, clip_low=0.2, clip_high=0.2) == pytest.approx(math.exp(2), rel=1e-5)
  assert f(2.0, -1.0, clip_low=0.2, clip_high=0.2, dual_clip=3.0) == pytest.approx(3.0)
  # extreme log-ratio: clamped at 20 before exp -> finite loss and finite gradient
  assert f(500.0, -1.0, clip_low=0.2, clip_high=0.2) == pytest.approx(math.exp(20), rel=1e-5)
  g = jax.grad(lambda lp: ppo_policy_loss(lp, jnp.zeros((1, 1)), -jnp.ones((1, 1)), one,
                                          clip_low=0.2, clip_high=0.2)[0])(jnp.full((1, 1), 500.))
  assert np.all(np.isfinite(g))
  with pytest.raises(ValueError, match="dual_clip"):
    f(0.0, 1.0, clip_low=0.2, clip_high=0.2, dual_clip=0.5)


def test_value_loss_matches_reference_and_explained_variance():
  m = _masks()
  v = RNG.normal(size=m.shape).astype(np.float32)
  old = v + RNG.normal(size=m.shape).astype(np.float32) * 0.5
  ret = RNG.normal(size=m.shape).astype(np.float32)
  loss, met = value_loss(v, old, ret, m, clip=0.2)
  vc = old + np.clip(v - old, -0.2, 0.2)
  want = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2)
  _close(loss, want[m].mean(), atol=1e-5)
  _close(met["vf_clip_frac"], ((vc - ret) ** 2 > (v - ret) ** 2)[m].mean())
  _close(met["explained_variance"], 1 - np.var((ret - v)[m]) / np.var(ret[m]), atol=1e-5)
  # clip off: plain 0.5 MSE.  Hand case: perfect values explain all variance; flat returns -> 0
  loss0, _ = value_loss(v, old, ret, m, clip=0.0)
  _close(loss0, 0.5 * ((v - ret) ** 2)[m].mean(), atol=1e-5)
  r = jnp.array([[1.0, 2.0, 3.0]])
  one = jnp.ones((1, 3), bool)
  assert float(value_loss(r, r, r, one, clip=0.2)[1]["explained_variance"]) == pytest.approx(1.0)
  assert float(value_loss(r, r, jnp.ones((1, 3)), one, clip=0.2)[1]["explained_variance"]) == 0


def test_entropy_bonus_and_sft_hand_cases():
  m = jnp.array([[1, 1, 0]], bool)
  loss, met = entropy_bonus(jnp.array([[1.0, 3.0, 99.0]]), m, coef=0.01)
  assert float(loss) == pytest.approx(-0.02) and float(met["entropy"]) == pytest.approx(2.0)
  loss, met = sft_loss(jnp.log(jnp.array([[0.5, 0.25, 1e-30]])), m)
  assert float(loss) == pytest.approx(1.5 * math.log(2))
  assert float(met["ppl"]) == pytest.approx(2 ** 1.5, rel=1e-5) and float(met["tokens"]) == 2


def _np_logsig(x):
  return -np.log1p(np.exp(-x))


def test_dpo_losses_hand_and_reference():
  pc, pr = np.array([-5.0, -3.0, -7.0]), np.array([-6.0, -2.0, -7.0])
  rc, rr = np.array([-5.5, -3.0, -6.0]), np.array([-5.5, -3.0, -8.0])
  h = (pc - rc) - (pr - rr)  # [1, -1, -2]
  beta = 0.5
  loss, met = dpo_loss(pc, pr, rc, rr, beta=beta)
  _close(loss, -_np_logsig(beta * h).mean())
  # implicit rewards beta*(pol - ref): chosen [.25, 0, -.5], rejected [-.25, .5, .5]
  _close(met["chosen_reward"], 0.25 / 3 - 0.5 / 3)
  _close(met["rejected_reward"], 0.25)
  _close(met["reward_margin"], beta * h.mean())
  _close(met["pref_accuracy"], 1 / 3)
  ls = 0.1
  loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="cdpo", label_smoothing=ls)
  _close(loss, (-(1 - ls) * _np_logsig(beta * h) - ls * _np_logsig(-beta * h)).mean())
  loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")
  _close(loss, ((h - 1 / (2 * beta)) ** 2).mean())
  # a padding pair holding NaN is excluded from the loss and from the gradient
  nan_pc = np.concatenate([pc, [np.nan]])
  pad = lambda a: np.concatenate([a, [0.0]])
  valid = np.array([1, 1, 1, 0], bool)
  f = lambda p: dpo_loss(p, pad(pr), pad(rc), pad(rr), beta=beta, valid_B=valid)[0]
  _close(f(nan_pc), -_np_logsig(beta * h).mean())
  assert np.all(np.isfinite(jax.grad(f)(jnp.asarray(nan_pc))))


def test_bradley_terry_hand_case():
  loss, met = bradley_terry_loss(jnp.array([1.0, 0.0, 2.0]), jnp.array([0.0, 0.0, 3.0]))
  # -log sigmoid of margins [1, 0, -1]; the tie counts as wrong
  want = (math.log1p(math.exp(-1)) + math.log(2) + math.log1p(math.exp(1))) / 3
  assert float(loss) == pytest.approx(want, rel=1e-6)
  assert float(met["accuracy"]) == pytest.approx(1 / 3)
  assert float(met["margin"]) == pytest.approx(0.0)


# ----------------------------------------------------------- global aggregation contract


def _toy_loss(w_F, batch, agg, denom=None):
  """A linear "policy" and "critic" so the gradient reaches a replicated parameter."""
  x_BTF, old_BT, adv_BT, ret_BT, m_BT = batch
  logp_BT = -jax.nn.softplus(x_BTF @ w_F)
  v_BT = x_BTF @ (w_F * 0.5)
  pg, _ = ppo_policy_loss(logp_BT, old_BT, adv_BT, m_BT, clip_low=0.2, clip_high=0.3,
                          dual_clip=3.0, agg=agg, denom=denom)
  vf, _ = value_loss(v_BT, ret_BT * 0.9, ret_BT, m_BT, clip=0.2, agg=agg, denom=denom)
  ent, _ = entropy_bonus(-logp_BT, m_BT, coef=0.01, agg=agg, denom=denom)
  return pg + 0.5 * vf + ent


def _toy_batch(b=8, t=6, f=5):
  m = np.ones((b, t), bool)
  m[0, 3:] = m[1, :2] = m[5, :] = False
  m[6, 1:] = False
  m[7, 2:] = False
  x = RNG.normal(size=(b, t, f)).astype(np.float32)
  x[~m] = 50.0  # padding garbage (finite: a NaN feature would poison x^T @ cotangent anyway)
  old = -np.abs(RNG.normal(size=(b, t))).astype(np.float32)
  adv = RNG.normal(size=(b, t)).astype(np.float32)
  ret = RNG.normal(size=(b, t)).astype(np.float32)
  old[~m], adv[~m], ret[~m] = np.nan, np.nan, np.inf
  return RNG.normal(size=f).astype(np.float32), (x, old, adv, ret, m)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_and_grad_same_on_4_dp_devices_and_over_micro_batches(agg):
  w, batch = _toy_batch()
  fn = jax.jit(jax.value_and_grad(lambda w, b: _toy_loss(w, b, agg)))
  ref_loss, ref_grad = fn(jax.device_put(w, jax.devices()[0]),
                          jax.device_put(batch, jax.devices()[0]))
  assert np.isfinite(ref_loss) and np.all(np.isfinite(ref_grad))

  m4 = mesh(dp=4)
  sharded = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(m4, P("dp"))), batch)
  assert len(sharded[0].sharding.device_set) == 4
  loss4, grad4 = fn(jax.device_put(w, NamedSharding(m4, P())), sharded)
  _close(loss4, ref_loss, rtol=1e-5)
  _close(grad4, ref_grad, rtol=1e-5)

  # gradient accumulation: micro-batches of 3, 3, 2 rows with the full batch's count
  denom = agg_count(batch[-1], mode=agg)
  step = jax.value_and_grad(lambda w, b: _toy_loss(w, b, agg, denom))
  loss_acc, grad_acc = 0.0, 0.0
  for sl in (slice(0, 3), slice(3, 6), slice(6, 8)):
    l, g = step(w, tuple(a[sl] for a in batch))
    loss_acc, grad_acc = loss_acc + l, grad_acc + g
  _close(loss_acc, ref_loss, rtol=1e-5)
  _close(grad_acc, ref_grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------- GSPO, CISPO, shaping, SimPO, ORPO, KTO (issue 26)


def _fd_grad(f, x, m, h=1e-4):
  """Central differences of a numpy loss ``f`` (float64) at the valid entries of ``x``."""
  x = x.astype(np.float64)
  g = np.zeros_like(x)
  for idx in zip(*np.nonzero(m)):
    e = np.zeros_like(x)
    e[idx] = h
    g[idx] = (f(x + e) - f(x - e)) / (2 * h)
  return g


def _np_gspo(logp, old, adv, m, cl, ch, token, agg, logp0=None):
  """GSPO per the paper: s = exp(mean_t log-ratio) per row, clipped per row; the token variant
  s_t = sg(s) * exp(logp_t - sg(logp_t)) (``logp0``: the stopped values)."""
  n = np.maximum(m.sum(-1), 1)
  s = np.exp(np.clip(np.where(m, logp - old, 0).sum(-1) / n, -10, 10))
  if token:
    base = logp if logp0 is None else logp0
    s0 = np.exp(np.clip(np.where(m, base - old, 0).sum(-1) / n, -10, 10))
    s_t = s0[:, None] * np.exp(logp - base)
  else:
    s_t = np.broadcast_to(s[:, None], m.shape)
  pg = np.maximum(-adv * s_t, -adv * np.clip(s_t, 1 - cl, 1 + ch))
  return _np_agg(np.where(m, pg, 0), m, agg)


def _policy_case():
  m = _masks()
  logp = RNG.normal(size=m.shape) * 0.3 - 1.0
  old = logp + RNG.normal(size=m.shape) * 0.2
  adv = np.repeat(RNG.normal(size=(m.shape[0], 1)), m.shape[1], 1)  # one advantage per row
  return m, logp, old, adv


@pytest.mark.parametrize("token", [False, True], ids=["gspo", "gspo_token"])
@pytest.mark.parametrize("agg", ["seq_mean_token_mean", "token_mean"])
def test_gspo_matches_reference_values_and_gradients(token, agg):
  m, logp, old, adv = _policy_case()
  cl, ch = 0.05, 0.08
  bad = lambda a, v: np.where(m, a, v).astype(np.float32)
  f = lambda lp: gspo_policy_loss(lp, bad(old, np.inf), bad(adv, np.nan), m, clip_low=cl,
                                  clip_high=ch, token_level=token, agg=agg)
  loss, met = f(bad(logp, np.nan))
  _close(loss, _np_gspo(logp, old, adv, m, cl, ch, token, agg), atol=1e-5)
  grad = jax.grad(lambda lp: f(lp)[0])(bad(logp, np.nan))
  ref = _fd_grad(lambda lp: _np_gspo(lp, old, adv, m, cl, ch, token, agg, logp0=logp), logp, m)
  _close(grad, ref, atol=2e-4, rtol=1e-3)
  assert np.all(np.asarray(grad)[~m] == 0)
  assert 0 <= float(met["clip_frac"]) <= 1 and np.isfinite(float(met["approx_kl"]))


def test_gspo_token_has_gspo_gradient_with_sequence_advantages():
  m, logp, old, adv = _policy_case()
  g = [jax.grad(lambda lp: gspo_policy_loss(lp, old, adv, m, clip_low=0.05, clip_high=0.08,
                                            token_level=t)[0])(logp.astype(np.float32))
       for t in (False, True)]
  _close(g[0], g[1], atol=1e-6)
  # Sequence-level clipping: a row whose ratio leaves the range gets no gradient at all
  one = np.ones((1, 3), bool)
  lp = np.array([[0.3, 0.3, 0.3]], np.float32)  # s = e^0.3 > 1 + 0.08 with A > 0: clipped
  gr = jax.grad(lambda x: gspo_policy_loss(x, np.zeros_like(lp), np.ones_like(lp), one,
                                           clip_low=0.05, clip_high=0.08)[0])(lp)
  assert np.all(np.asarray(gr) == 0)


def _np_cispo(logp, old, adv, m, cl, ch, agg, coef=None):
  r = np.exp(np.clip(logp - old, -20, 20))
  c = np.clip(r, max(1 - cl, 0), 1 + ch) * adv if coef is None else coef
  return _np_agg(np.where(m, -c * logp, 0), m, agg)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_cispo_matches_reference_values_and_stopped_weight_gradient(agg):
  m, logp, old, _ = _policy_case()
  old = logp + RNG.normal(size=m.shape) * 0.5  # ratios on both sides of the clip
  adv = RNG.normal(size=m.shape)
  cl, ch = 1.0, 0.2  # MiniMax-M1: no lower bound
  f = lambda lp: cispo_policy_loss(lp, old.astype(np.float32), adv.astype(np.float32), m,
                                   clip_low=cl, clip_high=ch, agg=agg)
  loss, met = f(logp.astype(np.float32))
  _close(loss, _np_cispo(logp, old, adv, m, cl, ch, agg), atol=1e-5)
  r = np.exp(logp - old)
  coef = np.clip(r, 0, 1 + ch) * adv
  ref = _fd_grad(lambda lp: _np_cispo(lp, old, adv, m, cl, ch, agg, coef=coef), logp, m)
  _close(jax.grad(lambda lp: f(lp)[0])(logp.astype(np.float32)), ref, atol=2e-5, rtol=1e-4)
  _close(met["clip_frac"], (r > 1 + ch)[m].mean())
  # A clipped token keeps its gradient (only its weight is bounded), unlike PPO's clip.
  one = np.ones((1, 1), bool)
  g = jax.grad(lambda x: cispo_policy_loss(x, np.zeros((1, 1)), np.ones((1, 1)), one,
                                           clip_low=1.0, clip_high=0.2)[0])(np.full((1, 1), 2.0))
  assert float(g[0, 0]) == pytest.approx(-1.2)
  with pytest.raises(ValueError, match="dual_clip"):
    cispo_policy_loss(logp, old, adv, m, clip_low=1.0, clip_high=0.2, dual_clip=3.0)


def test_policy_loss_registry_ppo_is_the_clipped_surrogate():
  m, logp, old, adv = _policy_case()
  kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=0.0, agg="token_mean", denom=None,
            max_len=None)
  for name, fn in POLICY_LOSSES.items():
    loss, met = fn(logp, old, adv, m, **kw)
    assert np.isfinite(float(loss)) and {"clip_frac", "approx_kl"} <= set(met), name
  assert float(POLICY_LOSSES["ppo"](logp, old, adv, m, **kw)[0]) == float(
      ppo_policy_loss(logp, old, adv, m, clip_low=0.2, clip_high=0.28)[0])


def test_overlong_penalty_hand_cases():
  got = overlong_penalty(np.array([1, 12, 13, 14, 16, 20]), max_len=16, buffer=4, penalty=1.0)
  _close(got, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
  with pytest.raises(ValueError, match="buffer"):
    overlong_penalty(np.array([1]), max_len=4, buffer=5)


def _np_informative(s, v, n):
  out = []
  for g in range(len(s) // n):
    vals = s[g * n:(g + 1) * n][v[g * n:(g + 1) * n]]
    out.append(len(vals) >= 2 and vals.max() > vals.min())
  return np.array(out)


@pytest.mark.parametrize("seed", range(4))
def test_dynamic_sampling_keeps_size_never_zero_variance_and_counts_shortfall(seed):
  rng = np.random.default_rng(seed)
  n, gen, keep = 4, 12, 5
  s = rng.integers(0, 2, size=gen * n).astype(np.float32)  # many all-equal groups
  s[:3 * n] = 1.0  # the first three groups say nothing
  v = rng.random(gen * n) > 0.1
  rows, valid, met = select_groups(s, v, group_size=n, num_groups=keep)
  rows, valid = np.asarray(rows), np.asarray(valid)
  assert rows.shape == valid.shape == (keep * n,)  # the batch keeps its size
  inf = _np_informative(s, v, n)
  for k in range(keep):  # each selected slot is one whole generated group
    g = rows[k * n] // n
    assert np.array_equal(rows[k * n:(k + 1) * n], g * n + np.arange(n))
    sel = valid[k * n:(k + 1) * n]
    if sel.any():  # a trained group has reward variance
      assert inf[g] and np.std(s[g * n:(g + 1) * n][sel], ddof=1) > 0
  assert float(met["dynamic/informative_groups"]) == inf.sum()
  assert float(met["dynamic/kept_groups"]) == min(inf.sum(), keep)
  assert float(met["dynamic/shortfall_groups"]) == keep - min(inf.sum(), keep)
  # The informative groups kept are the first ones generated, in order.
  kept = [rows[k * n] // n for k in range(keep) if valid[k * n:(k + 1) * n].any()]
  assert kept == list(np.nonzero(inf)[0][:keep])


def test_dynamic_sampling_stops_at_its_limit_with_a_count():
  s = np.zeros(16, np.float32)  # every group uninformative: over-sampling cannot help
  s[4:8] = [0, 1, 0, 1]  # one informative group of four
  rows, valid, met = select_groups(s, np.ones(16, bool), group_size=4, num_groups=3)
  assert np.asarray(valid).sum() == 4 and list(np.asarray(rows)[:4]) == [4, 5, 6, 7]
  assert float(met["dynamic/shortfall_groups"]) == 2
  # the advantages of what trains: no row of a masked group gets any
  adv = group_advantages(np.asarray(s)[np.asarray(rows)], group_size=4, valid_B=valid)
  assert np.all(np.asarray(adv)[~np.asarray(valid)] == 0) and np.any(np.asarray(adv) != 0)


def _np_off_policy(t, b, m, mode, cap):
  lw = np.where(m, t - b, 0.0)
  if mode.startswith("seq_"):
    lw = np.broadcast_to(lw.sum(-1, keepdims=True), m.shape)
  w = np.exp(np.clip(lw, -20, 20))
  if mode.endswith("tis"):
    return np.where(m, np.minimum(w, cap), 0), m
  keep = m & (w <= cap) & (w >= 1 / cap)
  return np.where(keep, w, 0), keep


@pytest.mark.parametrize("mode", ["tis", "mis", "seq_tis", "seq_mis"])
def test_off_policy_weights_match_reference(mode):
  m = _masks()
  t = RNG.normal(size=m.shape) * 0.2 - 1
  b = t + RNG.normal(size=m.shape) * 0.6
  w, keep, met = off_policy_weights(t, np.where(m, b, np.nan), m, mode=mode, cap=1.5)
  rw, rkeep = _np_off_policy(t, b, m, mode, 1.5)
  _close(w, rw, rtol=1e-5)
  assert np.array_equal(np.asarray(keep), rkeep)
  lw = np.where(m, t - b, 0.0)
  raw = np.exp(np.broadcast_to(lw.sum(-1, keepdims=True), m.shape) if "seq" in mode else lw)
  out = (raw > 1.5) if mode.endswith("tis") else ~rkeep
  _close(met["is_clipped_frac"], out[m].mean())
  _close(met["is_weight_mean"], rw[rkeep].mean(), rtol=1e-5)
  assert 0 < float(met["is_clipped_frac"]) < 1  # the case exercises the cap
  with pytest.raises(ValueError, match="cap"):
    off_policy_weights(t, b, m, mode=mode, cap=1.0)


def _pref_case(b=6):
  pc, pr = -np.abs(RNG.normal(size=b)) * 4 - 1, -np.abs(RNG.normal(size=b)) * 4 - 1
  lc, lr = RNG.integers(1, 6, size=b).astype(np.float64), RNG.integers(1, 6, size=b) * 1.0
  valid = np.ones(b, bool)
  valid[2] = False
  return pc, pr, lc, lr, valid


def _np_simpo(pc, pr, lc, lr, v, beta, gamma):
  per = -_np_logsig(beta * (pc / lc - pr / lr) - gamma)
  return per[v].mean()


def _np_orpo(pc, pr, lc, lr, v, beta):
  ac, ar = np.minimum(pc / lc, -1e-6), np.minimum(pr / lr, -1e-6)
  odds = lambda a: a - np.log1p(-np.exp(a))
  per = -ac - beta * _np_logsig(odds(ac) - odds(ar))
  return per[v].mean()


def _np_kto(p, r, good, v, beta, wd, wu, z0=None):
  lr = p - r
  z = max(lr[v].mean(), 0.0) if z0 is None else z0
  sig = lambda x: 1 / (1 + np.exp(-x))
  per = np.where(good, wd * (1 - sig(beta * (lr - z))), wu * (1 - sig(beta * (z - lr))))
  return per[v].mean()


def test_simpo_orpo_kto_match_reference_values_and_gradients():
  pc, pr, lc, lr, v = _pref_case()
  f32 = lambda x: np.asarray(x, np.float32)
  garbage = lambda x: np.where(v, x, np.nan).astype(np.float32)
  # SimPO
  simpo = lambda a, b: simpo_loss(a, b, lc, lr, beta=2.0, gamma=0.5, valid_B=v)[0]
  _close(simpo(garbage(pc), garbage(pr)), _np_simpo(pc, pr, lc, lr, v, 2.0, 0.5), rtol=1e-5)
  g = jax.grad(simpo)(f32(pc), f32(pr))
  _close(g, _fd_grad(lambda a: _np_simpo(a, pr, lc, lr, v, 2.0, 0.5), pc, v), atol=1e-5)
  # ORPO
  orpo = lambda a, b: orpo_loss(a, b, lc, lr, beta=0.5, valid_B=v)[0]
  _close(orpo(garbage(pc), garbage(pr)), _np_orpo(pc, pr, lc, lr, v, 0.5), rtol=1e-5)
  g = jax.grad(orpo, argnums=1)(f32(pc), f32(pr))
  _close(g, _fd_grad(lambda b: _np_orpo(pc, b, lc, lr, v, 0.5), pr, v), atol=1e-5)
  # log(1 - e^a) stays finite at a = 0 (a response of probability 1)
  assert np.isfinite(float(orpo_loss(np.zeros(2), np.zeros(2), np.ones(2), np.ones(2),
                                     beta=0.5)[0]))
  # KTO: z0 = max(0, mean log-ratio), a constant
  p, r = np.concatenate([pc, pr]), np.concatenate([pc, pr]) + RNG.normal(size=12) * 0.5
  good, vv = np.arange(12) < 6, np.concatenate([v, v])
  kto = lambda a: kto_loss(a, f32(r), good, beta=0.3, desirable_weight=1.0,
                           undesirable_weight=1.5, valid_B=vv)
  loss, met = kto(f32(p))
  _close(loss, _np_kto(p, r, good, vv, 0.3, 1.0, 1.5), rtol=1e-5)
  z0 = max((p - r)[vv].mean(), 0.0)
  _close(met["kl"], z0, atol=1e-6)
  _close(jax.grad(lambda a: kto(a)[0])(f32(p)),
         _fd_grad(lambda a: _np_kto(a, r, good, vv, 0.3, 1.0, 1.5, z0=z0), p, vv), atol=1e-5)
  # Its reference point is never negative: a policy below the reference compares with 0
  _, met = kto_loss(np.zeros(4), np.ones(4), np.arange(4) < 2, beta=0.3)
  assert float(met["kl"]) == 0.0


def test_new_losses_same_on_4_dp_devices():
  m4 = mesh(dp=4)
  shard = lambda a: jax.device_put(np.asarray(a, np.float32), NamedSharding(
      m4, P("dp", *([None] * (np.ndim(a) - 1)))))
  m = np.ones((8, 5), bool)
  m[1, 3:] = m[4, :] = False
  m[6, 1:] = False
  logp = (RNG.normal(size=m.shape) * 0.3 - 1).astype(np.float32)
  old = (logp + RNG.normal(size=m.shape) * 0.3).astype(np.float32)
  adv = RNG.normal(size=m.shape).astype(np.float32)
  pc, pr, lc, lr = (RNG.normal(size=8).astype(np.float32) - 3, RNG.normal(size=8) - 3,
                    RNG.integers(1, 5, 8), RNG.integers(1, 5, 8))
  cases = {
      "gspo": lambda lp, o, a: gspo_policy_loss(lp, o, a, m, clip_low=0.1, clip_high=0.1)[0],
      "gspo_token": lambda lp, o, a: gspo_policy_loss(lp, o, a, m, clip_low=0.1, clip_high=0.1,
                                                      token_level=True)[0],
      "cispo": lambda lp, o, a: cispo_policy_loss(lp, o, a, m, clip_low=1.0, clip_high=0.2)[0],
      "tis": lambda lp, o, a: jnp.sum(off_policy_weights(lp, o, m, mode="seq_tis",
                                                         cap=2.0)[0] * a),
      "simpo": lambda lp, o, a: simpo_loss(lp[:, 0], o[:, 0], lc, lr, beta=2.0, gamma=1.0)[0],
      "orpo": lambda lp, o, a: orpo_loss(lp[:, 0], o[:, 0], lc, lr, beta=0.5)[0],
      "kto": lambda lp, o, a: kto_loss(lp[:, 0], o[:, 0], a[:, 0] > 0, beta=0.3)[0],
  }
  for name, f in cases.items():
    fn = jax.jit(jax.value_and_grad(f))
    one = fn(logp, old, adv)
    four = fn(shard(logp), shard(old), shard(adv))
    assert len(four[1].sharding.device_set) == 4 or name in ("simpo", "orpo", "kto")
    _close(four[0], one[0], rtol=1e-5)
    _close(four[1], one[1], rtol=1e-5, atol=1e-7)
