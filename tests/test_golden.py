"""Behaviour pinned across refactors: short fixed-seed runs of every algorithm and step variant
(one program, timed phases, the host-reward split, the pools in sync mode) against the
metrics committed in tests/assets/golden_metrics.json (tests/golden.py says how to
regenerate them, only on purpose).

On the machine that wrote the file the runs agree bit for bit (``python tests/golden.py
--check --exact``); here the comparison allows for another CPU's codegen, whose rounding
differs (a relative 2e-3 after three steps is far below any change of behaviour, which moves
these figures by whole percents or adds and drops keys).
"""

import json

import pytest

import golden

CASES = golden.cases()

with open(golden.ASSET) as f:
  WANT = json.load(f)


def test_every_case_has_a_reference():
  assert sorted(CASES) == sorted(WANT)


@pytest.mark.parametrize("name", sorted(CASES))
def test_metrics_match_the_reference(name, tmp_path):
  got = golden.run_case(name, CASES[name], str(tmp_path))
  problems = golden.compare(name, got, WANT[name], exact=False)
  assert not problems, "\n".join(problems[:20])
