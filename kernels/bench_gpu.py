"""GPU speed benchmark: each kernel against the XLA path (and cuDNN for attention), and against
the device's own measured ceilings, in one run.  Prints a table and writes JSON.

    python -m kernels.bench_gpu --json kernels_h200.json          # on a GPU (~3-5 minutes)
    python -m kernels.bench_gpu --quick                           # tiny shapes: a smoke run

Method (see kernels/NOTES.md):
* Ceilings are measured here, not taken from a data sheet: the FLOP rate of XLA's best bf16
  matmul (8192^3) and the bandwidth of a 4 GiB streaming read+write (``x * 2``).
* Each case is jitted, run once to compile and once to warm up, then timed over ``--iters``
  runs (median, after ``block_until_ready``).  Before timing, its output is compared with the
  XLA path's, and the largest difference is printed with the row.
* Useful work per case is the minimal one, the same for every implementation, so the rates
  compare: log-prob forward ``2NDV`` FLOPs, forward+backward ``6NDV`` (the kernels' recompute
  is not counted); causal attention forward ``2*B*H*T*S*D`` (half of ``4BHTSD``),
  forward+backward 3.5x that; decode attention the bytes of the filled K/V cache plus q and o.
On a CPU the Pallas rows run in the interpreter (only meaningful with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from kernels._backend import platform_of
from kernels.attention import attention
from kernels.logprob import logprob_entropy, logprob_entropy_pallas


def _time(f, args, iters):
  out = f(*args)  # compile
  jax.block_until_ready(out)
  jax.block_until_ready(f(*args))  # warm up
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def ceilings(iters, quick):
  """Measured bf16 matmul FLOP/s and streaming bandwidth (bytes/s) of this device."""
  n = 1024 if quick else 8192
  a = jnp.ones((n, n), jnp.bfloat16)
  mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
  flops = 2 * n ** 3 / _time(mm, (a, a), iters)
  x = jnp.ones(((2 if quick else 1024) * 2 ** 20,), jnp.float32)  # 4 GiB
  copy = jax.jit(lambda x: x * 2)
  bandwidth = 2 * x.size * 4 / _time(copy, (x,), iters)
  return flops, bandwidth


def _max_err(a, b):
  leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in leaves)


def _grad_fn(f, n_diff):
  """Forward + backward of sum(outputs * 1): gradients w.r.t. the first n_diff args."""
  def loss(*args):
    return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(f(*args)))
  return jax.jit(jax.grad(loss, argnums=tuple(range(n_diff))))


def logprob_cases(quick, pallas):
  b, t, d, v = (2, 64, 256, 1000) if quick else (4, 2048, 4096, 128256)
  k = jax.random.split(jax.random.key(0), 3)
  h = jax.random.normal(k[0], (b, t, d), jnp.bfloat16)
  w = (jax.random.normal(k[1], (d, v), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
  tgt = jax.random.randint(k[2], (b, t), 0, v)
  n = b * t
  shape = f"B={b} T={t} D={d} V={v}"
  for impl in ("xla", pallas):
    f = lambda h, w, tg, impl=impl: logprob_entropy(h, w, tg, impl=impl)
    yield dict(op="logprob fwd", shape=shape, impl=impl, fn=jax.jit(f), args=(h, w, tgt),
               flops=2 * n * d * v)
    yield dict(op="logprob fwd+bwd", shape=shape, impl=impl, fn=_grad_fn(f, 2),
               args=(h, w, tgt), flops=6 * n * d * v)
  # The Pallas forward with the XLA blockwise backward (kernels/NOTES.md: which backward wins).
  f = lambda h, w, tg: logprob_entropy_pallas(h, w, tg, interpret=pallas != "pallas",
                                              backward="xla")
  yield dict(op="logprob fwd+bwd", shape=shape, impl=pallas + "+xla_bwd", fn=_grad_fn(f, 2),
             args=(h, w, tgt), flops=6 * n * d * v)


def _attn_inputs(b, t, s, h, kh, d, filled, key):
  k = jax.random.split(key, 3)
  q = jax.random.normal(k[0], (b, t, h, d), jnp.bfloat16)
  kk = jax.random.normal(k[1], (b, s, kh, d), jnp.bfloat16)
  v = jax.random.normal(k[2], (b, s, kh, d), jnp.bfloat16)
  mask = jnp.broadcast_to(jnp.arange(s)[None] < filled, (b, s))
  return q, kk, v, mask


def attention_cases(quick, pallas):
  b, t, h, kh, d = (1, 256, 4, 2, 128) if quick else (4, 4096, 32, 8, 128)
  q, k, v, mask = _attn_inputs(b, t, t, h, kh, d, t, jax.random.key(1))
  shape = f"B={b} T=S={t} H={h} K={kh} D={d}"
  causal_flops = 2 * b * h * t * t * d
  for impl in ("xla", pallas, "cudnn"):
    f = lambda q, k, v, m, impl=impl: attention(q, k, v, m, 0, impl=impl)
    yield dict(op="attention prefill fwd", shape=shape, impl=impl, fn=jax.jit(f),
               args=(q, k, v, mask), flops=causal_flops)
    yield dict(op="attention prefill fwd+bwd", shape=shape, impl=impl, fn=_grad_fn(f, 3),
               args=(q, k, v, mask), flops=int(3.5 * causal_flops))

  b, s, filled = (4, 512, 500) if quick else (64, 4096, 4000)
  q, k, v, mask = _attn_inputs(b, 1, s, h, kh, d, filled + 1, jax.random.key(2))
  off = jnp.int32(filled)
  shape = f"B={b} T=1 S={s} filled={filled} H={h} K={kh} D={d}"
  cache_bytes = 2 * b * (filled + 1) * kh * d * 2 + 2 * b * h * d * 2
  for impl in ("xla", pallas, "cudnn"):
    f = lambda q, k, v, m, o, impl=impl: attention(q, k, v, m, o, impl=impl)
    yield dict(op="attention decode", shape=shape, impl=impl, fn=jax.jit(f),
               args=(q, k, v, mask, off), bytes=cache_bytes)
  yield from shared_prefix_cases(quick, pallas, h, kh, d)


def shared_prefix_cases(quick, pallas, h, kh, d):
  """A decode step of GRPO's groups with shared prompts over pages (rollout.prefix_sharing
  with kv_page_size): each group's prompt read once for its ``n`` samples, each row's own
  slots from its page.  Useful bytes: the prompts once, the rows' filled own slots, q and o."""
  from kernels.attention.shared_prefix import shared_prefix_paged_attention
  g, n, p, s, filled = (2, 4, 256, 64, 40) if quick else (8, 16, 2048, 512, 256)
  ks = jax.random.split(jax.random.key(3), 5)
  dt = jnp.float32 if quick else jnp.bfloat16  # XLA:CPU has no bf16 x bf16 -> f32 dot
  q = jax.random.normal(ks[0], (g * n, 1, h, d), dt)
  pk, pv = (jax.random.normal(k, (g, kh, p, d), dt) for k in ks[1:3])
  pool_k, pool_v = (jax.random.normal(k, (kh, g * n, s, d), dt) for k in ks[3:5])
  pmask = jnp.ones((g, p), bool)
  length = jnp.full((g * n,), filled, jnp.int32)
  args = (q, pk, pv, pmask, pool_k, pool_v, length[:, None] - 1, length)
  shape = f"G={g} n={n} P={p} own={filled}/{s} H={h} K={kh} D={d}"
  size = jnp.dtype(dt).itemsize
  useful = (2 * kh * d * (g * p + g * n * filled) + 2 * g * n * h * d) * size
  for impl in ("xla", pallas):
    f = lambda q, pk, pv, pm, k, v, sl, ln, impl=impl: shared_prefix_paged_attention(
        q, pk, pv, pm, k, v, None, sl, ln, impl=impl)
    yield dict(op="shared-prefix decode", shape=shape, impl=impl, fn=jax.jit(f), args=args,
               bytes=useful)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  backend = platform_of(jax.devices()[0])  # the device every case runs on
  flops_peak, bw_peak = ceilings(a.iters, a.quick)
  print(f"device: {jax.devices()[0].device_kind} ({backend}); measured ceilings: "
        f"bf16 matmul {flops_peak / 1e12:.1f} TFLOP/s, streaming {bw_peak / 1e9:.0f} GB/s")
  rows, baseline = [], {}
  header = (f"{'op':<27}{'impl':<26}{'ms':>9}{'achieved':>16}{'of ceiling':>12}"
            f"{'vs xla':>8}{'max |diff|':>12}  shape")
  print(header)
  pallas = "pallas" if backend == "gpu" else "pallas_interpret"
  for case in list(logprob_cases(a.quick, pallas)) + list(attention_cases(a.quick, pallas)):
    impl, fn = case["impl"], case["fn"]
    row = dict(op=case["op"], impl=impl, shape=case["shape"])
    try:
      out = fn(*case["args"])
      key = (case["op"], case["shape"])
      if impl == "xla":
        baseline[key] = (out, None)
      row["max_abs_diff_vs_xla"] = (_max_err(out, baseline[key][0]) if key in baseline and
                                    impl != "xla" else 0.0)
      sec = _time(fn, case["args"], a.iters)
      row["ms"] = sec * 1e3
      if impl == "xla":
        baseline[key] = (out, sec)
      row["speedup_vs_xla"] = baseline[key][1] / sec if key in baseline else None
      if "flops" in case:
        row["tflops"] = case["flops"] / sec / 1e12
        row["fraction_of_ceiling"] = case["flops"] / sec / flops_peak
        achieved = f"{row['tflops']:.1f} TFLOP/s"
      else:
        row["gbps"] = case["bytes"] / sec / 1e9
        row["fraction_of_ceiling"] = case["bytes"] / sec / bw_peak
        achieved = f"{row['gbps']:.0f} GB/s"
      speed = f"{row['speedup_vs_xla']:.2f}x" if row["speedup_vs_xla"] else "-"
      print(f"{row['op']:<27}{impl:<26}{row['ms']:>9.3f}{achieved:>16}"
            f"{row['fraction_of_ceiling']:>11.0%}{speed:>8}{row['max_abs_diff_vs_xla']:>12.3g}"
            f"  {row['shape']}")
    except Exception as e:  # one unsupported case (e.g. cuDNN) must not end the run
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      print(f"{row['op']:<27}{impl:<26}  failed: {row['error']}")
    rows.append(row)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "backend": backend,
                 "ceilings": {"bf16_matmul_flops": flops_peak, "bandwidth_bytes": bw_peak},
                 "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
