"""The benchmark suite's GPU half (issue 11): a 1B-class GRPO step on one accelerator, its
update MFU against the *measured* bf16 matmul rate and its decode bandwidth against the
*measured* copy bandwidth.

    python -m benchmarks.gpu_1b --out=gpu_1b.json     # on one H200 (targets: 55% / 70%)
    python -m benchmarks.gpu_1b --smoke               # a tiny shape on CPU: checks the script

* Update MFU: the GRPO workload of :mod:`benchmarks.suite` (``a+b=`` prompts, 32 new tokens,
  KL to a reference, one update) at a Llama-3.2-1B shape in bf16 with 64 prompts x 8 samples,
  run as timed phases; MFU = the update phase's model FLOPs / its median time / the rate of a
  large bf16 ``jnp.dot`` measured in the same run.  The datasheet peak is printed beside it.
* Decode bandwidth: :mod:`benchmarks.rollout_bench` at the same shape (prefill timed apart;
  bytes per decode step = parameters + the whole KV cache) against a device copy measured in
  the same run.

Nothing here is GPU-specific: on CPU the same figures come out, only slower and smaller.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from benchmarks import rollout_bench, suite


def one_b_model(smoke: bool):
  from jaxrlhf.config import ModelConfig
  if smoke:
    return ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, mlp_dim=128, max_seq_len=64, param_dtype="bfloat16",
                       compute_dtype="bfloat16")
  # Llama-3.2-1B: 16 layers, d 2048, 32 heads of 64 over 8 KV heads, SwiGLU 8192, tied.
  return ModelConfig(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                     head_dim=64, mlp_dim=8192, max_seq_len=4096, tie_embeddings=True,
                     param_dtype="bfloat16", compute_dtype="bfloat16")


def bf16_matmul_rate(n: int, repeats: int = 10) -> float:
  """FLOP/s of a jitted bf16 ``[n,n] @ [n,n]``, best of ``repeats``."""
  import jax
  import jax.numpy as jnp
  a = jnp.full((n, n), 0.5, jnp.bfloat16)
  f = jax.jit(lambda x: x @ x)
  jax.block_until_ready(f(a))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a))
    best = min(best, time.perf_counter() - t0)
  return 2.0 * n ** 3 / best


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true",
                      help="a tiny shape that runs on CPU in seconds (checks the script)")
  parser.add_argument("--prompts", type=int, default=64)
  parser.add_argument("--samples", type=int, default=8)
  parser.add_argument("--steps", type=int, default=5, help="phase-timed steps after the first")
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)

  import jax
  from jaxrlhf import hardware
  from kernels._backend import platform_of
  from jaxrlhf.perf import enable_compilation_cache
  enable_compilation_cache()
  model = one_b_model(args.smoke)
  prompts, samples = (8, 2) if args.smoke else (args.prompts, args.samples)
  steps = 1 if args.smoke else args.steps

  cfg = suite.workload_config("grpo", model)
  cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, batch_size=prompts,
                                                          num_samples=samples))
  rate = bf16_matmul_rate(256 if args.smoke else 8192)
  ph = suite.worker_phases("grpo", steps, cfg=cfg)
  update_s = ph["phases_s"]["update"]
  update_flops = ph["phase_flops"]["update"]
  device = jax.devices()[0]  # the one the workload ran on
  res = {"backend": platform_of(device), "device": device.device_kind,
         "model": dataclasses.asdict(model), "params": model.num_params("lm"),
         "prompts": prompts, "samples": samples, "bf16_matmul_flops_per_s": rate,
         "phases_s": ph["phases_s"], "phase_flops": ph["phase_flops"],
         "update_mfu": update_flops / update_s / rate}
  acc = hardware.detect_accelerator()
  if acc is not None and not acc.measured:
    res["update_mfu_vs_datasheet"] = update_flops / update_s / acc.peak_flops
    res["datasheet_peak_flops"] = acc.peak_flops

  # Decode bandwidth: rollout_bench at the same shape, prefill timed apart.
  preset = "cpu" if args.smoke else "gpu-1b"
  rb_args = [f"--preset={preset}", "--bandwidth=on", "--recompute=off"]
  if args.smoke:
    rb_args += ["--batch=2", "--prompt_len=8", "--new_tokens=8", "--repeats=1",
                "--copy_mib=8"]
  rb = rollout_bench.main(rb_args)
  res["decode"] = {k: rb[k] for k in ("batch", "prompt_len", "new_tokens", "decode_step_ms",
                                       "decode_tokens_per_s", "bytes_per_decode_step",
                                       "copy_bandwidth_GBps", "decode_bandwidth_GBps",
                                       "decode_bandwidth_fraction")}
  res["decode_bandwidth_fraction"] = rb["decode_bandwidth_fraction"]

  print(f"update MFU {100 * res['update_mfu']:.1f}% of the measured bf16 matmul rate "
        f"({rate / 1e12:.1f} TFLOP/s; target 55%)"
        + (f", {100 * res['update_mfu_vs_datasheet']:.1f}% of the datasheet peak"
           if "update_mfu_vs_datasheet" in res else ""))
  if res["decode_bandwidth_fraction"] is None:
    print("decode bandwidth unmeasured: the prefill's timing reached generate's (a busy "
          "machine); rerun when it is idle")
  else:
    print(f"decode bandwidth {100 * res['decode_bandwidth_fraction']:.1f}% of the measured "
          f"copy bandwidth ({rb['copy_bandwidth_GBps']:.0f} GB/s; target 70%)")
  print("phases (s): " + ", ".join(f"{k} {v:.4f}" for k, v in ph["phases_s"].items()))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
  return res


if __name__ == "__main__":
  main()
