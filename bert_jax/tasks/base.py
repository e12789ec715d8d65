"""The fine-tuning task interface shared by GLUE, SQuAD, SWAG and CoNLL-2003.

A `Task` turns raw files into examples (`load` a split, `read_file` one file
to predict on), examples into fixed-shape numpy features (`featurize`), and
the model's raw head outputs back into predictions and official metrics
(`predict`, `evaluate`). The fine-tuning loop
only needs this interface and `Task.kind`, the name of the kind whose class
(`bert_jax.tasks.kinds.TASK_KINDS`) gives the head and the loss.

Features are a dict of numpy arrays padded to `max_len`, in the example order
(SQuAD windows and over-long CoNLL sentences give several features per
example; `example_index` links them):

  every kind:
    input_ids      int32 [N, L]   [CLS] A [SEP] (B [SEP]) then pad_id; A is the
                                  question and B the context window for
                                  SQuAD, the context and the ending for
                                  SWAG; NER rows have A only.
    segment_ids    int32 [N, L]   0 for [CLS], A and its [SEP]; 1 for B and its
                                  [SEP]; 0 on padding.
    lengths        int32 [N]      number of real tokens (the rest is padding).
    example_index  int32 [N]      index into the `examples` list.
  classification:   labels int32 [N] (label id, -1 when the example is unlabelled).
  regression:       labels float32 [N] (NaN when unlabelled).
  multiple_choice:  input_ids, segment_ids int32 [N, C, L]; lengths int32
                    [N, C]; labels int32 [N] (-1 when unlabelled).
  span:             start_positions, end_positions int32 [N] (the [CLS] index 0
                    when the answer is not inside the window or there is none),
                    token_offsets int32 [N, L, 2] (character span of each
                    context token in the context, -1 elsewhere),
                    max_context int32 [N, L] (1 where this window is the one
                    with most context around the token).
  tagging:          labels int32 [N, L] (tag id on the first piece of each
                    word of the centre sentence, -1 elsewhere: continuation
                    pieces, document context, specials, padding),
                    word_ids int32 [N, L] (index of the word a first piece
                    starts, -1 elsewhere).

Model outputs passed to `predict`/`evaluate` are the head's raw scores for
all features, stacked in feature order (strip any batch padding first):

  classification [N, K] logits; regression [N] or [N, 1]; span [N, L, 2]
  (start and end logits); multiple_choice [N, C]; tagging [N, L, K].

`predict` returns, per kind: classification a label string per example;
regression a float per example; span {question id: answer text} ("" is no
answer); multiple_choice the chosen index per example; tagging a tag list per
sentence. `submission_text` writes predictions in the task's official format
(GLUE's TSV, SQuAD's JSON, CoNLL lines); GLUE tasks write test predictions with
`write_submission`.

All metrics are reported on the 0-100 scale of the papers' tables
(correlations as 100 * r); thresholds are in logit units.
"""

from __future__ import annotations

import abc
import codecs
import dataclasses
import json
import pathlib
from typing import Any, Protocol, Sequence

import numpy as np
import tokenizers

Offsets = list[tuple[int, int]]


class TaskTokenizer(Protocol):
  """What the tasks need from a tokenizer.

  Attributes:
    cls_id: id of the classification token placed first ([CLS]).
    sep_id: id of the separator placed after each segment ([SEP]).
    pad_id: id used to pad rows to `max_len`.
  """

  cls_id: int
  sep_id: int
  pad_id: int

  def tokenize_with_offsets(self, texts: Sequence[str]) -> tuple[list[list[int]], list[Offsets]]:
    """Tokenizes texts without special tokens, truncation or padding.

    Args:
      texts: raw strings.

    Returns:
      (ids, offsets): per text, the token ids and, per token, the [start, end)
      character span in the *original* string that the token came from. A
      span may include a leading space (byte-level BPE) but must end inside
      the word the token belongs to; tokens that come from no characters may
      have start == end.
    """
    ...


class HFTokenizerAdapter:
  """Adapts a Hugging Face `tokenizers.Tokenizer` to `TaskTokenizer`.

  The wrapped tokenizer is copied with truncation and padding turned off:
  tokenizer.json files often enable both (MiniLM's pads to 128), which would
  silently cut SQuAD contexts.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, cls_token: str = "[CLS]", sep_token: str = "[SEP]",
               pad_token: str = "[PAD]"):
    """Wraps `tokenizer`.

    Args:
      tokenizer: a `tokenizers.Tokenizer`.
      cls_token: the classification token's string ("<s>" for RoBERTa).
      sep_token: the separator token's string ("</s>" for RoBERTa).
      pad_token: the padding token's string ("<pad>" for RoBERTa).

    Raises:
      ValueError: when a special token is not in the vocabulary.
    """
    self._tokenizer = tokenizers.Tokenizer.from_str(tokenizer.to_str())
    self._tokenizer.no_truncation()
    self._tokenizer.no_padding()
    special_ids = {}
    for token in (cls_token, sep_token, pad_token):
      token_id = self._tokenizer.token_to_id(token)
      if token_id is None:
        raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
      special_ids[token] = token_id
    self.cls_id = special_ids[cls_token]
    self.sep_id = special_ids[sep_token]
    self.pad_id = special_ids[pad_token]

  @classmethod
  def from_vocab_file(cls, vocab_path: str | pathlib.Path, lowercase: bool = True) -> "HFTokenizerAdapter":
    """A BERT WordPiece tokenizer (BERT normaliser and pre-tokenizer) from a vocab.txt.

    Args:
      vocab_path: one token per line, as shipped with BERT checkpoints.
      lowercase: lower-case and strip accents (uncased checkpoints).
    """
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece.from_file(str(vocab_path), unk_token="[UNK]"))
    tokenizer.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    return cls(tokenizer)

  def tokenize_with_offsets(self, texts: Sequence[str]) -> tuple[list[list[int]], list[Offsets]]:
    """See `TaskTokenizer.tokenize_with_offsets`."""
    encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in encodings], [e.offsets for e in encodings]


class Task(abc.ABC):
  """A fine-tuning task: files -> examples -> features; outputs -> metrics.

  Attributes:
    name: registry name, e.g. "glue/mrpc".
    kind: the name of its kind in `bert_jax.tasks.kinds.TASK_KINDS`, whose class gives the head and the loss.
    labels: label strings in id order (tag set for tagging; empty for
      regression, span and multiple choice).
    metric_names: keys of the dict `evaluate` returns that tables show.
    selection_metric: the metric to maximise for model selection.
    eval_splits: dev splits that `evaluate` is run on (MNLI has two).
    num_choices: choices per example for multiple choice, else 0.
  """

  name: str
  kind: str
  labels: tuple[str, ...] = ()
  metric_names: tuple[str, ...] = ()
  selection_metric: str = ""
  eval_splits: tuple[str, ...] = ("dev",)
  num_choices: int = 0

  @property
  def num_labels(self) -> int:
    """Width of the head's output per row, per choice or per token.

    One logit per label (classification, tagging), or one score where the task
    has no labels (regression, multiple choice); span extraction overrides it
    (start and end logits per token).
    """
    return len(self.labels) or 1

  @abc.abstractmethod
  def load(self, data_dir: str | pathlib.Path, split: str) -> list[Any]:
    """Reads the examples of `split` ("train", "dev", ...) from `data_dir`."""

  def read_file(self, path: str | pathlib.Path) -> list[Any]:
    """Reads the examples of one file a user names (`bert-jax predict --input`), labelled or not."""
    raise NotImplementedError(f"{self.name} reads no single input files")

  @abc.abstractmethod
  def featurize(self, examples: Sequence[Any], tokenizer: TaskTokenizer,
                max_len: int) -> dict[str, np.ndarray]:
    """Turns examples into the feature arrays described in this module's docstring."""

  @abc.abstractmethod
  def predict(self, outputs: np.ndarray, features: dict[str, np.ndarray],
              examples: Sequence[Any]) -> list[Any] | dict[str, Any]:
    """Turns the head's raw outputs into per-example predictions in the data's terms."""

  @abc.abstractmethod
  def evaluate(self, outputs: np.ndarray, features: dict[str, np.ndarray],
               examples: Sequence[Any]) -> dict[str, float]:
    """Official metrics of the predictions against the examples' gold labels."""

  def submission_text(self, examples: Sequence[Any], predictions: Any) -> str:
    """`predict`'s output for `examples` as the file the task's official evaluation reads."""
    raise NotImplementedError(f"{self.name} has no submission format")


@dataclasses.dataclass(frozen=True)
class TextPairExample:
  """One sentence or sentence-pair example (GLUE).

  Attributes:
    guid: the row's index in a test file (used in submissions), else "split-row".
    text_a: first segment.
    text_b: second segment, None for single-sentence tasks.
    label: label string (classification), score (regression), None unlabelled.
  """

  guid: str
  text_a: str
  text_b: str | None
  label: str | float | None


def check_outputs(outputs: np.ndarray, features: dict[str, np.ndarray],
                  trailing_shape: tuple[int, ...]) -> np.ndarray:
  """Checks that outputs has one row per feature and the expected trailing shape.

  Args:
    outputs: the head's stacked raw outputs.
    features: the features they were computed from.
    trailing_shape: expected shape after the feature axis; -1 matches anything.

  Returns:
    outputs as a float32 numpy array.

  Raises:
    ValueError: on any shape mismatch (typically a padded last batch left in).
  """
  outputs = np.asarray(outputs, dtype=np.float32)
  expected = (len(features["input_ids"]),) + trailing_shape
  if outputs.ndim != len(expected) or any(
      want not in (-1, got) for want, got in zip(expected, outputs.shape)):
    raise ValueError(f"outputs have shape {outputs.shape}, expected {expected} "
                     "(one row per feature; strip padded batch rows)")
  return outputs


def truncate_pair(ids_a: list[int], ids_b: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
  """Trims the longer of two token lists, one token at a time, to fit max_tokens.

  Trimming the longer one keeps as much of each segment as possible, as BERT's
  `_truncate_seq_pair` does; the first segment is trimmed on ties.
  """
  len_a, len_b = len(ids_a), len(ids_b)
  while len_a + len_b > max_tokens:
    if len_a >= len_b:
      len_a -= 1
    else:
      len_b -= 1
  return ids_a[:len_a], ids_b[:len_b]


def encode_segments(ids_a: Sequence[Sequence[int]], ids_b: Sequence[Sequence[int]] | None,
                    tokenizer: TaskTokenizer, max_len: int) -> dict[str, np.ndarray]:
  """Packs one or two token segments per row as [CLS] A [SEP] (B [SEP]).

  Args:
    ids_a: first-segment ids per row (no special tokens).
    ids_b: second-segment ids per row, or None for single segments.
    tokenizer: supplies the special ids.
    max_len: row length L; segments are truncated to fit.

  Returns:
    input_ids, segment_ids int32 [N, L] and lengths int32 [N].
  """
  rows = len(ids_a)
  input_ids = np.full((rows, max_len), tokenizer.pad_id, np.int32)
  segment_ids = np.zeros((rows, max_len), np.int32)
  lengths = np.zeros((rows,), np.int32)
  for row in range(rows):
    if ids_b is None:
      first, second = list(ids_a[row])[:max_len - 2], None
    else:
      first, second = truncate_pair(list(ids_a[row]), list(ids_b[row]), max_len - 3)
    tokens = [tokenizer.cls_id, *first, tokenizer.sep_id]
    if second is not None:
      segment_ids[row, len(tokens):len(tokens) + len(second) + 1] = 1
      tokens += [*second, tokenizer.sep_id]
    input_ids[row, :len(tokens)] = tokens
    lengths[row] = len(tokens)
  return {"input_ids": input_ids, "segment_ids": segment_ids, "lengths": lengths}


def data_error(path: str | pathlib.Path, line: int | None, message: str) -> ValueError:
  """A ValueError that names the file (and line) where the data is wrong."""
  where = f"{path}:{line}" if line is not None else str(path)
  return ValueError(f"{where}: {message}")


def describe_json(value: Any) -> str:
  """A JSON value as an error names it: null, true, the number 5, the string 'abc', a list, an object."""
  if value is None:
    return "null"
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float)):
    return f"the number {value!r}"
  if isinstance(value, str):
    return f"the string {value[:40]!r}" + ("..." if len(value) > 40 else "")
  return {list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def read_json_lines(path: str | pathlib.Path) -> list[tuple[int, Any]]:
  """(line number, parsed value) of every non-blank line of a JSON-lines file (a leading BOM is dropped).

  Raises:
    ValueError: naming the file and line of a line that is not JSON.
  """
  records = []
  for line_number, line in enumerate(read_utf8(path, strip_bom=True).splitlines(), start=1):
    if not line.strip():
      continue
    try:
      records.append((line_number, json.loads(line)))
    except json.JSONDecodeError as error:
      raise data_error(path, line_number, f"not JSON ({error.msg}); expected one JSON object per line") from None
  return records


def read_utf8(path: str | pathlib.Path, strip_bom: bool = False) -> str:
  """The text of a UTF-8 file; a byte that is not UTF-8 raises a ValueError naming its line and column."""
  data = pathlib.Path(path).read_bytes()
  if strip_bom:
    data = data.removeprefix(codecs.BOM_UTF8)
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as error:
    line_start = data.rfind(b"\n", 0, error.start) + 1
    raise data_error(path, data.count(b"\n", 0, error.start) + 1,
                     f"byte 0x{data[error.start]:02x} at column {error.start - line_start + 1} is not UTF-8; "
                     f"convert the file to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None
