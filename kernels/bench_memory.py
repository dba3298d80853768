"""Memory benchmark (CPU is enough): XLA's compiled temporary memory for log-prob + entropy,
forward and backward, naive full logits vs the blockwise XLA path.

Nothing is allocated: each program is lowered on ``jax.ShapeDtypeStruct``s and compiled, and
``memory_analysis()`` reports its temporary (scratch) bytes, the figure the issue asks for.
Arguments (h, W) and outputs (dh, dW) are the same for every implementation and reported apart.

    python -m kernels.bench_memory            # B=4 T=2048 D=4096 V=128256, bfloat16
    python -m kernels.bench_memory --json out.json

The Pallas kernels cannot be compiled for the CPU (only interpreted), so their figure is the
analytic one printed beside: float32 accumulators for dh [N, D] and for one dW vocabulary chunk
[D, vocab_chunk], plus [N]-sized statistics; see kernels/NOTES.md.

On the CPU, XLA computes bfloat16 matmuls in float32 and hoists the conversion of the whole
bfloat16 W out of the vocabulary loop (a [D, V] float32 temporary, visible in the compiled
HLO); GPUs multiply bfloat16 natively.  So the float32 run is the one that measures the
algorithm; the bfloat16 run shows that CPU artefact on top.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from kernels.logprob import BlockSizes, logprob_entropy_blockwise, logprob_entropy_reference

GiB = 2 ** 30


def _program(fn, b, t, d, v, dtype, backward):
  def loss(h, w, tgt, a, c):
    logp, ent = fn(h, w, tgt)
    return jnp.sum(logp * a) + jnp.sum(ent * c)

  f = jax.grad(loss, argnums=(0, 1)) if backward else (lambda h, w, tgt, a, c: fn(h, w, tgt))
  sds = jax.ShapeDtypeStruct
  args = (sds((b, t, d), dtype), sds((d, v), dtype), sds((b, t), jnp.int32),
          sds((b, t), jnp.float32), sds((b, t), jnp.float32))
  mem = jax.jit(f).lower(*args).compile().memory_analysis()
  return dict(temp=mem.temp_size_in_bytes, args=mem.argument_size_in_bytes,
              out=mem.output_size_in_bytes)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--d_model", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=128256)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--block_v", type=int, nargs="+", default=[4096, 8192, 16384])
  p.add_argument("--json", default="")
  a = p.parse_args(argv)
  b, t, d, v, dtype = a.batch, a.seq, a.d_model, a.vocab, jnp.dtype(a.dtype)
  n = b * t
  impls = {"naive": logprob_entropy_reference}
  for bv in a.block_v:
    impls[f"xla block_v={bv}"] = (
        lambda h, w, tg, bv=bv: logprob_entropy_blockwise(h, w, tg, block_v=bv))
  rows = {}
  for name, fn in impls.items():
    rows[name] = {"forward": _program(fn, b, t, d, v, dtype, False),
                  "fwd+bwd": _program(fn, b, t, d, v, dtype, True)}
  naive = rows["naive"]["fwd+bwd"]["temp"]
  print(f"log-prob + entropy, B={b} T={t} D={d} V={v} {dtype.name}; "
        f"full float32 logits would be {n * v * 4 / GiB:.2f} GiB")
  print(f"{'implementation':<22}{'fwd temp GiB':>14}{'fwd+bwd temp GiB':>18}{'naive / this':>14}")
  for name, r in rows.items():
    tmp = r["fwd+bwd"]["temp"]
    print(f"{name:<22}{r['forward']['temp'] / GiB:>14.3f}{tmp / GiB:>18.3f}{naive / tmp:>13.1f}x")
  pallas = (n * d * 4 + d * min(v, BlockSizes().vocab_chunk) * 4 + 4 * n * 4) / GiB
  print(f"{'pallas (analytic)':<22}{'~0':>14}{pallas:>18.3f}{naive / (pallas * GiB):>13.1f}x")
  args = rows["naive"]["fwd+bwd"]
  print(f"(every program: arguments {args['args'] / GiB:.3f} GiB, "
        f"outputs dh+dW {args['out'] / GiB:.3f} GiB)")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"shape": dict(B=b, T=t, D=d, V=v, dtype=dtype.name), "bytes": rows,
                 "pallas_analytic_temp_bytes": int(pallas * GiB)}, f, indent=1)


if __name__ == "__main__":
  main()
