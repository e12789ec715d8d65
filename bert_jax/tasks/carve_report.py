"""How much SST-2's old random dev carve leaked into its train split, against the sentence carve that replaced it.

SST-2's train file holds every phrase of the parse trees of ~7k sentences. The old carve held out 872 random rows
(`np.random.default_rng(0).permutation(rows)[:872]`), so most dev phrases had a piece of their sentence in train;
`glue.carve_sentence_dev` holds out 872 whole sentences and drops every train row inside one. For each carve the
report gives the split sizes, the fraction of dev examples contained in a train example and containing one (at word
boundaries, equal texts included), the same against the fixed subset the `scale=gpu` suites fine-tune on, and the
accuracy of copying a containing (else contained) train example's label.

  python -m bert_jax.tasks.carve_report ../shared/data/glue/SST-2/train.tsv --out docs/reproductions/sst2_dev_carve.json
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import pathlib
from typing import Any, Sequence

import numpy as np

from bert_jax.experiments.suite import GPU_TRAIN_EXAMPLES
from bert_jax.tasks import glue
from bert_jax.tasks.evaluate import subset

DEV_ROWS = 872
SEED = 0
CONTAINMENT = ('phrase a is contained in phrase b when f" {a} " in f" {b} " on the whitespace-tokenised texts '
               "(words joined by single spaces): containment at word boundaries, equal texts included")
SUBSET = (f"the {GPU_TRAIN_EXAMPLES} training examples of scale=gpu (train_examples=GPU_TRAIN_EXAMPLES): "
          f"np.sort(np.random.default_rng(0).choice(len(train), {GPU_TRAIN_EXAMPLES}, replace=False)) over the "
          "carved train split's rows in file order (bert_jax.tasks.evaluate.subset)")
COPY_LABEL = ("the label of the longest train example containing the dev example, else of the longest one it "
              "contains, else the train examples' majority label (ties: the first in file order)")


def old_random_carve(rows: Sequence[str]) -> tuple[list[str], list[str]]:
  """The carve bench/finetune_vs_reference.py used before: 872 random rows held out, both sides in file order."""
  held_out = set(np.random.default_rng(SEED).permutation(len(rows))[:DEV_ROWS].tolist())
  return ([row for i, row in enumerate(rows) if i not in held_out],
          [row for i, row in enumerate(rows) if i in held_out])


def _label(row: str) -> str:
  return row.rsplit("\t", 1)[1]


def overlap(dev: Sequence[str], train: Sequence[str]) -> dict[str, Any]:
  """Containment of dev examples in train examples and back, and the copy-the-label baseline (`COPY_LABEL`)."""
  train_texts = [glue.phrase_text(row) for row in train]
  train_lengths = [text.count(" ") + 1 for text in train_texts]
  # Every train text once, framed by spaces and ended by a newline: a framed dev text found in it lies in one row.
  joined = "".join(f" {text} \n" for text in train_texts)
  starts = np.cumsum([0] + [len(text) + 3 for text in train_texts]).tolist()
  first_index = {}
  for index, text in enumerate(train_texts):
    first_index.setdefault(text, index)
  labels = collections.Counter(_label(row) for row in train)
  majority = max(sorted(labels), key=labels.__getitem__)
  counts = collections.Counter()
  for row in dev:
    text = glue.phrase_text(row)
    pattern = f" {text} "
    containing = -1
    position = joined.find(pattern)
    while position != -1:
      index = bisect.bisect_right(starts, position) - 1
      if containing < 0 or train_lengths[index] > train_lengths[containing]:
        containing = index
      position = joined.find(pattern, starts[index + 1])
    words = text.split(" ")
    contained = -1
    for length in range(len(words), 0, -1):
      found = [first_index[gram] for gram in (" ".join(words[i:i + length]) for i in range(len(words) - length + 1))
               if gram in first_index]
      if found:
        contained = min(found)
        break
    if containing >= 0:
      source, predicted = "from_containing", _label(train[containing])
    elif contained >= 0:
      source, predicted = "from_contained", _label(train[contained])
    else:
      source, predicted = "from_majority", majority
    correct = predicted == _label(row)
    counts.update({"in_train": containing >= 0, "contains_train": contained >= 0,
                   "either": containing >= 0 or contained >= 0, "identical": text in first_index,
                   source: 1, f"{source}_correct": correct, "correct": correct,
                   "majority_correct": _label(row) == majority})
  size = len(dev)
  return {
      "dev_in_train": counts["in_train"] / size,
      "dev_contains_train": counts["contains_train"] / size,
      "dev_in_or_contains_train": counts["either"] / size,
      "dev_identical_to_train": counts["identical"] / size,
      "copy_label_accuracy": counts["correct"] / size,
      "copy_label_sources": {source: {"examples": counts[source],
                                      "accuracy": counts[f"{source}_correct"] / counts[source] if counts[source]
                                      else None}
                             for source in ("from_containing", "from_contained", "from_majority")},
      "majority_label": majority,
      "majority_label_accuracy": counts["majority_correct"] / size,
  }


def _carve_summary(header: str, train: list[str], dev: list[str]) -> dict[str, Any]:
  chosen = subset(train, GPU_TRAIN_EXAMPLES)
  return {
      "dev_rows": len(dev), "train_rows": len(train),
      "dev_labels": dict(sorted(collections.Counter(_label(row) for row in dev).items())),
      "sha256_dev": glue.bytes_fingerprint(glue.tsv_text(header, dev).encode("utf-8")),
      "sha256_train": glue.bytes_fingerprint(glue.tsv_text(header, train).encode("utf-8")),
      "vs_train": overlap(dev, train),
      f"vs_train_subset_{GPU_TRAIN_EXAMPLES}": overlap(dev, chosen),
  }


def carve_report(train_file: str | pathlib.Path) -> dict[str, Any]:
  """The old random carve and the sentence carve of SST-2's train file, measured as the module docstring says."""
  train_file = pathlib.Path(train_file)
  header, *rows = train_file.read_text(encoding="utf-8").splitlines()
  return {
      "train_file": {"name": f"{train_file.parent.name}/{train_file.name}", "rows": len(rows),
                     "sha256": glue.dev_set_fingerprint(train_file)},
      "containment": CONTAINMENT,
      "train_subset": SUBSET,
      "copy_label": COPY_LABEL,
      "old": {"method": f"random rows: np.random.default_rng({SEED}).permutation(rows)[:{DEV_ROWS}] held out",
              **_carve_summary(header, *old_random_carve(rows))},
      "new": {"method": glue.SENTENCE_CARVE_METHOD + f" (glue.carve_sentence_dev, size {DEV_ROWS}, seed {SEED})",
              **_carve_summary(header, *glue.carve_sentence_dev(rows, DEV_ROWS, SEED))},
  }


def markdown_table(report: dict[str, Any]) -> str:
  """The report's numbers, old carve against new, as a markdown table."""
  subset_key = f"vs_train_subset_{GPU_TRAIN_EXAMPLES}"
  lines = ["| | old (random rows) | new (sentences) |", "| --- | ---: | ---: |"]
  for name, value in (("dev rows", lambda c: f"{c['dev_rows']}"), ("train rows", lambda c: f"{c['train_rows']}")):
    lines.append(f"| {name} | {value(report['old'])} | {value(report['new'])} |")
  for against, key in (("train", "vs_train"), (f"{GPU_TRAIN_EXAMPLES}-example subset", subset_key)):
    for name, metric in (("dev in a train example", "dev_in_train"),
                         ("dev contains a train example", "dev_contains_train"),
                         ("copy-label accuracy", "copy_label_accuracy"),
                         ("majority-label accuracy", "majority_label_accuracy")):
      lines.append(f"| {name} ({against}) | {report['old'][key][metric]:.1%} | {report['new'][key][metric]:.1%} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("train_file", help="SST-2's train.tsv")
  parser.add_argument("--out", help="write the report here as JSON")
  args = parser.parse_args(argv)
  report = carve_report(args.train_file)
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
  print(markdown_table(report))


if __name__ == "__main__":
  main()
