"""Data: the built-in task, the fixed batch layout, and clear errors for bad JSONL files."""

import json

import numpy as np
import pytest

from jaxrlhf.config import ConfigError, DataConfig
from jaxrlhf.data import AdditionTask, CharTokenizer, DataSource


def _write(tmp_path, name, lines):
  path = tmp_path / name
  path.write_text("".join(l + "\n" for l in lines))
  return str(path)


def test_addition_task_splits_and_checks():
  task = AdditionTask(2)
  rng = np.random.default_rng(0)
  train = task.sample(rng, 200, "train")
  evals = task.sample(rng, 200, "eval")
  assert not {e.prompt for e in train} & {e.prompt for e in evals}
  for ex in train[:50]:
    a, b = ex.prompt[:-1].split("+")
    assert ex.answer == f"{int(a) + int(b):03d}" and len(a) == len(b) == 2
    assert ex.rejected != ex.chosen == ex.answer and len(ex.rejected) == 3


def test_batches_use_the_prompt_response_layout_and_are_deterministic():
  src = DataSource(DataConfig(digits=2, max_prompt_len=8, max_response_len=5))
  batch = src.encoder.sequences(src.examples("sft", 3, 4), "response")
  tok = CharTokenizer()
  for row, mask, loss in zip(batch["tokens"], batch["mask"], batch["loss_mask"]):
    assert tok.decode(row[8:]) and row[8:][loss[8:]][-1] == tok.eos_id
    assert not loss[:8].any() and mask[8:].sum() == 4
  again = src.encoder.sequences(src.examples("sft", 3, 4), "response")
  np.testing.assert_array_equal(batch["tokens"], again["tokens"])
  other = src.encoder.sequences(src.examples("sft", 4, 4), "response")
  assert not np.array_equal(batch["tokens"], other["tokens"])
  prompts = src.encoder.prompts(src.examples("prompts", 0, 2))
  assert prompts["answer_mask"].sum(-1).tolist() == [3, 3]  # the answer carries no EOS


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "1+1="'], ":1: not valid JSON"),
    (['{"prompt": "1+1=", "chosen": "2"}'], ":1: missing string field(s) rejected"),
    (['["prompt"]'], ":1: expected a JSON object"),
    ([], "the file is empty"),
])
def test_bad_jsonl_files_name_the_file_and_line(tmp_path, lines, message):
  path = _write(tmp_path, "pairs.jsonl", lines)
  src = DataSource(DataConfig(task="jsonl", pairs_path=path))
  with pytest.raises(ConfigError) as info:
    src.examples("pairs", 0, 2)
  assert path in str(info.value) and message in str(info.value)


def test_missing_file_names_the_field(tmp_path):
  src = DataSource(DataConfig(task="jsonl", prompts_path=str(tmp_path / "nope.jsonl")))
  with pytest.raises(ConfigError, match="file not found .data.prompts_path"):
    src.examples("prompts", 0, 1)
  with pytest.raises(ConfigError, match="set data.sft_path=FILE.jsonl"):
    DataSource(DataConfig(task="jsonl")).examples("sft", 0, 1)


def test_overlong_prompts_error_truncate_or_skip_and_are_counted(tmp_path, capsys):
  long = json.dumps({"prompt": "1" * 20, "answer": "1"})
  short = json.dumps({"prompt": "1+1=", "answer": "2"})
  path = _write(tmp_path, "p.jsonl", [short, long, short])
  with pytest.raises(ConfigError, match=r"p.jsonl:2: prompt is 21 tokens, longer than "
                                        r"data.max_prompt_len=8"):
    DataSource(DataConfig(task="jsonl", prompts_path=path, max_prompt_len=8)).examples(
        "prompts", 0, 1)
  skip = DataSource(DataConfig(task="jsonl", prompts_path=path, max_prompt_len=8,
                               overlong="skip"))
  assert all(len(e.prompt) == 4 for e in skip.examples("prompts", 0, 10))
  assert skip.encoder.counts["data/skipped"] == 1
  assert "1 over-long prompt(s) skipped" in capsys.readouterr().out
  trunc = DataSource(DataConfig(task="jsonl", prompts_path=path, max_prompt_len=8,
                                overlong="truncate"))
  batch = trunc.encoder.prompts(trunc.examples("prompts", 0, 10))
  assert batch["prompt_mask"].sum(-1).max() == 8
  assert trunc.encoder.counts["data/truncated"] >= 1


def test_unknown_characters_and_tokenizer_dirs_are_clear_errors(tmp_path):
  with pytest.raises(ConfigError, match="not in the built-in char tokenizer"):
    CharTokenizer().encode("hello!")
  with pytest.raises(ConfigError, match="is not a directory"):
    DataSource(DataConfig(tokenizer=str(tmp_path / "missing")))
