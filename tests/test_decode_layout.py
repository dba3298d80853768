"""Generation in its own layout (``rollout.decode_layout``): the policy is resharded once per
step into tensor-parallel weights instead of all-gathering its fsdp shards for every decoded
token.  Same tokens and log-probs as decoding in the training layout; the compiled decode loop
holds tensor-parallel collectives only."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import RolloutConfig
from jaxrlhf.data import DataSource
from jaxrlhf.plan import hlo
from jaxrlhf.train import phases
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.spec import build_stage
from jaxrlhf.train.types import StepCarry
from test_train import config


def _stage(m, layout, n_new=6):
  cfg = config(rollout=RolloutConfig(max_new_tokens=n_new, decode_layout=layout))
  cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, batch_size=8))
  return build_stage("grpo", cfg, m, DataSource(cfg.data, cfg.seed))


def _generate_fn(stage):
  return jax.jit(lambda st, b: phases.generate(stage.statics, {}, b, StepCarry(state=st)).rollout)


@pytest.mark.parametrize("shape", [(2, 2, 2), (2, 4, 1)])
def test_decode_layout_gives_the_training_layouts_tokens_and_logprobs(shape):
  m = mesh(*shape)
  out = {}
  for layout in ("train", "tp"):
    stage = _stage(m, layout)
    assert (stage.decode_shardings is None) == (layout == "train")
    state, _ = stage.init(jax.random.key(0), {})
    with jax.set_mesh(m):
      ro = _generate_fn(stage)(state, put_batch(m, stage.batch(0)))
    out[layout] = jax.device_get((ro.tokens_BT, ro.behaviour_logp_BN, ro.lengths_B))
  for a, b in zip(out["tp"], out["train"]):
    np.testing.assert_array_equal(a, b)


def test_without_fsdp_the_decode_layout_is_the_training_layout():
  assert _stage(mesh(4, 1, 2), "tp").decode_shardings is None


def _loop_collectives(stage, m):
  """(collective opcode, result dims, replica groups as device-id sets) of every collective
  the compiled generation runs inside a loop (the layer scans and the decode ``while``)."""
  state, _ = stage.abstract_init()
  batch = {k: v for k, v in stage.abstract_batch().items()}
  with jax.set_mesh(m):
    text = _generate_fn(stage).lower(state, batch).compile().as_text()
  module = hlo.parse_hlo(text)
  n = m.devices.size
  out = []
  for comp, mult in hlo.multiplicities(module, unknown_trip=7).items():
    if mult <= 1:
      continue
    for ins in module.computations[comp]:
      kind = next((k for k in hlo.COLLECTIVES if ins.opcode in (k, k + "-start")), None)
      if kind is not None:
        groups = hlo.replica_groups(ins.attrs, n)
        t = ins.type[-1] if isinstance(ins.type, list) and ins.type else ins.type
        out.append((kind, tuple(t[1]) if isinstance(t, tuple) else None,
                    None if groups is None else [set(g) for g in groups.tolist()]))
  return out


def _parameter_dims(stage, m):
  """Shapes a parameter (or one layer's slice of a stacked one) can have on a device, whole
  or tensor-parallel: what a gather of parameters returns."""
  state, _ = stage.abstract_init()
  out = set()
  for x in jax.tree.leaves(state.params["policy"]):
    for dims in (x.shape, x.shape[1:]):
      if not dims:
        continue
      out.add(tuple(dims))
      for i in range(len(dims)):
        if dims[i] % 2 == 0:
          out.add(tuple(d // 2 if j == i else d for j, d in enumerate(dims)))
  return out


def test_the_decode_loop_holds_tensor_parallel_collectives_only():
  m = mesh(2, 2, 2)
  ids = np.vectorize(lambda d: d.id)(m.devices)  # [dp, fsdp, tp] -> device id
  tp_groups = [set(ids[i, j, :].tolist()) for i in range(2) for j in range(2)]

  def within_tp(groups):
    return groups is not None and all(any(g <= t for t in tp_groups) for g in groups)

  stage = _stage(m, "tp")
  params = _parameter_dims(stage, m)
  trained = _loop_collectives(_stage(m, "train"), m)
  decoded = _loop_collectives(stage, m)
  # The training layout gathers fsdp shards of the weights inside the loops, every layer of
  # every token: what the decode layout removes.
  gathers = [(d, g) for k, d, g in trained if k == "all-gather" and not within_tp(g)
             and d in params]
  assert gathers, trained
  # Decoding moves no parameter across fsdp or dp inside a loop: whatever crosses them there is
  # an activation (the embedding lookup's rows, a few KB a token) or the loop's "all rows
  # done?" scalar.
  bad = [(k, d, g) for k, d, g in decoded if not within_tp(g) and d in params]
  assert not bad, f"parameters moved across fsdp/dp inside the decode loops: {bad}"
  assert sum(1 for k, d, g in decoded if not within_tp(g)) < len(gathers)
