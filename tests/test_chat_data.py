"""Users' own data: chat messages through the tokenizer's chat template, Parquet files and
datasets folders with column renames, and where each stage's evaluation examples come from."""

import json

import numpy as np
import pytest

from byo_helpers import chat_tokenizer, write_hf_disk, write_jsonl, write_parquet
from jaxrlhf.config import ConfigError, DataConfig, ExperimentConfig, validate
from jaxrlhf.data import Chat, DataSource


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


def _src(tok_dir, **kw):
  kw = {"task": "jsonl", "tokenizer": tok_dir, "max_prompt_len": 40, "max_response_len": 8, **kw}
  return DataSource(DataConfig(**kw))


def _text(src, ids):
  return src.tokenizer._tok.decode([int(i) for i in ids])


CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"}]


def test_chat_sft_trains_on_every_assistant_turn_only(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONV, "source": "gsm"}])
  src = _src(tok_dir, sft_path=path)
  ex = src.examples("sft", 0, 1)[0]
  assert isinstance(ex.prompt, Chat) and ex.response.messages == CONV[-1:]
  assert ex.record()["source"] == "gsm" and ex.record()["prompt"] == CONV[:-1]
  b = src.encoder.sequences([ex], "response")
  tokens, mask, loss = b["tokens"][0], b["mask"][0], b["loss_mask"][0]
  P = 40
  # The prompt is the template's rendering up to the generation prompt; the response the last
  # assistant turn up to its end token (the template's trailing newline is not trained).
  assert _text(src, tokens[:P][mask[:P]]) == "<s>S:be brief\nU:1+1=\nA:2</s>\nU:2+2=\nA:"
  assert _text(src, tokens[P:][mask[P:]]) == "4</s>"
  # The loss covers the assistant's tokens: the earlier turn's "2</s>" and the final "4</s>".
  assert _text(src, tokens[loss]) == "2</s>4</s>"
  assert tokens[P:][loss[P:]][-1] == src.tokenizer.eos_id


def test_chat_prompts_get_the_generation_prompt_and_no_second_bos(tmp_path, tok_dir):
  rows = [{"prompt": [{"role": "user", "content": "3+4="}], "answer": "7", "level": 2}]
  src = _src(tok_dir, prompts_path=write_jsonl(tmp_path / "p.jsonl", rows))
  ex = src.examples("prompts", 0, 1)[0]
  b = src.encoder.prompts([ex])
  assert _text(src, b["prompt"][0][b["prompt_mask"][0]]) == "<s>U:3+4=\nA:"
  assert ex.record() == {"prompt": rows[0]["prompt"], "answer": "7", "level": 2}


def test_plain_prompts_follow_the_tokenizers_own_bos_rule(tmp_path):
  """A plain-string prompt starts with what ``tokenizer(text)`` puts first, not an unconditional
  BOS: nothing for a chat model's tokenizer (SmolLM2's BOS is ``<|im_start|>``, which would open
  a chat turn), BOS where the tokenizer's post-processor adds one, BOS for the built-in char
  tokenizer (as ever).  Responses, chosen and rejected texts follow the same prompt."""
  from transformers import AutoTokenizer
  from byo_helpers import tiny_llama
  rows = [{"prompt": "3+4=", "answer": "7", "chosen": "7", "rejected": "8"}]
  path = write_jsonl(tmp_path / "p.jsonl", rows)
  for bos_rule in (False, True):
    folder = tiny_llama(tmp_path / f"m{int(bos_rule)}", vocab=120, bos_rule=bos_rule)
    own = AutoTokenizer.from_pretrained(folder)("3+4=")["input_ids"]
    src = _src(folder, prompts_path=path)
    ex = src.examples("prompts", 0, 1)[0]
    b = src.encoder.prompts([ex])
    ids = [int(i) for i in b["prompt"][0][b["prompt_mask"][0]]]
    assert ids == own and (ids[0] == src.tokenizer.bos_id) == bos_rule
    seq = src.encoder.sequences([ex], "chosen")
    P = src.cfg.max_prompt_len
    assert [int(i) for i in seq["tokens"][0][:P][seq["mask"][0][:P]]] == own
  char = DataSource(DataConfig(task="jsonl", prompts_path=path))
  b = char.encoder.prompts([char.examples("prompts", 0, 1)[0]])
  ids = [int(i) for i in b["prompt"][0][b["prompt_mask"][0]]]
  assert ids == [char.tokenizer.bos_id] + char.tokenizer.encode("3+4=")


def test_chat_needs_a_template_and_a_real_tokenizer(tmp_path, tok_dir):
  path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONV[1:3]}])
  bare = chat_tokenizer(tmp_path / "bare", template=None)
  with pytest.raises(ConfigError, match=r"sft.jsonl:1: data.tokenizer=.*bare.* has no chat "
                                        r"template.*tok.chat_template = "):
    _src(bare, sft_path=path).examples("sft", 0, 1)
  with pytest.raises(ConfigError, match=r"sft.jsonl:1: chat messages need a chat template, and "
                                        r"the built-in char tokenizer has none"):
    DataSource(DataConfig(task="jsonl", sft_path=path)).examples("sft", 0, 1)
  # A template that rewrites earlier turns once later ones follow cannot be masked: say so.
  shifty = chat_tokenizer(tmp_path / "shifty", template=(
      "{% for m in messages %}{% if loop.last %}[{{ m['content'] }}]{% else %}"
      "{{ m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"))
  with pytest.raises(ConfigError, match=r"sft.jsonl:1: the chat template of data.tokenizer does "
                                        r"not render append-only"):
    _src(shifty, sft_path=path).examples("sft", 0, 1)


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ({"messages": CONV[1:3] + [{"role": "user", "content": "?"}]},
     "ends with a 'user' message after the last assistant reply"),
    ({"messages": [{"role": "user"}]}, r'"messages"\[0\] is not a chat message'),
    ({"prompt": "x", "response": [{"role": "user", "content": "y"}]},
     r'"response" as messages must be one assistant message'),
])
def test_bad_chat_rows_name_the_file_and_line(tmp_path, tok_dir, row, message):
  path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONV[1:3]}, row])
  with pytest.raises(ConfigError, match=r"sft.jsonl:2: .*" + message):
    _src(tok_dir, sft_path=path).examples("sft", 0, 1)


def test_preference_pairs_as_whole_conversations(tmp_path, tok_dir):
  user = [{"role": "user", "content": "2+2="}]
  rows = [{"chosen": user + [{"role": "assistant", "content": "4"}],
           "rejected": user + [{"role": "assistant", "content": "5"}]}]
  src = _src(tok_dir, pairs_path=write_jsonl(tmp_path / "pairs.jsonl", rows))
  ex = src.examples("pairs", 0, 1)[0]
  assert ex.prompt.messages == user
  b = src.encoder.pairs([ex])
  for name, want in (("chosen", "4</s>"), ("rejected", "5</s>")):
    toks, loss = b[name][0], b[f"{name}_loss_mask"][0]
    assert _text(src, toks[loss]) == want
    assert _text(src, toks[:40][b[f"{name}_mask"][0][:40]]) == "<s>U:2+2=\nA:"
  # A prompt of messages with plain-string replies: each reply is the assistant's turn.
  mixed = [{"prompt": user, "chosen": "4", "rejected": "5", "source": "human"}]
  src = _src(tok_dir, pairs_path=write_jsonl(tmp_path / "mixed.jsonl", mixed))
  ex = src.examples("pairs", 0, 1)[0]
  assert ex.record()["source"] == "human"
  for name, arrays in ((n, src.encoder.pairs([ex])) for n in ("chosen", "rejected")):
    assert np.array_equal(arrays[name], b[name])  # the same tokens as the conversations
  bad = [{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user",
                                                                      "content": "b"}]}]
  with pytest.raises(ConfigError, match=r"bad.jsonl:1: \"chosen\" and \"rejected\" share no "
                                        r"first message"):
    _src(tok_dir, pairs_path=write_jsonl(tmp_path / "bad.jsonl", bad)).examples("pairs", 0, 1)


ROWS = [{"question": [{"role": "user", "content": f"{i}+1="}], "solution": str(i + 1),
         "tests": [f"assert x == {i + 1}"], "id": i} for i in range(6)]


@pytest.mark.parametrize("writer, name", [(write_parquet, "data.parquet"),
                                          (write_hf_disk, "data_dir")])
def test_tables_map_columns_and_keep_every_other_field(tmp_path, tok_dir, writer, name):
  path = writer(tmp_path / name, ROWS)
  src = _src(tok_dir, prompts_path=path, fields=("question:prompt", "solution:answer"))
  ex = src._file("prompts_path", "prompts")[3]
  assert ex.answer == "4" and ex.line == 4
  assert ex.record() == {"prompt": ROWS[3]["question"], "answer": "4",
                         "tests": ["assert x == 4"], "id": 3}
  ex.record()["tests"].append("changed by a reward function")
  assert ex.record()["tests"] == ["assert x == 4"]
  # Without the renames the rows lack a prompt: the error names the file and row.
  with pytest.raises(ConfigError, match=rf"{name}:1: missing string field\(s\) prompt"):
    _src(tok_dir, prompts_path=path).examples("prompts", 0, 1)
  with pytest.raises(ConfigError, match=rf"{name}:1: data.fields renames 'query', but this row "
                                        r"has no such field \(it has: question, solution"):
    _src(tok_dir, prompts_path=path, fields=("query:prompt",)).examples("prompts", 0, 1)
  # A rename onto a column the row already has would drop that column: refused.
  with pytest.raises(ConfigError, match=rf"{name}:1: data.fields renames 'solution' to 'id', "
                                        r"but this row already has a 'id' field"):
    _src(tok_dir, prompts_path=path, fields=("question:prompt", "solution:id")).examples(
        "prompts", 0, 1)


def test_bad_table_rows_get_file_row_errors(tmp_path, tok_dir):
  rows = [dict(r) for r in ROWS]
  rows[2] = {**rows[2], "solution": None}
  rows[4] = {**rows[4], "question": []}
  path = write_parquet(tmp_path / "bad.parquet", rows)
  with pytest.raises(ConfigError, match=r'bad.parquet:5: "prompt" is an empty list of messages'):
    _src(tok_dir, prompts_path=path, fields=("question:prompt", "solution:answer")).examples(
        "prompts", 0, 1)
  nums = write_parquet(tmp_path / "nums.parquet", [{"prompt": "1+1=", "answer": 2}])
  with pytest.raises(ConfigError, match=r'nums.parquet:1: field "answer" is the number 2, not a '
                                        r'string.*cast it to string'):
    _src(tok_dir, prompts_path=nums).examples("prompts", 0, 1)
  (tmp_path / "broken.parquet").write_text("not parquet")
  with pytest.raises(ConfigError, match=r"broken.parquet: not a readable Parquet file "
                                        r"\(data.prompts_path\)"):
    _src(tok_dir, prompts_path=str(tmp_path / "broken.parquet")).examples("prompts", 0, 1)


def test_a_datasets_folder_with_splits_names_them(tmp_path, tok_dir):
  import datasets
  datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:3]),
                        "test": datasets.Dataset.from_list(ROWS[3:])}).save_to_disk(
                            str(tmp_path / "dd"))
  with pytest.raises(ConfigError, match=r"dd \(data.prompts_path\) holds several splits "
                                        r"\(train, test\); point data.prompts_path at one of "
                                        r"them, e.g. .*dd/train"):
    _src(tok_dir, prompts_path=str(tmp_path / "dd")).examples("prompts", 0, 1)
  src = _src(tok_dir, prompts_path=str(tmp_path / "dd" / "test"),
             fields=("question:prompt", "solution:answer"))
  assert [e.answer for e in src._file("prompts_path", "prompts")] == ["4", "5", "6"]


def _prompts(tmp_path, n, name="p.jsonl"):
  return write_jsonl(tmp_path / name, [{"prompt": f"{i}+0=", "answer": str(i)}
                                       for i in range(n)])


def test_eval_split_holds_examples_out_of_training_and_says_so(tmp_path, capsys):
  path = _prompts(tmp_path, 40)
  src = DataSource(DataConfig(task="jsonl", prompts_path=path, eval_split=0.1))
  held = src.eval_examples("prompts")
  assert len(held) == 4
  trained = {e.prompt for s in range(50) for e in src.examples("prompts", s, 8)}
  assert not trained & {e.prompt for e in held} and len(trained) == 36
  out = capsys.readouterr().out
  assert "evaluation (greedy answers, prompts): 4 examples held out of data.prompts_path=" in out
  assert "data.eval_split=0.1 (not trained on)" in out
  # Without a split or a file, the console says the evaluation set is not held out.
  DataSource(DataConfig(task="jsonl", prompts_path=path, eval_size=5)).eval_examples("prompts")
  assert ("the first 5 examples of the training file data.prompts_path=" in
          capsys.readouterr().out)
  with pytest.raises(ConfigError, match=r"data.eval_split=0.99 of the 40 examples .* leaves none"):
    DataSource(DataConfig(task="jsonl", prompts_path=path, eval_split=0.99)).eval_examples()


def test_each_kind_has_its_own_eval_file(tmp_path, capsys):
  pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "chosen": "2",
                                                  "rejected": "3"}])
  held_pairs = write_jsonl(tmp_path / "hp.jsonl", [{"prompt": "2+2=", "chosen": "4",
                                                    "rejected": "5"}])
  src = DataSource(DataConfig(task="jsonl", prompts_path=_prompts(tmp_path, 5),
                              prompts_eval_path=_prompts(tmp_path, 2, "held.jsonl"),
                              pairs_path=pairs, pairs_eval_path=held_pairs))
  assert [e.prompt for e in src.eval_examples("prompts")] == ["0+0=", "1+0="]
  assert [e.chosen for e in src.eval_examples("pairs")] == ["4"]
  out = capsys.readouterr().out
  assert "2 held-out examples from data.prompts_eval_path=" in out
  assert "evaluation (pair accuracy, pairs): 1 held-out examples from data.pairs_eval_path" in out
  # One eval_path cannot serve exact match and pair accuracy in the same run.
  cfg = ExperimentConfig(stages=("sft", "dpo"), data=DataConfig(task="jsonl", eval_path="e.jsonl"))
  with pytest.raises(ConfigError, match=r"data.eval_path='e.jsonl' serves every stage, but the "
                                        r"stages \(sft, dpo\) read different kinds.*"
                                        r"--set=data.pairs_eval_path=FILE "
                                        r"--set=data.prompts_eval_path=FILE"):
    validate(cfg)
  bad = ExperimentConfig(data=DataConfig(fields=("question",), eval_split=1.5))
  with pytest.raises(ConfigError, match=r"data.fields: 'question' is not SOURCE:TARGET.*"
                                        r"data.eval_split=1.5: must be in \[0, 1\)"):
    validate(bad)


def test_a_pairs_only_run_evaluates_exact_match_on_its_pairs(tmp_path, tok_dir):
  """DPO on pairs alone (no data.prompts_path): exact match reads the evaluation pairs'
  prompts, from whichever file the pairs come from, data.eval_path included (chat pairs have
  no "prompt" field to read them as prompts by)."""
  user = [{"role": "user", "content": "1+1="}]
  pairs = write_jsonl(tmp_path / "pairs.jsonl", [
      {"chosen": user + [{"role": "assistant", "content": "2"}],
       "rejected": user + [{"role": "assistant", "content": "3"}], "answer": "2"}] * 3)
  for extra, source in (({}, ("pairs_path", "train")),
                        ({"eval_split": 0.34}, ("pairs_path", "split")),
                        ({"pairs_eval_path": pairs}, ("pairs_eval_path", "file")),
                        ({"eval_path": pairs}, ("eval_path", "file"))):
    src = _src(tok_dir, pairs_path=pairs, **extra)
    assert src.eval_source("prompts") == src.eval_source("pairs") == source
    ex = src.eval_examples("prompts")
    assert ex and all(e.prompt.messages == user and e.answer == "2" for e in ex)
    assert src.eval_held_out("prompts") == (source[1] != "train")
  assert src.eval_name("pairs", "pair accuracy") == "held-out pair accuracy"
  src = _src(tok_dir, pairs_path=pairs)
  assert (src.eval_name("prompts", "exact match")
          == "training-set exact match (not held out)")
  assert DataSource(DataConfig()).eval_held_out("pairs")  # the built-in task's own split
  # Pairs without "answer": DPO's exact match is skipped, saying why and how to get it.
  from jaxrlhf.train.evaluate import no_answer_note
  assert no_answer_note(src, 3, 3) == (
      f"exact match is not evaluated (no eval/accuracy): none of the 3 training-set prompts "
      f"(not held out) from data.pairs_path={pairs} has an \"answer\" to compare the greedy "
      f"response with; add \"answer\" to its rows, or set data.prompts_eval_path=FILE "
      f"(prompts with answers)")


def test_the_summary_names_the_evaluation_set_as_the_console_did(tmp_path, capsys):
  from jaxrlhf.train.pipeline import print_summary
  pairs = write_jsonl(tmp_path / "pairs.jsonl",
                      [{"prompt": f"{i}+1=", "chosen": "x", "rejected": "y"} for i in range(4)])
  cfg = ExperimentConfig(stages=("dpo",))
  summary = {"dpo": {"eval/pair_accuracy": 0.75, "eval/accuracy": 0.5, "time_s": 1.0,
                     "steps": cfg.dpo.steps}, "dpo/start": {"eval/pair_accuracy": 0.5}}
  for extra, words in (({}, ("dpo: training-set pair accuracy (not held out)",
                             "dpo: training-set exact match (not held out)")),
                       ({"eval_split": 0.25}, ("dpo: held-out pair accuracy",
                                               "dpo: held-out exact match"))):
    print_summary(cfg, summary, DataSource(DataConfig(task="jsonl", pairs_path=pairs, **extra)))
    out = capsys.readouterr().out
    assert all(w in out for w in words), out
    assert ("held-out" in out) == bool(extra)


def test_the_summary_shows_the_held_out_sft_loss(tmp_path, capsys):
  """SFT's headline figure, the held-out loss, is in the summary at the start and the end."""
  from jaxrlhf.train.pipeline import print_summary
  sft = write_jsonl(tmp_path / "sft.jsonl",
                    [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(8)])
  cfg = ExperimentConfig(stages=("sft",))
  summary = {"sft": {"eval/loss": 1.044, "time_s": 1.0, "steps": cfg.sft.steps},
             "sft/start": {"eval/loss": 1.417}}
  print_summary(cfg, summary, DataSource(DataConfig(task="jsonl", sft_path=sft,
                                                    eval_split=0.25)))
  out = capsys.readouterr().out
  row = next(line for line in out.splitlines() if "loss" in line)
  assert row.split() == ["sft:", "held-out", "loss", "(per", "response", "token)", "1.417",
                         "1.044"], out


def test_chat_lengths_follow_the_overlong_policy(tmp_path, tok_dir, capsys):
  rows = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "2"},
          {"prompt": [{"role": "user", "content": "1+1="}], "response": "a long reply"}]
  path = write_jsonl(tmp_path / "sft.jsonl", rows)
  with pytest.raises(ConfigError, match=r'sft.jsonl:2: "response" is 12 tokens, longer than the '
                                        r"7 that data.max_response_len=8 leaves"):
    _src(tok_dir, sft_path=path).examples("sft", 0, 1)
  src = _src(tok_dir, sft_path=path, overlong="truncate", max_prompt_len=8)
  b = src.encoder.sequences(src.examples("sft", 0, 4), "response")
  assert "3 truncated" in capsys.readouterr().out  # the long reply and both 10-token prompts
  for toks, mask in zip(b["tokens"], b["mask"]):
    assert toks[8:][mask[8:]][-1] == src.tokenizer.eos_id  # a cut reply still ends with EOS
    assert _text(src, toks[:8][mask[:8]]).endswith("1+1=\nA:")  # a prompt keeps its end


def test_settings_that_change_which_rows_train_break_resume():
  from jaxrlhf.checkpoint import check_resume_config
  from jaxrlhf.config import apply_overrides, to_dict
  saved = ExperimentConfig(data=DataConfig(task="jsonl", prompts_path="p.parquet"))
  for change in ("data.eval_split=0.1", "data.fields=q:prompt", "data.format=jsonl"):
    with pytest.raises(ConfigError, match="cannot resume from .*" + change.split("=")[0]):
      check_resume_config(to_dict(saved), apply_overrides(saved, [change]))
  # Another held-out file changes evaluation only.
  assert check_resume_config(to_dict(saved), apply_overrides(
      saved, ["data.prompts_eval_path=held.jsonl"])) == [
          ("data.prompts_eval_path", "", "held.jsonl")]
