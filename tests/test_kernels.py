"""Kernels against their plain-jnp references: values and gradients, on shapes with ragged tails
(not multiples of any tile), in float32 and bfloat16.  The Pallas kernels run in the Pallas
interpreter on the CPU; a separate test lowers them for CUDA to Triton IR (no GPU needed), and
GPU-marked tests run them compiled when a GPU is present.

Tolerances, as a fraction of the reference's largest magnitude: float32 1e-5 (values) and
1e-4 (gradients): the same math in another summation order.  bfloat16 2e-2: one bf16 rounding
(2^-8) of the outputs, or of the probabilities / logit gradients before the second matmul.
"""

import typing

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jaxrlhf.config import KernelsConfig
from kernels._backend import target_platform, triton_params
from kernels import attention as attn_mod
from kernels import logprob as lp_mod
from kernels.attention import (BlockSizes, DecodeBlockSizes, attention, attention_reference,
                               decode_attention, flash_attention)
from kernels.attention.reference import allowed_mask
from kernels.attention.splash import splash_attention
from kernels.logprob.mosaic import tiles as mosaic_tiles
from kernels.logprob import (logprob_entropy, logprob_entropy_blockwise, logprob_entropy_mosaic,
                             logprob_entropy_pallas, logprob_entropy_reference)
from kernels.numerics import fixed_order_sum

TOL = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 2e-2)}  # (values, gradients)


def assert_close(got, want, tol, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  scale = max(float(np.max(np.abs(want))), 1.0)
  err = float(np.max(np.abs(got - want)))
  assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"


def _with_grads(f, n_args, cot):
  """jit(args -> (outputs, grads of sum(outputs * cot) w.r.t. the first n_args args))."""
  def run(*args):
    out, vjp = jax.vjp(lambda *a: f(*a, *args[n_args:]), *args[:n_args])
    ct = jax.tree.map(lambda o, c: c.astype(o.dtype), out, cot)
    return out, vjp(ct)
  return jax.jit(run)


# ------------------------------------------------------------------------------- log-prob

def _logprob_case(key, b, t, d, v, dtype):
  k = jax.random.split(key, 5)
  h = jax.random.normal(k[0], (b, t, d), jnp.float32).astype(dtype)
  w = (jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5 * 3).astype(dtype)
  tgt = jax.random.randint(k[2], (b, t), 0, v)
  cot = (jax.random.normal(k[3], (b, t)), jax.random.normal(k[4], (b, t)))
  return h, w, tgt, cot


@pytest.mark.parametrize("dtype,shape,xla_block_v", [
    # N=18, D=40, V=70: every axis has a ragged tail (Pallas tiles 16, XLA tile 32); the
    # Pallas dW runs in vocabulary chunks of 32, the last one shifted back to end at V
    (jnp.float32, (2, 9, 40, 70), 32),
    # XLA tiles dividing V exactly
    (jnp.bfloat16, (1, 21, 48, 100), 25),
])
def test_logprob_pallas_and_xla_match_reference(dtype, shape, xla_block_v):
  h, w, tgt, cot = _logprob_case(jax.random.key(0), *shape, dtype)
  tol_v, tol_g = TOL[dtype]
  want, want_g = _with_grads(logprob_entropy_reference, 2, cot)(h, w, tgt)
  impls = {
      "pallas": lambda h, w, t: logprob_entropy_pallas(
          h, w, t, block_sizes=lp_mod.BlockSizes(16, 16, 16, vocab_chunk=32), interpret=True),
      "pallas fwd + xla bwd": lambda h, w, t: logprob_entropy_pallas(
          h, w, t, block_sizes=lp_mod.BlockSizes(16, 16, 16, vocab_chunk=32), interpret=True,
          backward="xla"),
      "xla": lambda h, w, t: logprob_entropy_blockwise(h, w, t, block_v=xla_block_v),
  }
  for name, f in impls.items():
    got, got_g = _with_grads(f, 2, cot)(h, w, tgt)
    assert got[0].dtype == got[1].dtype == jnp.float32
    assert_close(got[0], want[0], tol_v, f"{name} logp")
    assert_close(got[1], want[1], tol_v, f"{name} entropy")
    assert got_g[0].dtype == h.dtype and got_g[1].dtype == w.dtype
    assert_close(got_g[0], want_g[0], tol_g, f"{name} dh")
    assert_close(got_g[1], want_g[1], tol_g, f"{name} dW")


# ------------------------------------------------------------------------------ attention

def _attention_case(key, b, t, s, h, kh, d, q_offset, dtype):
  """Random q/k/v; left-padded keys (so some early queries see nothing) below ``q_offset``."""
  k = jax.random.split(key, 5)
  q = jax.random.normal(k[0], (b, t, h, d), jnp.float32).astype(dtype)
  kk = jax.random.normal(k[1], (b, s, kh, d), jnp.float32).astype(dtype)
  v = jax.random.normal(k[2], (b, s, kh, d), jnp.float32).astype(dtype)
  filled = q_offset + t
  lens = jax.random.randint(k[3], (b,), 1, filled + 1)
  slots = jnp.arange(s)[None]
  kv_mask = (slots >= filled - lens[:, None]) & (slots < filled)
  seen_BT = allowed_mask(t, kv_mask, q_offset).any(-1)
  cot = jax.random.normal(k[4], (b, t, h, d)) * seen_BT[:, :, None, None]
  return q, kk, v, kv_mask, seen_BT, cot


@pytest.mark.parametrize("dtype,shape", [
    # (B, T, S, H, K, D, q_offset): GQA, T and S not multiples of 16, D=8 padded to 16
    (jnp.float32, (2, 19, 19, 4, 2, 8, 0)),
    # a chunk of 5 queries at a traced cache offset 30, over a 37-slot cache
    (jnp.float32, (2, 5, 37, 4, 1, 32, 30)),
    (jnp.bfloat16, (1, 33, 33, 2, 2, 16, 0)),
])
def test_flash_attention_matches_reference(dtype, shape):
  b, t, s, h, kh, d, off = shape
  q, k, v, kv_mask, seen, cot = _attention_case(jax.random.key(2), b, t, s, h, kh, d, off, dtype)
  off = jnp.int32(off)  # traced, as a KV-cache index is
  tol_v, tol_g = TOL[dtype]
  bs = BlockSizes(16, 16, 16, 16)
  got, got_g = _with_grads(lambda q, k, v, m, o: flash_attention(
      q, k, v, m, o, block_sizes=bs, interpret=True), 3, cot)(q, k, v, kv_mask, off)
  want, want_g = _with_grads(attention_reference, 3, cot)(q, k, v, kv_mask, off)
  rows = seen[:, :, None, None]
  assert got.dtype == dtype
  assert_close(jnp.where(rows, got, 0), jnp.where(rows, want, 0), tol_v, "output")
  # Documented divergence: a query that sees no key gets 0 (the reference: mean of V).
  assert not np.any(np.asarray(jnp.where(rows, 0, got), np.float32))
  for name, g, r in zip("qkv", got_g, want_g):
    assert g.dtype == dtype
    assert_close(g, r, tol_g, f"d{name}")


@pytest.mark.parametrize("dtype,shape", [
    # one new token per sequence, 70-slot cache, 4 query heads per KV head, 3 key splits
    (jnp.float32, (3, 1, 70, 8, 2, 16, 41)),
    # three new tokens, plain multi-head, D=24 (padded to 32), cache exactly full
    (jnp.bfloat16, (2, 3, 50, 4, 4, 24, 47)),
])
@pytest.mark.parametrize("kv_layout", ["bskd", "bksd"])
def test_decode_attention_matches_reference(dtype, shape, kv_layout):
  b, t, s, h, kh, d, off = shape
  q, k, v, kv_mask, seen, cot = _attention_case(jax.random.key(3), b, t, s, h, kh, d, off, dtype)
  off = jnp.int32(off)
  bs = DecodeBlockSizes(block_k=16, target_programs=3 * b * kh)
  # The KV cache's head-major layout: the same keys and values, [B, K, S, D].
  lay = (lambda x: x) if kv_layout == "bskd" else (lambda x: x.transpose(0, 2, 1, 3))
  got, got_g = _with_grads(lambda q, k, v, m, o: decode_attention(
      q, k, v, m, o, block_sizes=bs, interpret=True, kv_layout=kv_layout), 3, cot)(
          q, lay(k), lay(v), kv_mask, off)
  want, want_g = _with_grads(attention_reference, 3, cot)(q, k, v, kv_mask, off)
  tol_v, tol_g = TOL[dtype]
  assert_close(jnp.where(seen[:, :, None, None], got, 0), want, tol_v, "output")
  for name, g, r in zip("qkv", got_g, want_g):  # the reference's gradient, by design
    assert_close(g if name == "q" else lay(g), r, tol_g, f"d{name}")


@pytest.mark.parametrize("max_rows,kv_layout", [(128, "bskd"), (8, "bksd"), (4, "kbsd")])
def test_decode_attention_lse_gives_the_output_and_its_log_sum_exp(max_rows, kv_layout):
  """The part-attention the shared-prefix kernel merges: the output of the reference and the
  log-sum-exp of each query's visible scores, with the query rows split over programs
  (``max_rows`` 8 and 4: 3 and 5 programs of 2 and 1 tokens) and every cache layout."""
  from kernels.attention.decode import decode_attention_lse
  b, t, s, h, kh, d, off = 2, 5, 37, 4, 1, 32, 30
  q, k, v, kv_mask, seen, _ = _attention_case(jax.random.key(5), b, t, s, h, kh, d, off,
                                              jnp.float32)
  lay = {"bskd": lambda x: x, "bksd": lambda x: x.transpose(0, 2, 1, 3),
         "kbsd": lambda x: x.transpose(2, 0, 1, 3)}[kv_layout]
  bs = DecodeBlockSizes(block_k=16, target_programs=3 * b * kh, max_rows=max_rows)
  o, lse = decode_attention_lse(q, lay(k), lay(v), kv_mask, jnp.int32(off), block_sizes=bs,
                                interpret=True, kv_layout=kv_layout)
  want = attention_reference(q, k, v, kv_mask, off)
  assert o.dtype == jnp.float32 and lse.shape == (b, t, h)
  assert_close(jnp.where(seen[:, :, None, None], o, 0), want, 1e-5, "output")
  sc = jnp.einsum("bthd,bshd->bths", q, jnp.repeat(k, h // kh, axis=2)) * d ** -0.5
  vis = allowed_mask(t, kv_mask, off)[:, :, None, :]
  want_lse = jax.nn.logsumexp(jnp.where(vis, sc, -jnp.inf), axis=-1)
  assert_close(jnp.where(seen[:, :, None], lse, 0), jnp.where(seen[:, :, None], want_lse, 0),
               1e-5, "lse")
  assert bool(jnp.all(jnp.where(seen[:, :, None], True, lse < -1e29)))  # no key: ~ -1e30


# ----------------------------------------------------------------------- packed segments

def random_segments(rng, b, s, max_segments=4):
  """``[B, S]`` int32 segment ids of a random packing: 1..n contiguous segments of random
  lengths from slot 0, then padding (0); some rows full, some with a tail."""
  seg = np.zeros((b, s), np.int32)
  for i in range(b):
    n = int(rng.integers(1, max_segments + 1))
    cuts = np.sort(rng.choice(np.arange(1, s), size=n, replace=False))
    if i % 2 == 0:
      cuts[-1] = s  # a full row
    start = 0
    for j, end in enumerate(cuts):
      seg[i, start:end] = j + 1
      start = end
  return seg


def test_segment_mask_is_attention_over_each_segment_alone():
  """The definition: a packed row's attention at a segment's tokens equals the attention of
  that segment computed alone (its own row, its own slots), for every segment of a random
  layout."""
  b, s, h, kh, d = 3, 23, 4, 2, 8
  seg = random_segments(np.random.default_rng(0), b, s)
  k = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(k[0], (b, s, h, d))
  kk = jax.random.normal(k[1], (b, s, kh, d))
  v = jax.random.normal(k[2], (b, s, kh, d))
  packed = np.asarray(attention(q, kk, v, jnp.asarray(seg != 0), impl="xla",
                                segment_ids=jnp.asarray(seg)))
  checked = 0
  for i in range(b):
    for sid in range(1, seg[i].max() + 1):
      cols = np.nonzero(seg[i] == sid)[0]
      a, e = cols[0], cols[-1] + 1
      alone = attention(q[i:i + 1, a:e], kk[i:i + 1, a:e], v[i:i + 1, a:e],
                        jnp.ones((1, e - a), bool), impl="xla")
      np.testing.assert_allclose(packed[i, a:e], np.asarray(alone)[0], atol=1e-6)
      checked += 1
  assert checked > b  # several segments per row were compared
  # Without the segment ids the same rows leak across segments: the mask does something.
  leaky = np.asarray(attention(q, kk, v, jnp.asarray(seg != 0), impl="xla"))
  assert np.abs(leaky - packed).max() > 1e-2


@pytest.mark.parametrize("dtype,shape", [
    # (B, S, H, K, D, max segments): ragged S, GQA, several segments per key block of 16
    (jnp.float32, (3, 37, 4, 2, 8, 5)),
    (jnp.bfloat16, (2, 33, 2, 2, 16, 3)),
])
def test_flash_attention_with_segments_matches_reference(dtype, shape):
  """The Pallas flash kernels (interpreted) with segment ids: outputs and dq, dk, dv against
  the reference's segment mask on random layouts; padding rows get 0, as documented."""
  b, s, h, kh, d, n = shape
  seg = jnp.asarray(random_segments(np.random.default_rng(1), b, s, n))
  kv_mask = seg != 0
  k = jax.random.split(jax.random.key(9), 4)
  q = jax.random.normal(k[0], (b, s, h, d), jnp.float32).astype(dtype)
  kk = jax.random.normal(k[1], (b, s, kh, d), jnp.float32).astype(dtype)
  v = jax.random.normal(k[2], (b, s, kh, d), jnp.float32).astype(dtype)
  cot = jax.random.normal(k[3], (b, s, h, d)) * kv_mask[:, :, None, None]
  bs = BlockSizes(16, 16, 16, 16)
  got, got_g = _with_grads(lambda q, k, v, m, sg: flash_attention(
      q, k, v, m, block_sizes=bs, interpret=True, segment_ids=sg), 3, cot)(q, kk, v, kv_mask,
                                                                           seg)
  want, want_g = _with_grads(lambda q, k, v, m, sg: attention_reference(
      q, k, v, m, segment_ids=sg), 3, cot)(q, kk, v, kv_mask, seg)
  tol_v, tol_g = TOL[dtype]
  rows = kv_mask[:, :, None, None]
  assert_close(jnp.where(rows, got, 0), jnp.where(rows, want, 0), tol_v, "output")
  assert not np.any(np.asarray(jnp.where(rows, 0, got), np.float32))
  for name, g, r in zip("qkv", got_g, want_g):
    assert_close(g, r, tol_g, f"d{name}")
  # The dispatcher sends packed calls to the flash kernels even for short rows (no decode).
  short = lambda q: attention(q, kk[:, :8], v[:, :8], kv_mask[:, :8], impl="pallas_interpret",
                              segment_ids=seg[:, :8])
  assert "flash_attention_fwd" in str(jax.make_jaxpr(short)(q[:, :8]))
  with pytest.raises(ValueError, match="cudnn.*segment ids.*data.pack=false"):
    attention(q, kk, v, kv_mask, impl="cudnn", segment_ids=seg)


# ----------------------------------------------------------------------------- dispatcher

def _has_pallas_call(f, *args):
  return "pallas_call" in str(jax.make_jaxpr(f)(*args))


def test_dispatcher_uses_xla_on_cpu_and_honours_overrides():
  assert target_platform() == "cpu"  # what "auto" chooses by
  h, w, tgt, _ = _logprob_case(jax.random.key(4), 1, 3, 16, 40, jnp.float32)
  lp = lambda impl: (lambda h, w, t: logprob_entropy(h, w, t, impl=impl))
  assert not _has_pallas_call(lp("auto"), h, w, tgt)
  assert _has_pallas_call(lp("pallas_interpret"), h, w, tgt)
  np.testing.assert_allclose(lp("pallas_interpret")(h, w, tgt)[0], lp("auto")(h, w, tgt)[0],
                             atol=1e-5)
  # "naive" is the full-logits reference: its jaxpr holds a [B, T, V] array.
  assert "1,3,40" in str(jax.make_jaxpr(lp("naive"))(h, w, tgt)).replace(" ", "")

  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(5), 1, 20, 20, 2, 1, 16, 0,
                                           jnp.float32)
  at = lambda impl: (lambda q, k, v: attention(q, k, v, kv_mask, 0, impl=impl))
  assert not _has_pallas_call(at("auto"), q, k, v)
  jaxpr = str(jax.make_jaxpr(at("pallas_interpret"))(q, k, v))
  assert "flash_attention_fwd" in jaxpr  # T=20 > DECODE_MAX_T: the prefill kernel
  jaxpr = str(jax.make_jaxpr(at("pallas_interpret"))(q[:, :1], k, v))
  assert "decode_attention" in jaxpr
  # The KV cache's head-major layout gives the same result on every path.
  head_major = lambda x: x.transpose(0, 2, 1, 3)
  for impl, tq in (("xla", 20), ("pallas_interpret", 20), ("pallas_interpret", 1)):
    want = attention(q[:, :tq], k, v, kv_mask, 0, impl=impl)
    got = attention(q[:, :tq], head_major(k), head_major(v), kv_mask, 0, impl=impl,
                    kv_layout="bksd")
    np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{impl}, T={tq}")
  with pytest.raises(ValueError, match=r"kv_layout='bsdk'; choose from bskd, bksd"):
    attention(q, k, v, kv_mask, 0, kv_layout="bsdk")


def test_dispatcher_errors_name_the_choices():
  h, w, tgt, _ = _logprob_case(jax.random.key(6), 1, 2, 16, 20, jnp.float32)
  with pytest.raises(ValueError, match=r"kernels.logprob='triton' is not valid; choose one of "
                                       r"'auto', 'xla', 'pallas', 'pallas_interpret', 'naive'"):
    logprob_entropy(h, w, tgt, impl="triton")
  with pytest.raises(ValueError, match=r"needs a GPU.*kernels.logprob=pallas_interpret"):
    logprob_entropy(h, w, tgt, impl="pallas")
  q = jnp.zeros((1, 2, 2, 16))
  kv = jnp.zeros((1, 2, 1, 16))
  mask = jnp.ones((1, 2), bool)
  with pytest.raises(ValueError, match=r"kernels.attention='flash' is not valid"):
    attention(q, kv, kv, mask, impl="flash")
  with pytest.raises(ValueError, match=r"'cudnn' needs an NVIDIA GPU"):
    attention(q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), mask,
              impl="cudnn")
  with pytest.raises(ValueError, match=r"3 query heads is not a multiple of 2 KV heads"):
    flash_attention(jnp.zeros((1, 2, 3, 16)), jnp.zeros((1, 2, 2, 16)), jnp.zeros((1, 2, 2, 16)),
                    mask, interpret=True)


def _mesh_on(platform: str):
  """An abstract one-device mesh of ``platform``'s devices: what a program compiled for them
  (the planner's compile-only targets) is traced under, on this CPU host."""
  from jax._src.mesh import AbstractDevice
  device = AbstractDevice(device_kind=platform, num_cores=None, platform=platform)
  return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)


def test_kernel_choices_follow_the_target_mesh_not_the_host():
  """Traced for GPU devices on this CPU host, a program makes the GPU's choices, not the
  host's: "auto" takes the Pallas (Triton) kernels; traced for a TPU, "auto" takes the TPU
  kernels (Mosaic log-prob, jax's splash attention); traced for the CPU it is XLA.  The
  reference attention's matmuls read bfloat16 on every platform (float32 products: the bits a
  decode step and the full forward share, docs/rollout.md)."""
  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(7), 1, 20, 20, 2, 1, 16, 0,
                                           jnp.bfloat16)
  h, w, tgt, _ = _logprob_case(jax.random.key(8), 1, 3, 16, 40, jnp.bfloat16)
  at = lambda q, k, v: attention(q, k, v, kv_mask, 0)
  lp = lambda h, w, t: logprob_entropy(h, w, t)

  def dot_dtypes():
    jaxpr = jax.make_jaxpr(lambda q, k, v: attention_reference(q, k, v, kv_mask, 0))(q, k, v)
    return {str(e.invars[0].aval.dtype) for e in jaxpr.eqns if e.primitive.name == "dot_general"}

  with jax.sharding.use_abstract_mesh(_mesh_on("cuda")):
    assert "flash_attention_fwd" in _kernel_names(at, q, k, v)
    assert _kernel_names(lp, h, w, tgt) == {"logprob_entropy_fwd"}
    assert dot_dtypes() == {"bfloat16"}
  with jax.sharding.use_abstract_mesh(_mesh_on("tpu")):
    assert any(n.startswith("splash_mha_fwd") for n in _kernel_names(at, q, k, v))
    assert _kernel_names(lp, h, w, tgt) == {"logprob_entropy_tpu_fwd"}
    assert not _kernel_names(lambda q, k, v: attention(q[:, :1], k, v, kv_mask, 0), q, k, v)
    assert dot_dtypes() == {"bfloat16"}
  with jax.sharding.use_abstract_mesh(_mesh_on("cpu")):
    assert not _has_pallas_call(at, q, k, v) and not _has_pallas_call(lp, h, w, tgt)
    assert dot_dtypes() == {"bfloat16"}


def _kernel_names(f, *args) -> set[str]:
  """The names of the Pallas kernels in ``f``'s jaxpr, nested ones included."""
  return _pallas_names(jax.make_jaxpr(f)(*args).jaxpr)


def _pallas_names(jaxpr) -> set[str]:
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      out.add(str(eqn.params["name"]).split()[0])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out |= _pallas_names(sub)
  return out


def _attention_loop(q, k, v, kv_mask, q_offset, scale, window, softcap):
  """Sliding-window, soft-capped GQA attention one query at a time in numpy (float64)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, h, d = q.shape
  g = h // k.shape[2]
  out = np.zeros_like(q)
  for bi in range(b):
    for ti in range(t):
      slot = q_offset + ti
      keys = [s for s in range(k.shape[1]) if kv_mask[bi, s] and slot - window < s <= slot]
      for hi in range(h):
        if not keys:
          continue
        z = np.array([q[bi, ti, hi] @ k[bi, s, hi // g] for s in keys]) * scale
        z = softcap * np.tanh(z / softcap)
        p = np.exp(z - z.max())
        out[bi, ti, hi] = (p / p.sum()) @ v[bi, keys, hi // g]
  return out


@pytest.mark.parametrize("width", [1, 7, 32, 100, 576, 8192])
def test_fixed_order_sum_rounds_a_row_alike_in_any_batch_and_with_trailing_zeros(width):
  """The norms', softmaxes' and log-softmaxes' float32 sums (kernels/numerics.py) give a row
  the same bits whatever the batch around it and however many zero lanes follow its last
  non-zero one -- what lets a decode step match the full forward in bf16 -- and are a sum."""
  x = jax.random.normal(jax.random.key(0), (8, 20, width)) * 3
  f = jax.jit(fixed_order_sum)
  full = np.asarray(f(x))
  for rows, cols in ((8, 12), (4, 20), (8, 1), (1, 20), (2, 7)):
    np.testing.assert_array_equal(np.asarray(f(x[:rows, :cols])), full[:rows, :cols])
  for pad in (1, 16, width + 3):
    padded = jnp.pad(x, ((0, 0), (0, 0), (0, pad)))
    np.testing.assert_array_equal(np.asarray(f(padded)), full)
  np.testing.assert_allclose(full, np.asarray(x, np.float64).sum(-1), rtol=1e-5, atol=1e-4)
  # jnp.sum gives no such promise: XLA:CPU vectorises a short minor axis by the array's shape.


@pytest.mark.parametrize("t,q_offset", [(9, 0), (1, 7), (3, 5)])
def test_sliding_window_and_softcap_reference_is_the_definition(t, q_offset):
  """Prefill (T=9 over its own slots) and decode (1 or 3 new tokens over a cache): a query
  sees the last ``window`` valid slots up to itself; scores are capped before the softmax.
  The window may be traced (one scanned layer stack holds sliding and full layers)."""
  s = q_offset + t
  q, k, v, kv_mask, seen, _ = _attention_case(jax.random.key(7), 2, t, s, 4, 2, 8, q_offset,
                                              jnp.float32)
  q = q * 3.0  # scores well past the cap
  want = _attention_loop(q, k, v, np.asarray(kv_mask), q_offset, 0.3, 3, 2.0)
  run = jax.jit(lambda q, k, v, w: attention(q, k, v, kv_mask, q_offset, impl="xla", scale=0.3,
                                             window=w, softcap=2.0))
  got = run(q, k, v, 3)
  ok = np.asarray(seen)
  np.testing.assert_allclose(np.asarray(got)[ok], want[ok], atol=1e-5)
  head_major = lambda x: x.transpose(0, 2, 1, 3)
  got = attention(q, head_major(k), head_major(v), kv_mask, q_offset, impl="xla", scale=0.3,
                  window=3, softcap=2.0, kv_layout="bksd")
  np.testing.assert_allclose(np.asarray(got)[ok], want[ok], atol=1e-5)
  # A window longer than every sequence is plain causal attention.
  np.testing.assert_allclose(run(q, k, v, 2 ** 30), attention(
      q, k, v, kv_mask, q_offset, impl="xla", scale=0.3, softcap=2.0), atol=1e-6)


@pytest.mark.parametrize("t,s,q_offset", [(19, 19, 0), (5, 37, 30)])
def test_flash_attention_with_window_and_softcap_matches_reference(t, s, q_offset):
  """Gemma's options in the Pallas flash kernels, values and all three gradients: a traced
  window of 5 (shorter than the rows, so whole key blocks of 16 fall before it) and a cap of
  2 on scores well past it."""
  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(11), 2, t, s, 4, 2, 8, q_offset,
                                           jnp.float32)
  q = q * 3.0
  seen = allowed_mask(t, kv_mask, q_offset, 5).any(-1)
  cot = jax.random.normal(jax.random.key(12), q.shape) * seen[:, :, None, None]
  off, bs = jnp.int32(q_offset), BlockSizes(16, 16, 16, 16)
  kw = dict(scale=0.3, softcap=2.0)
  got, got_g = _with_grads(lambda q, k, v, m, o, w: flash_attention(
      q, k, v, m, o, block_sizes=bs, interpret=True, window=w, **kw), 3, cot)(
          q, k, v, kv_mask, off, jnp.int32(5))
  want, want_g = _with_grads(lambda q, k, v, m, o, w: attention_reference(
      q, k, v, m, o, window=w, **kw), 3, cot)(q, k, v, kv_mask, off, jnp.int32(5))
  rows = seen[:, :, None, None]
  assert_close(jnp.where(rows, got, 0), jnp.where(rows, want, 0), 1e-5, "output")
  for name, g, r in zip("qkv", got_g, want_g):
    assert_close(g, r, 1e-4, f"d{name}")


@pytest.mark.parametrize("kv_layout", ["bskd", "bksd"])
def test_decode_attention_with_window_and_softcap_matches_reference(kv_layout):
  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(13), 3, 1, 70, 8, 2, 16, 41,
                                           jnp.float32)
  q = q * 3.0
  seen = allowed_mask(1, kv_mask, 41, 6).any(-1)
  lay = (lambda x: x) if kv_layout == "bskd" else (lambda x: x.transpose(0, 2, 1, 3))
  bs = DecodeBlockSizes(block_k=16, target_programs=9)
  got = decode_attention(q, lay(k), lay(v), kv_mask, jnp.int32(41), block_sizes=bs,
                         interpret=True, kv_layout=kv_layout, window=jnp.int32(6), softcap=2.0)
  want = attention_reference(q, k, v, kv_mask, 41, window=6, softcap=2.0)
  rows = seen[:, :, None, None]
  assert_close(jnp.where(rows, got, 0), jnp.where(rows, want, 0), 1e-5, "output")


def test_window_and_softcap_choices_per_kernel():
  """The dispatchers pass Gemma's options to the Pallas kernels; cuDNN has no soft-capping
  and says so."""
  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(8), 1, 20, 20, 2, 1, 16, 0,
                                           jnp.float32)
  for tq in (20, 1):  # flash, then the decode kernel
    f = lambda impl: attention(q[:, :tq], k, v, kv_mask, 0, impl=impl, window=3, softcap=5.0)
    assert _has_pallas_call(lambda q: attention(q[:, :tq], k, v, kv_mask, 0, window=3,
                                                softcap=5.0, impl="pallas_interpret"), q)
    rows = allowed_mask(tq, kv_mask, 0, 3).any(-1)[:, :, None, None]
    np.testing.assert_allclose(jnp.where(rows, f("pallas_interpret"), 0),
                               jnp.where(rows, f("xla"), 0), atol=1e-5)
  with pytest.raises(ValueError, match=r"kernels.attention='cudnn' has no logit soft-capping"):
    attention(q, k, v, kv_mask, 0, impl="cudnn", softcap=5.0)

  h, w, tgt, _ = _logprob_case(jax.random.key(9), 1, 3, 16, 40, jnp.float32)
  f = lambda impl: (lambda h: logprob_entropy(h, w * 4, tgt, impl=impl, softcap=3.0))
  assert _has_pallas_call(f("pallas_interpret"), h)
  np.testing.assert_allclose(f("pallas_interpret")(h)[0], f("xla")(h)[0], atol=1e-5)


@pytest.mark.parametrize("block_v", [16, 40])
def test_softcapped_logprob_blockwise_matches_reference_with_grads(block_v):
  """Gemma 2's final soft-capping in the blockwise op: values and both gradients (through
  the cap) equal the full-logits reference, which equals capping the logits by hand."""
  h, w, tgt, cot = _logprob_case(jax.random.key(10), 2, 5, 16, 40, jnp.float32)
  w = w * 4.0  # logits well past the cap
  cap = 2.5
  want, want_g = _with_grads(lambda h, w, t: logprob_entropy_reference(h, w, t, cap), 2,
                             cot)(h, w, tgt)
  z = cap * np.tanh(np.einsum("btd,dv->btv", h, w) / cap)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  np.testing.assert_allclose(want[0], np.take_along_axis(logp, tgt[..., None], -1)[..., 0],
                             atol=1e-5)
  bs = lp_mod.BlockSizes(16, 16, 16, vocab_chunk=32)
  impls = {
      "xla": lambda h, w, t: logprob_entropy(h, w, t, impl="xla", softcap=cap, block_v=block_v),
      "naive": lambda h, w, t: logprob_entropy(h, w, t, impl="naive", softcap=cap),
      "pallas": lambda h, w, t: logprob_entropy_pallas(h, w, t, block_sizes=bs, interpret=True,
                                                       softcap=cap),
      "pallas fwd + xla bwd": lambda h, w, t: logprob_entropy_pallas(
          h, w, t, block_sizes=bs, interpret=True, backward="xla", softcap=cap),
  }
  for impl, f in impls.items():
    got, got_g = _with_grads(f, 2, cot)(h, w, tgt)
    for a, b, what in zip((*got, *got_g), (*want, *want_g), ("logp", "entropy", "dh", "dw")):
      assert_close(a, b, TOL[jnp.float32][0 if what in ("logp", "entropy") else 1],
                   f"{impl} {what}")
  plain = logprob_entropy(h, w, tgt, impl="xla")
  assert np.abs(np.asarray(plain[0]) - np.asarray(want[0])).max() > 0.1  # the cap matters


def test_config_choices_are_the_dispatchers():
  hints = typing.get_type_hints(KernelsConfig)
  assert set(typing.get_args(hints["logprob"])) == set(lp_mod.IMPLS)
  assert set(typing.get_args(hints["attention"])) == set(attn_mod.IMPLS)


@pytest.mark.parametrize("family", [False, True])
def test_model_prefill_and_decode_on_pallas_kernels_match_xla(family):
  """The model's own call path: prefill (flash kernel) into a KV cache at a traced offset, then
  one decode step (decode kernel), against the XLA path, on left-padded prompts.  ``family``:
  Gemma's layout, sliding (window 4, traced in the layer scan) and full layers, soft-capped."""
  import dataclasses

  from helpers import TINY, ragged_batch
  from jaxrlhf import model as M

  cfg = TINY
  if family:
    cfg = dataclasses.replace(TINY, qk_norm=True, norm_offset=1.0, post_norms=True,
                              mlp_activation="gelu_tanh", embed_scale=True, attn_softcap=3.0,
                              sliding_window=4, layer_types=("sliding", "full"),
                              rope_local_theta=100.0, init_std=0.3)
  params = M.init_params(cfg, jax.random.key(0))
  tokens, mask = ragged_batch(jax.random.key(1), 2, 19, cfg.vocab_size)
  pos = M.positions_from_mask(mask)

  @jax.jit
  def run_both(params, tokens, mask, pos):
    outs = []
    for impl in ("xla", "pallas_interpret"):
      cache = M.init_cache(cfg, 2, 24)
      h1, cache = M.forward(params, tokens[:, :18], pos[:, :18], mask[:, :18], cfg=cfg,
                            cache=cache, attn_impl=impl)
      h2, _ = M.forward(params, tokens[:, 18:], pos[:, 18:], mask[:, 18:], cfg=cfg,
                        cache=cache, attn_impl=impl)
      outs.append(jnp.concatenate([h1, h2], axis=1))
    return outs

  want, got = run_both(params, tokens, mask, pos)
  assert_close(jnp.where(mask[..., None], got, 0), jnp.where(mask[..., None], want, 0), 1e-5,
               "hidden states")


def test_kernels_run_per_shard_on_a_mesh():
  """On a dp x tp mesh, batch-sharded tokens and head-sharded attention stay sharded through
  the kernels (no all-gather of activations), with the same numbers; dW is summed across token
  shards."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

  m = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2,
                    devices=jax.devices()[:8])
  put = lambda x, *spec: jax.device_put(x, NamedSharding(m, P(*spec)))
  q, k, v, kv_mask, seen, cot = _attention_case(jax.random.key(10), 4, 20, 20, 4, 2, 16, 0,
                                                jnp.float32)
  h, w, tgt, lcot = _logprob_case(jax.random.key(11), 8, 5, 16, 40, jnp.float32)
  bs = BlockSizes(16, 16, 16, 16)
  dbs = DecodeBlockSizes(block_k=16)
  lbs = lp_mod.BlockSizes(16, 16, 16)

  def everything(q, k, v, kv_mask, h, w, tgt):
    fa = _with_grads(lambda q, k, v: flash_attention(q, k, v, kv_mask, 0, block_sizes=bs,
                                                     interpret=True), 3, cot)
    dec = decode_attention(q[:, -1:], k, v, kv_mask, 19, block_sizes=dbs, interpret=True)
    lp = _with_grads(lambda h, w: logprob_entropy_pallas(h, w, tgt, block_sizes=lbs,
                                                         interpret=True), 2, lcot)
    return fa(q, k, v), dec, lp(h, w)

  args = (q, k, v, kv_mask, h, w, tgt)
  want = jax.jit(everything)(*args)
  with jax.set_mesh(m):
    sharded = (put(q, "dp", None, "tp"), put(k, "dp", None, "tp"), put(v, "dp", None, "tp"),
               put(kv_mask, "dp"), put(h, ("dp", "tp")), put(w), put(tgt, ("dp", "tp")))
    compiled = jax.jit(everything).lower(*sharded).compile()
    got = compiled(*sharded)
  hlo = compiled.as_text()
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  assert "all-reduce" in hlo  # dW over the token shards
  assert got[0][0].sharding.spec[:3] == ("dp", None, "tp")
  jax.tree.map(lambda a, b: assert_close(a, b, 1e-5, "sharded vs unsharded"), got, want)


# ------------------------------------------------------------------ TPU kernels, interpreted


@pytest.mark.parametrize("dtype,shape,block_v,softcap", [
    # N=18 pads to two blocks of 16; V=300 in tiles of 128, the last one partial (masked);
    # soft-capped logits
    (jnp.float32, (2, 9, 40, 300), 128, 3.0),
    # V=256 in two whole tiles; bf16 operands, float32 statistics
    (jnp.bfloat16, (1, 21, 48, 256), 128, None),
])
def test_mosaic_logprob_matches_reference(dtype, shape, block_v, softcap):
  """The TPU (Mosaic) log-prob kernels, forward and both backward kernels, in the Pallas
  interpreter against the full-logits reference: values and gradients."""
  h, w, tgt, cot = _logprob_case(jax.random.key(20), *shape, dtype)
  if softcap is not None:
    w = w * 4.0  # logits well past the cap
  tol_v, tol_g = TOL[dtype]
  want, want_g = _with_grads(lambda h, w, t: logprob_entropy_reference(h, w, t, softcap), 2,
                             cot)(h, w, tgt)
  bs = lp_mod.MosaicBlockSizes(block_n=16, block_v=block_v)
  got, got_g = _with_grads(lambda h, w, t: logprob_entropy_mosaic(
      h, w, t, block_sizes=bs, interpret=True, softcap=softcap), 2, cot)(h, w, tgt)
  assert got[0].dtype == got[1].dtype == jnp.float32
  assert got_g[0].dtype == h.dtype and got_g[1].dtype == w.dtype
  for a, b, what in zip((*got, *got_g), (*want, *want_g), ("logp", "entropy", "dh", "dw")):
    assert_close(a, b, tol_v if what in ("logp", "entropy") else tol_g, what)


def test_mosaic_logprob_tiles_fit_the_vmem_budget():
  """Tiles shrink to the VMEM budget at large d_model, divide V where a 128-multiple does, and
  the token axis pads to whole blocks."""
  bs = lp_mod.MosaicBlockSizes
  assert mosaic_tiles(16384, 4096, 128256, 2, bs()) == (256, 256, 16384)  # 128256 = 501 * 256
  assert mosaic_tiles(16384, 8192, 128256, 2, bs()) == (256, 256, 16384)
  assert mosaic_tiles(16384, 16384, 128256, 2, bs())[1] == 128
  assert mosaic_tiles(18, 40, 300, 4, bs(16, 128)) == (16, 128, 32)
  assert mosaic_tiles(18, 40, 70, 4, bs()) == (32, 70, 32)  # one tile: the whole axis
  with pytest.raises(ValueError, match=r"block_v=100 of 128"):
    mosaic_tiles(18, 40, 70, 4, bs(16, 100))


def test_splash_attention_matches_reference():
  """jax's splash attention behind our contract, in the Pallas interpreter: outputs and dq,
  dk, dv against the reference, on the rows that see a key.  Everything at once (one
  interpreter compile): 24 queries at slots 16..39 over 40 keys (a static offset; both padded
  to 128 lanes), left padding (the key mask as segment ids), two packed segments, a sliding
  window of 17, soft-capping, a scale, 4 query heads over 2 KV heads."""
  dtype, t, s, q_offset = jnp.float32, 24, 40, 16
  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(21), 2, t, s, 4, 2, 16, q_offset,
                                           dtype)
  kw = dict(window=17, softcap=5.0, scale=0.3,
            segment_ids=jnp.where(jnp.arange(s) < 23, 1, 2)[None].repeat(2, 0))
  seen = allowed_mask(t, kv_mask, q_offset, kw.get("window"), kw.get("segment_ids")).any(-1)
  cot = jax.random.normal(jax.random.key(22), q.shape) * seen[:, :, None, None]
  tol_v, tol_g = TOL[dtype]
  got, got_g = _with_grads(lambda q, k, v: splash_attention(
      q, k, v, kv_mask, q_offset, interpret=True, **kw), 3, cot)(q, k, v)
  want, want_g = _with_grads(lambda q, k, v: attention_reference(
      q, k, v, kv_mask, q_offset, **kw), 3, cot)(q, k, v)
  rows = seen[:, :, None, None]
  assert_close(jnp.where(rows, got, 0), jnp.where(rows, want, 0), tol_v, "output")
  for name, g, r in zip("qkv", got_g, want_g):
    assert_close(g, r, tol_g, f"d{name}")


def test_tpu_dispatch_falls_back_where_splash_does_not_fit():
  """On a TPU target: decode steps and a traced offset or window take the XLA path, and the
  Triton kernels, called directly, get Mosaic's compiler parameters, never Triton's."""
  q, k, v, kv_mask, _, _ = _attention_case(jax.random.key(23), 1, 20, 20, 2, 1, 16, 0,
                                           jnp.bfloat16)
  with jax.sharding.use_abstract_mesh(_mesh_on("tpu")):
    assert not _kernel_names(lambda q: attention(q, k, v, kv_mask, jnp.int32(0)), q)
    assert not _kernel_names(lambda q: attention(q, k, v, kv_mask, 0, window=jnp.int32(4)), q)
    assert _kernel_names(lambda q: attention(q, k, v, kv_mask, 0, window=4), q)
    assert isinstance(triton_params(4, 3), pltpu.CompilerParams)
  assert not isinstance(triton_params(4, 3), pltpu.CompilerParams)


def test_splash_runs_per_shard_on_a_mesh():
  """The TPU path's shard_map (``per_shard_manual``) on the 8 CPU devices, dp 4 x tp 2: batch
  over dp and KV heads over tp stay sharded (no all-gather), same numbers and gradients."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  m = jax.make_mesh((4, 1, 2), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3,
                    devices=jax.devices()[:8])
  put = lambda x, *spec: jax.device_put(x, NamedSharding(m, P(*spec)))
  q, k, v, kv_mask, seen, cot = _attention_case(jax.random.key(24), 4, 20, 20, 4, 2, 16, 0,
                                                jnp.float32)
  run = _with_grads(lambda q, k, v, mk: splash_attention(q, k, v, mk, 0, interpret=True), 3,
                    cot * seen[:, :, None, None])
  want = run(q, k, v, kv_mask)
  with jax.set_mesh(m):
    args = (put(q, "dp", None, "tp"), put(k, "dp", None, "tp"), put(v, "dp", None, "tp"),
            put(kv_mask, "dp"))
    compiled = jax.jit(run).lower(*args).compile()
    got = compiled(*args)
  assert "all-gather" not in compiled.as_text()
  rows = seen[:, :, None, None]
  assert_close(jnp.where(rows, got[0], 0), jnp.where(rows, want[0], 0), 1e-5, "output")
  jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, "grads"), got[1], want[1])


# ---------------------------------------------------------------------------- GPU lowering

def test_kernels_lower_to_triton_for_cuda():
  """Every Pallas kernel (forward and backward) lowers to Triton IR at production-like shapes
  and dtypes: catches non-power-of-two blocks and ops Triton lacks, without a GPU."""
  from jax import export

  def n_triton_calls(f, *avals):
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)
    return exp.mlir_module().count("__gpu$xla.gpu.triton")

  sds = jax.ShapeDtypeStruct
  bf16 = jnp.bfloat16
  h, w, tgt = sds((2, 100, 256), bf16), sds((256, 1000), bf16), sds((2, 100), jnp.int32)
  lp_loss = lambda h, w, t: sum(x.sum() for x in logprob_entropy_pallas(h, w, t))
  assert n_triton_calls(jax.grad(lp_loss, argnums=(0, 1)), h, w, tgt) == 3
  lp_capped = lambda h, w, t: sum(x.sum() for x in logprob_entropy_pallas(h, w, t, softcap=30.0))
  assert n_triton_calls(jax.grad(lp_capped, argnums=(0, 1)), h, w, tgt) == 3
  q, kv = sds((2, 100, 8, 128), bf16), sds((2, 120, 2, 128), bf16)
  mask, off = sds((2, 120), jnp.bool_), sds((), jnp.int32)
  fa_loss = lambda q, k, v, m, o: flash_attention(q, k, v, m, o).astype(jnp.float32).sum()
  assert n_triton_calls(jax.grad(fa_loss, argnums=(0, 1, 2)), q, kv, kv, mask, off) == 3
  assert n_triton_calls(decode_attention, sds((2, 1, 8, 128), bf16), kv, kv, mask, off) == 1
  # Gemma's options: a traced window and a soft-cap, in every kernel.
  gemma = dict(softcap=50.0, scale=0.0625)
  fa_gemma = lambda q, k, v, m, o, w: flash_attention(q, k, v, m, o, window=w, **gemma).astype(
      jnp.float32).sum()
  assert n_triton_calls(jax.grad(fa_gemma, argnums=(0, 1, 2)), q, kv, kv, mask, off, off) == 3
  dec_gemma = lambda q, k, v, m, o, w: decode_attention(q, k, v, m, o, window=w, **gemma)
  assert n_triton_calls(dec_gemma, sds((2, 1, 8, 128), bf16), kv, kv, mask, off, off) == 1
  # Packed rows: segment ids read from the int key mask, in the three flash kernels.
  qs = sds((2, 120, 8, 128), bf16)
  fa_packed = lambda q, k, v, m, sg: flash_attention(q, k, v, m, segment_ids=sg).astype(
      jnp.float32).sum()
  assert n_triton_calls(jax.grad(fa_packed, argnums=(0, 1, 2)), qs, kv, kv, mask,
                        sds((2, 120), jnp.int32)) == 3


# ------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
def test_compiled_kernels_match_reference_on_gpu():
  h, w, tgt, cot = _logprob_case(jax.random.key(7), 2, 300, 512, 5000, jnp.bfloat16)
  want, want_g = _with_grads(logprob_entropy_reference, 2, cot)(h, w, tgt)
  got, got_g = _with_grads(logprob_entropy_pallas, 2, cot)(h, w, tgt)
  for g, r, name in zip(got + got_g, want + want_g, ("logp", "ent", "dh", "dW")):
    assert_close(g, r, 3e-2, f"logprob {name}")
  q, k, v, kv_mask, seen, cot = _attention_case(jax.random.key(8), 2, 200, 200, 8, 2, 128, 0,
                                                jnp.bfloat16)
  want, want_g = _with_grads(attention_reference, 3, cot)(q, k, v, kv_mask, 0)
  rows = seen[:, :, None, None]
  for impl in ("pallas", "cudnn"):
    got, got_g = _with_grads(lambda q, k, v, m, o: attention(q, k, v, m, o, impl=impl), 3,
                             cot)(q, k, v, kv_mask, 0)
    assert_close(jnp.where(rows, got, 0), jnp.where(rows, want, 0), 3e-2, f"{impl} output")
    for name, g, r in zip("qkv", got_g, want_g):
      assert_close(g, r, 3e-2, f"{impl} d{name}")
  q, k, v, kv_mask, seen, _ = _attention_case(jax.random.key(9), 4, 1, 300, 8, 2, 128, 250,
                                              jnp.bfloat16)
  got = attention(q, k, v, kv_mask, jnp.int32(250), impl="pallas")
  assert_close(got, attention_reference(q, k, v, kv_mask, 250), 3e-2, "decode output")
