"""The pretraining input pipeline: prepared shards -> deterministic, host-sharded, resumable batches.

Built on Grain's dataset API (`grain.MapDataset` / `IterDataset`), whose
iterators checkpoint their position as a small dict:

  range(blocks)                    one element per (epoch, block) in order
    -> flat_map(block -> rows)     plan a block's examples, shuffle, pack
    -> batch(global batch)         the same global batch on every process
    -> map(materialise own rows)   each process copies only its rows' tokens
    -> thread prefetch

Each epoch shuffles the split's documents with (seed, epoch) and cuts them
into blocks of `block_documents` documents. A block's examples are planned
from sentence lengths alone (cheap, so every process plans every block),
shuffled within the block and, with packing, packed into rows. The stream of
rows is therefore one global sequence that does not depend on the number of
processes: global batch k is rows [kG, (k+1)G), and process p of n takes rows
[p*G/n, (p+1)*G/n) of it, reading tokens only for those.

`example_ids`: a row's id is the number of sentences in the epoch's shuffled
document order before its block, plus its index within the block. A block
never has more rows than sentences, so ids are unique within an epoch and the
same on every process. The eval pass pads its last global batch with empty
rows (all padding, zero weights) whose ids lie past the split's sentences.

Static examples (`duplicates=D`, BERT's static masking with its dupe factor):
the examples are built D ways once and then kept. Epoch e trains on copy
d = e mod D: the document order, the examples and their ids are those of
copy d, and a row's `epoch` field is d, so the masking key
(seed, example id, epoch) gives every copy its own mask and that mask every
time the copy comes back. Only the order in which the blocks are visited is
drawn anew each epoch. Without `duplicates` every epoch builds new examples
and the `epoch` field counts epochs (dynamic masking).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterator

import grain
import numpy as np
from grain import experimental as grain_experimental

from bert_jax.data import formats
from bert_jax.data import prepare

_FOREVER_EPOCHS = 1 << 30  # a repeating training stream; Grain's range is lazy


@dataclasses.dataclass(frozen=True)
class _RowPlan:
  """One row of the global stream: its examples and identity."""
  examples: tuple[formats.Example, ...]
  example_id: int
  epoch: int  # The copy of the examples under `duplicates`, else the epoch; the masking key's last part.


class _EpochBlocks:
  """Per-epoch document order and blocks of a split (the last epoch's order is cached)."""

  def __init__(self, corpus: prepare.PreparedCorpus, documents: np.ndarray, block_documents: int, seed: int,
               shuffle: bool):
    self.documents = documents
    self.block_documents = block_documents
    self.seed = seed
    self.shuffle = shuffle
    self.sentence_counts = np.diff(corpus.document_starts)[documents]
    self.blocks_per_epoch = math.ceil(len(documents) / block_documents)
    self._cached_epoch, self._cached = None, None

  def order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents int64 [D] in this epoch's order, sentences before each block int64 [blocks])."""
    if epoch != self._cached_epoch:
      if self.shuffle:
        permutation = np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.documents))
      else:
        permutation = np.arange(len(self.documents))
      sentences_before = np.concatenate([[0], np.cumsum(self.sentence_counts[permutation])])
      self._cached_epoch = epoch
      self._cached = self.documents[permutation], sentences_before[::self.block_documents][:self.blocks_per_epoch]
    return self._cached


class _BlockToRows(grain_experimental.FlatMapTransform):
  """Flat-map: block number (counted over all epochs) -> the block's row plans."""

  # Required by Grain's interface but only enforced by MapDataset flat-maps;
  # a block has at most as many rows as sentences.
  max_fan_out = 1 << 31

  def __init__(self, corpus: prepare.PreparedCorpus, blocks: _EpochBlocks, config: formats.FormatConfig,
               seed: int, shuffle: bool, duplicates: int | None = None):
    self.corpus = corpus
    self.blocks = blocks
    self.config = config
    self.seed = seed
    self.shuffle = shuffle
    self.duplicates = duplicates
    self._visits: tuple[int, np.ndarray] | None = None

  def _block(self, epoch: int, position: int) -> int:
    """The block visited at `position` of `epoch`: in order, or, for static copies, in an order drawn per epoch."""
    if self.duplicates is None or not self.shuffle:
      return position
    if self._visits is None or self._visits[0] != epoch:
      self._visits = epoch, np.random.default_rng([self.seed, epoch, 2]).permutation(self.blocks.blocks_per_epoch)
    return int(self._visits[1][position])

  def flat_map(self, global_block: int) -> list[_RowPlan]:
    epoch, position = divmod(int(global_block), self.blocks.blocks_per_epoch)
    block = self._block(epoch, position)
    if self.duplicates is not None:
      epoch %= self.duplicates  # The copy this epoch trains on names the examples.
    documents, sentences_before = self.blocks.order(epoch)
    size = self.blocks.block_documents
    rng = np.random.default_rng([self.seed, epoch, block, 1])
    examples = formats.plan_examples(self.corpus, documents[block * size:(block + 1) * size],
                                     self.blocks.documents, self.config, rng)
    if self.shuffle:
      examples = [examples[i] for i in rng.permutation(len(examples))]
    rows = formats.pack_examples(examples, self.config)
    first_id = int(sentences_before[block])
    return [_RowPlan(tuple(row), first_id + index, epoch) for index, row in enumerate(rows)]


class _MaterialiseOwnRows:
  """Map: a global batch of row plans -> this process's numpy batch (padding a short last batch)."""

  def __init__(self, corpus: prepare.PreparedCorpus, config: formats.FormatConfig, specials: dict[str, int],
               global_batch_size: int, process_index: int, process_count: int, padding_id_base: int):
    self.corpus = corpus
    self.config = config
    self.specials = specials
    self.global_batch_size = global_batch_size
    self.local_rows = slice(process_index * global_batch_size // process_count,
                            (process_index + 1) * global_batch_size // process_count)
    self.padding_id_base = padding_id_base

  def __call__(self, plans: list[_RowPlan]) -> dict[str, np.ndarray]:
    positions = range(self.global_batch_size)[self.local_rows]
    # Positions past the end of a short last (eval) batch become empty padding rows.
    rows = [plans[p].examples if p < len(plans) else () for p in positions]
    ids = [plans[p].example_id if p < len(plans) else self.padding_id_base + p for p in positions]
    epochs = [plans[min(p, len(plans) - 1)].epoch for p in positions]
    return formats.build_rows(self.corpus, rows, self.config, self.specials, np.array(ids), np.array(epochs))


class PretrainingIterator:
  """Yields process-local batches (see `bert_jax.data.batch`); `get_state`/`set_state` resume exactly.

  Attributes:
    corpus: the opened prepared corpus.
    config: the example format settings.
    specials: special-token ids of the corpus' tokenizer.
    global_batch_size: rows per step over all processes.
  """

  def __init__(self, corpus: prepare.PreparedCorpus, config: formats.FormatConfig, iterator: grain.DatasetIterator,
               global_batch_size: int, identity: dict[str, Any]):
    self.corpus = corpus
    self.config = config
    self.specials = corpus.manifest["tokenizer"]["special_ids"]
    self.global_batch_size = global_batch_size
    self._iterator = iterator
    self._identity = identity

  def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iterator)

  def close(self) -> None:
    """Stops the prefetch thread."""
    self._iterator.close()

  def __enter__(self) -> "PretrainingIterator":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def get_state(self) -> dict:
    """A JSON-serialisable dict: the position in the stream plus what the stream is."""
    return {"grain": json.loads(json.dumps(self._iterator.get_state())), "pipeline": self._identity}

  def set_state(self, state: dict) -> None:
    """Continues from `state` (from `get_state` of an iterator over the same data and settings)."""
    if state["pipeline"] != self._identity:
      raise ValueError(f"iterator state is for another pipeline:\n saved   {state['pipeline']}\n current "
                       f"{self._identity}")
    self._iterator.set_state(state["grain"])


def pretraining_iterator(prepared_dir: str | os.PathLike, *, split: str = "train", example_format: str,
                         seq_len: int, batch_size: int, seed: int, short_seq_prob: float = 0.1,
                         random_next_prob: float = 0.5, packing: bool = False, max_packs: int = 8,
                         process_index: int = 0, process_count: int = 1, num_epochs: int | None = None,
                         prefetch: int = 2, block_documents: int = 512,
                         duplicates: int | None = None) -> PretrainingIterator:
  """The pretraining input pipeline over a prepared directory.

  Args:
    prepared_dir: output of `bert-jax prepare`.
    split: 'train' (shuffled, repeats for `num_epochs`, reshuffled each
      epoch, drops a last partial batch) or 'eval' (in order, one pass unless
      `num_epochs` says otherwise, last batch padded with empty rows).
    example_format: one of `formats.EXAMPLE_FORMATS`.
    seq_len: row length L.
    batch_size: rows per batch on this process (global batch / process count).
    seed: drives document order, example planning and shuffling.
    short_seq_prob, random_next_prob, packing, max_packs: see `formats.FormatConfig`.
    process_index, process_count: this process and how many read the data
      (`jax.process_index()`, `jax.process_count()`).
    num_epochs: passes over the split; None repeats forever for 'train'.
    prefetch: batches prepared ahead in a background thread (0: none).
    block_documents: documents planned and shuffled together; larger mixes
      examples better, costs more memory and latency per block.
    duplicates: None (new examples every epoch: dynamic masking) or D >= 1
      (static examples: D copies built once, epoch e trains on copy e mod D;
      BERT's static masking with dupe factor D).

  Returns:
    A `PretrainingIterator` of dicts of numpy arrays with `batch_size` rows.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
  if duplicates is not None and (isinstance(duplicates, bool) or not isinstance(duplicates, int) or duplicates < 1):
    raise ValueError(f"duplicates must be None or an int >= 1 (masking.dupe_factor), got {duplicates!r}")
  config = formats.FormatConfig(example_format, seq_len, short_seq_prob, random_next_prob, packing, max_packs)
  corpus = prepare.open_prepared(prepared_dir)
  documents = corpus.split_documents(split)
  if len(documents) == 0:
    raise ValueError(f"split {split!r} of {prepared_dir} has no documents")
  train = split == "train"
  if num_epochs is None:
    num_epochs = _FOREVER_EPOCHS if train else 1
  global_batch_size = batch_size * process_count
  blocks = _EpochBlocks(corpus, documents, block_documents, seed, shuffle=train)
  specials = corpus.manifest["tokenizer"]["special_ids"]
  split_sentences = int(blocks.sentence_counts.sum())

  dataset = grain.MapDataset.range(blocks.blocks_per_epoch * num_epochs).to_iter_dataset(
      grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
  dataset = grain_experimental.FlatMapIterDataset(dataset, _BlockToRows(corpus, blocks, config, seed, train, duplicates))
  dataset = dataset.batch(global_batch_size, drop_remainder=train, batch_fn=list)
  dataset = dataset.map(_MaterialiseOwnRows(corpus, config, specials, global_batch_size, process_index,
                                            process_count, padding_id_base=split_sentences))
  if prefetch > 0:
    dataset = grain_experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
  identity = {"prepared": corpus.manifest["tokenizer"]["fingerprint"], "totals": corpus.manifest["totals"],
              "split": split, "config": dataclasses.asdict(config), "seed": seed,
              "global_batch_size": global_batch_size, "block_documents": block_documents, "num_epochs": num_epochs}
  if duplicates is not None:  # Only when set, so the state of a run saved before the field existed still loads.
    identity["duplicates"] = duplicates
  return PretrainingIterator(corpus, config, iter(dataset), global_batch_size, identity)
