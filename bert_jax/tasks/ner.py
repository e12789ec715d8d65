"""CoNLL-2003 named entities and noun-phrase chunks: reading, first-piece tagging features, conlleval F1.

Files have one `word POS chunk NER` line per token, blank lines between
sentences and `-DOCSTART- -X- O O` lines between documents; tags are IOB1
(I-TYPE inside any entity, B-TYPE only to start an entity right after another
of the same type). The model tags every word piece; only the first piece of
each word carries a label, and a word's prediction is read from its first
piece. Entities are scored as in conlleval: a predicted entity counts only
when its type and both boundaries match a gold one.

Two tasks read the files: "conll2003" tags the NER column; "conll2003_chunk"
tags the noun phrases of the syntactic chunk column (B-NP / I-NP kept, every
other chunk type read as O), scored by the same rules on NP chunks.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pathlib
from typing import Sequence

import numpy as np

from bert_jax.tasks.base import (Task, TaskTokenizer, check_outputs, data_error, describe_json, read_json_lines,
                                 read_utf8)

ENTITY_TYPES = ("LOC", "MISC", "ORG", "PER")
TAGS = ("O",) + tuple(f"{prefix}-{kind}" for prefix in ("B", "I") for kind in ENTITY_TYPES)
NP_CHUNK_TAGS = ("O", "B-NP", "I-NP")
COLUMNS = {"ner": 3, "chunk": 2}  # Which column of a line holds the tags read.
_DOCUMENT_START = "-DOCSTART-"
SPLIT_FILES = {"train": "eng.train", "dev": "eng.testa", "test": "eng.testb"}


@dataclasses.dataclass(frozen=True)
class TaggedSentence:
  """One sentence of a CoNLL file.

  Attributes:
    words: the tokens of the sentence.
    tags: one IOB1 tag per word.
    document_index: which document of the file it belongs to (0-based).
    pos: one part-of-speech tag per word (the file's second column).
    chunks: one IOB1 syntactic chunk tag per word (the third column).
  """

  words: tuple[str, ...]
  tags: tuple[str, ...]
  document_index: int
  pos: tuple[str, ...] = ()
  chunks: tuple[str, ...] = ()


def read_conll(path: str | pathlib.Path, tags: Sequence[str] = TAGS, words_only: bool = False,
               column: str = "ner") -> list[TaggedSentence]:
  """Reads a CoNLL-2003 file into sentences, in file order.

  Args:
    path: an eng.train / eng.testa / eng.testb style file.
    tags: the allowed tags of the NER column.
    words_only: read only the first column, the word (a file to predict on, which may have no other columns);
      the sentences then have no tags, POS or chunks.
    column: "ner": `TaggedSentence.tags` are the NER column's; "chunk": they are the noun-phrase tags of the
      chunk column (`NP_CHUNK_TAGS`: B-NP / I-NP kept, other chunk types O).

  Raises:
    ValueError: naming the file and line, for an empty file, a line without
      four space-separated columns, an NER tag outside `tags`, or a chunk tag
      that is not O, B-TYPE or I-TYPE.
  """
  if column not in COLUMNS:
    raise ValueError(f"column must be one of {sorted(COLUMNS)}, got {column!r}")
  path = pathlib.Path(path)
  allowed = frozenset(tags)
  sentences: list[TaggedSentence] = []
  words: list[str] = []
  sentence_tags: list[str] = []
  pos: list[str] = []
  chunks: list[str] = []
  document_index = -1

  def end_sentence() -> None:
    if words:
      sentences.append(TaggedSentence(tuple(words), tuple(sentence_tags), max(document_index, 0), tuple(pos),
                                      tuple(chunks)))
      for column in (words, sentence_tags, pos, chunks):
        column.clear()

  with io.StringIO(read_utf8(path), newline=None) as f:
    for line_number, line in enumerate(f, start=1):
      fields = line.split()
      if not fields:
        end_sentence()
        continue
      if len(fields) != 4 and not words_only:
        raise data_error(path, line_number, f"expected 4 space-separated columns, found {len(fields)}")
      if fields[0] == _DOCUMENT_START:
        end_sentence()
        document_index += 1
        continue
      if words_only:
        words.append(fields[0])
        continue
      if fields[3] not in allowed:
        raise data_error(path, line_number, f"tag {fields[3]!r} is not one of {sorted(allowed)}")
      if fields[2] != "O" and fields[2][:2] not in ("B-", "I-"):
        raise data_error(path, line_number, f"chunk tag {fields[2]!r} is not O, B-TYPE or I-TYPE")
      words.append(fields[0])
      pos.append(fields[1])
      chunks.append(fields[2])
      if column == "chunk":
        sentence_tags.append(fields[2] if fields[2] in NP_CHUNK_TAGS else "O")
      else:
        sentence_tags.append(fields[3])
  end_sentence()
  if not sentences:
    raise data_error(path, None, "file has no sentences (empty?)")
  return sentences


def read_tokens_jsonl(path: str | pathlib.Path) -> list[TaggedSentence]:
  """Reads JSON lines of {"tokens": [word, ...]} (Hugging Face datasets' field name), one sentence (and document)
  a line, without tags.

  Raises:
    ValueError: naming the file and line, for a line that is not a JSON object with a list "tokens" of words
      (non-blank strings without spaces: words are joined by spaces to be tokenised).
  """
  sentences = []
  for line_number, record in read_json_lines(path):
    tokens = record.get("tokens") if isinstance(record, dict) else None
    if not isinstance(tokens, list):
      found = f"field 'tokens' is {describe_json(tokens)}" if isinstance(record, dict) and "tokens" in record else (
          "no field 'tokens'" if isinstance(record, dict) else f"the line is {describe_json(record)}")
      raise data_error(path, line_number, f'{found}; expected an object with "tokens": a list of words')
    for index, token in enumerate(tokens):  # Words are joined by spaces: a blank one would take no piece, no tag.
      if not isinstance(token, str) or not token.strip() or len(token.split()) != 1:
        raise data_error(path, line_number, f"tokens[{index}] is {describe_json(token)}, expected a word (a string "
                         "without spaces); fix or remove that line")
    sentences.append(TaggedSentence(tuple(tokens), (), len(sentences)))
  if not sentences:
    raise data_error(path, None, "file has no sentences (empty?)")
  return sentences


def iob1_chunks(tags: Sequence[str]) -> set[tuple[int, int, str]]:
  """Entities of a tag sequence as (first, last, type), with conlleval's rules.

  A chunk starts at a B- tag, at an I- tag after O, and wherever the type
  changes; it ends where the next one starts or at O. These rules read both
  IOB1 and IOB2, as conlleval does.
  """
  chunks = set()
  start, previous_type = None, None
  for position, tag in enumerate([*tags, "O"]):
    prefix, _, kind = tag.partition("-")
    starts_chunk = prefix == "B" or (prefix == "I" and kind != previous_type)
    if start is not None and (prefix == "O" or starts_chunk):
      chunks.add((start, position - 1, previous_type))
      start = None
    if starts_chunk:
      start = position
    previous_type = kind if prefix != "O" else None
  return chunks


def conll_f1(predicted: Sequence[Sequence[str]], gold: Sequence[Sequence[str]]) -> dict[str, float]:
  """Entity-level precision, recall and F1 (percent) over sentences, as conlleval.

  Args:
    predicted: predicted tags per sentence.
    gold: gold tags per sentence (same lengths).

  Returns:
    precision, recall, f1 overall and f1_TYPE per entity type, in percent.
  """
  if len(predicted) != len(gold):
    raise ValueError(f"{len(predicted)} predicted sentences but {len(gold)} gold ones")
  correct = collections.Counter()
  predicted_counts = collections.Counter()
  gold_counts = collections.Counter()
  for predicted_tags, gold_tags in zip(predicted, gold):
    if len(predicted_tags) != len(gold_tags):
      raise ValueError(f"sentence lengths differ: {len(predicted_tags)} predicted vs {len(gold_tags)} gold")
    predicted_chunks, gold_chunks = iob1_chunks(predicted_tags), iob1_chunks(gold_tags)
    for chunks, counts in ((predicted_chunks, predicted_counts), (gold_chunks, gold_counts),
                           (predicted_chunks & gold_chunks, correct)):
      counts.update(kind for _, _, kind in chunks)

  def scores(num_correct: int, num_predicted: int, num_gold: int) -> tuple[float, float, float]:
    precision = 100.0 * num_correct / num_predicted if num_predicted else 0.0
    recall = 100.0 * num_correct / num_gold if num_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1

  precision, recall, f1 = scores(sum(correct.values()), sum(predicted_counts.values()),
                                 sum(gold_counts.values()))
  results = {"precision": precision, "recall": recall, "f1": f1}
  for kind in sorted(set(predicted_counts) | set(gold_counts)):
    results[f"f1_{kind}"] = scores(correct[kind], predicted_counts[kind], gold_counts[kind])[2]
  return results


def _word_first_pieces(words: Sequence[str], ids: Sequence[int],
                       offsets: Sequence[tuple[int, int]]) -> np.ndarray:
  """For each piece of " ".join(words), the word it starts, or -1 if not a first piece."""
  word_starts = np.cumsum([0] + [len(w) + 1 for w in words[:-1]])
  word_ends = word_starts + np.array([len(w) for w in words])
  first_word = np.full((len(ids),), -1, np.int32)
  seen = set()
  for piece, (start, end) in enumerate(offsets):
    if start == end:
      continue
    # A piece's last character is always inside its word, even when its span
    # begins with the separating space (byte-level BPE).
    word = int(np.searchsorted(word_starts, end - 1, side="right")) - 1
    if word >= 0 and end - 1 < word_ends[word] and word not in seen:
      seen.add(word)
      first_word[piece] = word
  return first_word


def _centre_chunks(first_word: np.ndarray, budget: int) -> list[tuple[int, int]]:
  """Splits a sentence's pieces into [start, end) runs of at most `budget`, at word starts.

  A single word longer than `budget` is cut (its later pieces carry no label).
  An empty sentence still gets one (empty) run so that it has a row.
  """
  chunks, start, num_pieces = [], 0, len(first_word)
  while True:
    end = min(start + budget, num_pieces)
    if end < num_pieces:
      word_starts = np.flatnonzero(first_word[start + 1:end + 1] >= 0)
      if word_starts.size:
        end = start + 1 + int(word_starts[-1])
    chunks.append((start, end))
    if end >= num_pieces:
      return chunks
    start = end


def _context(stream: Sequence[int], centre_start: int, centre_end: int,
             budget: int) -> tuple[list[int], list[int]]:
  """Pieces of `stream` just before and just after [centre_start, centre_end), `budget` in all.

  The centre sits in the middle when both sides have enough pieces; a side
  that runs out (a document edge) leaves its share to the other.
  """
  num_after = min(len(stream) - centre_end, max(budget // 2, budget - centre_start))
  num_before = min(centre_start, budget - num_after)
  return list(stream[centre_start - num_before:centre_start]), list(stream[centre_end:centre_end + num_after])


class Conll2003Task(Task):
  """CoNLL-2003 English NER (column "ner") or noun-phrase chunking (column "chunk") as token tagging."""

  name = "conll2003"
  kind = "tagging"
  labels = TAGS
  metric_names = ("f1", "precision", "recall")
  selection_metric = "f1"

  def __init__(self, document_context: bool = False, column: str = "ner"):
    """Configures featurisation.

    Args:
      document_context: fill each row with the surrounding sentences of the
        same document (labels only on the centre sentence), as for BERT's
        reported CoNLL result; otherwise one sentence per row.
      column: "ner" tags named entities (task "conll2003"); "chunk" tags noun
        phrases (task "conll2003_chunk", labels `NP_CHUNK_TAGS`).
    """
    if column not in COLUMNS:
      raise ValueError(f"conll2003: column must be one of {sorted(COLUMNS)}, got {column!r}")
    self.document_context = document_context
    self.column = column
    if column == "chunk":
      self.name, self.labels = "conll2003_chunk", NP_CHUNK_TAGS

  def load(self, data_dir: str | pathlib.Path, split: str) -> list[TaggedSentence]:
    """Reads eng.train / eng.testa / eng.testb for split train / dev / test."""
    if split not in SPLIT_FILES:
      raise ValueError(f"{self.name} has no split {split!r}; valid: {list(SPLIT_FILES)}")
    return read_conll(pathlib.Path(data_dir) / SPLIT_FILES[split], column=self.column)

  def read_file(self, path: str | pathlib.Path) -> list[TaggedSentence]:
    """Untagged sentences from a CoNLL file (only its word column is read) or JSON lines (`.jsonl`,
    `read_tokens_jsonl`)."""
    return read_tokens_jsonl(path) if pathlib.Path(path).suffix == ".jsonl" else read_conll(path, words_only=True)

  def featurize(self, examples: Sequence[TaggedSentence], tokenizer: TaskTokenizer,
                max_len: int) -> dict[str, np.ndarray]:
    """Rows of [CLS] (left context) centre (right context) [SEP]; see `bert_jax.tasks.base`.

    Words are joined with single spaces and tokenized as one text, so the
    tokenizer sees real text. The centre is a whole sentence, or, when it has
    more than max_len - 2 pieces, consecutive runs of whole words of it on
    several rows (`example_index` repeats), so no word goes unpredicted.
    With `document_context`, the rest of the row is filled with the pieces
    around the centre in the same document (consecutive examples with the
    same `document_index`), split evenly between both sides where possible.
    """
    if not examples:
      raise ValueError(f"{self.name}: no examples to featurize")
    ids, offsets = tokenizer.tokenize_with_offsets([" ".join(s.words) for s in examples])
    tag_ids = {tag: i for i, tag in enumerate(self.labels)}
    budget = max_len - 2
    # Each run of consecutive sentences of one document shares a piece stream.
    stream_of, stream_begin, streams = [], [], []
    for row, sentence in enumerate(examples):
      if row == 0 or sentence.document_index != examples[row - 1].document_index:
        streams.append([])
      stream_of.append(len(streams) - 1)
      stream_begin.append(len(streams[-1]))
      streams[-1].extend(ids[row])
    rows = collections.defaultdict(list)
    for example_index, sentence in enumerate(examples):
      first_word = _word_first_pieces(sentence.words, ids[example_index], offsets[example_index])
      stream, begin = streams[stream_of[example_index]], stream_begin[example_index]
      for start, end in _centre_chunks(first_word, budget):
        left, right = [], []
        if self.document_context:
          left, right = _context(stream, begin + start, begin + end, budget - (end - start))
        tokens = [tokenizer.cls_id, *left, *stream[begin + start:begin + end], *right, tokenizer.sep_id]
        input_ids = np.full((max_len,), tokenizer.pad_id, np.int32)
        input_ids[:len(tokens)] = tokens
        words = first_word[start:end]
        positions = 1 + len(left) + np.flatnonzero(words >= 0)
        word_ids = np.full((max_len,), -1, np.int32)
        word_ids[positions] = words[words >= 0]
        labels = np.full((max_len,), -1, np.int32)
        if sentence.tags:
          labels[positions] = [tag_ids[sentence.tags[w]] for w in words[words >= 0]]
        rows["input_ids"].append(input_ids)
        rows["segment_ids"].append(np.zeros((max_len,), np.int32))
        rows["lengths"].append(len(tokens))
        rows["example_index"].append(example_index)
        rows["labels"].append(labels)
        rows["word_ids"].append(word_ids)
    return {key: np.asarray(values, np.int32) for key, values in rows.items()}

  def predict(self, outputs: np.ndarray, features: dict[str, np.ndarray],
              examples: Sequence[TaggedSentence]) -> list[list[str]]:
    """Tags per word, read from each word's first piece; a word without pieces gets O."""
    max_len = features["input_ids"].shape[1]
    predicted_ids = np.argmax(check_outputs(outputs, features, (max_len, len(self.labels))), axis=-1)
    predictions = [["O"] * len(sentence.words) for sentence in examples]
    rows, positions = np.nonzero(features["word_ids"] >= 0)
    for row, position in zip(rows, positions):
      predictions[features["example_index"][row]][features["word_ids"][row, position]] = (
          self.labels[predicted_ids[row, position]])
    return predictions

  def evaluate(self, outputs: np.ndarray, features: dict[str, np.ndarray],
               examples: Sequence[TaggedSentence]) -> dict[str, float]:
    """conlleval chunk-level precision, recall, F1 (and F1 per type), in percent."""
    return conll_f1(self.predict(outputs, features, examples), [s.tags for s in examples])

  def submission_text(self, examples: Sequence[TaggedSentence], predictions: Sequence[Sequence[str]]) -> str:
    """CoNLL lines of `word tag`, a blank line after each sentence, -DOCSTART- before each document."""
    lines = []
    for index, (sentence, tags) in enumerate(zip(examples, predictions)):
      if index == 0 or sentence.document_index != examples[index - 1].document_index:
        lines += ["-DOCSTART- O", ""]
      lines += [f"{word} {tag}" for word, tag in zip(sentence.words, tags)] + [""]
    return "\n".join(lines)
