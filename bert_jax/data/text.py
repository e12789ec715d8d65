"""Reading raw text inputs into documents of sentences, counting bad input as it goes.

Three kinds of input, named by a string:

  * a text file in BERT's format (`create_pretraining_data.py`): one sentence
    per line, a blank line between documents; `.gz` files are read compressed;
  * a JSON-lines file (`.jsonl`, `.json`, optionally `.gz`): one document per
    line in a `text` field, split into sentences by `split_sentences`;
  * a TFDS text dataset, `tfds:NAME[:SPLIT]` (e.g. `tfds:wikipedia/20230601.en`),
    whose `text` feature is split the same way; this needs the `[tfds]` extra.

Bad input never stops a run and never vanishes silently: `InputReport` counts
each problem and keeps the first few locations (`file:line`). What happens to
each kind:

  invalid_utf8     line kept, undecodable bytes replaced by U+FFFD
  binary_junk      line dropped (a NUL byte, or over 10% control/U+FFFD chars)
                   (a file whose lines are mostly either stops the run: it is
                   binary or not UTF-8, and would leave little of itself)
  bad_json         JSON-lines line dropped (not JSON, or no string `text`)
  empty_documents  document dropped (nothing left after cleaning/tokenising)
  empty_sentences  sentence dropped (tokenises to nothing)
  long_sentences   sentence over the token limit split or truncated (prepare.py)
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import hashlib
import json
import os
import pathlib
import re
import zlib
from typing import Iterator

TFDS_PREFIX = "tfds:"
_MAX_EXAMPLES_PER_KIND = 20
_JUNK_FRACTION = 0.1
# A file is refused once over half of its first `_UNREADABLE_CHECK_LINES` lines (or of all of them) are unreadable.
_UNREADABLE_FRACTION = 0.5
_UNREADABLE_CHECK_LINES = 1000
_CONTROL_OR_REPLACEMENT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]")
# A sentence ends at '.', '!' or '?' (plus closing quotes/brackets) followed by
# whitespace and then an upper-case letter, a digit or an opening quote/bracket.
# Abbreviations such as "e.g. the" stay joined because a lower-case word follows;
# "Mr. Smith" is split: a simple, predictable rule, not a linguistic one.
_SENTENCE_BOUNDARY = re.compile(r"([.!?][\"'\u201d\u2019)\]]*)\s+(?=[A-Z0-9\"'\u201c\u2018(\[])")


@dataclasses.dataclass
class Document:
  """One document: its sentences and where each came from (1-based line numbers)."""
  sentences: list[str]
  source: str
  lines: list[int]


class InputReport:
  """Counts of bad input by kind, with the first few `file:line: detail` locations of each."""

  def __init__(self):
    self.counts: collections.Counter[str] = collections.Counter()
    self.examples: dict[str, list[str]] = collections.defaultdict(list)

  def add(self, kind: str, source: str, line: int, detail: str = "") -> None:
    self.counts[kind] += 1
    if len(self.examples[kind]) < _MAX_EXAMPLES_PER_KIND:
      self.examples[kind].append(f"{source}:{line}" + (f": {detail}" if detail else ""))

  def merge(self, other: "InputReport") -> None:
    for kind, count in other.counts.items():
      self.counts[kind] += count
      room = _MAX_EXAMPLES_PER_KIND - len(self.examples[kind])
      self.examples[kind].extend(other.examples[kind][:max(room, 0)])

  def to_json(self) -> dict:
    return {"counts": dict(sorted(self.counts.items())),
            "examples": {k: v for k, v in sorted(self.examples.items()) if v}}

  def summary(self) -> str:
    if not self.counts:
      return "input report: no problems found"
    lines = ["input report:"]
    for kind, count in sorted(self.counts.items()):
      first = self.examples[kind][0] if self.examples[kind] else ""
      lines.append(f"  {kind:16s} {count:8d}   first at {first}")
    return "\n".join(lines)


def split_sentences(text: str) -> list[str]:
  """Splits text into sentences: at newlines, then at `_SENTENCE_BOUNDARY` (see its comment)."""
  sentences = []
  for paragraph in text.splitlines():
    sentences.extend(s.strip() for s in _SENTENCE_BOUNDARY.sub("\\1\n", paragraph).split("\n"))
  return [s for s in sentences if s]


def is_binary_junk(line: str) -> bool:
  """True for a line with a NUL or more than 10% control / replacement characters."""
  if "\x00" in line:
    return True
  return len(_CONTROL_OR_REPLACEMENT.findall(line)) > _JUNK_FRACTION * max(len(line), 1)


class _LineReader:
  """Numbered, decoded lines of a text file (optionally .gz), refusing a truncated, binary or non-UTF-8 file.

  Yields (line number, stripped text); junk lines are counted in `report` and skipped.
  """

  def __init__(self, path: pathlib.Path, report: InputReport):
    self.path = path
    self.report = report
    self.lines = 0
    self.unreadable = 0

  def __iter__(self) -> Iterator[tuple[int, str]]:
    source = str(self.path)
    line_number = 0
    try:
      with _open_binary(self.path) as stream:
        for line_number, raw in enumerate(stream, start=1):
          line = self._decode(raw, source, line_number)
          if line_number == _UNREADABLE_CHECK_LINES:
            self._check()
          if line is not None:
            yield line_number, line
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
      raise ValueError(f"{source}: truncated or corrupt gzip data after line {line_number} ({error}); "
                       f"download or compress the file again (`gzip -t {source}` checks it)") from None
    self._check()

  def _decode(self, raw: bytes, source: str, line_number: int) -> str | None:
    """UTF-8 text of one raw line, or None when it is junk (both counted in `report`)."""
    if raw.strip():
      self.lines += 1
    try:
      line, undecodable = raw.decode("utf-8"), False
    except UnicodeDecodeError as error:
      line, undecodable = raw.decode("utf-8", errors="replace"), True
      self.report.add("invalid_utf8", source, line_number, f"{error.reason} at byte {error.start}")
    junk = is_binary_junk(line)
    if junk:
      self.report.add("binary_junk", source, line_number, repr(line[:40]))
    self.unreadable += junk or undecodable
    return None if junk else line.strip()

  def _check(self) -> None:
    if self.unreadable > _UNREADABLE_FRACTION * max(self.lines, 1):
      raise ValueError(
          f"{self.path}: {self.unreadable} of its first {self.lines} non-blank lines are not UTF-8 text (binary, "
          f"or another encoding such as Latin-1); convert it (e.g. `iconv -f latin1 -t utf-8`) or leave it out")


def _open_binary(path: pathlib.Path):
  return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _is_json_lines(path: pathlib.Path) -> bool:
  suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
  return bool(suffixes) and suffixes[0] in (".jsonl", ".json")


def _read_sentence_per_line(path: pathlib.Path, report: InputReport) -> Iterator[Document]:
  source = str(path)
  sentences, lines = [], []
  for line_number, line in _LineReader(path, report):
    if line:
      sentences.append(line)
      lines.append(line_number)
    elif sentences:
      yield Document(sentences, source, lines)
      sentences, lines = [], []
  if sentences:
    yield Document(sentences, source, lines)


def _read_json_lines(path: pathlib.Path, report: InputReport) -> Iterator[Document]:
  source = str(path)
  for line_number, line in _LineReader(path, report):
    if not line:
      continue
    try:
      text = json.loads(line).get("text")
    except (json.JSONDecodeError, AttributeError):
      text = None
    if not isinstance(text, str):
      report.add("bad_json", source, line_number, "not a JSON object with a string 'text' field")
      continue
    sentences = split_sentences(text)
    if not sentences:
      report.add("empty_documents", source, line_number, "no text")
      continue
    yield Document(sentences, source, [line_number] * len(sentences))


def _read_tfds(spec: str, report: InputReport) -> Iterator[Document]:
  try:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  except ImportError as error:
    raise ImportError(f"reading {spec!r} needs TensorFlow Datasets: pip install 'bert_jax[tfds]'") from error
  name, _, split = spec[len(TFDS_PREFIX):].partition(":")
  dataset = tfds.load(name, split=split or "train", shuffle_files=False)
  for index, example in enumerate(tfds.as_numpy(dataset), start=1):
    text = example["text"].decode("utf-8", errors="replace")
    sentences = [s for s in split_sentences(text) if not is_binary_junk(s)]
    if not sentences:
      report.add("empty_documents", spec, index, "no text")
      continue
    yield Document(sentences, spec, [index] * len(sentences))


def iter_documents(spec: str, report: InputReport) -> Iterator[Document]:
  """Documents of one input (a file path or `tfds:NAME[:SPLIT]`), bad input counted in `report`."""
  if spec.startswith(TFDS_PREFIX):
    return _read_tfds(spec, report)
  path = pathlib.Path(spec)
  if not path.is_file():
    raise FileNotFoundError(f"input {spec} does not exist")
  if _is_json_lines(path):
    return _read_json_lines(path, report)
  return _read_sentence_per_line(path, report)


def input_fingerprint(spec: str, head_bytes: int = 1 << 20) -> dict:
  """Identifies an input cheaply: size, mtime and a hash of its first MiB (TFDS: its name)."""
  if spec.startswith(TFDS_PREFIX):
    return {"input": spec}
  stat = os.stat(spec)
  with open(spec, "rb") as f:
    head_hash = hashlib.sha256(f.read(head_bytes)).hexdigest()[:16]
  return {"input": str(pathlib.Path(spec).resolve()), "size": stat.st_size, "mtime": int(stat.st_mtime),
          "head_sha256": head_hash}
