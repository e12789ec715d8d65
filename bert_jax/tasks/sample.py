"""A sample task in RTE's file layout, made from the built-in corpus, to try fine-tuning without GLUE.

  bert-jax sample-rte --out data/sample
  bert-jax finetune --config configs/finetune/glue.py:task=rte --config.data_dir=data/sample \
      --config.init.model=runs/demo --workdir runs/rte

writes OUT/RTE/train.tsv, dev.tsv and test.tsv as GLUE's download lays RTE out (index, sentence1, sentence2, label;
test.tsv without labels), so the GLUE reader and `configs/finetune/glue.py:task=rte` read it unchanged. It is not
RTE and not GLUE: sentence2 is the sentence after sentence1 in the same document of Python's documentation (the
built-in corpus, `bert_jax.data.builtin_corpus`) for "entailment", or a sentence of another document for
"not_entailment", half each: BERT's next-sentence prediction as a sentence-pair task. Word overlap alone gets part
of the way, so a model learns it in minutes; the demo pre-trains on the same text with the same objective, so its
dev score says the pipeline works, not how well a model understands language.

Documents, not pairs, are split into train, dev and test, and a sentence that an earlier split's documents also hold
is left out, so no sentence is in two splits. The files are the same bytes on every run with one Python version (the
corpus is, and the shuffles are seeded).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from bert_jax import paths
from bert_jax.data import builtin_corpus

LABELS = ("entailment", "not_entailment")
SPLIT_SIZES = {"train": 2000, "dev": 400, "test": 400}
# Sentences within this many words: long enough to carry a topic, short enough that a pair fits 128 tokens.
MIN_WORDS, MAX_WORDS = 4, 40
_SEED = 0
_ABOUT = ("A sample task in RTE's layout, written by `bert-jax sample-rte` from the built-in corpus (Python's "
          "documentation): sentence2 follows sentence1 in the same document (entailment) or comes from another "
          "document (not_entailment). It is not GLUE's RTE; it is for trying the fine-tuning pipeline.\n")


def _pairs(documents: list[list[str]], count: int, taken: set[str],
           rng: np.random.Generator) -> list[tuple[str, str, str]]:
  """`count` (sentence1, sentence2, label) rows from `documents`, half of each label, in shuffled order; no
  sentence of `taken` (the earlier splits': docstrings repeat sentences across documents) is used.

  Raises:
    ValueError: the documents hold fewer than `count` usable consecutive pairs.
  """
  def usable(sentence: str) -> bool:
    return MIN_WORDS <= len(sentence.split()) <= MAX_WORDS and sentence not in taken

  adjacent = [(index, first, second) for index, document in enumerate(documents)
              for first, second in zip(document, document[1:]) if usable(first) and usable(second)]
  if len(adjacent) < count:
    raise ValueError(f"the built-in corpus has {len(adjacent)} usable sentence pairs for a split of {count}")
  pool = [(index, sentence) for index, document in enumerate(documents) for sentence in document if usable(sentence)]
  rows = []
  for position, pair_index in enumerate(rng.permutation(len(adjacent))[:count]):
    document, first, second = adjacent[pair_index]
    label = LABELS[position % 2]
    if label == "not_entailment":
      while True:  # another document's sentence; a split has dozens of documents, so this ends at once
        other_document, second = pool[rng.integers(len(pool))]
        if other_document != document:
          break
    rows.append((first, second, label))
  return [rows[i] for i in rng.permutation(len(rows))]


def _tsv(rows: list[tuple[str, str, str]], labelled: bool) -> str:
  header = "index\tsentence1\tsentence2" + ("\tlabel" if labelled else "")
  lines = [f"{index}\t{first}\t{second}" + (f"\t{label}" if labelled else "")
           for index, (first, second, label) in enumerate(rows)]
  return "\n".join([header, *lines]) + "\n"


def write_sample_rte(out_dir: str, force: bool = False) -> dict[str, int]:
  """Writes OUT/RTE/{train,dev,test}.tsv and OUT/README.txt; returns each split's row count.

  Raises:
    ValueError: `out_dir` is a file, or a non-empty folder that holds no earlier sample, without `force`.
  """
  out = paths.as_path(out_dir)
  if out.exists() and not out.is_dir():
    raise ValueError(f"--out {out_dir} is a file; give a new or empty folder")
  present = sorted(path.name for path in out.iterdir()) if out.exists() else []
  earlier_sample = (out / "README.txt").exists() and (out / "README.txt").read_text() == _ABOUT
  if present and not (force or earlier_sample):  # rewriting an earlier sample gives the same bytes
    raise ValueError(f"--out {out_dir} is not empty ({', '.join(present[:5])}); give a new or empty folder, or "
                     "--force to write RTE/train.tsv, dev.tsv, test.tsv and README.txt over what is there")
  rng = np.random.default_rng(_SEED)
  # Sentences with single spaces: a tab or newline would break the TSV.
  documents = [[" ".join(sentence.split()) for sentence in document]
               for document in builtin_corpus.iter_builtin_documents()]
  order = rng.permutation(len(documents))
  # Documents are dealt to the splits in proportion to the rows each needs.
  total = sum(SPLIT_SIZES.values())
  bounds = np.cumsum([0] + [round(len(documents) * size / total) for size in SPLIT_SIZES.values()])
  bounds[-1] = len(documents)
  # README.txt first: a run killed mid-way leaves a folder that a rerun knows as its own and writes again.
  paths.write_text(out / "README.txt", _ABOUT)
  counts, taken = {}, set()
  for (split, size), start, stop in zip(SPLIT_SIZES.items(), bounds[:-1], bounds[1:]):
    split_documents = [documents[i] for i in order[start:stop]]
    rows = _pairs(split_documents, size, taken, rng)
    taken.update(sentence for document in split_documents for sentence in document)
    paths.write_text(out / "RTE" / f"{split}.tsv", _tsv(rows, labelled=split != "test"))
    counts[split] = len(rows)
  return counts


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="bert-jax sample-rte", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="folder to write RTE/*.tsv in (the fine-tuning data_dir)")
  parser.add_argument("--force", action="store_true", help="write into a non-empty --out, over its RTE files")
  args = parser.parse_args(argv)
  counts = write_sample_rte(args.out, force=args.force)
  print(f"wrote {args.out}/RTE/train.tsv, dev.tsv, test.tsv ({counts['train']:,}, {counts['dev']:,} and "
        f"{counts['test']:,} pairs): a sample task in RTE's layout from Python's documentation, not GLUE "
        f"(README.txt says what it is)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
