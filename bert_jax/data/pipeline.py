"""The pretraining input pipeline: prepared shards -> deterministic, host-sharded, resumable batches.

Built on Grain's dataset API (`grain.MapDataset` / `IterDataset`):

  range(blocks)                    one element per (epoch, block) in order
    -> map(block -> its rows)      plan a block's examples, shuffle, pack, build every row's arrays
    -> worker processes            `workers` processes build blocks i, i+N, ... (Grain's mp_prefetch) and
                                   hand them back in order, through shared memory (a block's fields in one
                                   array, one segment a block)
    -> cut into global batches     the same global batch on every process; each keeps only its rows
    -> map(place) + thread prefetch  batches ahead, optionally put on the devices by that thread

Each epoch shuffles the split's documents with (seed, epoch) and cuts them
into blocks of `block_documents` documents. A block's examples are planned
from sentence lengths alone, shuffled within the block and, with packing,
packed into rows. The stream of rows is therefore one global sequence that
does not depend on the number of processes or workers: global batch k is rows
[kG, (k+1)G), and process p of n takes rows [p*G/n, (p+1)*G/n) of it. Every
process builds whole blocks (its workers do), so the work of a host does not
shrink with the process count; in return the main process, which also runs
the training loop, only cuts rows out of finished blocks.

The iterator's state is the position of the next row in that stream (block,
row): any number of workers resumes from it.

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
import gc
import json
import math
import os
from typing import Any, Callable, Iterator

from absl import flags
import grain
import numpy as np
from grain import experimental as grain_experimental

from bert_jax.data import batch as batch_lib
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


class _BlockRows:
  """Block number (counted over all epochs) -> the block's rows: their plans (`plan`) or their arrays (call).

  Picklable: Grain's worker processes each get a copy (the corpus reopens its shards there).
  """

  def __init__(self, corpus: prepare.PreparedCorpus, blocks: _EpochBlocks, config: formats.FormatConfig,
               seed: int, shuffle: bool, duplicates: int | None = None):
    self.corpus = corpus
    self.blocks = blocks
    self.config = config
    self.specials = corpus.manifest["tokenizer"]["special_ids"]
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

  def _rows(self, global_block: int) -> tuple[list[list[formats.Example]], int, int]:
    """(the block's rows, the id of its first row, the epoch field of its rows)."""
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
    return formats.pack_examples(examples, self.config), int(sentences_before[block]), epoch

  def plan(self, global_block: int) -> list[_RowPlan]:
    rows, first_id, epoch = self._rows(global_block)
    return [_RowPlan(tuple(row), first_id + index, epoch) for index, row in enumerate(rows)]

  def __call__(self, global_block: int) -> dict[str, np.ndarray]:
    rows, first_id, epoch = self._rows(global_block)
    return formats.build_rows(self.corpus, rows, self.config, self.specials, first_id + np.arange(len(rows)),
                              np.full(len(rows), epoch))


@dataclasses.dataclass(frozen=True)
class _Stream:
  """What the global batches are cut from, and how this process takes its rows."""
  block_rows: _BlockRows
  num_blocks: int  # Over all epochs.
  global_batch_size: int
  local_rows: slice  # This process's rows of a global batch.
  drop_remainder: bool  # Else a short last batch is padded with empty rows.
  padding_id_base: int
  workers: int


class _GlobalBatches(grain.IterDataset):
  """The stream of block rows cut into global batches; yields this process's rows of each."""

  def __init__(self, stream: _Stream):
    super().__init__()
    self._stream = stream

  def __iter__(self) -> "_GlobalBatchIterator":
    return _GlobalBatchIterator(self._stream)


class _GlobalBatchIterator(grain.DatasetIterator):
  """State: {"block", "row"}, the position of the next row of the stream (independent of the worker count)."""

  def __init__(self, stream: _Stream):
    super().__init__()
    self._stream = stream
    self._block, self._row = 0, 0
    self._blocks = None  # Iterator over the blocks from `_block` on, started at the first `__next__`.
    self._current: dict[str, np.ndarray] | None = None  # The rows of `_block` once fetched.

  def _start_blocks(self):
    stream = self._stream
    blocks = grain.MapDataset.range(self._block, stream.num_blocks).map(stream.block_rows)
    if stream.workers > 0:
      blocks = blocks.map(_to_block_buffer)
    blocks = blocks.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    if stream.workers > 0:
      if not flags.FLAGS.is_parsed():  # Grain's worker processes read its absl flags; ours are left at their defaults.
        flags.FLAGS.mark_as_parsed()
      blocks = blocks.mp_prefetch(grain.MultiprocessingOptions(num_workers=stream.workers,
                                                               per_worker_buffer_size=2),
                                  worker_init_fn=_freeze_worker_heap)
    return iter(blocks)

  def _take(self, count: int) -> list[dict[str, np.ndarray]]:
    """Up to `count` next rows of the stream, as pieces of consecutive rows (fewer at its end)."""
    pieces = []
    while count > 0:
      if self._current is None:
        if self._block >= self._stream.num_blocks:
          break
        if self._blocks is None:
          self._blocks = self._start_blocks()
        self._current = next(self._blocks)
        if self._stream.workers > 0:
          self._current = _from_block_buffer(self._current, self._stream.block_rows.config)
      in_block = len(self._current["example_ids"])
      end = min(in_block, self._row + count)
      if end > self._row:
        pieces.append({k: v[self._row:end] for k, v in self._current.items()})
        count -= end - self._row
      self._row = end
      if self._row == in_block:
        self._block, self._row, self._current = self._block + 1, 0, None
    return pieces

  def __next__(self) -> dict[str, np.ndarray]:
    stream = self._stream
    pieces = self._take(stream.global_batch_size)
    real = sum(len(piece["example_ids"]) for piece in pieces)
    if real == 0 or (stream.drop_remainder and real < stream.global_batch_size):
      raise StopIteration
    own = _rows_between(pieces, stream.local_rows.start, min(stream.local_rows.stop, real))
    padding = range(max(stream.local_rows.start, real), stream.local_rows.stop)
    if padding:  # Past the end of a short last (eval) batch: empty rows, with the epoch of the last real row.
      block_rows = stream.block_rows
      own.append(formats.build_rows(block_rows.corpus, [()] * len(padding), block_rows.config,
                                    block_rows.specials, stream.padding_id_base + np.array(padding),
                                    np.full(len(padding), pieces[-1]["epoch"][-1])))
    if len(own) == 1:  # Rows of one block: views of it, copied only by whoever reads them (the device transfer).
      return own[0]
    return {k: np.concatenate([piece[k] for piece in own]) for k in own[0]}

  def get_state(self) -> dict[str, int]:
    return {"block": self._block, "row": self._row}

  def set_state(self, state: dict[str, int]) -> None:
    self._close_blocks()
    self._block, self._row, self._current = int(state["block"]), int(state["row"]), None

  def _close_blocks(self) -> None:
    if self._blocks is not None:
      self._blocks.close()
      self._blocks = None

  def close(self) -> None:
    self._close_blocks()
    self._current = None
    super().close()


def _to_block_buffer(rows: dict[str, np.ndarray]) -> np.ndarray:
  """A block's fields laid end to end in one int32 array, which a worker hands over in one shared-memory segment
  (one a field costs the main process a segment to open, register, close and unlink per field)."""
  return np.concatenate([np.ascontiguousarray(rows[key], batch_lib.DTYPES[key]).view(np.int32).ravel()
                         for key in batch_lib.FIELDS])


def _from_block_buffer(buffer: np.ndarray, config: formats.FormatConfig) -> dict[str, np.ndarray]:
  """`_to_block_buffer`'s fields again, as views of `buffer`, each field's rows contiguous.

  The views are plain ndarrays (they keep the shared-memory array alive): slicing Grain's shared-memory array
  subclass runs Python code for every view."""
  widths = batch_lib.field_widths(config.seq_len, config.packs_per_row)
  flat = buffer.view(np.ndarray)
  rows = flat.size // sum(widths.values())
  fields, offset = {}, 0
  for key in batch_lib.FIELDS:
    part = flat[offset:offset + rows * widths[key]].view(batch_lib.DTYPES[key])
    fields[key] = part if key in batch_lib.ROW_FIELDS else part.reshape(rows, widths[key])
    offset += rows * widths[key]
  return fields


def _freeze_worker_heap(worker_index: int, worker_count: int) -> None:
  """Moves a worker's start-up objects (its imports) out of reach of Python's full collections, which otherwise
  walk them over and over while a block's many small objects are made (a sixth of a worker's time)."""
  del worker_index, worker_count
  gc.freeze()


def _rows_between(pieces: list[dict[str, np.ndarray]], start: int, stop: int) -> list[dict[str, np.ndarray]]:
  """Rows [start, stop) of the pieces laid end to end, as pieces."""
  out, offset = [], 0
  for piece in pieces:
    rows = len(piece["example_ids"])
    low, high = max(start - offset, 0), min(stop - offset, rows)
    if low < high:
      out.append(piece if (low, high) == (0, rows) else {k: v[low:high] for k, v in piece.items()})
    offset += rows
  return out


class PretrainingIterator:
  """Yields process-local batches (see `bert_jax.data.batch`; or what `place` makes of them); `get_state`/`set_state`
  resume exactly.

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

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return self

  def __next__(self) -> dict[str, Any]:
    return next(self._iterator)

  def start(self) -> None:
    """Starts building batches in the background now, not at the first `next` (with `prefetch` > 0)."""
    if isinstance(self._iterator, grain_experimental.ThreadPrefetchDatasetIterator):
      self._iterator.start_prefetch()

  def close(self) -> None:
    """Stops the prefetch thread and the worker processes."""
    self._iterator.close()

  def __enter__(self) -> "PretrainingIterator":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def get_state(self) -> dict:
    """A JSON-serialisable dict: the position in the stream plus what the stream is."""
    return {"position": json.loads(json.dumps(self._iterator.get_state())), "pipeline": self._identity}

  def set_state(self, state: dict) -> None:
    """Continues from `state` (from `get_state` of an iterator over the same data and settings)."""
    if state["pipeline"] != self._identity:
      raise ValueError(f"iterator state is for another pipeline:\n saved   {state['pipeline']}\n current "
                       f"{self._identity}")
    if "position" in state:
      position = state["position"]
    else:  # Saved before the workers: Grain's flat-map state names the block being read and the rows taken of it.
      position = {"block": state["grain"]["parent"]["next_index"], "row": state["grain"]["next_index_in_buffer"]}
    self._iterator.set_state(position)


def default_workers() -> int:
  """Batch-building processes for this host: half the cores this process may run on, at most 8; none below 4."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
  return min(cores // 2, 8) if cores >= 4 else 0


def pretraining_iterator(prepared_dir: str | os.PathLike, *, split: str = "train", example_format: str,
                         seq_len: int, batch_size: int, seed: int, short_seq_prob: float = 0.1,
                         random_next_prob: float = 0.5, packing: bool = False, max_packs: int = 8,
                         process_index: int = 0, process_count: int = 1, num_epochs: int | None = None,
                         prefetch: int = 2, block_documents: int = 512, duplicates: int | None = None,
                         workers: int | None = 0,
                         place: Callable[[dict[str, np.ndarray]], Any] | None = None) -> PretrainingIterator:
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
    workers: processes that build blocks (0: build them in the thread that
      reads the iterator; None: `default_workers()`). The batches do not
      depend on it.
    place: applied to each batch in the prefetch thread (such as the
      transfer to the devices); what it returns is yielded.

  Returns:
    A `PretrainingIterator` of dicts of numpy arrays (or what `place` makes of them) with `batch_size` rows.
  """
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
  if duplicates is not None and (isinstance(duplicates, bool) or not isinstance(duplicates, int) or duplicates < 1):
    raise ValueError(f"duplicates must be None or an int >= 1 (masking.dupe_factor), got {duplicates!r}")
  if workers is None:
    workers = default_workers()
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
    raise ValueError(f"workers must be None (as many as the host's cores suit) or an int >= 0 (data.workers), got "
                     f"{workers!r}")
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
  stream = _Stream(
      block_rows=_BlockRows(corpus, blocks, config, seed, train, duplicates),
      num_blocks=blocks.blocks_per_epoch * num_epochs, global_batch_size=global_batch_size,
      local_rows=slice(process_index * global_batch_size // process_count,
                       (process_index + 1) * global_batch_size // process_count),
      drop_remainder=train, padding_id_base=int(blocks.sentence_counts.sum()), workers=workers)
  dataset = _GlobalBatches(stream)
  if place is not None:
    dataset = dataset.map(place)
  if prefetch > 0:
    dataset = grain_experimental.ThreadPrefetchIterDataset(dataset, prefetch_buffer_size=prefetch)
  identity = {"prepared": corpus.manifest["tokenizer"]["fingerprint"], "totals": corpus.manifest["totals"],
              "split": split, "config": dataclasses.asdict(config), "seed": seed,
              "global_batch_size": global_batch_size, "block_documents": block_documents, "num_epochs": num_epochs}
  if duplicates is not None:  # Only when set, so the state of a run saved before the field existed still loads.
    identity["duplicates"] = duplicates
  if prepare.SPANS in corpus.manifest:  # Span marks change the rows' word_starts field.
    identity["spans"] = corpus.manifest[prepare.SPANS]["fingerprint"]
  return PretrainingIterator(corpus, config, iter(dataset), global_batch_size, identity)
