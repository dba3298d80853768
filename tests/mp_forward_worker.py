"""One process of the two-process test: joins the cluster, builds a 2x4 mesh over both
processes' devices and runs the sharded forward pass; process 0 writes the result.

The test starts it with XLA_FLAGS giving each process 4 simulated CPU devices."""

import sys

import jax
import numpy as np

from jaxrlhf import distributed
from jaxrlhf import model as M
from jaxrlhf.config import DistributedConfig, MeshConfig, ModelConfig
from jaxrlhf.mesh import PARAM_RULES, batch_sharding, make_mesh, tree_shardings

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8,
                  mlp_dim=64, max_seq_len=32)


def inputs():
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, CFG.vocab_size, size=(8, 12)).astype(np.int32)
  mask = np.arange(12)[None, :] >= rng.integers(0, 6, size=(8, 1))
  return np.where(mask, tokens, 0), mask


def sharded_forward(mesh):
  tokens, mask = inputs()
  params = jax.tree.map(np.asarray, M.init_params(CFG, jax.random.key(0)))
  with jax.set_mesh(mesh):
    shard = tree_shardings(mesh, M.param_axes(CFG), params, PARAM_RULES)
    params = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                          params, shard)
    bs = batch_sharding(mesh, 2, tokens.shape)
    t = jax.make_array_from_callback(tokens.shape, bs, lambda i: tokens[i])
    m = jax.make_array_from_callback(mask.shape, bs, lambda i: mask[i])
    fn = jax.jit(lambda p, t, m: M.forward(p, t, M.positions_from_mask(m), m, cfg=CFG)[0],
                 out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return np.asarray(jax.device_get(fn(params, t, m)))


def main():
  port, pid, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
  distributed.initialize(DistributedConfig(enabled=True, coordinator_address=f"127.0.0.1:{port}",
                                           num_processes=2, process_id=pid))
  assert jax.process_count() == 2 and len(jax.devices()) == 8, (jax.process_count(),
                                                                 jax.devices())
  mesh = make_mesh(MeshConfig(dp=2, tp=4))
  h = sharded_forward(mesh)
  if pid == 0:
    np.save(out, h)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
