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
  assert "1 over-long example(s) skipped" in capsys.readouterr().out
  trunc = DataSource(DataConfig(task="jsonl", prompts_path=path, max_prompt_len=8,
                                overlong="truncate"))
  batch = trunc.encoder.prompts(trunc.examples("prompts", 0, 10))
  assert batch["prompt_mask"].sum(-1).max() == 8
  assert trunc.encoder.counts["data/truncated"] >= 1


def test_overlong_responses_and_answers_follow_the_overlong_policy(tmp_path, capsys):
  """A target longer than its slots used to be cut silently (an SFT response ending mid-text in
  an end token; an answer no response can match)."""
  sft = _write(tmp_path, "s.jsonl", [json.dumps({"prompt": "1+1=", "response": "2"}),
                                     json.dumps({"prompt": "1+1=", "response": "1" * 8})])
  with pytest.raises(ConfigError, match=r"s.jsonl:2: \"response\" is 8 tokens, longer than the "
                                        r"7 that data.max_response_len=8 leaves for it \(one slot "
                                        r"is the end token\)"):
    DataSource(DataConfig(task="jsonl", sft_path=sft, max_response_len=8)).examples("sft", 0, 1)
  skip = DataSource(DataConfig(task="jsonl", sft_path=sft, max_response_len=8, overlong="skip"))
  assert {e.response for e in skip.examples("sft", 0, 10)} == {"2"}
  assert "1 over-long example(s) skipped" in capsys.readouterr().out
  ans = _write(tmp_path, "a.jsonl", [json.dumps({"prompt": "1+1=", "answer": "1" * 9})])
  with pytest.raises(ConfigError, match=r"a.jsonl:1: \"answer\" is 9 tokens, longer than the 8"):
    DataSource(DataConfig(task="jsonl", prompts_path=ans, max_response_len=8)).examples(
        "prompts", 0, 1)
  fits = _write(tmp_path, "f.jsonl", [json.dumps({"prompt": "1+1=", "answer": "1" * 8})])
  DataSource(DataConfig(task="jsonl", prompts_path=fits, max_response_len=8)).examples(
      "prompts", 0, 1)


def test_unknown_characters_and_tokenizer_dirs_are_clear_errors(tmp_path):
  with pytest.raises(ConfigError, match="not in the built-in char tokenizer"):
    CharTokenizer().encode("hello!")
  with pytest.raises(ConfigError, match="is not a directory"):
    DataSource(DataConfig(tokenizer=str(tmp_path / "missing")))


# --------------------------------------------------------------- input errors (user audit)


def _source(tmp_path, lines, name="p.jsonl", **kw):
  return DataSource(DataConfig(task="jsonl", prompts_path=_write(tmp_path, name, lines), **kw))


def test_a_non_string_answer_is_an_error_at_its_line(tmp_path):
  src = _source(tmp_path, ['{"prompt": "1+1=", "answer": "2"}',
                           '{"prompt": "12+34=", "answer": 46}'])
  with pytest.raises(ConfigError, match=r'p.jsonl:2: field "answer" is the number 46, not a '
                                        r'string; write it as a string: "answer": "46"'):
    src.examples("prompts", 0, 1)
  # A missing (or null) answer stays allowed in a prompts file.
  src = _source(tmp_path, ['{"prompt": "1+1="}', '{"prompt": "1+2=", "answer": null}'], "n.jsonl")
  assert [e.answer for e in src.eval_examples()] == ["", ""]


def test_rules_that_read_the_answer_need_answers(tmp_path):
  lines = ['{"prompt": "1+1=", "answer": "2"}', '', '{"prompt": "12+34="}', '{"prompt": "1+2="}']
  src = _source(tmp_path, lines)
  with pytest.raises(ConfigError) as info:
    src.check_answers(("model", "rule:exact_match"), "grpo.reward.sources")
  msg = str(info.value)
  assert msg.startswith(f"{src.cfg.prompts_path}:3: 2 of the 3 prompts in ")
  assert 'lack "answer"' in msg and "rule:exact_match" in msg
  assert "drop rule:exact_match from grpo.reward.sources" in msg
  for sources in (("rule:token_accuracy",), ("host:exact_match",)):
    with pytest.raises(ConfigError, match="lack"):
      src.check_answers(sources, "ppo.reward.sources")
  src.check_answers(("model",), "ppo.reward.sources")  # a reward model needs no answers
  src.check_answers(("model", "rule:exact_match"), "ppo.reward.sources", weights=(1.0, 0.0))
  good = _source(tmp_path, ['{"prompt": "1+1=", "answer": "2"}'], "good.jsonl")
  good.check_answers(("rule:exact_match",), "grpo.reward.sources")
  DataSource(DataConfig()).check_answers(("rule:exact_match",), "grpo.reward.sources")


def test_errors_report_physical_line_numbers_past_blank_lines(tmp_path):
  src = _source(tmp_path, ['', '', '{"prompt": "1+1=", "answer": "2"}', '',
                           json.dumps({"prompt": "1" * 20, "answer": "2"})], max_prompt_len=8)
  with pytest.raises(ConfigError, match=r"p.jsonl:5: prompt is 21 tokens"):
    src.examples("prompts", 0, 1)


def test_unknown_characters_name_the_file_line_and_field(tmp_path):
  src = _source(tmp_path, ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "HELLO=", "answer": "2"}'])
  with pytest.raises(ConfigError, match=r"p.jsonl:2: \"prompt\": character 'H' is not in the "
                                        r"built-in char tokenizer"):
    src.examples("prompts", 0, 1)
  sft = DataSource(DataConfig(task="jsonl", sft_path=_write(
      tmp_path, "s.jsonl", ['{"prompt": "1+1=", "response": "twO"}'])))
  with pytest.raises(ConfigError, match=r"s.jsonl:1: \"response\": character 'O'"):
    sft.examples("sft", 0, 1)
  ev = _source(tmp_path, ['{"prompt": "1+1=", "answer": "2"}'],
               eval_path=_write(tmp_path, "e.jsonl", ['', '{"prompt": "1+1=", "answer": "TWO"}']))
  with pytest.raises(ConfigError, match=r"e.jsonl:2: \"answer\": character 'T'"):
    ev.eval_examples()


def test_overlong_eval_prompts_name_the_line_and_follow_the_policy(tmp_path, capsys):
  long = json.dumps({"prompt": "1" * 20, "answer": "1"})
  short = json.dumps({"prompt": "1+1=", "answer": "2"})
  eval_path = _write(tmp_path, "e.jsonl", [short, long])
  kw = dict(max_prompt_len=8, eval_path=eval_path)
  with pytest.raises(ConfigError, match=r"e.jsonl:2: prompt is 21 tokens"):
    _source(tmp_path, [short], **kw).eval_examples()
  skip = _source(tmp_path, [short], overlong="skip", **kw)
  examples = skip.eval_examples()
  assert [e.prompt for e in examples] == ["1+1="]  # dropped, never evaluated as an empty prompt
  assert skip.encoder.prompts(examples)["prompt_mask"].sum(-1).tolist() == [5]
  assert f"{eval_path}: 1 over-long example(s) skipped" in capsys.readouterr().out


def test_unreadable_files_and_tokenizer_folders_are_config_errors(tmp_path):
  latin = tmp_path / "latin.jsonl"
  latin.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9=", "answer": "2"}\n')
  with pytest.raises(ConfigError, match=r"latin.jsonl:2: not UTF-8 text .*save the file as UTF-8"):
    DataSource(DataConfig(task="jsonl", prompts_path=str(latin))).examples("prompts", 0, 1)
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n')
  assert DataSource(DataConfig(task="jsonl", prompts_path=str(bom))).eval_examples()[0].answer == "2"
  with pytest.raises(ConfigError, match=r"is a directory, not a JSONL file \(data.prompts_path\)"):
    DataSource(DataConfig(task="jsonl", prompts_path=str(tmp_path))).examples("prompts", 0, 1)
  (tmp_path / "tok").mkdir()
  with pytest.raises(ConfigError, match=r"data.tokenizer=.*tok.: no tokenizer files"):
    DataSource(DataConfig(tokenizer=str(tmp_path / "tok")))


def test_rules_registered_without_answers_need_none(tmp_path):
  from jaxrlhf import rewards as R

  @R.register_host_reward("test_answer_free", needs_answer=False)
  def _length(responses, answers):
    return [float(len(r)) for r in responses]

  try:
    assert not R.reads_answer("host:test_answer_free") and R.reads_answer("rule:exact_match")
    _source(tmp_path, ['{"prompt": "1+1="}']).check_answers(("host:test_answer_free",),
                                                             "grpo.reward.sources")
  finally:
    del R.HOST_RULES["test_answer_free"]


def test_a_tokenizer_folder_transformers_cannot_load_is_a_config_error(tmp_path):
  (tmp_path / "tokenizer.json").write_text("not json")
  with pytest.raises(ConfigError, match=r"data.tokenizer=.*: transformers cannot load a "
                                        r"tokenizer from this folder \(JSONDecodeError"):
    DataSource(DataConfig(tokenizer=str(tmp_path)))
