"""Compiled by the real accelerators' compilers, on this CPU host (jaxrlhf/targets.py): every
Pallas kernel for an H200 at production shapes, every TPU kernel (our Mosaic log-prob, jax's
splash attention and paged attention) for a TPU v5e and v5p chip, the one-program step of
SFT, DPO, GRPO and PPO on 8 compile-only H200s (Pallas on and off) and on a TPU v5e slice
(TPU kernels on, and off under ``slow``), what the compiled programs hold (the kernels, the
collectives) and need (``memory_analysis()`` against the device's memory).

Skipped only where the ``aot`` extra is not installed (``pip install -e '.[aot]'``).  The
tests set JAX_PLATFORMS=cpu (tests/conftest.py), which the CUDA plugin needs to load without
CUDA.  Compiles are cached per module: about 40 s for the kernels and the CI steps, the
other steps ``slow`` (15-45 s each on 2 cores).  The TPU kernels and steps: about 60 s more.
"""

import dataclasses
import re
import time

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from helpers import TINY
from jaxrlhf import registry, targets
from jaxrlhf.config import ConfigError, MeshConfig, apply_overrides
from jaxrlhf.data import DataSource
from jaxrlhf.model.transformer import _matmul
from jaxrlhf.train.spec import build_stage
from kernels.attention import (BlockSizes, attention, attention_reference, decode_attention,
                               flash_attention)
from kernels.attention.paged import paged_attention
from kernels.attention.shared_prefix import shared_prefix_paged_attention
from kernels.logprob import (MosaicBlockSizes, logprob_entropy, logprob_entropy_mosaic,
                             logprob_entropy_pallas)

needs_gpu_compiler = pytest.mark.skipif(bool(targets.missing("h200")),
                                        reason=targets.missing("h200") or "")
needs_tpu_compiler = pytest.mark.skipif(bool(targets.missing("tpu-v5e")),
                                        reason=targets.missing("tpu-v5e") or "")

TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'
MOSAIC = 'custom_call_target="tpu_custom_call"'
GiB = 2**30
bf16, f32 = jnp.bfloat16, jnp.float32


# --------------------------------------------------------------- the table, no plugin needed


def test_gpu_target_configs_render_the_device_facts():
  h200 = targets.GPUS["h200"].target_config(141e9, 4.8e12)
  assert "core_count: 132" in h200 and "cuda_compute_capability { major: 9 minor: 0 }" in h200
  assert "device_memory_size: 141000000000" in h200 and 'device_description_str: "NVIDIA H200"' in h200
  assert "cuda_compute_capability { major: 10 minor: 0 }" in targets.GPUS["b200"].target_config(1, 1)
  assert targets.memory_bytes("h200") == 141e9 and targets.memory_bytes("tpu-v5e") == 16 * GiB
  with pytest.raises(ConfigError, match=r"unknown target accelerator 'a100'; choose one of h100"):
    targets.platform_of("a100")


def test_a_missing_extra_names_the_install_command(monkeypatch):
  import importlib.util
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  for acc, what in (("h100", "the CUDA plugin"), ("tpu-v5p", "libtpu")):
    with pytest.raises(ConfigError, match=re.escape(f"needs {what}") + r".*pip install -e '\.\[aot\]'"):
      targets._topology(acc, 8)


# ------------------------------------------------------------------------ kernels, H200


def _one_h200():
  return targets.mesh("h200", MeshConfig(dp=1, fsdp=1, tp=1), 1)


def _compile(mesh, f, *avals):
  with jax.set_mesh(mesh):
    return jax.jit(f).lower(*avals).compile()


def _kernels_in(compiled) -> list[str]:
  """The Pallas (Triton) kernels the executable launches, by name, in program order."""
  return [re.search(r'name = \\?"(\w+)\\?"', line).group(1)
          for line in compiled.as_text().splitlines() if TRITON in line]


def _sum(*xs):
  return sum(x.astype(f32).sum() for x in xs)


def _kernel_cases():
  """(name, function, abstract args, kernels it must hold): every kernel forward and backward
  at production shapes (Llama-3 8B/70B log-prob head, 32 query / 8 KV heads of 128), with the
  variants the models use (soft-cap, sliding window, packed segments, head_dim 256, float32,
  the head-major cache)."""
  sds = jax.ShapeDtypeStruct
  lp_grad = lambda **kw: jax.grad(
      lambda h, w, t: _sum(*logprob_entropy_pallas(h, w, t, **kw)), argnums=(0, 1))
  fa_grad = lambda **kw: jax.grad(
      lambda q, k, v, m, o: _sum(flash_attention(q, k, v, m, o, **kw)), argnums=(0, 1, 2))
  lp_all = ["logprob_entropy_fwd", "logprob_entropy_bwd_dh", "logprob_entropy_bwd_dw"]
  fa_all = ["flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv"]
  h, w, t = sds((8, 2048, 4096), bf16), sds((4096, 128256), bf16), sds((8, 2048), jnp.int32)
  q, kv = sds((2, 4096, 32, 128), bf16), sds((2, 4096, 8, 128), bf16)
  mask, off = sds((2, 4096), jnp.bool_), sds((), jnp.int32)
  q256, kv256 = sds((1, 2048, 8, 256), bf16), sds((1, 2048, 4, 256), bf16)
  qd, kv_bksd = sds((16, 1, 32, 128), bf16), sds((16, 8, 4096, 128), bf16)
  mask16 = sds((16, 4096), jnp.bool_)
  return [
      ("logprob bf16 8x2048x4096 V128256", lp_grad(), (h, w, t), lp_all),
      ("logprob soft-cap f32", lp_grad(softcap=30.0),
       (sds((4, 1024, 2048), f32), sds((2048, 32000), f32), sds((4, 1024), jnp.int32)), lp_all),
      ("flash bf16 32x128 heads T=S=4096", fa_grad(), (q, kv, kv, mask, off), fa_all),
      ("flash window+soft-cap (Gemma)", jax.grad(
          lambda q, k, v, m, o, wd: _sum(flash_attention(q, k, v, m, o, window=wd, softcap=50.0,
                                                         scale=0.0625)), argnums=(0, 1, 2)),
       (q, kv, kv, mask, off, off), fa_all),
      ("flash packed segments", jax.grad(
          lambda q, k, v, m, sg: _sum(flash_attention(q, k, v, m, segment_ids=sg)),
          argnums=(0, 1, 2)), (q, kv, kv, mask, sds((2, 4096), jnp.int32)), fa_all),
      ("flash head_dim 256", fa_grad(), (q256, kv256, kv256, sds((1, 2048), jnp.bool_), off),
       fa_all),
      ("flash f32", fa_grad(), (sds((2, 1024, 8, 64), f32), sds((2, 1024, 2, 64), f32),
                                sds((2, 1024, 2, 64), f32), sds((2, 1024), jnp.bool_), off),
       fa_all),
      ("decode bf16 cache bskd", decode_attention, (qd, sds((16, 4096, 8, 128), bf16),
                                                    sds((16, 4096, 8, 128), bf16), mask16, off),
       ["decode_attention"]),
      ("decode window+soft-cap cache bksd", lambda q, k, v, m, o, wd: decode_attention(
          q, k, v, m, o, kv_layout="bksd", window=wd, softcap=50.0),
       (qd, kv_bksd, kv_bksd, mask16, off, off), ["decode_attention"]),
      *[(f"paged decode bf16 64/8 heads, 16-slot pages (jax's kernel){name}", fn, _paged_args(),
         ["paged_attention_block_h_16_pages_per_compute_block_8"])
        for name, fn in _paged_fns()],
  ]


def _paged_args():
  """A decode step over a paged cache (rollout.kv_page_size): 16 rows of a 70B's 64 query /
  8 KV heads of 128, up to 128 pages of 16 slots a row, 2,048 pages in the pool."""
  sds = jax.ShapeDtypeStruct
  pool = sds((8, 2048, 16, 128), bf16)
  return (sds((16, 1, 64, 128), bf16), pool, pool, sds((16, 128), jnp.int32),
          sds((16,), jnp.int32))


def _paged_fns():
  """jax's Pallas paged-attention kernel through our dispatcher (``impl="pallas"``), plain
  and soft-capped."""
  def step(softcap=None):
    return lambda q, k, v, t, n: paged_attention(q, k, v, t, (n - 1)[:, None], n,
                                                 impl="pallas", softcap=softcap)
  return [("", step()), (" soft-cap", step(50.0))]


def _split_pool_decode(mesh):
  """A paged decode step compiled on a 2-device ``mesh`` over a contiguous pool (no table)
  split over dp as its rows are."""
  rows = NamedSharding(mesh, P("dp"))
  q, pool, _, _, length = _paged_args()
  pool = jax.ShapeDtypeStruct(pool.shape, pool.dtype, sharding=NamedSharding(mesh, P(None, "dp")))
  q = jax.ShapeDtypeStruct(q.shape, q.dtype, sharding=rows)
  length = jax.ShapeDtypeStruct(length.shape, length.dtype, sharding=rows)
  return _compile(mesh, lambda q, k, v, n: paged_attention(
      q, k, v, None, (n - 1)[:, None], n, impl="pallas"), q, pool, pool, length)


@needs_gpu_compiler
def test_a_contiguous_pool_split_over_two_h200s_is_read_in_place():
  """Paged decode over a pool whose rows own their pages in order (kv_pages=0), split over
  dp=2 H200s as its rows are: each GPU launches jax's kernel on its own rows and its own half
  of the pool; nothing is gathered."""
  compiled = _split_pool_decode(targets.mesh("h200", MeshConfig(dp=2, fsdp=1, tp=1), 2))
  assert _kernels_in(compiled) == ["paged_attention_block_h_16_pages_per_compute_block_8"]
  assert "all-gather" not in compiled.as_text()


@pytest.fixture(scope="module")
def compiled_kernels():
  """Each case compiled for one H200: (compiled, seconds)."""
  mesh = _one_h200()
  rep = NamedSharding(mesh, P())
  out = {}
  for name, f, avals, want in _kernel_cases():
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in avals]
    t0 = time.perf_counter()
    out[name] = (_compile(mesh, f, *avals), time.perf_counter() - t0, want)
  return out


@needs_gpu_compiler
@pytest.mark.parametrize("case", [c[0] for c in _kernel_cases()])
def test_every_pallas_kernel_compiles_for_h200(compiled_kernels, case):
  """Triton's own compile (to PTX and a cubin, register and shared-memory limits included)
  succeeds, and the executable launches our kernels, not an XLA fallback."""
  compiled, _, want = compiled_kernels[case]
  assert sorted(set(_kernels_in(compiled))) == sorted(want)
  assert targets.check_fits(compiled, "h200") < targets.memory_bytes("h200")


@needs_gpu_compiler
@pytest.mark.parametrize("accelerator", ["h100", "b200"])
def test_the_other_gpus_of_the_table_compile_the_flash_kernels(accelerator):
  """H100 (sm_90, 80 GB) and B200 (sm_100): the table's other entries give devices that
  compile the flash kernels forward and backward."""
  mesh = targets.mesh(accelerator, MeshConfig(dp=1, fsdp=1, tp=1), 1)
  rep = NamedSharding(mesh, P())
  sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)
  q, kv = sds((2, 1024, 32, 128), bf16), sds((2, 1024, 8, 128), bf16)
  fa = jax.grad(lambda q, k, v, m: _sum(flash_attention(q, k, v, m)), argnums=(0, 1, 2))
  compiled = _compile(mesh, fa, q, kv, kv, sds((2, 1024), jnp.bool_))
  assert sorted(_kernels_in(compiled)) == ["flash_attention_bwd_dkv", "flash_attention_bwd_dq",
                                           "flash_attention_fwd"]
  assert mesh.devices.flat[0].device_kind == targets.GPUS[accelerator].description


@needs_gpu_compiler
def test_an_oversized_block_setting_is_rejected_by_the_gpu_compiler():
  """Blocks whose tiles need more shared memory than an H200 SM has (227 KiB a block) fail in
  Triton's compile, with the figures; the interpreter and the Triton IR lowering accept them."""
  mesh = _one_h200()
  rep = NamedSharding(mesh, P())
  sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)
  q, kv = sds((1, 2048, 8, 256), bf16), sds((1, 2048, 8, 256), bf16)
  big = BlockSizes(block_q=256, block_k=256, num_stages=4)
  fa = lambda q, k, v, m: flash_attention(q, k, v, m, block_sizes=big)
  with pytest.raises(Exception, match=r"(?i)shared memory"):
    _compile(mesh, fa, q, kv, kv, sds((1, 2048), jnp.bool_))


@needs_gpu_compiler
def test_the_wo_projection_after_xla_attention_compiles_for_gpu():
  """Regression: XLA:GPU's Triton GEMM fusion took the transpose of the attention output
  ``[b, k, d, g, t]`` (t minor) into the output projection's matmul and then found no tiling
  of the merged ``b*t`` rows when t is not a power of two ("Couldn't find output tile sizes",
  the tiny GRPO step on the XLA path).  The reference attention now contracts v first, so
  XLA lays the output out t-major; this is the failing shape (32 sequences of 13 tokens)."""
  mesh = _one_h200()
  rep = NamedSharding(mesh, P())
  sds = lambda s: jax.ShapeDtypeStruct(s, f32, sharding=rep)

  def layer(q, k, v, wo):
    o = attention_reference(q, k, v, jnp.ones(k.shape[:2], bool))
    return _matmul(o, wo)

  args = (sds((32, 13, 2, 32)), sds((32, 13, 2, 32)), sds((32, 13, 2, 32)), sds((2, 32, 128)))
  _compile(mesh, layer, *args)
  _compile(mesh, jax.grad(lambda *a: layer(*a).sum(), argnums=(0, 1, 2, 3)), *args)


def _shared_prefix_decode_args(rep, n=16):
  """One decode step of ``n`` samples of one 2,048-token prompt (rollout.prefix_sharing with
  refill): a 70B's 64 query / 8 KV heads of 128, the prompt once, each row's own page of 512
  slots."""
  sds = lambda s, d=bf16: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
  pre, pool = sds((1, 8, 2048, 128)), sds((8, n, 512, 128))
  return (sds((n, 1, 64, 128)), pre, pre, sds((1, 2048), jnp.bool_), pool, pool,
          sds((n, 1), jnp.int32), sds((n,), jnp.int32))


def _shared_prefix_decode(impl):
  return lambda q, pk, pv, pm, k, v, slot, length: shared_prefix_paged_attention(
      q, pk, pv, pm, k, v, None, slot, length, window=None, impl=impl)


@needs_gpu_compiler
@pytest.mark.parametrize("impl,n", [("xla", 16), ("pallas", 16), ("pallas", 64)])
def test_shared_prefix_decode_over_pages_compiles_for_h200(impl, n):
  """The shared-prompt split over a row's page compiles for an H200 and fits its memory:
  the XLA path, and the Pallas one (the decode kernel twice, the prompt part and the own
  part; 64 samples x 8 query heads a KV head are 512 query rows, served 128 a program)."""
  mesh = _one_h200()
  compiled = _compile(mesh, _shared_prefix_decode(impl),
                      *_shared_prefix_decode_args(NamedSharding(mesh, P()), n))
  assert targets.check_fits(compiled, "h200") < targets.memory_bytes("h200")
  want = ["decode_attention", "decode_attention"] if impl == "pallas" else []
  assert _kernels_in(compiled) == want


# ------------------------------------------------------------------- kernels, TPU (Mosaic)


def _one_tpu(accelerator: str):
  """A one-chip mesh of a compile-only TPU (libtpu has no 1-chip slice: the first chip of a
  2x4 / 2x2x2 one)."""
  return Mesh(np.asarray(targets.devices(accelerator, 8)[:1]).reshape(1, 1, 1),
              ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)


def _tpu_kernels_in(compiled) -> list[str]:
  """The Mosaic kernels the TPU executable runs (``tpu_custom_call``), by name (the instruction
  is named after the kernel, wrapped in the transformations it came through:
  ``transpose_jvp_logprob_entropy_tpu_bwd_dh__.1``)."""
  names = [re.search(r"%([A-Za-z_]\w*?)(?:\.\d+)? = ", line).group(1)
           for line in compiled.as_text().splitlines() if MOSAIC in line]
  return [re.sub(r"^(?:(?:transpose|jvp|vmap)_)+", "", n).rstrip("_") for n in names]


LP_TPU = ["logprob_entropy_tpu_fwd", "logprob_entropy_tpu_bwd_dh", "logprob_entropy_tpu_bwd_dw"]
SPLASH = ["splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
          "splash_mha_dkv_segmented_no_residuals"]


def _tpu_kernel_cases():
  """(name, function, abstract args, kernels it must hold, slow): the TPU kernels forward and
  backward through the dispatchers (``impl="pallas"`` on a TPU target) at the GPU cases'
  production shapes: the Llama-3 8B and 70B log-prob heads, 32 query / 8 KV heads of 128 at
  4096 tokens, Gemma's window and soft-cap, packed segments, head_dim 256, float32."""
  sds = jax.ShapeDtypeStruct
  lp_grad = lambda **kw: jax.grad(
      lambda h, w, t: _sum(*logprob_entropy(h, w, t, impl="pallas", **kw)), argnums=(0, 1))
  at_grad = lambda **kw: jax.grad(
      lambda q, k, v, m, *a: _sum(attention(q, k, v, m, 0, impl="pallas", **kw)),
      argnums=(0, 1, 2))
  h, w, t = sds((8, 2048, 4096), bf16), sds((4096, 128256), bf16), sds((8, 2048), jnp.int32)
  q, kv, mask = sds((2, 4096, 32, 128), bf16), sds((2, 4096, 8, 128), bf16), sds((2, 4096), bool)
  return [
      ("logprob bf16 8x2048x4096 V128256", lp_grad(), (h, w, t), LP_TPU, False),
      ("logprob soft-cap f32 4x1024x2048 V32001 (partial tile)", lp_grad(softcap=30.0),
       (sds((4, 1024, 2048), f32), sds((2048, 32001), f32), sds((4, 1024), jnp.int32)), LP_TPU,
       False),
      ("logprob bf16 4x2048x8192 V128256 (70B head)", lp_grad(),
       (sds((4, 2048, 8192), bf16), sds((8192, 128256), bf16), sds((4, 2048), jnp.int32)),
       LP_TPU, True),
      ("splash bf16 32/8 heads of 128 T=S=4096", at_grad(), (q, kv, kv, mask), SPLASH, False),
      ("splash window 1024 + soft-cap (Gemma)", at_grad(window=1024, softcap=50.0, scale=0.0625),
       (q, kv, kv, mask), SPLASH, False),
      ("splash packed segments", jax.grad(
          lambda q, k, v, m, sg: _sum(attention(q, k, v, m, 0, impl="pallas", segment_ids=sg)),
          argnums=(0, 1, 2)), (q, kv, kv, mask, sds((2, 4096), jnp.int32)), SPLASH, False),
      ("splash head_dim 256", at_grad(),
       (sds((1, 2048, 8, 256), bf16), sds((1, 2048, 4, 256), bf16), sds((1, 2048, 4, 256), bf16),
        sds((1, 2048), bool)), SPLASH, True),
      ("splash f32 T 1024 head_dim 64", at_grad(),
       (sds((2, 1024, 8, 64), f32), sds((2, 1024, 2, 64), f32), sds((2, 1024, 2, 64), f32),
        sds((2, 1024), bool)), SPLASH, True),
      *[(f"paged decode bf16 64/8 heads, 16-slot pages (jax's kernel){name}", fn,
         _paged_args(), ["paged_attention"], False) for name, fn in _paged_fns()],
  ]


@needs_tpu_compiler
def test_a_contiguous_pool_split_over_two_v5e_chips_is_read_in_place():
  """The same on TPU (the shard_map path of kernels/_sharding.py: the pool's pages split as
  the rows are): each chip runs the Mosaic paged kernel on its own rows and pages, nothing
  gathered."""
  compiled = _split_pool_decode(Mesh(np.asarray(targets.devices("tpu-v5e", 8)[:2]).reshape(
      2, 1, 1), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3))
  assert sorted(set(_tpu_kernels_in(compiled))) == ["paged_attention"]
  assert "all-gather" not in compiled.as_text()


_TPU_KERNEL_CACHE: dict = {}


def compile_tpu_kernel(accelerator: str, case: str):
  """``(compiled, seconds, kernels wanted)`` of one TPU kernel case on one chip, cached."""
  key = (accelerator, case)
  if key not in _TPU_KERNEL_CACHE:
    mesh = _one_tpu(accelerator)
    rep = NamedSharding(mesh, P())
    name, f, avals, want, _ = next(c for c in _tpu_kernel_cases() if c[0] == case)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in avals]
    t0 = time.perf_counter()
    _TPU_KERNEL_CACHE[key] = (_compile(mesh, f, *avals), time.perf_counter() - t0, want)
  return _TPU_KERNEL_CACHE[key]


TPU_KERNEL_CASES = [pytest.param(c[0], marks=pytest.mark.slow if c[4] else ())
                    for c in _tpu_kernel_cases()]


@needs_tpu_compiler
@pytest.mark.parametrize("case", TPU_KERNEL_CASES)
def test_every_tpu_kernel_compiles_for_v5e(case):
  """XLA:TPU with Mosaic compiles each kernel (Mosaic checks the blocks against the chip's
  VMEM, an oversized block is refused: ``test_tpu_blocks_over_the_vmem_limit_...``), and the
  executable runs our kernels as ``tpu_custom_call``s, not an XLA fallback."""
  compiled, _, want = compile_tpu_kernel("tpu-v5e", case)
  assert sorted(set(_tpu_kernels_in(compiled))) == sorted(want)
  assert targets.check_fits(compiled, "tpu-v5e") < targets.memory_bytes("tpu-v5e")


@needs_tpu_compiler
@pytest.mark.parametrize("case", ["logprob bf16 8x2048x4096 V128256",
                                  "splash bf16 32/8 heads of 128 T=S=4096"])
def test_the_tpu_kernels_compile_for_v5p(case):
  """v5p (95 GiB HBM, a megacore: the kernels' "parallel" grid axes are split over its two
  TensorCores) compiles the production cases too."""
  compiled, _, want = compile_tpu_kernel("tpu-v5p", case)
  assert sorted(set(_tpu_kernels_in(compiled))) == sorted(want)
  assert targets.check_fits(compiled, "tpu-v5p") < targets.memory_bytes("tpu-v5p")


@needs_tpu_compiler
def test_shared_prefix_decode_over_pages_compiles_for_v5e():
  """The same split compiles for a TPU v5e chip and fits; ``auto`` there is the XLA path (the
  decode kernel is Triton's: no Mosaic kernel is launched)."""
  mesh = _one_tpu("tpu-v5e")
  compiled = _compile(mesh, _shared_prefix_decode("auto"),
                      *_shared_prefix_decode_args(NamedSharding(mesh, P())))
  assert targets.check_fits(compiled, "tpu-v5e") < targets.memory_bytes("tpu-v5e")
  assert _tpu_kernels_in(compiled) == []


@needs_tpu_compiler
def test_tpu_blocks_over_the_vmem_limit_are_rejected_by_mosaic():
  """The log-prob kernels' tiles at D 4096 hold ~28 MiB of VMEM (``mosaic.BlockSizes``); held
  to 8 MiB (the scoped limit passed to Mosaic), the compile refuses them with the figures.
  (Tiles over v5e's whole 128 MiB, 2048 x 8192, are refused alike, after three minutes.)"""
  mesh = _one_tpu("tpu-v5e")
  rep = NamedSharding(mesh, P())
  sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)
  big = MosaicBlockSizes(vmem_limit=8 * 2**20)
  f = lambda h, w, t: logprob_entropy_mosaic(h, w, t, block_sizes=big)
  with pytest.raises(Exception, match=r"(?i)vmem"):
    _compile(mesh, f, sds((2, 1024, 4096), bf16), sds((4096, 32000), bf16),
             sds((2, 1024), jnp.int32))


@needs_tpu_compiler
def test_the_tpu_kernels_run_per_shard_on_a_v5e_slice():
  """On the 2x4 slice (dp 4 x tp 2) the kernels run in a shard_map (custom_partitioning does
  not compile on TPU): each chip's log-prob kernel gets its quarter of the tokens and its
  splash kernel its quarter of the batch and half of the heads; dW is summed over the token
  shards."""
  mesh = targets.mesh("tpu-v5e", MeshConfig(dp=4, fsdp=1, tp=2), 8)
  sds = lambda s, d, *spec: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P(*spec)))
  lp = jax.grad(lambda h, w, t: _sum(*logprob_entropy(h, w, t)), argnums=(0, 1))
  lp_c = _compile(mesh, lp, sds((8, 2048, 1024), bf16, "dp"), sds((1024, 32000), bf16, None, "tp"),
                  sds((8, 2048), jnp.int32, "dp"))
  text = lp_c.as_text()
  assert sorted(set(_tpu_kernels_in(lp_c))) == sorted(LP_TPU)
  fwd = next(line for line in text.splitlines() if "logprob_entropy_tpu_fwd" in line)
  assert "f32[4096,1]" in fwd.split("custom-call(")[0]  # 16384 / 4 rows
  assert "all-reduce" in text  # dW
  at = jax.grad(lambda q, k, v, m: _sum(attention(q, k, v, m, 0)), argnums=(0, 1, 2))
  q = sds((8, 1024, 8, 128), bf16, "dp", None, "tp")
  kv = sds((8, 1024, 2, 128), bf16, "dp", None, "tp")
  at_c = _compile(mesh, at, q, kv, kv, sds((8, 1024), bool, "dp"))
  assert sorted(set(_tpu_kernels_in(at_c))) == sorted(SPLASH)
  # per chip: 2 of 8 sequences, 4 of 8 query heads (1 of 2 KV heads), all 1024 positions
  fwd = next(line for line in at_c.as_text().splitlines() if "%splash_mha_fwd" in line)
  assert "bf16[2,4,1024,128]" in fwd.split("custom-call(")[0]


@needs_tpu_compiler
def test_the_triton_kernels_on_a_tpu_fail_in_mosaic_not_on_their_parameters():
  """Called directly on a TPU target, a Triton kernel is given Mosaic's compiler parameters
  (never Triton's, which Mosaic's lowering rejects with a bare AssertionError), so the error
  is Mosaic's own: its masked loads have no TPU lowering."""
  mesh = _one_tpu("tpu-v5e")
  rep = NamedSharding(mesh, P())
  sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)
  f = lambda h, w, t: logprob_entropy_pallas(h, w, t)
  with pytest.raises(NotImplementedError):
    _compile(mesh, f, sds((2, 256, 512), bf16), sds((512, 1024), bf16), sds((2, 256), jnp.int32))


# -------------------------------------------------------------- the algorithms' steps


def _tiny(exp: str):
  cfg = registry.get(exp)
  rm = dataclasses.replace(TINY, score_pool="mean") if cfg.reward_model is not None else None
  return dataclasses.replace(cfg, model=TINY, reward_model=rm)


STEPS = {"sft": ("tiny_ppo", "sft"), "dpo": ("tiny_dpo", "dpo"), "grpo": ("tiny_grpo", "grpo"),
         "ppo": ("tiny_ppo", "ppo")}
# dp x fsdp x tp: every kind of sharding (batch, ZeRO-3 weights, tensor-parallel heads and
# vocabulary) is in the program, so every kind of collective.
MESH = MeshConfig(dp=2, fsdp=2, tp=2)
_STEP_CACHE: dict = {}


def compile_step(accelerator: str, algo: str, impl: str, n: int = 8):
  """The one-program step of ``algo`` (TINY model) compiled on ``n`` compile-only devices:
  ``(compiled, compile seconds)``, cached for the session."""
  key = (accelerator, algo, impl, n)
  if key not in _STEP_CACHE:
    exp, stage_name = STEPS[algo]
    # Prompts padded to 24 slots: sequences over 16 tokens take the flash kernels (16 and
    # fewer, the decode kernel: kernels/attention/dispatch.py).
    cfg = apply_overrides(_tiny(exp), [f"kernels.logprob={impl}", f"kernels.attention={impl}",
                                       "data.max_prompt_len=24"])
    mesh = targets.mesh(accelerator, MESH, n)
    stage = build_stage(stage_name, cfg, mesh, DataSource(cfg.data, cfg.seed))
    state, frozen = stage.abstract_init()
    batch = stage.abstract_batch()
    with jax.set_mesh(mesh):
      t0 = time.perf_counter()
      compiled = stage.make_step_fn(state, frozen, batch).lower(state, frozen, batch).compile()
    _STEP_CACHE[key] = (compiled, time.perf_counter() - t0)
  return _STEP_CACHE[key]


def collectives(compiled) -> dict[str, int]:
  """Collective ops of the compiled program by kind (GPU: the async ``*-start`` halves)."""
  kinds = re.findall(r"= [^=]*?\b(all-reduce|all-gather|reduce-scatter|all-to-all|"
                     r"collective-permute)(?:-start)?\(", compiled.as_text())
  return {k: kinds.count(k) for k in sorted(set(kinds))}


# In CI: every algorithm's step with the kernels (generation's decode, attention, the log-prob
# head, the fsdp-sharded unembedding), and SFT on the XLA path (the dot XLA:GPU once refused).
# The XLA path of the other three: ``pytest -m slow``.
_FAST = {("sft", "pallas"), ("dpo", "pallas"), ("grpo", "pallas"), ("ppo", "pallas"),
         ("sft", "xla")}
STEP_CASES = [pytest.param(a, i, marks=() if (a, i) in _FAST else pytest.mark.slow)
              for a in STEPS for i in ("pallas", "xla")]


@needs_gpu_compiler
@pytest.mark.parametrize("algo,impl", STEP_CASES)
def test_step_compiles_on_8_h200s(algo, impl):
  compiled, _ = compile_step("h200", algo, impl)
  kernels = set(_kernels_in(compiled))
  if impl == "pallas":
    want = {"flash_attention_fwd", "flash_attention_bwd_dq", "flash_attention_bwd_dkv",
            "logprob_entropy_fwd", "logprob_entropy_bwd_dh", "logprob_entropy_bwd_dw"}
    if algo in ("grpo", "ppo"):
      want.add("decode_attention")
    assert want <= kernels, want - kernels
  else:
    assert not kernels
  coll = collectives(compiled)
  # Gradients summed over the data shards; fsdp weights gathered for the matmuls.
  assert coll.get("all-reduce", 0) > 0 and coll.get("all-gather", 0) > 0, coll
  assert 0 < targets.check_fits(compiled, "h200", f"{algo} step") < 0.1 * GiB


@needs_gpu_compiler
def test_a_program_over_the_device_memory_is_reported_as_not_fitting():
  """XLA:GPU compiles a program larger than the device with only a log line; check_fits is
  the check.  80 GiB of float32 in and 80 out per device, on an H200 (141 GB)."""
  mesh = _one_h200()
  big = jax.ShapeDtypeStruct((80, 2**28), f32, sharding=NamedSharding(mesh, P()))
  compiled = _compile(mesh, lambda x: x * 2, big)
  with pytest.raises(ConfigError, match=r"needs 160\.00 GiB per device, over the 131\.3 GiB"):
    targets.check_fits(compiled, "h200", "the test program")


# ------------------------------------------------------------- the host does not leak in


def _calls(jaxpr) -> list[str]:
  """Every dot's operand dtypes and every Pallas kernel of ``jaxpr``, nested ones included,
  in order: what differs when a program is traced for another platform."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append("dot " + ",".join(str(v.aval.dtype) for v in eqn.invars))
    elif eqn.primitive.name == "pallas_call":
      out.append("pallas " + str(eqn.params["name"]).split()[0])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      out += _calls(sub)
  return out


@needs_gpu_compiler
def test_a_gpu_program_traced_on_this_host_is_the_one_a_gpu_host_traces():
  """The bf16 model's forward and log-prob head, kernels on ``auto``: traced here under the
  compile-only H200 mesh, and traced as on a GPU host (no mesh, the default device a GPU),
  the same dots in the same dtypes and the same kernels.  Traced for this CPU host it differs
  (no kernels; its dots are the same bf16 ones, docs/rollout.md): the comparison would see a
  leak."""
  from jaxrlhf.model.transformer import forward, init_params, unembedding
  cfg = dataclasses.replace(TINY, param_dtype="bfloat16", compute_dtype="bfloat16")
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  sds = jax.ShapeDtypeStruct
  tokens, mask = sds((2, 16), jnp.int32), sds((2, 16), jnp.bool_)

  def head(params, tokens, mask):
    h, _ = forward(params, tokens, jnp.cumsum(mask, 1) - 1, mask, cfg=cfg)
    return logprob_entropy(h, unembedding(params, cfg), tokens)

  def trace():  # jit's trace cache is keyed by the mesh, not by the default device
    jax.clear_caches()
    return _calls(jax.make_jaxpr(head)(params, tokens, mask).jaxpr)

  on_cpu = trace()
  with jax.set_mesh(targets.mesh("h200", MeshConfig(dp=1, fsdp=1, tp=1), 1)):
    for_h200 = trace()
  with jax.default_device(targets.devices("h200", 1)[0]):
    on_gpu_host = trace()
  assert for_h200 == on_gpu_host
  assert {c for c in for_h200 if c.startswith("pallas")} == {
      "pallas decode_attention", "pallas logprob_entropy_fwd"}  # 16 tokens: decode kernel
  assert "dot float32,float32" not in for_h200
  assert not any(c.startswith("pallas") for c in on_cpu) and "dot float32,float32" not in on_cpu


# ----------------------------------------------------------------------------- TPU v5e


TPU_STEP_CASES = [pytest.param(a, i, marks=() if i == "auto" else pytest.mark.slow)
                  for a in STEPS for i in ("auto", "xla")]


@needs_tpu_compiler
@pytest.mark.parametrize("algo,impl", TPU_STEP_CASES)
def test_step_compiles_for_a_tpu_v5e_slice(algo, impl):
  """XLA:TPU on a v5e 2x4 slice: with ``auto`` the step runs the TPU kernels (the Mosaic
  log-prob head, splash attention for the training and reference passes; generation's decode
  and cache prefill stay on XLA, kernels/NOTES.md), with ``xla`` none; either compiles,
  gathers and reduces across the slice, and fits the chip's 16 GiB."""
  compiled, _ = compile_step("tpu-v5e", algo, impl)
  kernels = set(_tpu_kernels_in(compiled))
  assert not _kernels_in(compiled)
  if impl == "auto":
    want = set(LP_TPU) | set(SPLASH)
    assert want <= kernels, want - kernels
  else:
    assert not kernels
  coll = collectives(compiled)
  assert coll.get("all-reduce", 0) > 0, coll
  assert 0 < targets.check_fits(compiled, "tpu-v5e", f"{algo} step") < 0.1 * GiB


# ---------------------------------------------------------------------------- the planner


@needs_gpu_compiler
def test_the_planner_reads_a_program_compiled_for_h100s():
  """``plan.plan_stage`` takes any mesh: on compile-only H100s its memory and collective
  traffic come from XLA:GPU's program.  SMALL_SFT on fsdp 4 x tp 2: 11.6 MiB per device here, 13.6 MiB
  on the CPU; 8.49 vs 8.51 MB of collective traffic (kernels/NOTES.md)."""
  from jaxrlhf import hardware, plan
  from test_plan import SMALL_SFT
  mesh = targets.mesh("h100", MeshConfig(dp=1, fsdp=4, tp=2), 8)
  step = plan.plan_stage(SMALL_SFT, "sft", mesh, hardware.get_accelerator("h100")).programs[0]
  assert step.name == "sft/step" and step.cpu_upcast_bytes == 0
  assert 0 < step.peak_bytes_per_device < 0.1 * GiB
  assert step.comm_intra_bytes > 0 and step.comm_inter_bytes == 0  # one node of 8


@needs_gpu_compiler
def test_plan_on_the_command_line_compiles_with_the_targets_compiler(tmp_path):
  """``--plan --accelerator=h100`` with the plugin installed (plan.compiler=auto) compiles on
  compile-only H100s, says so, and writes it in plan.json; plan.compiler=cpu keeps the
  simulated CPU devices.  The same programs, so the same analytic FLOPs."""
  import json
  import os
  import subprocess
  import sys
  out = {}
  for compiler in ("auto", "cpu"):
    wd = tmp_path / compiler
    run = subprocess.run([sys.executable, "-m", "jaxrlhf.main", "--experiment=tiny_dpo",
                          "--plan", "--devices=8", "--accelerator=h100", f"--workdir={wd}",
                          "--steps=1", f"--set=plan.compiler={compiler}"],
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    out[compiler] = (run.stdout, json.loads((wd / "plan.json").read_text()))
  (gpu_text, gpu), (cpu_text, cpu) = out["auto"], out["cpu"]
  assert "by XLA:GPU for h100 itself" in gpu_text and gpu["compiler"] == "gpu"
  assert "on simulated CPU devices" in cpu_text and cpu["compiler"] == "cpu"
  assert gpu["fits"] and 0 < gpu["memory"]["peak_bytes_per_device"] < 0.1 * GiB
  assert [p["flops"] for p in gpu["programs"]] == [p["flops"] for p in cpu["programs"]]


def test_plan_compiler_target_without_the_plugin_is_one_line(monkeypatch):
  """plan.compiler=target where the extra is missing names the install; auto falls back."""
  from jaxrlhf import hardware
  from jaxrlhf.plan.build import compiler_of
  monkeypatch.setattr(targets, "missing", lambda acc: f"no plugin for {acc}: pip install -e '.[aot]'")
  cfg = registry.get("tiny_dpo")
  h100 = hardware.get_accelerator("h100")
  with pytest.raises(ConfigError, match=r"plan.compiler=target: no plugin for h100.*\[aot\]"):
    compiler_of(apply_overrides(cfg, ["plan.compiler=target"]), h100)
  assert compiler_of(cfg, h100) == "cpu"
