"""The nine GLUE tasks: TSV and TFDS readers, featurisation, metrics, submissions.

Local files follow the layout of the classic `download_glue_data.py`
(`GLUE_DIR/TASK/{train,dev,test}.tsv`; MNLI has `dev_matched`,
`dev_mismatched`, `test_matched`, `test_mismatched`), with the columns the
Hugging Face `run_glue` processors read. Fields are split on tabs with no
quoting (csv.QUOTE_NONE), because some fields start with a `"`.

SST-2's official dev labels are not public here, so `carve_sentence_dev` carves a dev set of whole sentences from
its train file, sharing no text with the train split left (`write_sentence_carve` writes both and `carve.json`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import os
import pathlib
from typing import Any, Iterator, Sequence

from etils import epath
import numpy as np

from bert_jax.tasks import metrics
from bert_jax.tasks.base import (Task, TaskTokenizer, TextPairExample, check_outputs, data_error, describe_json,
                                 encode_segments, read_json_lines, read_utf8)

STSB_SCORE_RANGE = (0.0, 5.0)
# The label column's header in the labelled (train/dev) files; the test files lack that column.
_LABEL_HEADERS = frozenset({"label", "Quality", "score", "is_duplicate", "gold_label"})
# carve.json's "method" for `carve_sentence_dev`'s split.
SENTENCE_CARVE_METHOD = "sentence-level, no word-boundary containment either way"


@dataclasses.dataclass(frozen=True)
class Columns:
  """Where a TSV file keeps its fields (negative indices count from the end).

  Attributes:
    text_a: column of the first sentence.
    text_b: column of the second sentence; None for single-sentence tasks.
    label: label column; None for unlabelled (test) files.
    index: column whose value becomes the example guid; None to number rows.
    header: whether the first line is a header (its width sets the row width).
    width: row width for header-less files.
  """

  text_a: int
  text_b: int | None
  label: int | None
  index: int | None = None
  header: bool = True
  width: int = 0


@dataclasses.dataclass(frozen=True)
class GlueSpec:
  """Everything that differs between GLUE tasks.

  Attributes:
    name: short name, as in TFDS ("sst2").
    directory: folder under GLUE_DIR ("SST-2").
    labels: label strings in id order; empty for regression (STS-B).
    metric_names: official metrics, reported in this order.
    selection_metric: metric for model selection.
    labelled: columns of the train and dev files.
    unlabelled: columns of the test files.
    tfds_text_keys: feature names of the sentence(s) in TFDS `glue/NAME`.
    submissions: test split -> file name in the GLUE submission zip.
  """

  name: str
  directory: str
  labels: tuple[str, ...]
  metric_names: tuple[str, ...]
  selection_metric: str
  labelled: Columns
  unlabelled: Columns
  tfds_text_keys: tuple[str, ...]
  submissions: dict[str, str]

  @property
  def eval_splits(self) -> tuple[str, ...]:
    return tuple(s.replace("test", "dev") for s in self.submissions)

  @property
  def splits(self) -> tuple[str, ...]:
    return ("train",) + self.eval_splits + tuple(self.submissions)


_BINARY = ("0", "1")
_NLI = ("entailment", "not_entailment")
_PAIR_INDEXED = Columns(text_a=1, text_b=2, label=-1, index=0)
_PAIR_INDEXED_TEST = Columns(text_a=1, text_b=2, label=None, index=0)

SPECS: dict[str, GlueSpec] = {
    spec.name: spec for spec in (
        GlueSpec("cola", "CoLA", _BINARY, ("mcc",), "mcc",
                 labelled=Columns(text_a=3, text_b=None, label=1, header=False, width=4),
                 unlabelled=Columns(text_a=1, text_b=None, label=None, index=0),
                 tfds_text_keys=("sentence",), submissions={"test": "CoLA.tsv"}),
        GlueSpec("sst2", "SST-2", _BINARY, ("accuracy",), "accuracy",
                 labelled=Columns(text_a=0, text_b=None, label=1),
                 unlabelled=Columns(text_a=1, text_b=None, label=None, index=0),
                 tfds_text_keys=("sentence",), submissions={"test": "SST-2.tsv"}),
        GlueSpec("mrpc", "MRPC", _BINARY, ("f1", "accuracy"), "f1",
                 labelled=Columns(text_a=3, text_b=4, label=0),
                 unlabelled=Columns(text_a=3, text_b=4, label=None, index=0),
                 tfds_text_keys=("sentence1", "sentence2"), submissions={"test": "MRPC.tsv"}),
        GlueSpec("stsb", "STS-B", (), ("pearson", "spearman"), "spearman",
                 labelled=Columns(text_a=7, text_b=8, label=-1, index=0),
                 unlabelled=Columns(text_a=7, text_b=8, label=None, index=0),
                 tfds_text_keys=("sentence1", "sentence2"), submissions={"test": "STS-B.tsv"}),
        GlueSpec("qqp", "QQP", _BINARY, ("f1", "accuracy"), "f1",
                 labelled=Columns(text_a=3, text_b=4, label=5, index=0),
                 unlabelled=_PAIR_INDEXED_TEST,
                 tfds_text_keys=("question1", "question2"), submissions={"test": "QQP.tsv"}),
        GlueSpec("mnli", "MNLI", ("contradiction", "entailment", "neutral"), ("accuracy",), "accuracy",
                 labelled=Columns(text_a=8, text_b=9, label=-1, index=0),
                 unlabelled=Columns(text_a=8, text_b=9, label=None, index=0),
                 tfds_text_keys=("premise", "hypothesis"),
                 submissions={"test_matched": "MNLI-m.tsv", "test_mismatched": "MNLI-mm.tsv"}),
        GlueSpec("qnli", "QNLI", _NLI, ("accuracy",), "accuracy",
                 labelled=_PAIR_INDEXED, unlabelled=_PAIR_INDEXED_TEST,
                 tfds_text_keys=("question", "sentence"), submissions={"test": "QNLI.tsv"}),
        GlueSpec("rte", "RTE", _NLI, ("accuracy",), "accuracy",
                 labelled=_PAIR_INDEXED, unlabelled=_PAIR_INDEXED_TEST,
                 tfds_text_keys=("sentence1", "sentence2"), submissions={"test": "RTE.tsv"}),
        GlueSpec("wnli", "WNLI", _BINARY, ("accuracy",), "accuracy",
                 labelled=_PAIR_INDEXED, unlabelled=_PAIR_INDEXED_TEST,
                 tfds_text_keys=("sentence1", "sentence2"), submissions={"test": "WNLI.tsv"}),
    )
}


def _parse_label(spec: GlueSpec, value: str, path: pathlib.Path, line: int) -> str | float:
  """Checks a label field against the task's label set (or STS-B's score range)."""
  if spec.labels:
    if value not in spec.labels:
      raise data_error(path, line, f"label {value!r} is not one of {list(spec.labels)} ({spec.name})")
    return value
  try:
    score = float(value)
  except ValueError:
    raise data_error(path, line, f"score {value!r} is not a number ({spec.name})") from None
  low, high = STSB_SCORE_RANGE
  if not low <= score <= high:
    raise data_error(path, line, f"score {score} is outside [{low}, {high}] ({spec.name})")
  return score


def read_glue_tsv(spec: GlueSpec, path: str | pathlib.Path, labelled: bool) -> list[TextPairExample]:
  """Reads one GLUE TSV file.

  Args:
    spec: the task's layout.
    path: the .tsv file.
    labelled: True for train/dev files, False for test files.

  Returns:
    The examples in file order.

  Raises:
    ValueError: naming the file and line, for an empty file, a row whose
      column count differs from the header (or the fixed width), or a label
      outside the task's label set.
  """
  path = pathlib.Path(path)
  columns = spec.labelled if labelled else spec.unlabelled
  split = path.stem
  # strip_bom drops the BOM that MRPC's files start with; newline="\n" keeps a
  # stray "\r" inside a field from splitting the row.
  with io.StringIO(read_utf8(path, strip_bom=True), newline="\n") as f:
    lines = [line.rstrip("\n").removesuffix("\r") for line in f]
  if not lines:
    raise data_error(path, None, "file is empty")
  width, first_row = (len(lines[0].split("\t")), 1) if columns.header else (columns.width, 0)
  needed = max(abs(c) + (c >= 0) for c in (columns.text_a, columns.text_b, columns.label, columns.index)
               if c is not None)
  if width < needed:
    raise data_error(path, 1, f"expected at least {needed} columns for {spec.name}, header has {width}")
  if len(lines) <= first_row:
    raise data_error(path, None, "file has a header but no rows")
  examples = []
  for line_number, line in enumerate(lines[first_row:], start=first_row + 1):
    fields = line.split("\t")
    if len(fields) != width:
      raise data_error(path, line_number, f"expected {width} tab-separated columns, found {len(fields)}")
    label = _parse_label(spec, fields[columns.label], path, line_number) if labelled else None
    guid = fields[columns.index] if columns.index is not None else f"{split}-{line_number - first_row - 1}"
    text_b = fields[columns.text_b] if columns.text_b is not None else None
    examples.append(TextPairExample(guid, fields[columns.text_a], text_b, label))
  return examples


def tsv_has_labels(spec: GlueSpec, path: str | pathlib.Path) -> bool:
  """Whether a GLUE TSV has the labelled (train/dev) layout rather than the test one, told by its first line.

  The header of a labelled file names the label column ("label", MRPC's "Quality", ...); CoLA's labelled files have
  no header and four columns, its test file a two-column header.
  """
  first_line = read_utf8(path, strip_bom=True).split("\n", 1)[0].removesuffix("\r")
  fields = first_line.split("\t")
  columns = spec.labelled
  if not columns.header:
    return len(fields) == columns.width
  return -len(fields) <= columns.label < len(fields) and fields[columns.label] in _LABEL_HEADERS


def read_glue_jsonl(spec: GlueSpec, path: str | pathlib.Path) -> list[TextPairExample]:
  """Reads JSON lines with the task's TFDS (and Hugging Face datasets) field names.

  Each line is an object with the text fields `spec.tfds_text_keys` ("sentence", or "sentence1" and "sentence2",
  "question" and "sentence", ...), optionally "label" (a label string, a "0"/"1" index for the binary tasks, the
  score for STS-B; -1 or null for none) and "idx" (the guid; default "STEM-ROW").

  Raises:
    ValueError: naming the file, line and field, for a line that is not a JSON object, lacks a text field, has a
      text that is not a string (null, a number), a label outside the task's label set or an idx that is no id.
  """
  path = pathlib.Path(path)
  keys = list(spec.tfds_text_keys)
  examples = []
  for line_number, record in read_json_lines(path):
    if not isinstance(record, dict):
      raise data_error(path, line_number, f"the line is {describe_json(record)}, expected a JSON object: {spec.name} "
                       f"lines are objects with {keys} (and optionally 'label', 'idx')")
    missing = [key for key in keys if key not in record]
    if missing:
      raise data_error(path, line_number, f"no {missing} field: {spec.name} lines are objects with "
                       f"{keys} (and optionally 'label', 'idx')")
    for key in keys:  # str() would turn null into the text "None" and 5 into "5", and predict on that.
      if not isinstance(record[key], str):
        raise data_error(path, line_number, f"field {key!r} is {describe_json(record[key])}, expected a string (the "
                         "text); fix or remove that line")
    label = record.get("label")
    if label is not None and label != -1 and (isinstance(label, bool) or not isinstance(label, (str, int, float))):
      raise data_error(path, line_number, f"field 'label' is {describe_json(label)}, expected a label string, "
                       "an index, a score, or -1 / null for none")
    label = None if label is None or label == -1 else _parse_label(spec, str(label), path, line_number)
    idx = record.get("idx", f"{path.stem}-{len(examples)}")
    if isinstance(idx, bool) or not isinstance(idx, (str, int)):
      raise data_error(path, line_number, f"field 'idx' is {describe_json(idx)}, expected a string or an integer "
                       "(the example's id); fix it or leave it out")
    examples.append(TextPairExample(str(idx), record[keys[0]], record[keys[1]] if len(keys) > 1 else None, label))
  if not examples:
    raise data_error(path, None, "file has no examples (empty?)")
  return examples


class GlueTask(Task):
  """One GLUE task; see `SPECS` for the per-task layout and metrics."""

  def __init__(self, spec: GlueSpec):
    self.spec = spec
    self.name = f"glue/{spec.name}"
    self.kind = "classification" if spec.labels else "regression"  # STS-B alone scores (it names no labels)
    self.labels = spec.labels
    self.metric_names = spec.metric_names
    self.selection_metric = spec.selection_metric
    self.eval_splits = spec.eval_splits

  def _check_split(self, split: str) -> None:
    if split not in self.spec.splits:
      raise ValueError(f"{self.name} has no split {split!r}; valid: {list(self.spec.splits)}")

  def load(self, data_dir: str | pathlib.Path, split: str) -> list[TextPairExample]:
    """Reads `data_dir/TASK/split.tsv` (data_dir is the GLUE root)."""
    self._check_split(split)
    path = pathlib.Path(data_dir) / self.spec.directory / f"{split}.tsv"
    return read_glue_tsv(self.spec, path, labelled=not split.startswith("test"))

  def read_file(self, path: str | pathlib.Path) -> list[TextPairExample]:
    """A file a user gives: a TSV of this task, labelled or not (`tsv_has_labels`), or JSON lines (`.jsonl`,
    `read_glue_jsonl`)."""
    path = pathlib.Path(path)
    if path.suffix == ".jsonl":
      return read_glue_jsonl(self.spec, path)
    return read_glue_tsv(self.spec, path, labelled=tsv_has_labels(self.spec, path))

  def load_tfds(self, split: str, data_dir: str | None = None) -> list[TextPairExample]:
    """Reads the split from TFDS `glue/NAME` (needs the `[tfds]` extra).

    Args:
      split: our split name ("dev", "test_matched", ...); mapped to TFDS's
        "validation", "test_matched", ...
      data_dir: TFDS data directory; None for TFDS's default.

    Raises:
      ImportError: when tensorflow-datasets is not installed.
    """
    self._check_split(split)
    try:
      import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
    except ImportError as error:
      raise ImportError(f"reading {self.name} from TFDS needs tensorflow-datasets; "
                        "install the extra: pip install 'bert_jax[tfds]'") from error
    builder = tfds.builder(f"glue/{self.spec.name}", data_dir=data_dir)
    builder.download_and_prepare()
    dataset = builder.as_dataset(split=split.replace("dev", "validation"))
    id_to_label = []
    if self.labels:
      # TFDS orders MNLI's labels differently from the TSV processors; map by
      # name when TFDS's names are ours, by id when ours are "0"/"1".
      tfds_names = list(builder.info.features["label"].names)
      id_to_label = tfds_names if set(tfds_names) == set(self.labels) else list(self.labels)
    examples = []
    for record in tfds.as_numpy(dataset):
      texts = [record[key].decode("utf-8") for key in self.spec.tfds_text_keys]
      raw_label = record["label"]
      if self.labels:
        label = id_to_label[int(raw_label)] if int(raw_label) >= 0 else None
      else:
        label = None if split.startswith("test") else float(raw_label)
      examples.append(TextPairExample(str(int(record["idx"])), texts[0],
                                      texts[1] if len(texts) > 1 else None, label))
    return examples

  def featurize(self, examples: Sequence[TextPairExample], tokenizer: TaskTokenizer,
                max_len: int) -> dict[str, np.ndarray]:
    """[CLS] A [SEP] (B [SEP]) rows; see `bert_jax.tasks.base` for the fields."""
    ids_a, _ = tokenizer.tokenize_with_offsets([e.text_a for e in examples])
    ids_b = None
    if self.spec.labelled.text_b is not None:
      ids_b, _ = tokenizer.tokenize_with_offsets([e.text_b or "" for e in examples])
    features = encode_segments(ids_a, ids_b, tokenizer, max_len)
    features["example_index"] = np.arange(len(examples), dtype=np.int32)
    if self.labels:
      label_ids = {label: i for i, label in enumerate(self.labels)}
      features["labels"] = np.array([label_ids[e.label] if e.label is not None else -1 for e in examples],
                                    np.int32)
    else:
      features["labels"] = np.array([e.label if e.label is not None else math.nan for e in examples],
                                    np.float32)
    return features

  def _predicted_ids_or_scores(self, outputs: np.ndarray, features: dict[str, np.ndarray]) -> np.ndarray:
    if self.labels:
      return np.argmax(check_outputs(outputs, features, (len(self.labels),)), axis=-1)
    outputs = np.asarray(outputs)
    return check_outputs(outputs, features, (1,) if outputs.ndim == 2 else ()).reshape(-1)

  def predict(self, outputs: np.ndarray, features: dict[str, np.ndarray],
              examples: Sequence[TextPairExample]) -> list[str | float]:
    """Label strings (classification) or scores (STS-B), one per example."""
    values = self._predicted_ids_or_scores(outputs, features)
    if self.labels:
      return [self.labels[i] for i in values]
    return [float(v) for v in values]

  def evaluate(self, outputs: np.ndarray, features: dict[str, np.ndarray],
               examples: Sequence[TextPairExample]) -> dict[str, float]:
    """The task's official metrics (see `GlueSpec.metric_names`).

    Raises:
      ValueError: when the examples are unlabelled (a test split).
    """
    if any(e.label is None for e in examples):
      raise ValueError(f"{self.name}: cannot evaluate unlabelled examples (a test split?)")
    predicted = self._predicted_ids_or_scores(outputs, features)
    gold = features["labels"]
    metric_functions = {
        "accuracy": metrics.accuracy,
        "f1": metrics.binary_f1,
        "mcc": metrics.matthews_corrcoef,
        "pearson": metrics.pearson,
        "spearman": metrics.spearman,
    }
    return {name: metric_functions[name](predicted, gold) for name in self.metric_names}

  def write_submission(self, output_dir: str | os.PathLike, split: str,
                       examples: Sequence[TextPairExample], predictions: Sequence[Any]) -> epath.Path:
    """Writes `predict`'s output for a test split as GLUE's `index\\tprediction` file.

    Args:
      output_dir: folder of the submission (created if missing; local or `gs://`).
      split: a test split ("test", "test_matched", "test_mismatched").
      examples: the test examples (their guids are the GLUE indices).
      predictions: `predict`'s output for them.

    Returns:
      The written file, named as GLUE expects (CoLA.tsv, MNLI-m.tsv, ...).
    """
    if split not in self.spec.submissions:
      raise ValueError(f"{self.name}: no submission file for split {split!r}; "
                       f"valid: {list(self.spec.submissions)}")
    if len(examples) != len(predictions):
      raise ValueError(f"{len(examples)} examples but {len(predictions)} predictions")
    path = epath.Path(output_dir) / self.spec.submissions[split]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(self.submission_text(examples, predictions), encoding="utf-8")
    return path

  def submission_text(self, examples: Sequence[TextPairExample], predictions: Sequence[Any]) -> str:
    """GLUE's `index\\tprediction` rows (scores to 3 decimals) for `predict`'s output on `examples`."""
    rows = ["index\tprediction"]
    for example, prediction in zip(examples, predictions):
      value = str(prediction) if self.labels else f"{prediction:.3f}"
      rows.append(f"{example.guid}\t{value}")
    return "\n".join(rows) + "\n"


def dev_set_fingerprint(path: str | os.PathLike) -> str:
  """The first 16 hex digits of the sha256 of a file's bytes: which carve (or any data file) a run read."""
  return bytes_fingerprint(pathlib.Path(path).read_bytes())


def bytes_fingerprint(data: bytes) -> str:
  """`dev_set_fingerprint` of a file with these bytes."""
  return hashlib.sha256(data).hexdigest()[:16]


def phrase_text(row: str) -> str:
  """A TSV row's first field with its words joined by single spaces: the text `carve_sentence_dev` compares."""
  return " ".join(row.split("\t", 1)[0].split())


def _ngrams(words: Sequence[str]) -> Iterator[str]:
  """Every run of consecutive words, the whole included, as text."""
  for start in range(len(words)):
    for end in range(start + 1, len(words) + 1):
      yield " ".join(words[start:end])


def maximal_phrases(texts: Sequence[str]) -> list[str]:
  """The distinct texts contained in no other text (word-boundary containment, see `carve_sentence_dev`), in order
  of first appearance."""
  distinct = list(dict.fromkeys(texts))
  # Longest first: a text inside any other is inside a longer maximal one, whose n-grams are then already in the set.
  order = sorted(range(len(distinct)), key=lambda i: -distinct[i].count(" "))
  inside_maximal: set[str] = set()
  maximal = []
  for i in order:
    if distinct[i] not in inside_maximal:
      maximal.append(i)
      inside_maximal.update(_ngrams(distinct[i].split(" ")))
  return [distinct[i] for i in sorted(maximal)]


def carve_sentence_dev(rows: Sequence[str], size: int, seed: int) -> tuple[list[str], list[str]]:
  """Splits SST-2's train rows into a train split and a dev set of whole sentences that share no text.

  SST-2's train file holds every phrase of the parse trees of ~7k sentences, so a random carve puts phrases of one
  sentence on both sides. Here phrase `a` is contained in phrase `b` when `f" {a} " in f" {b} "`, both texts
  whitespace-tokenised and joined by single spaces (`phrase_text`): containment at word boundaries, equal texts
  included. The dev sentences are `size` maximal phrases (contained in no other phrase of the rows), drawn with
  `np.random.default_rng(seed)`; the train split is every row neither contained in a dev sentence nor containing one.

  Args:
    rows: the data rows of the TSV, header left out; the sentence is the first tab-separated field.
    size: dev sentences to carve.
    seed: seeds the draw.

  Returns:
    (train_rows, dev_rows), each in file order. Dev holds one row (the first) for each drawn sentence; the other
    rows with a dev sentence's text are contained in it, so they are on neither side.

  Raises:
    ValueError: when the rows have fewer than `size` maximal phrases.
  """
  texts = [phrase_text(row) for row in rows]
  maximal = maximal_phrases(texts)
  if size > len(maximal):
    raise ValueError(f"cannot carve {size} dev sentences: the rows hold {len(maximal)} maximal phrases")
  dev_texts = {maximal[i] for i in np.random.default_rng(seed).choice(len(maximal), size, replace=False).tolist()}
  first_rows = {}
  for index, text in enumerate(texts):
    first_rows.setdefault(text, index)
  dev_indices = sorted(first_rows[text] for text in dev_texts)
  inside_dev = set()
  for text in dev_texts:
    inside_dev.update(_ngrams(text.split(" ")))
  # A dev sentence is maximal, so the only rows containing one have its text and are inside it too.
  train = [row for row, text in zip(rows, texts) if text not in inside_dev]
  return train, [rows[i] for i in dev_indices]


def tsv_text(header: str, rows: Sequence[str]) -> str:
  """A TSV file's text as `write_sentence_carve` writes it: the header, the rows, a newline after each."""
  return "\n".join([header, *rows]) + "\n"


def write_sentence_carve(train_file: str | os.PathLike, out_dir: str | os.PathLike, size: int,
                         seed: int) -> dict[str, Any]:
  """Writes `carve_sentence_dev`'s split of a train TSV as out_dir/{train,dev}.tsv, and out_dir/carve.json.

  Returns:
    carve.json's content: the method, the row counts and the two files' fingerprints (`dev_set_fingerprint`, under
    the keys "sha256_dev" and "sha256_train").
  """
  header, *rows = pathlib.Path(train_file).read_text(encoding="utf-8").splitlines()
  train, dev = carve_sentence_dev(rows, size, seed)
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  files = {}
  for split, chosen in (("train", train), ("dev", dev)):
    files[split] = tsv_text(header, chosen).encode("utf-8")
    (out_dir / f"{split}.tsv").write_bytes(files[split])
  marker = {"method": SENTENCE_CARVE_METHOD, "dev_rows": len(dev), "train_rows": len(train),
            "sha256_dev": bytes_fingerprint(files["dev"]), "sha256_train": bytes_fingerprint(files["train"])}
  (out_dir / "carve.json").write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
  return marker
