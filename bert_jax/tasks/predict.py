"""`bert-jax predict`: a fine-tuned model's predictions for the examples of one file.

  bert-jax predict --workdir runs/sst2 --input reviews.tsv --output predictions.jsonl
  bert-jax predict --workdir runs/squad --input dev-v1.1.json --output predictions.json --format submission

The input is read by the task (`Task.read_file`), labelled or not: a GLUE TSV
of the run's task (train/dev or test layout) or JSON lines of its field names,
a CoNLL file (only the word column is read) or JSON lines of {"tokens": [...]},
SQuAD JSON, a swagaf CSV. A field of the wrong type (a null or numeric text) is refused naming its file and line
(JSON: its path); so is an --output that is the input file or a link to it.

Output formats:
  jsonl       (default) one JSON object per example: {"id", "label", "probabilities"} for classification,
              {"id", "score"} for regression, {"id", "answer"} for SQuAD ("" is no answer), {"id", "choice"}
              for SWAG, {"words", "tags"} for NER.
  submission  the task's own: GLUE's `index<TAB>prediction` TSV, SQuAD's predictions.json ({id: answer}),
              CoNLL lines of `word tag` (blank lines between sentences, -DOCSTART- between documents).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Any, Sequence

import jax
import numpy as np

from bert_jax import progress as progress_lib
from bert_jax.tasks.base import Task
from bert_jax.tasks.inference import length_buckets, load_for_inference
from bert_jax.tasks.kinds import task_kind

FORMATS = ("jsonl", "submission")


def prediction_records(task: Task, predictions: Any, outputs: np.ndarray, examples: Sequence[Any]) -> list[dict]:
  """One JSON-ready record per example (see the module docstring; its kind's `TaskKind.records`), in example
  order."""
  return task_kind(task.kind).records(task.labels, predictions, outputs, examples)


def submission_text(task: Task, predictions: Any, examples: Sequence[Any]) -> str:
  """The task's submission file for `predictions` (see the module docstring; `Task.submission_text`)."""
  try:
    return task.submission_text(examples, predictions)
  except NotImplementedError as error:
    raise ValueError(f"--format submission: {error}; use --format jsonl") from None


def predict_file(workdir: str, input_path: str, output_path: str, seed: int | None = None,
                 batch_size: int | None = None, output_format: str = "jsonl") -> dict[str, Any]:
  """Writes the predictions of `workdir`'s model for the examples in `input_path` to `output_path`.

  Returns:
    examples, rows (features), seconds, output, and the model's task, seed and max_len.
  """
  if output_format not in FORMATS:
    raise ValueError(f"--format {output_format!r}: expected one of {FORMATS}")
  source = pathlib.Path(input_path)
  if not source.is_file():
    raise FileNotFoundError(f"--input {input_path}: no such file")
  output = pathlib.Path(output_path)
  if output.exists() and output.samefile(source):  # samefile: the same inode, so hard and symbolic links too.
    raise ValueError(f"--output {output_path} is the input file {input_path} (the same path or a link to it); "
                     "writing there would overwrite the examples: choose another --output")
  model = load_for_inference(workdir, seed)
  examples = model.task.read_file(source)
  features = model.featurize(examples)
  rows = len(features["input_ids"])
  print(f"bert_jax predict: task={model.task.name} ({model.task.kind}) seed={model.seed} examples={len(examples)} "
        f"rows={rows} batch={batch_size or model.batch_size} lengths={list(length_buckets(model.max_len))}",
        flush=True)
  progress = progress_lib.Progress(rows, "predict", unit="row")
  started = time.perf_counter()
  outputs = model.predict_outputs(features, batch_size, progress)
  progress.close()
  seconds = time.perf_counter() - started
  predictions = model.task.predict(outputs, features, examples)
  if output_format == "submission":
    text = submission_text(model.task, predictions, examples)
  else:
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n"
                   for record in prediction_records(model.task, predictions, outputs, examples))
  if jax.process_index() == 0:
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
  return {"examples": len(examples), "rows": rows, "seconds": seconds, "output": str(output_path),
          "task": model.task.name, "seed": model.seed, "max_len": model.max_len}


def main(argv: list[str]) -> int:
  """bert-jax predict --workdir DIR --input FILE --output FILE [--seed S] [--batch-size N] [--format FORMAT]."""
  parser = argparse.ArgumentParser(prog="bert-jax predict", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  parser.add_argument("--workdir", required=True, help="a fine-tuning run, or the pruned model of `analyze`")
  parser.add_argument("--input", required=True, help="examples of the run's task (TSV, JSON lines, CoNLL, ...)")
  parser.add_argument("--output", required=True, help="where the predictions go")
  parser.add_argument("--seed", type=int, help="the fine-tuning seed whose parameters predict (default: the best)")
  parser.add_argument("--batch-size", type=int, help="rows per batch (default: the run's eval batch size)")
  parser.add_argument("--format", default="jsonl", choices=FORMATS, help="jsonl, or the task's submission format")
  args = parser.parse_args(argv)
  result = predict_file(args.workdir, args.input, args.output, args.seed, args.batch_size, args.format)
  print(f"wrote {result['examples']} predictions to {result['output']} ({result['rows']} rows in "
        f"{result['seconds']:.1f} s)")
  return 0
