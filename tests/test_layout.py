"""The state layout (jaxrlhf/train/layout.py): one pure init per stage, whose ``eval_shape`` is
the abstract state a restore, the planner and each pool read; weights read from files are
donated to it, never held twice; the frozen manifest names the source the init used."""

import dataclasses

import jax
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf.config import LoraConfig
from jaxrlhf.data import DataSource
from jaxrlhf.model import hf
from jaxrlhf import model as M
from jaxrlhf.train.spec import build_stage
from test_train import config

LO = LoraConfig(rank=4, alpha=8.0)


def _stage(cfg, name, m=None):
  return build_stage(name, cfg, m or mesh(), DataSource(cfg.data, cfg.seed))


def _describe(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding.spec), tree)


def _with(cfg, name, **changes):
  return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)})


CASES = {
    "sft": ("sft", config()),
    "rm": ("rm", config()),
    "ppo": ("ppo", config()),
    "ppo_lora_policy_and_value": ("ppo", _with(config(), "ppo", lora=LO)),
    "grpo_lora": ("grpo", _with(config(), "grpo", lora=LO)),
    "dpo_lora_bf16_base": ("dpo", _with(config(), "dpo", lora=dataclasses.replace(
        LO, base_dtype="bfloat16"))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_abstract_state_is_the_inits_shape_and_frozen_only_its_frozen_half(case):
  name, cfg = CASES[case]
  stage = _stage(cfg, name, mesh(dp=2, tp=2))
  state, frozen = stage.init(jax.random.key(3), {})
  none, frozen_alone = stage.init(jax.random.key(3), {}, frozen_only=True)
  abstract_state, abstract_frozen = stage.abstract_init()
  assert jax.tree.structure(abstract_state) == jax.tree.structure(state)
  assert _describe(abstract_state) == _describe(state)
  assert _describe(abstract_frozen) == _describe(frozen)
  assert none is None
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(frozen_alone),
               jax.device_get(frozen))
  if case == "ppo_lora_policy_and_value":  # the table: each LoRA role's base, one copy each
    assert stage.layout.base_keys == {"policy": "reference", "value": "reward"}
    assert set(frozen) == {"reference", "reward"}


def _pointers(tree):
  return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]


def test_weights_read_from_files_are_donated_into_the_state_not_copied(monkeypatch):
  """A frozen reference read from a Hugging Face directory ends up in the frozen tree in the
  very buffers it was read into (a 70B reference held once, not twice); the policy's read
  buffers are given up to the init too (they become its float32 master, or are freed once
  a master in another dtype is made from them)."""
  cfg = config()
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_path="/models/x"))
  reads = []

  def fake_load(path, mcfg, m, head="lm", dtype=None, *, rules, shardings=None):
    assert path == "/models/x"
    key = jax.random.key(10 + len(reads))
    params = M.init_sharded(mcfg, key, m, head, rules)
    # (The values from a second read: a host view of these buffers would pin them on the
    # CPU, and a pinned buffer cannot be donated.)
    reads.append((params, _pointers(params), M.init_sharded(mcfg, key, m, head, rules)))
    return params
  monkeypatch.setattr(hf, "load_hf", fake_load)
  stage = _stage(cfg, "dpo")
  assert reads == []  # building a stage reads nothing
  state, frozen = stage.init(jax.random.key(0), {})
  assert len(reads) == 2  # the policy's weights, then the reference's
  (policy, _, policy_values), (reference, reference_at, reference_values) = reads
  assert all(x.is_deleted() for x in jax.tree.leaves((policy, reference)))
  assert _pointers(frozen["reference"]) == reference_at
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(frozen["reference"]),
               reference_values)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params["policy"]),
               policy_values)


def test_the_manifest_names_the_earlier_result_the_init_started_from(tmp_path):
  """A frozen scalar role on the policy's backbone starts from the policy's earlier result
  (its backbone, a zero head), and the checkpoint's frozen manifest says so."""
  from jaxrlhf import checkpoint as ckpt
  from jaxrlhf.train.pipeline import frozen_manifest
  cfg = config()
  sft = _stage(cfg, "sft")
  _, sft_frozen = sft.init(jax.random.key(5), {})
  policy = sft.outputs(sft.init(jax.random.key(5), {})[0], sft_frozen)
  ckpt.save_stage_result(str(tmp_path), "sft", policy, {"summary": {}, "steps": 0})
  stage = _stage(cfg, "ppo")
  _, frozen = stage.init(jax.random.key(0), {"policy": policy["policy"]})
  manifest = frozen_manifest(stage, str(tmp_path), {"policy": "sft"})
  assert manifest["reference"]["stage"] == "sft" and manifest["reward"]["stage"] == "sft"
  np.testing.assert_array_equal(jax.device_get(frozen["reward"]["embed"]),
                                jax.device_get(policy["policy"]["embed"]))
  assert not np.any(jax.device_get(frozen["reward"]["score"]["w"]))
