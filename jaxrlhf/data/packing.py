"""Packing: several sequences per row, so a batch of spread lengths stops paying for padding.

The encoder's padded batch (``tokens, mask, loss_mask``, one sequence per row, the prompt
left-padded to ``P`` and the response right-padded to ``R``) is the input: each sequence's real
tokens (``mask``) are taken out in order and placed first-fit decreasing into rows of
``row_len`` slots.  A packed batch holds, per row slot,

* ``tokens``, ``mask``, ``loss_mask``: as in the padded layout;
* ``segment_ids``: 1, 2, ... for the sequences of the row in slot order, 0 for padding
  (attention stays within a segment, positions restart at each: ``model.forward``);
* ``sequence_ids``: which input sequence the slot belongs to (-1: padding),

and ``sequence_lengths [S]``, the real tokens of each input sequence, whose shape also tells a
per-sequence reduction how many sequences its rows hold.

Shapes are bucketed: the sequences are split into ``groups`` contiguous ranges (the micro-
batches of gradient accumulation; each is packed into its own rows, so a micro-batch never cuts
a sequence), every group gets the same number of rows, and that number is rounded up to a
multiple of ``step`` rows: at most ``buckets`` distinct shapes per stage, each compiled once.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Packer:
  """How a stage packs its batches (from ``data.pack_*`` and the mesh)."""

  row_len: int  # slots per row
  groups: int = 1  # micro-batches, each packed into its own rows
  row_multiple: int = 1  # rows per group stay a multiple of this (the data-parallel shards)
  buckets: int = 8  # distinct row counts per group at most
  pad_id: int = 0

  def step(self, n_sequences: int) -> int:
    """Rows per group come in multiples of this."""
    per_group = -(-n_sequences // self.groups)
    step = -(-per_group // self.buckets)
    return -(-step // self.row_multiple) * self.row_multiple

  def max_rows(self, n_sequences: int) -> int:
    """Rows of the largest bucket (all groups): every sequence alone in its row."""
    per_group = -(-n_sequences // self.groups)
    step = self.step(n_sequences)
    return self.groups * (-(-per_group // step) * step)

  def bucket_rows(self, n_sequences: int) -> tuple[int, ...]:
    """Every row count (all groups) a packed batch of ``n_sequences`` can have."""
    step = self.step(n_sequences)
    top = self.max_rows(n_sequences) // self.groups
    return tuple(self.groups * r for r in range(step, top + 1, step))

  def place(self, lengths) -> tuple[list[list[list[int]]], int]:
    """Where ``S`` sequences of ``lengths`` go: each group's rows (the group-local indices of
    its sequences, in slot order) and the rows every group gets (bucketed).  The padded
    batches here and the RL rollout's packed forwards (:mod:`jaxrlhf.train.packed`) share it."""
    lengths = np.asarray(lengths)
    n = lengths.shape[0]
    if n % self.groups:
      raise ValueError(f"{n} sequences do not split into {self.groups} micro-batches; make the "
                       f"batch size a multiple of optim.grad_accum")
    if lengths.max(initial=0) > self.row_len:
      raise ValueError(f"a sequence of {lengths.max()} tokens does not fit a packed row of "
                       f"{self.row_len}; raise data.pack_length")
    per_group = n // self.groups
    layouts = [first_fit(lengths[g * per_group:(g + 1) * per_group], self.row_len)
               for g in range(self.groups)]
    step = self.step(n)
    rows = max(len(rows) for rows in layouts)
    return layouts, max(-(-rows // step) * step, step)

  def pack(self, tokens, mask, loss_mask) -> dict:
    """The packed batch of ``S`` padded sequences ``[S, L]`` (see the module doc)."""
    tokens, mask, loss_mask = (np.asarray(x) for x in (tokens, mask, loss_mask))
    mask = mask.astype(bool)
    n = tokens.shape[0]
    lengths = mask.sum(axis=1)
    layouts, rows = self.place(lengths)
    per_group = n // self.groups
    shape = (self.groups * rows, self.row_len)
    out = {"tokens": np.full(shape, self.pad_id, np.int32), "mask": np.zeros(shape, bool),
           "loss_mask": np.zeros(shape, bool), "segment_ids": np.zeros(shape, np.int32),
           "sequence_ids": np.full(shape, -1, np.int32),
           "sequence_lengths": lengths.astype(np.int32)}
    for g, layout in enumerate(layouts):
      for r, members in enumerate(layout):
        row, at = g * rows + r, 0
        for k, local in enumerate(members):
          i = g * per_group + local
          m = mask[i]
          span = slice(at, at + int(lengths[i]))
          out["tokens"][row, span] = tokens[i][m]
          out["loss_mask"][row, span] = loss_mask[i][m]
          out["mask"][row, span] = True
          out["segment_ids"][row, span] = k + 1
          out["sequence_ids"][row, span] = i
          at = span.stop
    return out


def first_fit(lengths, row_len: int) -> list[list[int]]:
  """First-fit decreasing: the longest sequence first, each into the first row with room;
  returns each row's sequence indices (in slot order).  Ties keep their input order, so the
  layout is a pure function of the lengths."""
  order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
  rows: list[list[int]] = []
  free: list[int] = []
  for i in order:
    need = int(lengths[i])
    for r, room in enumerate(free):
      if room >= need:
        rows[r].append(i)
        free[r] -= need
        break
    else:
      rows.append([i])
      free.append(row_len - need)
  return rows


def interleave_pairs(chosen: dict, rejected: dict, keys=("tokens", "mask", "loss_mask")) -> dict:
  """Padded chosen and rejected sequences as one list, pair by pair (sequence ``2i`` is pair
  ``i``'s chosen side, ``2i + 1`` its rejected side), so that contiguous sequence ranges hold
  whole pairs and per-sequence results reshape to ``[pairs, 2]``."""
  out = {}
  for k in keys:
    c, r = np.asarray(chosen[k]), np.asarray(rejected[k])
    out[k] = np.stack([c, r], axis=1).reshape((-1,) + c.shape[1:])
  return out
