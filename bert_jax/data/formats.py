"""Example builders: prepared documents -> pretraining rows in the batch contract.

Building happens in two steps so that it is cheap and exactly reproducible:

1. `plan_examples` decides, from sentence lengths alone, which token ranges
   form each example (`Example`). It never touches token ids; each choice is
   drawn from a numpy Generator the caller seeds from (seed, epoch, block).
2. `build_rows` copies those ranges out of the memory-mapped shards with numpy
   slicing and adds [CLS]/[SEP], segment ids, positions and pack ids.

Formats (`EXAMPLE_FORMATS`), with L the sequence length:

  segment_pair    BERT's NSP examples, as `create_pretraining_data.py` builds
                  them: per document a target length (L-3, or with probability
                  `short_seq_prob` a uniform draw from [2, L-3]); sentences are
                  gathered until the target is reached, split at a random
                  sentence into A and B; with probability `random_next_prob`
                  (always, when the chunk is one sentence) B is replaced by
                  sentences from a random other document, and the unused
                  sentences are put back. The pair is cut to L-3 tokens by
                  trimming the longer segment, from a random end each time.
                  label 0 = B follows A, 1 = B is random.
  sentence_pair   RoBERTa's SENTENCE-PAIR: one natural sentence a segment. A is
                  each sentence in turn; B is the sentence after it (label 0,
                  both consumed) or, with probability `random_next_prob` and
                  always for a document's last sentence, a sentence of a random
                  other document (label 1, only A consumed). Cut to L-3 tokens
                  as segment_pair. Rows are short: RoBERTa raised the batch size
                  to keep the tokens a batch about the same.
  sop             ALBERT's sentence-order examples: the same chunks, B always
                  the true continuation, A and B swapped with probability 1/2
                  (label 1 = swapped). A one-sentence chunk is split inside the
                  sentence at a random token, so both segments stay real,
                  consecutive text (ALBERT instead drew a random B there).
  sso             StructBERT's sentence structural examples: the same chunks,
                  split into a first part X and a second part Y; with
                  probability 1/3 each the pair is (X, Y), label 0 = B is the
                  next segment of A; (Y, X), label 1 = B is the previous
                  segment of A; or (X, a random other document's sentences),
                  label 2 = B is random, its unused sentences put back as NSP
                  does. A one-sentence chunk is split inside the sentence for
                  labels 0 and 1, as sop does, so the labels stay 1/3 each.
  full_sentences  RoBERTa: contiguous full sentences filling L-2 tokens, crossing
                  document boundaries with an extra [SEP] between documents.
  doc_sentences   RoBERTa: like full_sentences but an example never crosses a
                  document: the last one of a document may be short.
  single          one segment per row with BERT's target lengths (including
                  `short_seq_prob`), never crossing documents (No-NSP, LTR and
                  ELECTRA-style training).

A sentence longer than the room left for it is cut at its end (prepare.py
already splits sentences longer than `max_sentence_tokens`).

Packing (`pack_examples`) puts consecutive examples into one row while they
fit, up to `max_packs` per row; each keeps its own [CLS]...[SEP], positions
restart at 0, `pack_ids` are 1..P and the per-pack fields (`cls_positions`,
`sentence_labels`, `sentence_weights`) describe each packed example, so NSP
and SOP work with packing too.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from bert_jax.data import prepare

EXAMPLE_FORMATS = ("segment_pair", "sentence_pair", "sop", "sso", "full_sentences", "doc_sentences", "single")
PAIR_FORMATS = ("segment_pair", "sentence_pair", "sop", "sso")
# The labels of each sentence-pair format's examples (the sentence head's classes).
SENTENCE_CLASSES = {"segment_pair": 2, "sentence_pair": 2, "sop": 2, "sso": 3}
SSO_NEXT, SSO_PREVIOUS, SSO_RANDOM = 0, 1, 2
_RANDOM_DOCUMENT_TRIES = 10


class Example(NamedTuple):
  """One example as global token ranges; ranges inside a segment are joined by [SEP].

  Attributes:
    segment_a: ((start, end), ...) of segment A.
    segment_b: ranges of segment B; empty for single-segment formats.
    label: NSP/SOP/SSO label (0 for formats without one).
  """
  segment_a: tuple[tuple[int, int], ...]
  segment_b: tuple[tuple[int, int], ...]
  label: int

  @property
  def length(self) -> int:
    """Tokens in the row, specials included: [CLS] A [SEP] (B [SEP])."""
    tokens = sum(end - start for start, end in self.segment_a + self.segment_b)
    separators = len(self.segment_a) + (len(self.segment_b) if self.segment_b else 0)
    return 1 + tokens + separators


@dataclasses.dataclass(frozen=True)
class FormatConfig:
  """How examples are built.

  Attributes:
    example_format: one of EXAMPLE_FORMATS.
    seq_len: row length L, specials included.
    short_seq_prob: probability of a short target length (segment_pair, sop, sso, single).
    random_next_prob: probability that B is random (segment_pair, sentence_pair).
    packing: pack several examples per row.
    max_packs: most examples in one packed row (P); 1 when packing is off.
  """
  example_format: str
  seq_len: int
  short_seq_prob: float = 0.1
  random_next_prob: float = 0.5
  packing: bool = False
  max_packs: int = 8

  def __post_init__(self):
    if self.example_format not in EXAMPLE_FORMATS:
      raise ValueError(f"unknown example_format {self.example_format!r}; choose one of {EXAMPLE_FORMATS}")
    minimum = 5 if self.example_format in PAIR_FORMATS else 3
    if self.seq_len < minimum:
      raise ValueError(f"seq_len {self.seq_len} is too short for {self.example_format} (at least {minimum})")
    if self.packing and self.max_packs < 1:
      raise ValueError(f"max_packs must be at least 1, got {self.max_packs}")

  @property
  def packs_per_row(self) -> int:
    return self.max_packs if self.packing else 1


class _Planner:
  """Sentence-level planning over one corpus; all positions are global indices."""

  def __init__(self, corpus: prepare.PreparedCorpus, split_documents: np.ndarray, config: FormatConfig,
               rng: np.random.Generator):
    self.sentence_starts = corpus.sentence_starts
    self.document_starts = corpus.document_starts
    self.split_documents = split_documents
    self.config = config
    self.rng = rng

  def sentences_until(self, first: int, stop: int, min_tokens: int) -> int:
    """Smallest end in (first, stop] with tokens of sentences [first, end) >= min_tokens, else stop."""
    goal = self.sentence_starts[first] + min_tokens
    # The array's own method: the np.searchsorted wrapper costs several times the search on these short slices.
    end = first + 1 + int(self.sentence_starts[first + 1:stop + 1].searchsorted(goal, side="left"))
    return min(end, stop)

  def tokens(self, first_sentence: int, end_sentence: int) -> tuple[int, int]:
    return self.sentence_starts.item(first_sentence), self.sentence_starts.item(end_sentence)

  def bert_target(self, max_tokens: int) -> int:
    if self.rng.random() < self.config.short_seq_prob:
      return int(self.rng.integers(2, max_tokens + 1))
    return max_tokens

  def random_other_document(self, document: int) -> int:
    for _ in range(_RANDOM_DOCUMENT_TRIES):
      candidate = int(self.split_documents[self.rng.integers(len(self.split_documents))])
      if candidate != document:
        break
    return candidate

  def truncate_pair(self, a: tuple[int, int], b: tuple[int, int], max_tokens: int):
    """BERT's truncate_seq_pair in closed form: trim the longer segment (B on ties), from a random end.

    Trimming one token at a time from the longer segment first levels the two
    (the longer loses the difference), then alternates B, A, B, ...; the front/back
    choice of each removed token is a fair coin, so the number cut from the front
    of a segment is Binomial(removed, 1/2).
    """
    length_a, length_b = a[1] - a[0], b[1] - b[0]
    excess = length_a + length_b - max_tokens
    if excess <= 0:
      return a, b
    gap = abs(length_a - length_b)
    first_trim = min(gap, excess)
    rest = excess - first_trim
    cut_a = (first_trim if length_a > length_b else 0) + rest // 2
    cut_b = (first_trim if length_b > length_a else 0) + rest - rest // 2
    front_a = int(self.rng.binomial(cut_a, 0.5)) if cut_a else 0
    front_b = int(self.rng.binomial(cut_b, 0.5)) if cut_b else 0
    return (a[0] + front_a, a[1] - (cut_a - front_a)), (b[0] + front_b, b[1] - (cut_b - front_b))

  def segment_pairs(self, document: int, example_format: str) -> list[Example]:
    """BERT's chunks of `document` as segment pairs of `example_format` (segment_pair, sop or sso)."""
    max_tokens = self.config.seq_len - 3
    first, stop = int(self.document_starts[document]), int(self.document_starts[document + 1])
    target = self.bert_target(max_tokens)
    examples = []
    sentence = first
    while sentence < stop:
      chunk_end = self.sentences_until(sentence, stop, target)
      chunk_sentences = chunk_end - sentence
      a_end = sentence + (int(self.rng.integers(1, chunk_sentences)) if chunk_sentences >= 2 else 1)
      segment_a = self.tokens(sentence, a_end)
      if example_format == "sso":
        label = int(self.rng.integers(3))
        random_b = label == SSO_RANDOM
      else:  # NSP's B is random with random_next_prob (always for a one-sentence chunk); SOP's never
        random_b = example_format == "segment_pair" and (
            chunk_sentences == 1 or self.rng.random() < self.config.random_next_prob)
        label = int(random_b)
      if random_b:
        target_b = target - (segment_a[1] - segment_a[0])
        other = self.random_other_document(document)
        other_first, other_stop = int(self.document_starts[other]), int(self.document_starts[other + 1])
        b_first = other_first + int(self.rng.integers(other_stop - other_first))
        segment_b = self.tokens(b_first, self.sentences_until(b_first, other_stop, target_b))
        sentence = a_end  # the chunk's unused sentences are put back
      else:
        if example_format != "segment_pair" and chunk_sentences == 1:
          segment_a, segment_b = self.split_inside(segment_a)
        else:
          segment_b = self.tokens(a_end, chunk_end)
        if example_format == "sop" and self.rng.random() < 0.5:
          label = 1
        if label == 1:  # SOP's swapped pair, SSO's previous segment: B precedes A
          segment_a, segment_b = segment_b, segment_a
        sentence = chunk_end
      if segment_a[1] > segment_a[0] and segment_b[1] > segment_b[0]:
        segment_a, segment_b = self.truncate_pair(segment_a, segment_b, max_tokens)
        examples.append(Example((segment_a,), (segment_b,), label))
    return examples

  def sentence_pairs(self, document: int) -> list[Example]:
    """RoBERTa SENTENCE-PAIR: (a sentence, the next one or a random other document's sentence) pairs."""
    max_tokens = self.config.seq_len - 3
    first, stop = int(self.document_starts[document]), int(self.document_starts[document + 1])
    examples = []
    sentence = first
    while sentence < stop:
      segment_a = self.tokens(sentence, sentence + 1)
      if sentence + 1 < stop and self.rng.random() >= self.config.random_next_prob:
        segment_b, label = self.tokens(sentence + 1, sentence + 2), 0
        sentence += 2
      else:
        other = self.random_other_document(document)
        other_first, other_stop = int(self.document_starts[other]), int(self.document_starts[other + 1])
        b_sentence = other_first + int(self.rng.integers(other_stop - other_first))
        segment_b, label = self.tokens(b_sentence, b_sentence + 1), 1
        sentence += 1
      if segment_a[1] > segment_a[0] and segment_b[1] > segment_b[0]:
        segment_a, segment_b = self.truncate_pair(segment_a, segment_b, max_tokens)
        examples.append(Example((segment_a,), (segment_b,), label))
    return examples

  def split_inside(self, token_range: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Two consecutive non-empty parts of one range (an empty part when it has one token)."""
    start, end = token_range
    if end - start < 2:
      return token_range, (end, end)
    cut = start + int(self.rng.integers(1, end - start))
    return (start, cut), (cut, end)

  def single_segments(self, document: int, target: int) -> list[Example]:
    """Runs of whole sentences of one document, at most `target` tokens each (a lone longer sentence is cut)."""
    first, stop = int(self.document_starts[document]), int(self.document_starts[document + 1])
    examples = []
    sentence = first
    while sentence < stop:
      end = self.fill(sentence, stop, target)
      start_token, end_token = self.tokens(sentence, end)
      examples.append(Example(((start_token, min(end_token, start_token + target)),), (), 0))
      sentence = end
    return examples

  def fill(self, first: int, stop: int, budget: int) -> int:
    """End of the longest run of whole sentences from `first` within `budget` tokens (at least one sentence)."""
    limit = self.sentence_starts[first] + budget
    end = first + int(self.sentence_starts[first + 1:stop + 1].searchsorted(limit, side="right"))
    return max(end, first + 1)

  def full_sentences(self, documents: np.ndarray) -> list[Example]:
    """RoBERTa FULL-SENTENCES over documents in the given order, [SEP] between documents."""
    budget = self.config.seq_len - 2
    examples, ranges, used = [], [], 0
    for document in documents:
      sentence, stop = int(self.document_starts[document]), int(self.document_starts[document + 1])
      while sentence < stop:
        separator = 1 if ranges else 0  # a document after another costs an extra [SEP]
        room = budget - used - separator
        end = self.fill(sentence, stop, room)
        start_token, end_token = self.tokens(sentence, end)
        if end_token - start_token > room:  # not even one sentence fits
          if ranges:
            examples.append(Example(tuple(ranges), (), 0))
            ranges, used = [], 0
            continue
          end_token = start_token + room  # a lone over-long sentence is cut
        ranges.append((start_token, end_token))
        used += separator + end_token - start_token
        sentence = end
        if sentence < stop:  # the next sentence did not fit: the row is full
          examples.append(Example(tuple(ranges), (), 0))
          ranges, used = [], 0
    if ranges:
      examples.append(Example(tuple(ranges), (), 0))
    return examples


def plan_examples(corpus: prepare.PreparedCorpus, documents: np.ndarray, split_documents: np.ndarray,
                  config: FormatConfig, rng: np.random.Generator) -> list[Example]:
  """Plans the examples of `documents` (global ids, in the order to use) for `config.example_format`.

  Args:
    corpus: the prepared corpus.
    documents: int [N] documents to turn into examples, in order.
    split_documents: int [D] all documents of the split (random-B draws for NSP).
    config: format settings.
    rng: the only source of randomness.
  """
  planner = _Planner(corpus, split_documents, config, rng)
  example_format = config.example_format
  if example_format == "full_sentences":
    return planner.full_sentences(documents)
  examples = []
  for document in documents:
    document = int(document)
    if example_format == "sentence_pair":
      examples.extend(planner.sentence_pairs(document))
    elif example_format in PAIR_FORMATS:
      examples.extend(planner.segment_pairs(document, example_format))
    elif example_format == "doc_sentences":
      examples.extend(planner.single_segments(document, config.seq_len - 2))
    else:
      examples.extend(planner.single_segments(document, planner.bert_target(config.seq_len - 2)))
  return examples


def pack_examples(examples: Sequence[Example], config: FormatConfig) -> list[list[Example]]:
  """Groups consecutive examples into rows: one per row, or as many as fit (<= max_packs) when packing."""
  if not config.packing:
    return [[example] for example in examples]
  rows, row, used = [], [], 0
  for example in examples:
    length = example.length
    if row and (used + length > config.seq_len or len(row) == config.max_packs):
      rows.append(row)
      row, used = [], 0
    row.append(example)
    used += length
  if row:
    rows.append(row)
  return rows


def build_rows(corpus: prepare.PreparedCorpus, rows: Sequence[Sequence[Example]], config: FormatConfig,
               specials: dict[str, int], example_ids: np.ndarray, epochs: np.ndarray) -> dict[str, np.ndarray]:
  """Materialises planned rows into a batch following `bert_jax.data.batch`.

  A row is [CLS] A [SEP] (B [SEP]) per example, the ranges of a segment joined by [SEP]. One Python pass lists
  the batch's pieces (a corpus range or one special token); numpy then writes every field of the batch at once
  and reads the corpus ranges with one concatenate (numpy calls row by row took most of the host's batching time;
  docs/performance.md).

  Args:
    corpus: the prepared corpus the ranges point into.
    rows: B rows, each a list of at most `config.packs_per_row` examples; an
      empty row is padding (all pad tokens, zero weights).
    config: format settings (seq_len, packs per row, whether B gets segment 1).
    specials: special-token ids, as `Tokenizer.special_ids`.
    example_ids: int [B] row ids.
    epochs: int [B] epoch of each row.

  Returns:
    The batch dict: sequence fields [B, L], pack fields [B, P], row fields [B].
  """
  num_rows, length, packs = len(rows), config.seq_len, config.packs_per_row
  batch = {
      "input_ids": np.full((num_rows, length), specials["pad"], np.int32),
      "segment_ids": np.zeros((num_rows, length), np.int32),
      "position_ids": np.zeros((num_rows, length), np.int32),
      "pack_ids": np.zeros((num_rows, length), np.int32),
      "word_starts": np.zeros((num_rows, length), np.int32),
      "special_mask": np.ones((num_rows, length), np.int32),
      "cls_positions": np.zeros((num_rows, packs), np.int32),
      "sentence_labels": np.zeros((num_rows, packs), np.int32),
      "sentence_weights": np.zeros((num_rows, packs), np.float32),
      "example_ids": np.asarray(example_ids, np.int32),
      "epoch": np.asarray(epochs, np.int32),
  }
  cls, sep = specials["cls"], specials["sep"]
  # Per piece (a corpus range or one special token), in row-major order: its length, segment, pack (1-based),
  # position in its example, and the corpus start of a range or -1 - the id of a special token.
  pieces, used_per_row, pack_rows, pack_indices, pack_starts, labels = [], [], [], [], [], []
  for row_index, row in enumerate(rows):
    used = 0
    for pack_index, example in enumerate(row):
      pack = pack_index + 1
      pieces.append((1, 0, pack, 0, -1 - cls))
      position = 1
      for segment, ranges in ((0, example.segment_a), (1, example.segment_b)):
        for start, end in ranges:
          pieces.append((end - start, segment, pack, position, start))
          pieces.append((1, segment, pack, position + end - start, -1 - sep))
          position += end - start + 1
      pack_rows.append(row_index), pack_indices.append(pack_index), pack_starts.append(used)
      labels.append(example.label)
      used += position
    if used > length:
      raise ValueError(f"row {row_index} has {used} tokens, more than seq_len {length}; a plan is wrong")
    used_per_row.append(used)
  batch["cls_positions"][pack_rows, pack_indices] = pack_starts
  batch["sentence_labels"][pack_rows, pack_indices] = labels
  batch["sentence_weights"][pack_rows, pack_indices] = 1.0
  if not pieces:
    return batch
  sizes, segments, packs, positions, sources = np.array(pieces, np.int64).T
  # The pieces fill each row from column 0 in order, so the tokens in piece order are the rows' used prefixes in
  # row-major order: boolean-mask writes.
  filled = np.arange(length) < np.array(used_per_row)[:, None]
  offsets = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
  ranges = sources >= 0
  special = np.repeat(~ranges, sizes)
  input_ids, word_starts = np.empty(len(special), np.int32), np.ones(len(special), np.int32)
  input_ids[special] = -1 - sources[~ranges]
  input_ids[~special], word_starts[~special] = corpus.gather(sources[ranges].tolist(), sizes[ranges].tolist())
  batch["input_ids"][filled] = input_ids
  batch["word_starts"][filled] = word_starts
  batch["special_mask"][filled] = special
  batch["segment_ids"][filled] = np.repeat(segments, sizes)
  batch["pack_ids"][filled] = np.repeat(packs, sizes)
  batch["position_ids"][filled] = np.repeat(positions, sizes) + offsets
  return batch
