"""SWAG multiple choice: the swagaf CSV files, [N, 4, L] features, accuracy.

swagaf's `train.csv` / `val.csv` / `test.csv` have the header
`,video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,...,ending3,label`
(the first, unnamed column is a row number; test has no `label`). As in
BERT's SWAG setup, each choice is the pair (sent1, sent2 + " " + ending).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import pathlib
from typing import Sequence

import numpy as np

from bert_jax.tasks import metrics
from bert_jax.tasks.base import Task, TaskTokenizer, check_outputs, data_error, encode_segments, read_utf8

NUM_CHOICES = 4
ENDING_COLUMNS = tuple(f"ending{i}" for i in range(NUM_CHOICES))
REQUIRED_COLUMNS = ("fold-ind", "sent1", "sent2") + ENDING_COLUMNS
SPLIT_FILES = {"train": "train.csv", "dev": "val.csv", "test": "test.csv"}


@dataclasses.dataclass(frozen=True)
class MultipleChoiceExample:
  """One context with its candidate endings.

  Attributes:
    guid: swagaf's `fold-ind`.
    context: the first sentence (`sent1`).
    start_ending: the start of the second sentence shared by all endings (`sent2`).
    endings: the candidate endings.
    label: index of the right ending; None when unlabelled.
  """

  guid: str
  context: str
  start_ending: str
  endings: tuple[str, ...]
  label: int | None


def read_swag_csv(path: str | pathlib.Path) -> list[MultipleChoiceExample]:
  """Reads a swagaf CSV file (columns found by header name).

  Raises:
    ValueError: naming the file and line, for an empty file, a header
      without the needed columns, a row of the wrong width, or a label
      outside 0..3.
  """
  path = pathlib.Path(path)
  with io.StringIO(read_utf8(path), newline="") as f:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
      raise data_error(path, None, "file is empty")
    missing = [name for name in REQUIRED_COLUMNS if name not in header]
    if missing:
      raise data_error(path, 1, f"header lacks columns {missing}")
    column = {name: header.index(name) for name in header}
    examples = []
    for row in reader:
      line_number = reader.line_num
      if len(row) != len(header):
        raise data_error(path, line_number, f"expected {len(header)} columns, found {len(row)}")
      label = None
      if "label" in column:
        value = row[column["label"]]
        if value not in {str(i) for i in range(NUM_CHOICES)}:
          raise data_error(path, line_number, f"label {value!r} is not one of 0..{NUM_CHOICES - 1}")
        label = int(value)
      examples.append(MultipleChoiceExample(row[column["fold-ind"]], row[column["sent1"]], row[column["sent2"]],
                                            tuple(row[column[name]] for name in ENDING_COLUMNS), label))
  if not examples:
    raise data_error(path, None, "file has a header but no rows")
  return examples


class SwagTask(Task):
  """SWAG: pick the most plausible of four endings."""

  name = "swag"
  kind = "multiple_choice"
  num_choices = NUM_CHOICES
  metric_names = ("accuracy",)
  selection_metric = "accuracy"

  def load(self, data_dir: str | pathlib.Path, split: str) -> list[MultipleChoiceExample]:
    """Reads train.csv / val.csv / test.csv for split train / dev / test."""
    if split not in SPLIT_FILES:
      raise ValueError(f"{self.name} has no split {split!r}; valid: {list(SPLIT_FILES)}")
    return read_swag_csv(pathlib.Path(data_dir) / SPLIT_FILES[split])

  def read_file(self, path: str | pathlib.Path) -> list[MultipleChoiceExample]:
    """A swagaf CSV (`read_swag_csv`), with or without its label column."""
    return read_swag_csv(path)

  def featurize(self, examples: Sequence[MultipleChoiceExample], tokenizer: TaskTokenizer,
                max_len: int) -> dict[str, np.ndarray]:
    """[N, C, L] rows of [CLS] context [SEP] start_ending ending [SEP]; see `bert_jax.tasks.base`."""
    contexts = [e.context for e in examples for _ in range(NUM_CHOICES)]
    endings = [f"{e.start_ending} {ending}".strip() for e in examples for ending in e.endings]
    context_ids, _ = tokenizer.tokenize_with_offsets(contexts)
    ending_ids, _ = tokenizer.tokenize_with_offsets(endings)
    flat = encode_segments(context_ids, ending_ids, tokenizer, max_len)
    features = {key: value.reshape(len(examples), NUM_CHOICES, *value.shape[1:]) for key, value in flat.items()}
    features["example_index"] = np.arange(len(examples), dtype=np.int32)
    features["labels"] = np.array([e.label if e.label is not None else -1 for e in examples], np.int32)
    return features

  def predict(self, outputs: np.ndarray, features: dict[str, np.ndarray],
              examples: Sequence[MultipleChoiceExample]) -> list[int]:
    """Index of the highest-scoring ending per example."""
    return np.argmax(check_outputs(outputs, features, (NUM_CHOICES,)), axis=-1).tolist()

  def evaluate(self, outputs: np.ndarray, features: dict[str, np.ndarray],
               examples: Sequence[MultipleChoiceExample]) -> dict[str, float]:
    """Accuracy in percent."""
    if any(e.label is None for e in examples):
      raise ValueError(f"{self.name}: cannot evaluate unlabelled examples (the test split?)")
    return {"accuracy": metrics.accuracy(self.predict(outputs, features, examples), [e.label for e in examples])}
