"""Corpus preparation, done once: text -> tokenised, sharded documents with a manifest.

`bert-jax prepare --input FILE... --tokenizer PATH --out DIR` reads the inputs
(see `bert_jax.data.text`), tokenises documents in parallel on all cores and
writes shards that the example builders memory-map:

  DIR/shard-00000.tokens.npy            int32 [T]    token ids, no special tokens
  DIR/shard-00000.word_starts.npy       uint8 [T]    1 where a token starts a word
  DIR/shard-00000.sentence_offsets.npy  int64 [S+1]  token offset of each sentence
  DIR/shard-00000.document_offsets.npy  int64 [D+1]  sentence offset of each document
  DIR/shard-00000.spans.npy             uint8 [T]    linguistic span marks (only after `bert-jax mark-spans`)
  DIR/eval_documents.npy                int64 [E]    global ids of held-out documents
  DIR/tokenizer/                        the tokenizer, saved
  DIR/manifest.json                     counts, fingerprints, options, report

A sentence or a document never straddles two shards. Documents are numbered
globally in input order; the held-out eval split is a seeded random choice of
them and the train split is the rest.

The span marks of a token are two bits per kind of `batch.SPAN_KINDS`
(named_entity, noun_phrase; `batch.span_marks`): bit 2k, the token starts
a span of kind k; bit 2k+1, it is inside one. `write_spans` adds them to a prepared corpus (the
manifest's "spans" entry says which kinds and from which taggers); the
example builders read them shifted above the word-start bit of the batch's
`word_starts` field (`PreparedCorpus.gather`).

Running again with the same inputs, tokenizer and options does nothing;
a different tokenizer against an existing manifest is refused.

DIR may be local or on Cloud Storage (`gs://bucket/prepared`, through
`etils.epath`). Shards are written to a staging folder (beside DIR, or a local
temporary folder for a remote DIR) and moved into DIR only once complete, the
manifest last, so a failed run leaves an earlier prepared corpus in DIR as it
was. A non-empty DIR that holds no prepared corpus is refused unless forced,
and files that prepare did not write are never deleted.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Callable, Iterable, Iterator, Sequence

from etils import epath
import numpy as np

from bert_jax import progress as progress_lib
from bert_jax.data import text as text_lib
from bert_jax import paths
from bert_jax.data import batch as batch_lib
from bert_jax.data import tokenizers

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
EVAL_DOCUMENTS = "eval_documents.npy"
SHARD_ARRAYS = ("tokens", "word_starts", "sentence_offsets", "document_offsets")
LONG_SENTENCE_POLICIES = ("split", "truncate")
SHARD_DTYPES = {"tokens": np.int32, "word_starts": np.uint8, "sentence_offsets": np.int64,
                "document_offsets": np.int64, "spans": np.uint8}
SPANS = "spans"  # The optional per-token array of span marks.
_STAGING_MARKER = ".bert_jax_preparing"
# Written into --out while a corpus moves in: the names it may hold, so a rerun after a crash there may replace them.
_INSTALLING = "manifest.json.installing"


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  """Options that change the prepared bytes (recorded in the manifest).

  Attributes:
    max_sentence_tokens: longer sentences are split into pieces of this many
      tokens ('split') or cut to it ('truncate'); keep it below the shortest
      sequence length you will train with.
    long_sentences: 'split' or 'truncate'.
    eval_fraction: fraction of documents held out for evaluation.
    eval_documents: a count of held-out documents instead of a fraction.
    seed: draws the held-out documents.
    shard_tokens: a shard is closed once it holds at least this many tokens.
  """
  max_sentence_tokens: int = 510
  long_sentences: str = "split"
  eval_fraction: float = 0.0
  eval_documents: int | None = None
  seed: int = 0
  shard_tokens: int = 1 << 26


@dataclasses.dataclass
class _TokenisedChunk:
  """Tokenised documents of one chunk (flat arrays) and what went wrong in it."""
  tokens: np.ndarray
  word_starts: np.ndarray
  sentence_lengths: np.ndarray
  document_sentence_counts: np.ndarray
  report: text_lib.InputReport


_worker_tokenizer: tokenizers.Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
  global _worker_tokenizer
  _worker_tokenizer = tokenizers.load_tokenizer(tokenizer_dir)


def _tokenise_chunk(documents: Sequence[text_lib.Document], options: PrepareOptions,
                    tokenizer: tokenizers.Tokenizer | None = None) -> _TokenisedChunk:
  """Tokenises documents; drops empty sentences/documents and splits or cuts long sentences."""
  tokenizer = tokenizer or _worker_tokenizer
  report = text_lib.InputReport()
  sentences = [s for document in documents for s in document.sentences]
  tokens, word_starts, lengths = tokenizer.encode_arrays(sentences)
  sentence_document = np.repeat(np.arange(len(documents)), [len(d.sentences) for d in documents])
  locations = [(d.source, line) for d in documents for line in d.lines]

  for index in np.flatnonzero(lengths == 0):
    report.add("empty_sentences", *locations[index], repr(sentences[index][:40]))
  limit = options.max_sentence_tokens
  for index in np.flatnonzero(lengths > limit):
    report.add("long_sentences", *locations[index],
               f"{lengths[index]} tokens, {'split into pieces' if options.long_sentences == 'split' else 'cut'}"
               f" of {limit}")

  if options.long_sentences == "truncate":
    position_in_sentence = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = position_in_sentence < limit
    tokens, word_starts = tokens[keep], word_starts[keep]
    lengths = np.minimum(lengths, limit)
    pieces = (lengths > 0).astype(np.int64)
  else:
    pieces = -(-lengths // limit)  # ceil; 0 for empty sentences, which drops them
  # A piece has `limit` tokens except the last piece of each sentence.
  piece_lengths = np.full(int(pieces.sum()), limit, np.int64)
  last_piece = np.cumsum(pieces)[pieces > 0] - 1
  piece_lengths[last_piece] = lengths[pieces > 0] - limit * (pieces[pieces > 0] - 1)
  document_piece_counts = np.bincount(sentence_document, weights=pieces, minlength=len(documents)).astype(np.int64)

  for index in np.flatnonzero(document_piece_counts == 0):
    report.add("empty_documents", documents[index].source, documents[index].lines[0], "no tokens")
  return _TokenisedChunk(tokens, word_starts, piece_lengths, document_piece_counts[document_piece_counts > 0],
                         report)


def _chunked(iterable: Iterable, size: int) -> Iterator[list]:
  iterator = iter(iterable)
  while chunk := list(itertools.islice(iterator, size)):
    yield chunk


class _ShardWriter:
  """Accumulates tokenised chunks and writes a shard whenever it holds `shard_tokens` tokens."""

  def __init__(self, out_dir: pathlib.Path, shard_tokens: int):
    self.out_dir = out_dir
    self.shard_tokens = shard_tokens
    self.shards: list[dict] = []
    self._pending: list[_TokenisedChunk] = []
    self._pending_tokens = 0

  def add(self, chunk: _TokenisedChunk) -> None:
    self._pending.append(chunk)
    self._pending_tokens += len(chunk.tokens)
    if self._pending_tokens >= self.shard_tokens:
      self.flush()

  def flush(self) -> None:
    if not self._pending:
      return
    name = f"shard-{len(self.shards):05d}"
    sentence_lengths = np.concatenate([c.sentence_lengths for c in self._pending])
    document_counts = np.concatenate([c.document_sentence_counts for c in self._pending])
    arrays = {
        "tokens": np.concatenate([c.tokens for c in self._pending]).astype(np.int32),
        "word_starts": np.concatenate([c.word_starts for c in self._pending]).astype(np.uint8),
        "sentence_offsets": np.concatenate([[0], np.cumsum(sentence_lengths)]).astype(np.int64),
        "document_offsets": np.concatenate([[0], np.cumsum(document_counts)]).astype(np.int64),
    }
    for key, array in arrays.items():
      paths.write_array(self.out_dir / f"{name}.{key}.npy", array)
    self.shards.append({"name": name, "documents": len(document_counts), "sentences": len(sentence_lengths),
                        "tokens": len(arrays["tokens"])})
    self._pending, self._pending_tokens = [], 0


def _choose_eval_documents(num_documents: int, options: PrepareOptions) -> np.ndarray:
  """Global ids (sorted) of the held-out documents, drawn from `options.seed`."""
  if options.eval_documents is not None:
    count = options.eval_documents
  else:
    count = int(round(options.eval_fraction * num_documents))
  if count > num_documents - 1 and count > 0:
    raise ValueError(f"cannot hold out {count} of {num_documents} documents and still train")
  rng = np.random.default_rng([options.seed, 0x5E1D])
  return np.sort(rng.choice(num_documents, size=count, replace=False)).astype(np.int64)


def _read_manifest(out_dir: epath.Path) -> dict | None:
  path = out_dir / MANIFEST
  if not path.exists():
    return None
  try:
    manifest = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise ValueError(f"{path} is not a readable manifest ({error}); prepare the corpus again into a new --out") \
        from None
  if not isinstance(manifest, dict) or not isinstance(manifest.get("shards"), list):
    raise ValueError(f"{path} is not a bert_jax prepared-corpus manifest (no 'shards' list)")
  return manifest


def _corpus_names(manifest: dict) -> set[str]:
  """The file and folder names a prepared corpus consists of (what prepare may replace)."""
  names = {MANIFEST, EVAL_DOCUMENTS, manifest.get("tokenizer", {}).get("path", TOKENIZER_DIR)}
  names.update(f"{shard['name']}.{key}.npy" for shard in manifest["shards"] for key in SHARD_ARRAYS)
  if SPANS in manifest:
    names.update(f"{shard['name']}.{SPANS}.npy" for shard in manifest["shards"])
  return _plain_names(names)


def _plain_names(names) -> set[str]:
  """Only names of entries directly inside the folder: prepare deletes what it owns."""
  return {name for name in names if isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
          and "\\" not in name}


def _owned_names(out_dir: epath.Path, existing: dict | None) -> set[str]:
  """Names in `out_dir` that an earlier prepare wrote (a finished corpus, or one a crash left half moved in)."""
  names = _corpus_names(existing) if existing else set()
  if (out_dir / _INSTALLING).exists():
    names.update(_plain_names(json.loads((out_dir / _INSTALLING).read_text())))
    names.add(_INSTALLING)
  return names


def _check_out_dir(out_dir: epath.Path, existing: dict | None, force: bool) -> None:
  """Refuses an --out that is a file, or a non-empty folder that is not a prepared corpus (unless forced)."""
  if out_dir.exists() and not out_dir.is_dir():
    raise ValueError(f"--out {out_dir} is a file; give a directory (new, empty, or an earlier prepared corpus)")
  if existing is not None or not out_dir.exists():
    return
  owned = _owned_names(out_dir, None)
  present = sorted(path.name for path in out_dir.iterdir() if path.name not in owned)
  if present and not force:
    raise ValueError(f"--out {out_dir} is not empty ({', '.join(present[:5])}{', ...' if len(present) > 5 else ''}) "
                     f"and holds no prepared corpus ({MANIFEST}); give a new or empty directory, or --force to "
                     f"write beside those files")
  clashes = [name for name in present
             if name in (MANIFEST, EVAL_DOCUMENTS, TOKENIZER_DIR) or name.startswith("shard-")]
  if clashes:
    raise ValueError(f"--out {out_dir} holds {', '.join(clashes)}, which prepare would overwrite but did not write; "
                     f"move them elsewhere or give another --out")


def _staging_dir(out_dir: epath.Path) -> pathlib.Path:
  """An empty local folder to prepare into: beside a local --out (same file system, so moves are renames)."""
  if paths.is_remote(out_dir):
    return pathlib.Path(tempfile.mkdtemp(prefix="bert_jax_prepare-"))
  out_dir = pathlib.Path(out_dir)
  staging = out_dir.parent / f".{out_dir.name}.preparing"
  if (staging / _STAGING_MARKER).exists():
    shutil.rmtree(staging)  # left by a killed run
  elif staging.exists():
    raise ValueError(f"{staging} exists and was not made by prepare; move it away (prepare stages --out there)")
  staging.mkdir(parents=True)
  (staging / _STAGING_MARKER).touch()
  return staging


def _move(source: pathlib.Path, target: epath.Path) -> None:
  """Moves a staged file or folder to `target` (a rename when local, an upload when remote)."""
  if paths.is_remote(target):
    paths.upload(source, target)
  else:
    os.replace(source, target)


def _install(staging: pathlib.Path, out_dir: epath.Path, old_names: set[str]) -> None:
  """Moves a complete staged corpus into `out_dir`, replacing only the files of the earlier corpus there."""
  out_dir.mkdir(parents=True, exist_ok=True)
  new_names = {path.name for path in staging.iterdir()} - {MANIFEST, _STAGING_MARKER}
  paths.write_text(out_dir / _INSTALLING, json.dumps(sorted(old_names | new_names | {MANIFEST})))
  if (out_dir / MANIFEST).exists():
    # Without its manifest a half-replaced folder reads as unprepared, never as a mix of two corpora.
    (out_dir / MANIFEST).unlink()
  for name in sorted(old_names - {MANIFEST, _INSTALLING}):
    old = out_dir / name
    if old.is_dir():
      old.rmtree()
    elif old.exists() and name not in new_names:
      old.unlink()
  for name in sorted(new_names):
    _move(staging / name, out_dir / name)
  _move(staging / MANIFEST, out_dir / MANIFEST)
  (out_dir / _INSTALLING).unlink()


def prepare_corpus(inputs: Sequence[str], tokenizer: tokenizers.Tokenizer | str | os.PathLike,
                   out_dir: str | os.PathLike, *, eval_fraction: float = 0.0, eval_documents: int | None = None,
                   seed: int = 0, num_workers: int | None = None, max_sentence_tokens: int = 510,
                   long_sentences: str = "split", shard_tokens: int = 1 << 26, chunk_documents: int = 256,
                   force: bool = False, log=print, before_write: Callable[[], None] | None = None) -> dict:
  """Tokenises `inputs` into shards under `out_dir` and returns the manifest.

  Args:
    inputs: text / JSON-lines files (optionally .gz) or `tfds:NAME[:SPLIT]`.
    tokenizer: a Tokenizer, or a path `load_tokenizer` understands.
    out_dir: output directory, local or `gs://` (created); see the module docstring for what happens to
      what is already there.
    eval_fraction: fraction of documents held out for evaluation.
    eval_documents: a count of held-out documents instead (wins over the fraction).
    seed: draws the held-out documents.
    num_workers: tokenising processes; default all cores; 0 or 1 tokenises in
      this process.
    max_sentence_tokens, long_sentences, shard_tokens: see `PrepareOptions`.
    chunk_documents: documents sent to a worker at a time.
    force: write into a non-empty `out_dir` that holds no prepared corpus
      (files with the names prepare writes are still refused).
    log: where progress lines go.
    before_write: called once prepare knows it will write (`out_dir` holds no
      corpus, or one of other inputs or options) and before it writes anything;
      what it raises leaves `out_dir` as it was (the trainer refuses a changed
      experiment there before its held-out split is drawn again).

  Raises:
    ValueError: the directory was prepared with another tokenizer, is a file,
      is not empty without `force`, or an input is unreadable.
    paths.StorageError: a file could not be written (disk full, quota,
      permission); `out_dir` keeps the corpus it held, and nothing partial
      is left to be reused.
  """
  if long_sentences not in LONG_SENTENCE_POLICIES:
    raise ValueError(f"long_sentences must be one of {LONG_SENTENCE_POLICIES}, got {long_sentences!r}")
  if not isinstance(tokenizer, tokenizers.Tokenizer):
    tokenizer = tokenizers.load_tokenizer(tokenizer)
  options = PrepareOptions(max_sentence_tokens, long_sentences, eval_fraction, eval_documents, seed, shard_tokens)
  out_dir = paths.as_path(out_dir)
  fingerprint = tokenizer.fingerprint()
  input_fingerprints = [text_lib.input_fingerprint(spec) for spec in inputs]

  existing = _read_manifest(out_dir) if out_dir.is_dir() else None
  _check_out_dir(out_dir, existing, force)
  if existing is not None:
    if existing["tokenizer"]["fingerprint"] != fingerprint:
      raise ValueError(
          f"{out_dir} was prepared with tokenizer {existing['tokenizer']['fingerprint']}, but the given tokenizer is "
          f"{fingerprint}; use another --out directory or delete {out_dir}")
    if existing["inputs"] == input_fingerprints and existing["options"] == dataclasses.asdict(options):
      log(f"{out_dir} is already prepared from these inputs with this tokenizer ({fingerprint}); nothing to do")
      return existing
    log(f"inputs or options differ from {out_dir / MANIFEST}; preparing again")
  if before_write is not None:
    before_write()

  try:
    staging = _staging_dir(out_dir)
  except OSError as error:
    raise paths.storage_error(error, error.filename or out_dir) from error
  try:
    manifest, report = _prepare_into(staging, inputs, tokenizer, options, input_fingerprints, num_workers,
                                     chunk_documents)
    try:
      _install(staging, out_dir, _owned_names(out_dir, existing))
    except OSError as error:  # Files are written through `paths`, which names them; a rename or delete is named here.
      raise paths.storage_error(error, error.filename2 or error.filename or out_dir) from error
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  totals, seconds = manifest["totals"], manifest["seconds"]
  log(f"prepared {totals['documents']:,} documents, {totals['sentences']:,} sentences, {totals['tokens']:,} tokens "
      f"in {len(manifest['shards'])} shards ({manifest['splits']['eval']['documents']:,} documents held out) in "
      f"{seconds:.1f}s -> {out_dir}")
  log(report.summary())
  return manifest


def _prepare_into(out_dir: pathlib.Path, inputs: Sequence[str], tokenizer: tokenizers.Tokenizer,
                  options: PrepareOptions, input_fingerprints: list[dict], num_workers: int | None,
                  chunk_documents: int) -> tuple[dict, text_lib.InputReport]:
  """Writes the whole corpus into the local folder `out_dir`, the manifest last; returns it and the input report."""
  fingerprint = tokenizer.fingerprint()
  tokenizer_dir = out_dir / TOKENIZER_DIR
  tokenizer.save(tokenizer_dir)
  started = time.perf_counter()
  report = text_lib.InputReport()
  documents = itertools.chain.from_iterable(text_lib.iter_documents(spec, report) for spec in inputs)
  chunks = _chunked(documents, chunk_documents)
  writer = _ShardWriter(out_dir, options.shard_tokens)
  num_workers = os.cpu_count() if num_workers is None else num_workers
  progress = progress_lib.Progress(None, "prepare", unit="doc", clock_after_first=False)
  try:
    if num_workers <= 1:
      tokenised = (_tokenise_chunk(chunk, options, tokenizer) for chunk in chunks)
      _collect(tokenised, writer, report, progress)
    else:
      # 'spawn' keeps workers clear of threads (JAX, the tokenizers' thread pool)
      # that the parent may already run; each worker loads the saved tokenizer.
      context = multiprocessing.get_context("spawn")
      with context.Pool(num_workers, initializer=_init_worker, initargs=(str(tokenizer_dir),)) as pool:
        _collect(pool.imap(functools.partial(_tokenise_chunk, options=options), chunks, chunksize=1), writer, report,
                 progress)
  finally:
    progress.close()
  writer.flush()
  seconds = time.perf_counter() - started

  totals = {key: sum(shard[key] for shard in writer.shards) for key in ("documents", "sentences", "tokens")}
  if totals["documents"] == 0:
    raise ValueError(f"no documents with any tokens in {list(inputs)}\n{report.summary()}")
  eval_ids = _choose_eval_documents(totals["documents"], options)
  paths.write_array(out_dir / EVAL_DOCUMENTS, eval_ids)
  manifest = {
      "format_version": 1,
      "shards": writer.shards,
      "totals": totals,
      "splits": {"train": {"documents": totals["documents"] - len(eval_ids)},
                 "eval": {"documents": len(eval_ids), "file": EVAL_DOCUMENTS}},
      "tokenizer": {"fingerprint": fingerprint, "kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size,
                    "special_ids": tokenizer.special_ids, "path": TOKENIZER_DIR},
      "inputs": input_fingerprints,
      "options": dataclasses.asdict(options),
      "report": report.to_json(),
      "seconds": round(seconds, 2),
  }
  paths.write_text(out_dir / MANIFEST, json.dumps(manifest, indent=1))
  return manifest, report


def _collect(tokenised: Iterable[_TokenisedChunk], writer: _ShardWriter, report: text_lib.InputReport,
             progress: progress_lib.Progress) -> None:
  tokens = 0
  for chunk in tokenised:
    report.merge(chunk.report)
    if len(chunk.document_sentence_counts):
      writer.add(chunk)
    tokens += len(chunk.tokens)
    progress.set_postfix({"tokens": f"{tokens:,}"})
    progress.update(len(chunk.document_sentence_counts))


class PreparedCorpus:
  """Read access to a prepared directory (local shards memory-mapped, `gs://` ones read into memory).

  Tokens are addressed in one global token space (shards laid end to end),
  sentences and documents by global index.

  Attributes:
    manifest: the parsed manifest.json.
    sentence_starts: int64 [S+1] global token offset of each sentence.
    document_starts: int64 [D+1] global sentence offset of each document.
  """

  def __init__(self, directory: str | os.PathLike):
    self.directory = paths.as_path(directory)
    manifest = _read_manifest(self.directory)
    if manifest is None:
      raise FileNotFoundError(f"{self.directory} has no {MANIFEST}; run `bert-jax prepare` first")
    self.manifest = manifest
    self._tokens, self._word_starts, self._marks = [], [], []
    sentence_starts, document_starts = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    token_base = sentence_base = 0
    for shard in manifest["shards"]:
      load = lambda key, name=shard["name"]: self._load_array(f"{name}.{key}.npy", SHARD_DTYPES[key])
      self._tokens.append(load("tokens"))
      self._word_starts.append(load("word_starts"))
      if SPANS in manifest:
        spans = load(SPANS)
        if len(spans) != shard["tokens"]:
          raise ValueError(f"{self.directory / (shard['name'] + '.spans.npy')} has {len(spans)} marks for "
                           f"{shard['tokens']} tokens; run `bert-jax mark-spans` again")
        # Span bits above the word-start bit, as the batch's word_starts field carries them (batch.span_bits).
        self._marks.append(self._word_starts[-1] | (spans << 1))
      else:
        self._marks.append(self._word_starts[-1])
      sentence_starts.append(np.asarray(load("sentence_offsets")[1:]) + token_base)
      document_starts.append(np.asarray(load("document_offsets")[1:]) + sentence_base)
      token_base += shard["tokens"]
      sentence_base += shard["sentences"]
    self.sentence_starts = np.concatenate(sentence_starts)
    self.document_starts = np.concatenate(document_starts)
    self._shard_token_starts = np.cumsum([0] + [s["tokens"] for s in manifest["shards"]]).tolist()
    self.eval_documents = np.asarray(self._load_array(EVAL_DOCUMENTS, np.int64))

  def __getstate__(self) -> dict[str, str]:
    # A pickled copy (in a worker process) opens the shards again: pickling a memory map would copy its data.
    return {"directory": str(self.directory)}

  def __setstate__(self, state: dict[str, str]) -> None:
    self.__init__(state["directory"])

  def _load_array(self, name: str, dtype) -> np.ndarray:
    """One array of the corpus: memory-mapped when local, read into memory when remote.

    Remote shards are read whole rather than cached on local disk: example
    building reads tokens at random, which a remote file serves slowly, and a
    host's memory holds its corpus (int32 ids plus a flag byte, 5 bytes a token).
    """
    path = self.directory / name
    try:
      if paths.is_remote(path):
        array = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
      else:
        # Plain-array views of the maps: a memmap's slicing goes through its Python subclass, and `gather` slices often.
        array = np.load(os.fspath(path), mmap_mode="r", allow_pickle=False).view(np.ndarray)
    except FileNotFoundError:
      raise FileNotFoundError(f"{path} is missing from the prepared corpus; run `bert-jax prepare` again into a "
                              f"new --out") from None
    except (ValueError, OSError, EOFError) as error:
      raise ValueError(f"{path} is not a readable numeric array ({error}); run `bert-jax prepare` again into a new "
                       f"--out") from None
    if array.dtype != dtype or array.ndim != 1:
      raise ValueError(f"{path} holds {array.dtype} {list(array.shape)}, not the {np.dtype(dtype)} vector prepare "
                       f"writes; run `bert-jax prepare` again into a new --out")
    return array

  @property
  def shard_token_starts(self) -> list[int]:
    """Global offset of each shard's first token, then the total: [shards + 1]."""
    return self._shard_token_starts

  @property
  def span_kinds(self) -> tuple[str, ...]:
    """The kinds of linguistic spans marked in the corpus (`batch.SPAN_KINDS`); empty when none are."""
    return tuple(self.manifest.get(SPANS, {}).get("kinds", ()))

  @property
  def num_documents(self) -> int:
    return len(self.document_starts) - 1

  @property
  def num_sentences(self) -> int:
    return len(self.sentence_starts) - 1

  def split_documents(self, split: str) -> np.ndarray:
    """Global ids (sorted, int64) of the documents in 'train' or 'eval'."""
    if split == "eval":
      return self.eval_documents
    if split == "train":
      keep = np.ones(self.num_documents, bool)
      keep[self.eval_documents] = False
      return np.flatnonzero(keep)
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")

  def _locate(self, start: int, end: int) -> tuple[int, int, int]:
    shard = bisect.bisect_right(self._shard_token_starts, start) - 1
    base = self._shard_token_starts[shard]
    if end > self._shard_token_starts[shard + 1]:
      raise ValueError(f"token range [{start}, {end}) crosses a shard boundary")
    return shard, start - base, end - base

  def tokens(self, start: int, end: int) -> np.ndarray:
    """int32 [end-start] token ids of a global range inside one shard."""
    shard, local_start, local_end = self._locate(start, end)
    return self._tokens[shard][local_start:local_end]

  def word_starts(self, start: int, end: int) -> np.ndarray:
    """uint8 [end-start] word-start flags of a global range inside one shard."""
    shard, local_start, local_end = self._locate(start, end)
    return self._word_starts[shard][local_start:local_end]

  def gather(self, starts: Sequence[int], sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32, marks uint8) of the global ranges [start, start + size), each inside one shard, laid end to
    end; marks are the word-start flag in bit 0 and the span marks above it (the batch's word_starts field)."""
    tokens, word_starts = [], []
    for start, size in zip(starts, sizes):
      shard, local_start, local_end = self._locate(start, start + size)
      tokens.append(self._tokens[shard][local_start:local_end])
      word_starts.append(self._marks[shard][local_start:local_end])
    if not tokens:
      return np.zeros(0, np.int32), np.zeros(0, np.uint8)
    return np.concatenate(tokens), np.concatenate(word_starts)

  def document_sentences(self, document: int) -> list[np.ndarray]:
    """Token ids of each sentence of one document."""
    first, last = self.document_starts[document], self.document_starts[document + 1]
    bounds = self.sentence_starts[first:last + 1]
    return [np.asarray(self.tokens(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]

  def load_tokenizer(self) -> tokenizers.Tokenizer:
    """The corpus' tokenizer (a remote one is copied to a local temporary folder first)."""
    return tokenizers.load_tokenizer(self.directory / self.manifest["tokenizer"]["path"])


def write_spans(directory: str | os.PathLike, spans: Sequence[np.ndarray], kinds: Sequence[str],
                info: dict) -> dict:
  """Adds span marks to a prepared corpus (replacing any it had) and returns the new manifest.

  Args:
    directory: a prepared corpus.
    spans: uint8 [T] per shard, the marks of its tokens (see the module docstring).
    kinds: the kinds marked, a subset of `batch.SPAN_KINDS` in its order.
    info: what marked them (recorded in the manifest with a fingerprint of the marks).
  """
  directory = paths.as_path(directory)
  manifest = _read_manifest(directory)
  if manifest is None:
    raise FileNotFoundError(f"{directory} has no {MANIFEST}; run `bert-jax prepare` first")
  if list(kinds) != [kind for kind in batch_lib.SPAN_KINDS if kind in kinds]:
    raise ValueError(f"span kinds {list(kinds)} must be a subset of {batch_lib.SPAN_KINDS} in that order")
  if len(spans) != len(manifest["shards"]):
    raise ValueError(f"{len(spans)} span arrays for {len(manifest['shards'])} shards of {directory}")
  allowed = sum(sum(batch_lib.span_marks(kind)) for kind in kinds)
  digest = hashlib.sha256()
  for shard, marks in zip(manifest["shards"], spans):
    if marks.dtype != np.uint8 or marks.shape != (shard["tokens"],):
      raise ValueError(f"spans of {shard['name']}: uint8 [{shard['tokens']}] expected, got {marks.dtype} "
                       f"{list(marks.shape)}")
    if np.any(marks & ~np.uint8(allowed)):
      raise ValueError(f"spans of {shard['name']} set bits of kinds other than {list(kinds)}")
    digest.update(marks.tobytes())
  manifest.pop(SPANS, None)
  # Without the "spans" entry while the files change: a crash leaves a corpus that reads as unmarked.
  paths.write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
  for shard, marks in zip(manifest["shards"], spans):
    paths.write_array(directory / f"{shard['name']}.{SPANS}.npy", marks)
  manifest[SPANS] = {"kinds": list(kinds), "fingerprint": digest.hexdigest()[:16], **info}
  paths.write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
  return manifest


def open_prepared(directory: str | os.PathLike) -> PreparedCorpus:
  """Opens a prepared directory for reading (see `PreparedCorpus`)."""
  return PreparedCorpus(directory)


def _sentences_for_training(inputs: Sequence[str]) -> Iterator[str]:
  report = text_lib.InputReport()
  for spec in inputs:
    for document in text_lib.iter_documents(spec, report):
      yield from document.sentences


def main(argv: list[str]) -> int:
  """`bert-jax prepare`: see the module docstring; returns the exit status."""
  parser = argparse.ArgumentParser(prog="bert-jax prepare", description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--input", nargs="+", required=True, help="text/JSON-lines files (.gz ok) or tfds:NAME[:SPLIT]")
  parser.add_argument("--out", required=True, help="output directory, local or gs://")
  parser.add_argument("--force", action="store_true",
                      help="write into a non-empty --out that holds no prepared corpus (its files are kept)")
  parser.add_argument("--tokenizer", help="tokenizer file or directory (vocab.txt, tokenizer.json, *.model, ...)")
  parser.add_argument("--train-tokenizer", choices=tokenizers.TOKENIZER_KINDS,
                      help="train a tokenizer of this kind on the inputs instead of --tokenizer")
  parser.add_argument("--vocab-size", type=int, default=30522, help="vocabulary size for --train-tokenizer")
  parser.add_argument("--cased", action="store_true", help="train a cased tokenizer (default: lowercase)")
  parser.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of documents held out")
  parser.add_argument("--eval-documents", type=int, help="number of documents held out (instead of a fraction)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
  parser.add_argument("--num-workers", type=int, default=None, help="tokenising processes (default: all cores)")
  parser.add_argument("--max-sentence-tokens", type=int, default=510)
  parser.add_argument("--long-sentences", choices=LONG_SENTENCE_POLICIES, default="split")
  parser.add_argument("--shard-tokens", type=int, default=1 << 26)
  args = parser.parse_args(argv)
  if (args.tokenizer is None) == (args.train_tokenizer is None):
    parser.error("give exactly one of --tokenizer and --train-tokenizer")

  try:
    with tempfile.TemporaryDirectory() as scratch:
      tokenizer = _main_tokenizer(args, pathlib.Path(scratch))
      prepare_corpus(args.input, tokenizer, args.out, eval_fraction=args.eval_fraction,
                     eval_documents=args.eval_documents, seed=args.seed, num_workers=args.num_workers,
                     max_sentence_tokens=args.max_sentence_tokens, long_sentences=args.long_sentences,
                     shard_tokens=args.shard_tokens, force=args.force)
  except (ValueError, FileNotFoundError, ImportError, paths.StorageError) as error:
    print(f"bert-jax prepare: error: {error}", file=sys.stderr)
    return 1
  return 0


def _main_tokenizer(args: argparse.Namespace, scratch: pathlib.Path) -> tokenizers.Tokenizer:
  """The tokenizer `main` prepares with: loaded, reused from an earlier run in --out, or trained into `scratch`."""
  if not args.train_tokenizer:
    return tokenizers.load_tokenizer(args.tokenizer)
  out_dir = epath.Path(args.out)
  if out_dir.is_dir() and _read_manifest(out_dir) is not None:
    # Training again would give the same vocabulary, at the cost of the training.
    print(f"using the tokenizer already trained in {out_dir / TOKENIZER_DIR}")
    return open_prepared(out_dir).load_tokenizer()
  print(f"training a {args.train_tokenizer} tokenizer with {args.vocab_size} ids on {args.input}")
  # Trained into scratch space: --out receives it with the shards, only once those are complete.
  return tokenizers.train_tokenizer(args.train_tokenizer, _sentences_for_training(args.input), args.vocab_size,
                                    scratch / TOKENIZER_DIR, lowercase=not args.cased)
