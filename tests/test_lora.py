"""LoRA (``STAGE.lora``): the adapters' forward equals the merged model's; with B = 0 the first
step's policy is the base exactly (KL to the reference exactly 0); the reference is the base
itself (no second copy); only the adapters (and a scalar head) have optimizer state; the steps
agree across meshes; PEFT's layout round-trips; resume is bit-identical; bad settings are
refused by name."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mesh
from jaxrlhf import model as M
from jaxrlhf.config import ConfigError, LoraConfig, validate
from jaxrlhf.data import DataSource
from jaxrlhf.model import lora as LORA
from jaxrlhf.train.common import put_batch
from jaxrlhf.train.spec import build_stage
from test_train import MODEL, config, run_steps

LO = LoraConfig(rank=4, alpha=8.0)


def with_lora(cfg, name, lo=LO):
  return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), lora=lo)})


def _random_adapters(cfg, lo, key):
  """Adapters with a non-zero B (a trained adapter), so the delta is visible."""
  ad = LORA.init_adapters(cfg, lo, key)
  return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                             x.shape), ad)


@pytest.mark.parametrize("targets", [LO.targets, ("q", "v"), ("o", "down")])
def test_merged_forward_equals_the_adapter_forward(targets):
  lo = dataclasses.replace(LO, targets=targets, rslora=targets == ("q", "v"))
  base = M.init_params(MODEL, jax.random.key(0))
  ad = _random_adapters(MODEL, lo, jax.random.key(1))
  tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, MODEL.vocab_size)
  mask = jnp.ones_like(tokens, bool)
  lp_view, _ = M.token_logprobs(LORA.view(ad, base, lo), tokens, mask, cfg=MODEL)
  lp_merged, _ = M.token_logprobs(LORA.merge(ad, base, lo, "float32"), tokens, mask, cfg=MODEL)
  lp_base, _ = M.token_logprobs(base, tokens, mask, cfg=MODEL)
  np.testing.assert_allclose(lp_view, lp_merged, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(lp_view - lp_base))) > 1e-3  # the adapters do change the model


def test_zero_b_adapters_are_the_base_exactly():
  base = M.init_params(MODEL, jax.random.key(0))
  ad = LORA.init_adapters(MODEL, LO, jax.random.key(1))
  assert all(float(jnp.abs(x["a"]).max()) > 0 and not np.any(x["b"])
             for x in ad["layers"]["lora"].values())
  tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, MODEL.vocab_size)
  mask = jnp.ones_like(tokens, bool)
  a, _ = M.token_logprobs(LORA.view(ad, base, LO), tokens, mask, cfg=MODEL)
  b, _ = M.token_logprobs(base, tokens, mask, cfg=MODEL)
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_first_rl_step_has_exactly_zero_kl_and_one_copy_of_the_base(name):
  cfg = with_lora(config(), name)
  stage, state, frozen, metrics = run_steps(cfg, name, mesh(), steps=2)
  # The KL the update sees (the policy's teacher-forced log-probs against the reference's):
  # PPO's reward-side KL, GRPO's loss-side KL: with every b zero the policy's view counts as
  # the reference (phases.same_weights), so neither reads the sampler's or another program's
  # float32 rounding.
  kl = "kl/mean" if name == "ppo" else "kl/loss"
  assert metrics[0][kl] == 0.0
  if name == "grpo":  # one minibatch: the update's ratio is exactly 1 (PPO's second is not)
    assert metrics[0]["policy/approx_kl"] == 0.0
  if name == "ppo":  # (GRPO's tiny random policy earns no reward: zero advantages)
    assert metrics[1][kl] != 0.0  # the adapters trained: the policy left the reference
  # The policy's base is the reference: no "policy.base", and the trained tree holds adapters.
  assert "policy.base" not in frozen and "reference" in frozen
  assert sorted(state.params["policy"]) == ["layers"]
  assert sorted(state.params["policy"]["layers"]) == ["lora"]
  if name == "ppo":  # the value model: adapters + its own head on the reward model's backbone
    assert "value.base" not in frozen
    assert sorted(state.params["value"]) == ["layers", "score"]


def test_only_adapters_and_heads_have_optimizer_state():
  cfg = with_lora(config(), "ppo")
  stage = build_stage("ppo", cfg, mesh(), DataSource(cfg.data, cfg.seed))
  state, frozen = stage.init(jax.random.key(0), {})
  size = lambda t: sum(x.size for x in jax.tree.leaves(t))
  full = M.param_shapes(MODEL)
  full_size = sum(int(np.prod(s)) for s in jax.tree.leaves(
      full, is_leaf=lambda x: isinstance(x, tuple)))
  adapters = size(state.params["policy"])
  # 4 projections of [32 -> 32 / 16] and 3 MLP ones of [32 <-> 64], rank 4, 2 layers.
  assert adapters == size(LORA.init_adapters(MODEL, LO, jax.random.key(0)))
  assert adapters < full_size / 5
  # Adam's two moments of the adapters (and the value head), nothing of the base.
  assert size(state.opt_state["policy"]) <= 2 * adapters + 2  # + Adam's and the schedule's counts
  assert size(state.opt_state["value"]) <= 2 * size(state.params["value"]) + 2  # + counts


@pytest.mark.parametrize("name", ["sft", "rm", "dpo", "ppo"])
def test_lora_step_on_dp2_tp2_equals_single_device(name):
  cfg = with_lora(config(), name)
  _, s1, _, m1 = run_steps(cfg, name, mesh(), steps=2)
  _, s2, _, m2 = run_steps(cfg, name, mesh(dp=2, tp=2), steps=2)
  for k in m1[1]:
    if not k.startswith(("time/", "memory/")):
      np.testing.assert_allclose(m2[1][k], m1[1][k], rtol=2e-4, atol=2e-5, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
               jax.device_get(s2.params), jax.device_get(s1.params))


def test_decode_layout_with_lora_gives_the_training_layouts_rollout():
  from jaxrlhf.config import RolloutConfig
  from jaxrlhf.train import phases
  from jaxrlhf.train.types import StepCarry
  m = mesh(2, 2, 2)
  out = {}
  for layout in ("train", "tp"):
    cfg = with_lora(config(rollout=RolloutConfig(max_new_tokens=4, decode_layout=layout)),
                    "grpo")
    cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, batch_size=8))
    stage = build_stage("grpo", cfg, m, DataSource(cfg.data, cfg.seed))
    assert (stage.decode_shardings is None) == (layout == "train")
    state, frozen = stage.init(jax.random.key(0), {})
    # A trained adapter, so the generation really reads it.
    state = state.replace(params={"policy": jax.device_put(
        _random_adapters(MODEL, LO, jax.random.key(3)),
        jax.tree.map(lambda x: x.sharding, state.params["policy"]))})
    gen = jax.jit(lambda st, fz, b: phases.generate(stage.statics, fz, b,
                                                    StepCarry(state=st)).rollout)
    with jax.set_mesh(m):
      ro = gen(state, frozen, put_batch(m, stage.batch(0)))
    out[layout] = jax.device_get((ro.tokens_BT, ro.behaviour_logp_BN))
  # The same tokens; the log-probs to float rounding (the frozen base's matmuls contract over
  # dp x fsdp shards in one layout, whole rows in the other).
  np.testing.assert_array_equal(out["tp"][0], out["train"][0])
  np.testing.assert_allclose(out["tp"][1], out["train"][1], rtol=1e-6, atol=1e-6)


def test_outputs_are_the_merged_model_and_the_next_stage_starts_from_it():
  cfg = with_lora(config(), "sft")
  stage, state, frozen, _ = run_steps(cfg, "sft", mesh(), steps=3)
  out = stage.outputs(state, frozen)["policy"]
  assert "lora" not in out["layers"]
  want = LORA.merge(state.params["policy"], frozen["policy.base"], LO, "float32")
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(out), jax.device_get(want))
  # DPO with LoRA after it: its reference (= its policy's base) is SFT's merged model.
  cfg2 = with_lora(cfg, "dpo")
  dpo = build_stage("dpo", cfg2, mesh(), DataSource(cfg2.data, cfg2.seed))
  _, fz = dpo.init(jax.random.key(1), {"policy": out})
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(fz["reference"]),
               jax.device_get(out))


def test_bfloat16_base_keeps_float32_adapters():
  lo = dataclasses.replace(LO, base_dtype="bfloat16")
  cfg = with_lora(config(), "dpo", lo)
  stage, state, frozen, m = run_steps(cfg, "dpo", mesh(), steps=2)
  assert {x.dtype for x in jax.tree.leaves(frozen["reference"])} == {jnp.dtype("bfloat16")}
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
  assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype("float32")}
  abstract, afz = stage.abstract_init()
  assert jax.tree.map(lambda x: x.dtype, afz) == jax.tree.map(lambda x: x.dtype, frozen)
  assert np.isfinite(m[1]["loss"])


def test_peft_export_reloads_into_identical_adapters(tmp_path):
  lo = dataclasses.replace(LO, targets=("q", "k", "o", "down"))
  ad = jax.device_get(_random_adapters(MODEL, lo, jax.random.key(1)))
  out = LORA.export_peft(ad, MODEL, lo, str(tmp_path), base_model="my/base")
  config_json = json.load(open(os.path.join(out, "adapter_config.json")))
  assert config_json["r"] == 4 and config_json["lora_alpha"] == 8.0
  assert config_json["target_modules"] == ["down_proj", "k_proj", "o_proj", "q_proj"]
  from safetensors.numpy import load_file
  tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
  # PEFT's names and shapes: lora_A [r, in], lora_B [out, r].
  a = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"]
  b = tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
  assert a.shape == (4, MODEL.n_heads * MODEL.head_dim) and b.shape == (MODEL.d_model, 4)
  # The same product as ours: x @ A^T @ B^T == (x @ a) @ b for layer 1's o_proj.
  ours = LORA.delta(ad["layers"]["lora"]["wo"]["a"], ad["layers"]["lora"]["wo"]["b"])[1]
  np.testing.assert_allclose((b @ a).T.reshape(ours.shape), ours, rtol=1e-5, atol=1e-7)
  back = LORA.load_peft(out, MODEL, lo)
  jax.tree.map(np.testing.assert_array_equal, back, ad)


def test_training_continues_from_a_peft_adapter(tmp_path):
  ad = jax.device_get(_random_adapters(MODEL, LO, jax.random.key(1)))
  LORA.export_peft(ad, MODEL, LO, str(tmp_path))
  cfg = with_lora(config(), "sft", dataclasses.replace(LO, init_from=str(tmp_path)))
  stage = build_stage("sft", cfg, mesh(), DataSource(cfg.data, cfg.seed))
  state, _ = stage.init(jax.random.key(0), {})
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params["policy"]), ad)


def test_a_mismatched_peft_adapter_is_refused_with_the_setting_to_change(tmp_path):
  ad = jax.device_get(LORA.init_adapters(MODEL, LO, jax.random.key(1)))
  LORA.export_peft(ad, MODEL, LO, str(tmp_path))
  with pytest.raises(ConfigError, match=r"r=4 \(set --set=sft.lora.rank=4\)"):
    LORA.load_peft(str(tmp_path), MODEL, dataclasses.replace(LO, rank=8), "sft.lora.init_from")
  with pytest.raises(ConfigError, match=r"set --set=lora.targets=q,k,v,o,gate,up,down\)"):
    LORA.load_peft(str(tmp_path), MODEL, dataclasses.replace(LO, targets=("q",)))
  with pytest.raises(ConfigError, match="no adapter_config.json"):
    LORA.load_peft(str(tmp_path / "nothing"), MODEL, LO)
  other = dataclasses.replace(MODEL, d_model=48)
  with pytest.raises(ConfigError, match="another model size"):
    LORA.load_peft(str(tmp_path), other, LO)


@pytest.mark.parametrize("lo, message", [
    (LoraConfig(rank=4, targets=("q", "lm_head")), "lm_head is not a projection"),
    (LoraConfig(rank=4, dropout=0.1), "dropout is not supported"),
    (LoraConfig(rank=4, roles=("critic",)), "must be one or more of policy,value,reward"),
    (LoraConfig(rank=4, alpha=0.0), "dpo.lora.alpha=0.0"),
    (LoraConfig(rank=-1), "dpo.lora.rank=-1"),
])
def test_bad_lora_settings_are_refused_by_name(lo, message):
  cfg = dataclasses.replace(with_lora(config(), "dpo", lo), stages=("dpo",))
  with pytest.raises(ConfigError, match=message):
    validate(cfg)


def test_lora_with_a_shared_backbone_is_refused():
  cfg = with_lora(config(), "ppo")
  cfg = dataclasses.replace(cfg, stages=("ppo",),
                            ppo=dataclasses.replace(cfg.ppo, shared_backbone=True))
  with pytest.raises(ConfigError, match="ppo.shared_backbone=false"):
    validate(cfg)


def test_pipeline_with_lora_writes_peft_adapters_and_a_merged_result(tmp_path):
  """SFT -> DPO, both with adapters, through the real pipeline: each stage writes its adapter
  in PEFT's layout and hands on merged weights; a rerun skips both finished stages; the merged
  policy exports to a Hugging Face checkpoint that reads back to the same weights."""
  from jaxrlhf import checkpoint as C
  from jaxrlhf.config import LoggingConfig, MeshConfig
  from jaxrlhf.model import hf
  from jaxrlhf.train import pipeline
  cfg = with_lora(with_lora(config(), "sft"), "dpo")
  cfg = dataclasses.replace(cfg, stages=("sft", "dpo"), mesh=MeshConfig(dp=-1),
                            logging=LoggingConfig(console_every_s=0.0, sinks=()))
  wd = str(tmp_path / "run")
  assert pipeline.run(cfg, wd) == 0
  for stage in ("sft", "dpo"):
    adapter = os.path.join(wd, stage, "adapters", "policy")
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
  ad = LORA.load_peft(os.path.join(wd, "dpo", "adapters", "policy"), MODEL, LO)
  assert any(np.any(x["b"]) for x in ad["layers"]["lora"].values())  # trained, not B = 0
  m = mesh()
  dpo = build_stage("dpo", cfg, m, DataSource(cfg.data, cfg.seed))
  result = C.load_stage_result(wd, "dpo", dpo.abstract_outputs())["policy"]
  sft = C.load_stage_result(wd, "sft", dpo.abstract_outputs())["policy"]
  # DPO's result = SFT's merged model + DPO's adapter merged on top.
  want = LORA.merge(ad, sft, LO, "float32")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               jax.device_get(result), jax.device_get(want))
  out = hf.export_hf(result, MODEL, str(tmp_path / "hf"))
  back = hf.load_hf(out, MODEL, m)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(back), jax.device_get(result))
  assert pipeline.run(cfg, wd) == 0  # both stages finished: loaded, not trained again


@pytest.mark.slow
def test_lora_gains_at_least_70_percent_of_what_full_finetuning_gains(tmp_path):
  """The issue's learning claim on the tiny tasks: from the same SFT policy, GRPO and DPO with
  rank-8 adapters (tiny_grpo_lora, tiny_dpo_lora) raise held-out exact match by at least 70% of
  what the full fine-tune gains in the same steps, and DPO's held-out pair accuracy reaches
  at least 70% of the full fine-tune's.  About 15 minutes on 2 cores."""
  import shutil
  import subprocess
  import sys
  summaries = {}
  # As a newcomer runs them: one process each, on the machine's one CPU device (not this test
  # process's simulated 8: XLA's in-process CPU collectives can deadlock on a LoRA base
  # sharded over dp, NOTES.md).
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name in ("tiny_grpo", "tiny_grpo_lora", "tiny_dpo", "tiny_dpo_lora"):
    wd = tmp_path / name
    if name != "tiny_grpo":  # the same SFT result: its stage is loaded, not trained again
      wd.mkdir()
      shutil.copytree(tmp_path / "tiny_grpo" / "sft", wd / "sft")
    run = subprocess.run([sys.executable, "-m", "jaxrlhf.main", f"--experiment={name}",
                          f"--workdir={wd}"], env=env, cwd=root, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summaries[name] = json.load(open(wd / "summary.json"))
  gain = lambda s, stage: s[stage]["eval/accuracy"] - s[f"{stage}/start"]["eval/accuracy"]
  for full, stage in (("tiny_grpo", "grpo"), ("tiny_dpo", "dpo")):
    want, got = gain(summaries[full], stage), gain(summaries[f"{full}_lora"], stage)
    assert want > 0.05 and got >= 0.7 * want, (stage, want, got)
  pairs = lambda n: summaries[n]["dpo"]["eval/pair_accuracy"]
  assert pairs("tiny_dpo_lora") >= 0.7 * pairs("tiny_dpo"), (pairs("tiny_dpo"),
                                                              pairs("tiny_dpo_lora"))
