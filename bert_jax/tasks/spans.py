"""`bert-jax mark-spans`: named entities and noun phrases of a prepared corpus, from fine-tuned taggers.

  bert-jax finetune --config configs/finetune/ner.py --workdir runs/ner --config.init.model=MODEL ...
  bert-jax finetune --config configs/finetune/ner.py:column=chunk --workdir runs/np_chunker ...
  bert-jax mark-spans --prepared data/wiki --ner runs/ner --chunker runs/np_chunker

SpanBERT's "Named Entities" and "Noun Phrases" masking (`masking.granularity`
named_entity / noun_phrase) needs those spans in the pre-training text. A
tagger fine-tuned on CoNLL-2003 (`conll2003` for entities, `conll2003_chunk`
for noun phrases) tags the whole corpus and the spans go into the prepared
corpus beside its shards (`prepare.write_spans`), from where the example
builders carry them with their tokens.

The corpus' own token ids are the tagger's input, so a tagger must have been
fine-tuned with the corpus' tokenizer (checked by fingerprint). Rows are runs
of whole sentences of one document, up to the tagger's max_len (a longer
sentence is cut at a word start); they go through the same bucketed, jitted
predict step as `bert-jax predict` (`InferenceModel.predict_outputs`). As
there, a word's tag is its first piece's, and spans follow conlleval's IOB
rules within a sentence; every piece of a word in a span is marked. Marking
again replaces the marks of every kind.

`export_spans` writes a marked corpus' spans into one compressed file and
`import_spans` adds them to another copy of the same prepared corpus (same
tokenizer and shards): a machine that keeps nothing between runs marks once
and carries the file (`bert-jax reproduce`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import time
from typing import Any, Sequence

import numpy as np

from bert_jax import progress as progress_lib
from bert_jax.data import batch as batch_lib
from bert_jax.data import prepare
from bert_jax.data.tokenizers import load_tokenizer
from bert_jax.tasks.inference import InferenceModel, load_for_inference

# The span kind each tagging task marks, and which of its chunk types count.
TAGGER_TASKS = {"named_entity": ("conll2003", None), "noun_phrase": ("conll2003_chunk", "NP")}
CHUNK_ROWS = 8192  # Rows predicted at a time: bounds the host memory of the outputs ([rows, max_len, tags] floats).


def row_bounds(corpus: prepare.PreparedCorpus, budget: int) -> np.ndarray:
  """Global token offsets that cut the corpus into tagger rows of at most `budget` tokens.

  A row is a run of whole sentences of one document; a sentence longer than
  `budget` is cut at its last word start that fits (at `budget` when a word is
  longer still). Rows tile the token stream in order.

  Returns:
    int64 [R+1]: row r holds tokens [bounds[r], bounds[r+1]).
  """
  sentence_starts = corpus.sentence_starts.tolist()
  document_starts = corpus.sentence_starts[corpus.document_starts].tolist()
  total = sentence_starts[-1]
  bounds, position = [0], 0
  while position < total:
    document_end = document_starts[bisect.bisect_right(document_starts, position)]
    stop = min(position + budget, document_end)
    end = sentence_starts[bisect.bisect_right(sentence_starts, stop) - 1]
    if end <= position:  # One sentence longer than the budget: cut it at a word start.
      word_starts = np.flatnonzero(corpus.word_starts(position, stop)[1:])
      end = position + 1 + int(word_starts[-1]) if stop < document_end and word_starts.size else stop
    bounds.append(end)
    position = end
  return np.asarray(bounds, np.int64)


def _features(tokens: np.ndarray, bounds: np.ndarray, max_len: int, specials: dict[str, int]) -> dict[str, Any]:
  """The tagging features of rows [CLS] tokens[a:b] [SEP] for consecutive (a, b) of `bounds` (offsets into
  `tokens`), and where each token sits: (row, column) int64 [len(tokens)]."""
  sizes = np.diff(bounds)
  rows = np.repeat(np.arange(len(sizes)), sizes)
  columns = 1 + np.arange(len(tokens)) - np.repeat(bounds[:-1] - bounds[0], sizes)
  input_ids = np.full((len(sizes), max_len), specials["pad"], np.int32)
  input_ids[:, 0] = specials["cls"]
  input_ids[rows, columns] = tokens
  input_ids[np.arange(len(sizes)), sizes + 1] = specials["sep"]
  return {"input_ids": input_ids, "segment_ids": np.zeros_like(input_ids), "lengths": (sizes + 2).astype(np.int32),
          "rows": rows, "columns": columns}


def _tag_types(labels: Sequence[str], only: str | None) -> tuple[np.ndarray, np.ndarray]:
  """Per tag id: its chunk type id (0 for O and for types other than `only`) and whether it is a B- tag."""
  names = sorted({label[2:] for label in labels if label != "O" and (only is None or label[2:] == only)})
  types = np.array([names.index(label[2:]) + 1 if label[2:] in names else 0 for label in labels], np.int32)
  return types, np.array([label.startswith("B-") for label in labels])


def spans_from_tags(token_tags: np.ndarray, word_starts: np.ndarray, sentence_starts: np.ndarray,
                    labels: Sequence[str], only: str | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Spans of IOB tags read at each word's first piece, as conlleval reads them, per token.

  Args:
    token_tags: int [T] a tag id per token (only those at word starts are read).
    word_starts: [T] 1 where a token starts a word.
    sentence_starts: int [S] offsets of the sentences' first tokens (a span never crosses one).
    labels: the tag names of the ids.
    only: the chunk type to keep ("NP"); None keeps every type.

  Returns:
    (starts, inside) bool [T]: the first token of each span; every token of a word inside a span.
  """
  types, is_b = _tag_types(labels, only)
  starts_word = word_starts.astype(bool).copy()
  starts_word[sentence_starts] = True
  first_pieces = np.flatnonzero(starts_word)
  word_of_token = np.cumsum(starts_word) - 1
  tags = token_tags[first_pieces]
  word_type = types[tags]
  first_of_sentence = np.zeros(len(token_tags), bool)
  first_of_sentence[sentence_starts] = True
  previous_type = np.concatenate([[0], word_type[:-1]])
  previous_type[first_of_sentence[first_pieces]] = 0
  word_begins = (word_type > 0) & (is_b[tags] | (word_type != previous_type))
  inside = word_type[word_of_token] > 0
  starts = np.zeros(len(token_tags), bool)
  starts[first_pieces[word_begins]] = True
  return starts, inside


def _check_tagger(model: InferenceModel, workdir: str, kind: str, corpus: prepare.PreparedCorpus) -> None:
  task_name = TAGGER_TASKS[kind][0]
  flag = f"--{batch_lib.TAGGER_OPTIONS[kind]}"
  if model.task.name != task_name:
    raise ValueError(f"{flag} {workdir} was fine-tuned on {model.task.name}, not {task_name}")
  tagger = load_tokenizer(model.source / "tokenizer").fingerprint()
  prepared = corpus.manifest["tokenizer"]["fingerprint"]
  if tagger != prepared:
    raise ValueError(f"{flag} {workdir} has tokenizer {tagger} but {corpus.directory} was prepared with {prepared}: "
                     f"fine-tune the tagger from a model with the corpus' vocabulary")


def mark_spans(prepared_dir: str | os.PathLike, taggers: dict[str, str], batch_size: int | None = None,
               seed: int | None = None, log=print) -> dict:
  """Tags every token of a prepared corpus with each tagger and writes the spans into it.

  Args:
    prepared_dir: a `bert-jax prepare` output.
    taggers: {span kind: fine-tuning workdir}, kinds from `batch.SPAN_KINDS` (see `TAGGER_TASKS`).
    batch_size: rows per predict batch (default: each run's eval batch size).
    seed: the fine-tuning seed whose parameters tag (default: each run's best).
    log: where progress lines go.

  Returns:
    The corpus' new manifest.
  """
  unknown = set(taggers) - set(TAGGER_TASKS)
  if unknown or not taggers:
    raise ValueError(f"span kinds {sorted(unknown) or '(none)'}: give taggers for {list(TAGGER_TASKS)}")
  corpus = prepare.open_prepared(prepared_dir)
  specials = corpus.manifest["tokenizer"]["special_ids"]
  shard_starts = corpus.shard_token_starts
  marks = [np.zeros(shard["tokens"], np.uint8) for shard in corpus.manifest["shards"]]
  kinds = [kind for kind in batch_lib.SPAN_KINDS if kind in taggers]
  info: dict[str, Any] = {"taggers": {}}
  started = time.perf_counter()
  for kind in kinds:
    workdir = taggers[kind]
    model = load_for_inference(workdir, seed)
    _check_tagger(model, workdir, kind, corpus)
    start_bit, inside_bit = batch_lib.span_marks(kind)
    bounds = row_bounds(corpus, model.max_len - 2)
    kind_started = time.perf_counter()
    progress = progress_lib.Progress(len(bounds) - 1, f"mark {kind}", unit="row")
    spans_found = 0
    for shard, (shard_start, shard_end) in enumerate(zip(shard_starts[:-1], shard_starts[1:])):
      tokens = np.asarray(corpus.tokens(shard_start, shard_end))
      token_tags = np.zeros(len(tokens), np.int32)
      first, last = np.searchsorted(bounds, [shard_start, shard_end])
      for chunk in range(first, last, CHUNK_ROWS):
        chunk_bounds = bounds[chunk:min(chunk + CHUNK_ROWS, last) + 1]
        features = _features(tokens[chunk_bounds[0] - shard_start:chunk_bounds[-1] - shard_start], chunk_bounds,
                             model.max_len, specials)
        outputs = model.predict_outputs({k: features[k] for k in ("input_ids", "segment_ids", "lengths")},
                                        batch_size, progress)
        token_tags[chunk_bounds[0] - shard_start:chunk_bounds[-1] - shard_start] = (
            outputs[features["rows"], features["columns"]].argmax(-1))
      sentence_starts = corpus.sentence_starts[(corpus.sentence_starts >= shard_start)
                                               & (corpus.sentence_starts < shard_end)] - shard_start
      starts, inside = spans_from_tags(token_tags, corpus.word_starts(shard_start, shard_end), sentence_starts,
                                       model.task.labels, TAGGER_TASKS[kind][1])
      marks[shard] |= (starts * start_bit | inside * inside_bit).astype(np.uint8)
      spans_found += int(starts.sum())
    progress.close()
    seconds = time.perf_counter() - kind_started
    tokens_total = corpus.manifest["totals"]["tokens"]
    log(f"marked {spans_found:,} {kind} spans over {tokens_total:,} tokens in {seconds:.1f} s "
        f"({tokens_total / max(seconds, 1e-9):,.0f} tokens/s) with {workdir} (seed {model.seed})")
    info["taggers"][kind] = {"workdir": str(workdir), "task": model.task.name, "seed": model.seed,
                             "spans": spans_found}
  info["seconds"] = round(time.perf_counter() - started, 2)
  return prepare.write_spans(prepared_dir, marks, kinds, info)


_META = "__corpus__"


def _identity(manifest: dict) -> dict:
  """What must match for spans to belong to a prepared corpus: its tokenizer and its shards' sizes."""
  return {"tokenizer": manifest["tokenizer"]["fingerprint"],
          "shards": [[shard["name"], shard["tokens"]] for shard in manifest["shards"]]}


def export_spans(prepared_dir: str | os.PathLike, path: str | os.PathLike) -> None:
  """Writes the spans of a marked corpus into one compressed .npz file (mostly zeros: small)."""
  corpus = prepare.open_prepared(prepared_dir)
  if prepare.SPANS not in corpus.manifest:
    raise ValueError(f"{prepared_dir} holds no spans; run `bert-jax mark-spans` first")
  meta = {**_identity(corpus.manifest), "spans": corpus.manifest[prepare.SPANS]}
  starts = corpus.shard_token_starts
  # The marks `gather` reads are the word-start bit with the span marks above it.
  arrays = {shard["name"]: corpus.gather([start], [end - start])[1] >> 1
            for shard, start, end in zip(corpus.manifest["shards"], starts[:-1], starts[1:])}
  np.savez_compressed(path, **{_META: np.frombuffer(json.dumps(meta).encode(), np.uint8)}, **arrays)


def import_spans(path: str | os.PathLike, prepared_dir: str | os.PathLike) -> bool:
  """Adds the spans of `export_spans`'s file to the same prepared corpus; returns False when it already has them.

  Raises:
    ValueError: when the file marks another corpus (another tokenizer or other shards).
  """
  manifest = prepare.open_prepared(prepared_dir).manifest
  with np.load(path) as data:
    meta = json.loads(bytes(data[_META]))
    if {key: meta[key] for key in ("tokenizer", "shards")} != _identity(manifest):
      raise ValueError(f"{path} holds the spans of another prepared corpus than {prepared_dir} (tokenizer or shards "
                       f"differ); mark this one with `bert-jax mark-spans`")
    if manifest.get(prepare.SPANS, {}).get("fingerprint") == meta["spans"]["fingerprint"]:
      return False
    info = {key: value for key, value in meta["spans"].items() if key not in ("kinds", "fingerprint")}
    prepare.write_spans(prepared_dir, [data[shard["name"]] for shard in manifest["shards"]], meta["spans"]["kinds"],
                        info)
  return True


def main(argv: list[str]) -> int:
  """bert-jax mark-spans --prepared DIR [--ner WORKDIR] [--chunker WORKDIR] [--batch-size N] [--seed S]."""
  parser = argparse.ArgumentParser(prog="bert-jax mark-spans", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  parser.add_argument("--prepared", required=True, help="a prepared corpus (bert-jax prepare)")
  parser.add_argument("--ner", help="a conll2003 fine-tuning workdir: marks named_entity spans")
  parser.add_argument("--chunker", help="a conll2003_chunk fine-tuning workdir: marks noun_phrase spans")
  parser.add_argument("--batch-size", type=int, help="rows per predict batch (default: the run's eval batch size)")
  parser.add_argument("--seed", type=int, help="the fine-tuning seed whose parameters tag (default: the best)")
  parser.add_argument("--export", metavar="FILE", help="then write the corpus' spans into FILE (.npz) to carry")
  parser.add_argument("--import", dest="import_file", metavar="FILE",
                      help="instead of tagging, add the spans of an --export FILE of the same prepared corpus")
  args = parser.parse_args(argv)
  taggers = {kind: getattr(args, option) for kind, option in batch_lib.TAGGER_OPTIONS.items() if getattr(args, option)}
  if args.import_file:
    if taggers:
      parser.error("--import takes the spans from its file: leave out --ner and --chunker")
    added = import_spans(args.import_file, args.prepared)
    print(f"{args.prepared}: spans {'added from' if added else 'already those of'} {args.import_file}")
  elif taggers:
    manifest = mark_spans(args.prepared, taggers, args.batch_size, args.seed)
    print(f"{args.prepared}: spans {manifest[prepare.SPANS]['kinds']} ({manifest[prepare.SPANS]['seconds']:.1f} s)")
  elif not args.export:
    parser.error("give --ner, --chunker, --import or --export")
  if args.export:
    export_spans(args.prepared, args.export)
    print(f"wrote the spans of {args.prepared} to {args.export}")
  return 0
