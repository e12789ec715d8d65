"""The pretraining batch contract between the data pipeline and the train step.

The input pipeline yields, per host, a dict of numpy arrays with a leading
batch axis B (rows) and, where it applies, a sequence axis L. Masking is *not*
done on the host: the train step masks `input_ids` on device, keyed by
(seed, example_id, epoch) so that the same row gets the same mask whatever the
device count (see `bert_jax.data.masking`).

Fields (every batch has all of them; P is the maximum number of packed
examples per row, 1 when packing is off):

  input_ids        int32 [B, L]  token ids with [CLS]/[SEP] already placed;
                                 padding is the tokenizer's pad id.
  segment_ids      int32 [B, L]  token type: 0 for segment A, 1 for segment B
                                 (RoBERTa-style formats use 0 everywhere).
  position_ids     int32 [B, L]  position of the token inside its own packed
                                 example (restarts at 0 for each example); the
                                 model adds the family's offset (RoBERTa).
  pack_ids         int32 [B, L]  1..P: which packed example a token belongs
                                 to; 0 for padding. Attention never crosses
                                 pack ids. Unpacked rows are 1 on real tokens.
  word_starts      int32 [B, L]  bit 0 (value 1) where a token starts a word
                                 (special tokens count as words); used by
                                 whole-word, n-gram and span masking. When
                                 the prepared corpus holds linguistic spans
                                 (`bert-jax mark-spans`), two more bits per
                                 kind of `SPAN_KINDS` (`span_bits`): the token
                                 starts a span, the token is inside one; 0
                                 on special tokens and padding. Carrying them
                                 in this field lets them follow their tokens
                                 through every format, cut and pack.
  special_mask     int32 [B, L]  1 for special tokens and padding: never masked.
  cls_positions    int32 [B, P]  position of each packed example's first token.
  sentence_labels  int32 [B, P]  NSP: 0 = B follows A, 1 = B is random.
                                 SOP: 0 = in order, 1 = swapped. 0 when unused.
  sentence_weights float32 [B, P] 1 for a real packed example, else 0.
  example_ids      int32 [B]     a unique id of the row within its epoch
                                 (global across hosts), used in the mask key.
  epoch            int32 [B]     the epoch the row was drawn in (or, for static examples, its copy).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

SPAN_KINDS = ("named_entity", "noun_phrase")
# The `bert-jax mark-spans` option that takes the tagger of each span kind.
TAGGER_OPTIONS = {"named_entity": "ner", "noun_phrase": "chunker"}


def span_marks(kind: str) -> tuple[int, int]:
  """(starts-a-span bit, inside-a-span bit) of `kind` in a prepared corpus' span marks (`prepare.write_spans`)."""
  shift = 2 * SPAN_KINDS.index(kind)
  return 1 << shift, 2 << shift


def span_bits(kind: str) -> tuple[int, int]:
  """(starts-a-span bit, inside-a-span bit) of `kind` in the `word_starts` field: the corpus' marks shifted above
  the word-start bit."""
  start, inside = span_marks(kind)
  return start << 1, inside << 1


SEQUENCE_FIELDS = ("input_ids", "segment_ids", "position_ids", "pack_ids", "word_starts", "special_mask")
PACK_FIELDS = ("cls_positions", "sentence_labels", "sentence_weights")
ROW_FIELDS = ("example_ids", "epoch")
FIELDS = SEQUENCE_FIELDS + PACK_FIELDS + ROW_FIELDS
DTYPES = {**{k: np.dtype(np.int32) for k in FIELDS}, "sentence_weights": np.dtype(np.float32)}


def field_widths(seq_len: int, packs: int) -> dict[str, int]:
  """Each field's values per row: L for sequence fields, P for pack fields, 1 for row fields."""
  return {**{k: seq_len for k in SEQUENCE_FIELDS}, **{k: packs for k in PACK_FIELDS}, **{k: 1 for k in ROW_FIELDS}}


def validate_batch(batch: Mapping[str, np.ndarray]) -> None:
  """Raises ValueError naming the field when `batch` breaks the contract above."""
  missing = [k for k in FIELDS if k not in batch]
  if missing:
    raise ValueError(f"batch is missing fields {missing}; it has {sorted(batch)}")
  rows, length = np.shape(batch["input_ids"])
  for k in SEQUENCE_FIELDS:
    if np.shape(batch[k]) != (rows, length):
      raise ValueError(f"batch[{k!r}] has shape {np.shape(batch[k])}, expected {(rows, length)}")
  packs = np.shape(batch["cls_positions"])
  for k in PACK_FIELDS:
    if np.shape(batch[k]) != packs or packs[0] != rows:
      raise ValueError(f"batch[{k!r}] has shape {np.shape(batch[k])}, expected {packs} with {rows} rows")
  for k in ROW_FIELDS:
    if np.shape(batch[k]) != (rows,):
      raise ValueError(f"batch[{k!r}] has shape {np.shape(batch[k])}, expected ({rows},)")
