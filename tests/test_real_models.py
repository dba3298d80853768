"""Issue 37: the templates on a real checkpoint.  A Llama-architecture HF folder whose vocabulary
(602) is larger than the templates' placeholder (512) goes through ``*_jsonl`` with no ``--set``
of architecture fields: the checks, ``--print_config`` and ``--plan`` see the checkpoint's model,
and a step trains.  On the prepared SmolLM2-135M-Instruct (helpers.real_model prepares it)
the same holds for ``--print_config``."""

import dataclasses
import json

import jax
import pytest

from byo_helpers import run_main, tiny_llama, write_jsonl
from helpers import real_model
from jaxrlhf import main as M
from jaxrlhf.config import MeshConfig
from jaxrlhf.train import pipeline

VOCAB = 602  # > 512, and a multiple of neither 4 nor 8: tp pads it

SMALL = ["--steps=1", "--set=data.max_prompt_len=16", "--set=data.max_response_len=8",
         "--set=rollout.max_new_tokens=8", "--set=model.compute_dtype=float32",
         "--set=model.remat=none", "--set=logging.sinks=jsonl", "--set=checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  return tiny_llama(tmp_path_factory.mktemp("llama") / "model", vocab=VOCAB)


def test_the_config_is_the_checkpoints_before_any_check(llama, tmp_path):
  """resolve_config (what --print_config prints and validate checks) reads the architecture;
  mesh.tp pads the vocabulary, and mesh.tp=-1 leaves it for the run, which pads it for the
  devices present (pipeline.resolve_for_devices)."""
  sets = [f"model.hf_path={llama}", f"data.tokenizer={llama}", "data.prompts_path=p.jsonl"]
  cfg = M.resolve_config("grpo_jsonl", sets, required=False)
  m = cfg.model
  assert (m.vocab_size, m.unpadded_vocab_size, m.d_model, m.n_layers, m.n_kv_heads,
          m.rope_theta, m.max_seq_len) == (VOCAB, 0, 32, 2, 2, 50000.0, 128)
  assert m.remat == "full" and m.param_dtype == "float32"  # the template's training fields kept
  assert json.loads(M.to_json(cfg))["model"]["vocab_size"] == VOCAB
  m4 = M.resolve_config("grpo_jsonl", sets + ["mesh.tp=4"], required=False).model
  assert (m4.vocab_size, m4.unpadded_vocab_size) == (604, VOCAB)
  free = M.resolve_config("grpo_jsonl", sets + ["mesh.dp=1", "mesh.tp=-1"], required=False)
  assert (free.model.vocab_size, free.model.unpadded_vocab_size) == (VOCAB, 0)
  run = pipeline.resolve_for_devices(free)  # 8 test devices: tp=8
  assert jax.device_count() == 8
  assert (run.model.vocab_size, run.model.unpadded_vocab_size) == (608, VOCAB)
  # A mesh these devices cannot form: left as it is (make_mesh says why, later).
  odd = dataclasses.replace(free, mesh=MeshConfig(dp=3, tp=-1))
  assert pipeline.resolve_for_devices(odd) == odd
  # Roles with their own checkpoint are resolved too.
  rm = M.resolve_config("ppo_jsonl", sets + [f"reward_model.hf_path={llama}"], required=False)
  assert rm.reward_model.vocab_size == VOCAB and rm.reward_model.d_model == 32


TRL_REWARD = """
import json, os

def accuracy(completions, answer, completion_ids, **kwargs):
  # As written for TRL's GRPOTrainer.
  with open(os.path.join(os.path.dirname(__file__), "calls.jsonl"), "a") as f:
    f.write(json.dumps({"completions": completions, "answer": answer, "ids": completion_ids,
                        "level": kwargs["level"]}) + "\\n")
  return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""


def test_grpo_jsonl_on_a_checkpoint_larger_than_the_placeholder(llama, tmp_path):
  """No --set of architecture fields; and a reward function written for TRL's GRPOTrainer."""
  rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "level": a}
          for a in range(4) for b in range(2)]
  write_jsonl(tmp_path / "prompts.jsonl", rows)
  (tmp_path / "trl_reward.py").write_text(TRL_REWARD)
  sets = ["--experiment=grpo_jsonl", f"--set=model.hf_path={llama}",
          f"--set=data.tokenizer={llama}", "--set=data.prompts_path=prompts.jsonl"]
  printed = json.loads(run_main(str(tmp_path), *sets, "--print_config"))
  assert printed["model"]["vocab_size"] == VOCAB and printed["model"]["d_model"] == 32
  out = run_main(str(tmp_path), *sets, f"--workdir={tmp_path / 'work'}", "--set=grpo.batch_size=2",
              "--set=grpo.num_samples=2", "--set=grpo.num_minibatches=1", "--set=data.eval_size=2",
              "--set=grpo.reward.sources=rule:exact_match,host:trl_reward.py:accuracy",
              "--set=grpo.reward.weights=1,1", *SMALL)
  assert "grpo: stages grpo" in out or "grpo_jsonl: stages grpo" in out
  records = [json.loads(l) for l in open(tmp_path / "work" / "metrics.jsonl")]
  assert any(r.get("step") == 1 and "loss" in r for r in records)
  calls = [json.loads(l) for l in open(tmp_path / "calls.jsonl")]
  assert len(calls) == 1 and len(calls[0]["completions"]) == 4  # 2 prompts x 2 samples
  call = calls[0]
  assert all(isinstance(c, str) for c in call["completions"]) and len(call["level"]) == 4
  assert call["answer"][0] == call["answer"][1] and call["level"][0] == call["level"][1]
  for ids in call["ids"]:  # each response's ids, ending at its EOS (id 2) if it has one
    assert 1 <= len(ids) <= 8 and (2 not in ids or ids.index(2) == len(ids) - 1)
  saved = json.loads((tmp_path / "work" / "config.json").read_text())
  assert saved["model"]["vocab_size"] == VOCAB and saved["model"]["n_layers"] == 2


@pytest.mark.slow
def test_sft_and_dpo_jsonl_on_the_same_checkpoint(llama, tmp_path):
  write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{a}+1=", "response": str(a + 1)}
                                       for a in range(8)])
  write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{a}+1=", "chosen": str(a + 1),
                                          "rejected": str(a + 2)} for a in range(8)])
  for name, field, path in (("sft", "sft_path", "sft.jsonl"), ("dpo", "pairs_path", "pairs.jsonl")):
    run_main(str(tmp_path), f"--experiment={name}_jsonl", f"--set=model.hf_path={llama}",
          f"--set=data.tokenizer={llama}", f"--set=data.{field}={path}",
          f"--workdir={tmp_path / name}", f"--set={name}.batch_size=4", "--set=data.eval_size=2",
          *SMALL)
    records = [json.loads(l) for l in open(tmp_path / name / "metrics.jsonl")]
    assert any(r.get("step") == 1 and "loss" in r for r in records), name


def test_print_config_on_the_prepared_smollm2():
  smol, why = real_model()
  if smol is None:
    pytest.skip(why)
  cfg = M.resolve_config("grpo_jsonl", [f"model.hf_path={smol}", f"data.tokenizer={smol}"],
                         required=False)
  m = cfg.model
  assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.tie_embeddings) == (
      49152, 576, 30, 9, 3, True)


@pytest.mark.parametrize("name", ["smol_gsm8k_sft", "smol_gsm8k_grpo", "smol_hh_dpo"])
def test_the_real_model_experiments_resolve_with_the_shared_data(name):
  """Registered, pointed at the prepared model and ../shared/data by default, checked like a
  run (validate), and their data files read into examples with answers where GRPO needs them."""
  smol, why = real_model()
  if smol is None:
    pytest.skip(why)
  from jaxrlhf import registry
  from jaxrlhf.data import DataSource
  cfg = registry.get(name)
  if not (cfg.data.sft_path or cfg.data.prompts_path or cfg.data.pairs_path):
    pytest.skip("../shared/data is not beside this checkout")
  cfg = M.resolve_config(name, [])
  assert cfg.model.hf_path == smol and cfg.model.n_layers == 30
  src = DataSource(cfg.data, cfg.seed)
  kind = {"smol_gsm8k_sft": "sft", "smol_gsm8k_grpo": "prompts", "smol_hh_dpo": "pairs"}[name]
  train, held = src.examples(kind, 0, 4), src.eval_examples(kind)
  assert len(train) == 4 and len(held) >= 32
  if kind != "pairs":
    assert all(ex.answer and ex.answer.replace(",", "").lstrip("-").replace(".", "").isdigit()
               for ex in held)  # GSM8K's final values, out of "#### N"


def test_pretrained_defaults_and_a_warm_up_whose_first_step_trains():
  """The templates' learning rates are the published recipes' (experiments/jsonl_templates.py),
  and warm-up over W steps runs step k at lr * k / W: step 1 moves the weights."""
  import jax.numpy as jnp
  import optax
  from jaxrlhf import registry
  from jaxrlhf.config import OptimizerConfig
  from jaxrlhf.train.common import learning_rate, make_optimizer
  lrs = {n: getattr(registry.get(n), s).optim.lr for n, s in (
      ("grpo_jsonl", "grpo"), ("grpo_math", "grpo"), ("ppo_jsonl", "ppo"), ("dpo_jsonl", "dpo"),
      ("sft_jsonl", "sft"))}
  assert lrs == {"grpo_jsonl": 1e-6, "grpo_math": 1e-6, "ppo_jsonl": 1e-6, "dpo_jsonl": 1e-6,
                 "sft_jsonl": 1e-5}
  assert registry.get("ppo_jsonl").ppo.value_optim.lr == 9e-6
  for name in ("grpo_jsonl", "dpo_jsonl", "sft_jsonl", "smol_gsm8k_grpo", "smol_hh_dpo"):
    c = registry.get(name)
    assert getattr(c, c.stages[-1]).optim.warmup_start == "first_step"
  for schedule in ("constant", "cosine", "linear"):
    f = learning_rate(OptimizerConfig(lr=1.0, warmup_steps=4, schedule=schedule,
                                      warmup_start="first_step"), 20)
    assert [float(f(i)) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    # The default ramps from 0, as the tiny experiments' documented figures were measured.
    f = learning_rate(OptimizerConfig(lr=1.0, warmup_steps=4, schedule=schedule), 20)
    assert [float(f(i)) for i in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
  assert float(learning_rate(OptimizerConfig(lr=2.0, warmup_steps=0), 20)(0)) == 2.0
  opt = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=10, grad_clip=0.0,
                                       warmup_start="first_step"), 100)
  params = {"w": jnp.ones(3)}
  updates, _ = opt.update({"w": jnp.ones(3)}, opt.init(params), params)
  moved = optax.apply_updates(params, updates)["w"]
  assert float(jnp.max(jnp.abs(moved - 1.0))) > 5e-5  # Adam's first step: about lr / 10
