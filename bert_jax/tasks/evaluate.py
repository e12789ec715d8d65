"""`bert-jax evaluate`, and the scoring a fine-tuning run shares with it: a task's splits read and featurised,
a model's outputs for every row, the task's metrics, the seeds' summary and results.md.

  bert-jax evaluate --workdir runs/rte [--split dev|test] [--seed 1] [--data-dir DIR]

"dev" re-scores the saved checkpoints on the task's evaluation splits (evaluate_dev.json); "test" writes GLUE
submission files (submission/seed_<s>/TASK.tsv) or, for other tasks, predictions/seed_<s>/<split>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from typing import Any, Sequence

import jax
import numpy as np

from bert_jax import paths
from bert_jax.tasks.base import Task
from bert_jax.tasks.batching import BatchMaker, padded_length, trim_features
from bert_jax.tasks.finetune_config import finetune_defaults
from bert_jax.tasks.finetune_model import RUN_FILE, device_fields
from bert_jax.tasks.glue import GlueTask
from bert_jax.tasks.inference import load_for_inference
from bert_jax.train import run as run_lib


@dataclasses.dataclass
class EvalSet:
  """One evaluation split: its examples and (trimmed) features."""

  split: str
  examples: list[Any]
  features: dict[str, np.ndarray]


def load_split(task: Task, data_dir: str, split: str) -> list[Any]:
  """A split from task files, or from TFDS when data_dir is "tfds" or "tfds:TFDS_DATA_DIR"."""
  if data_dir == "tfds" or data_dir.startswith("tfds:"):
    if not hasattr(task, "load_tfds"):
      raise ValueError(f"config.data_dir={data_dir!r}: task {task.name} has no TFDS source; give its files")
    return task.load_tfds(split, data_dir=data_dir.partition(":")[2] or None)
  return task.load(data_dir, split)


def subset(examples: list[Any], count: int | None) -> list[Any]:
  """`count` of the examples, drawn without replacement by a fixed generator and kept in file order: the same
  subset for every seed and model (all of them when count is None or at least their number)."""
  if count is None or count >= len(examples):
    return examples
  keep = np.sort(np.random.default_rng(0).choice(len(examples), count, replace=False))
  return [examples[i] for i in keep]


def featurize(task: Task, examples: list[Any], tokenizer, max_len: int, what: str) -> dict[str, np.ndarray]:
  if not examples:
    raise ValueError(f"{task.name}: the {what} split has no examples")
  return task.featurize(examples, tokenizer, max_len)


def read_task_data(task: Task, data_dir: str, tokenizer, max_len: int, train_examples: int | None,
                   pad_to_max_len: bool) -> tuple[dict[str, np.ndarray], list[EvalSet], int]:
  """A fine-tuning run's data: (the train split's features, an `EvalSet` per evaluation split, the padded length).

  Every split is padded to one length: the longest feature of them all rounded up to 8 (`padded_length`), or
  max_len with `pad_to_max_len`; `train_examples` rows of train (`subset`), or all of them for None.
  """
  train = featurize(task, subset(load_split(task, data_dir, "train"), train_examples), tokenizer, max_len, "train")
  examples = {split: load_split(task, data_dir, split) for split in task.eval_splits}
  features = {split: featurize(task, examples[split], tokenizer, max_len, split) for split in task.eval_splits}
  seq_len = max_len if pad_to_max_len else padded_length([train, *features.values()], max_len)
  eval_sets = [EvalSet(split, examples[split], trim_features(features[split], task.kind, max_len, seq_len))
               for split in task.eval_splits]
  return trim_features(train, task.kind, max_len, seq_len), eval_sets, seq_len


@dataclasses.dataclass
class Selection:
  """One seed's evaluations so far and the one selected: the best on the task's selection metric of the first
  evaluation split (ties keep the earlier), or with `keep_last` the newest; its seconds of training and evaluation.
  A stopped seed saves it (`dataclasses.asdict`) with its training state."""

  selected: dict[str, Any] | None = None
  history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  evaluations_since_best: int = 0  # early stopping's count
  train_seconds: float = 0.0
  eval_seconds: float = 0.0

  def add(self, record: dict[str, Any], task: Task, keep_last: bool) -> bool:
    """Adds an evaluation (`{"step", "epoch", "metrics": {split: metrics}}`); returns whether it is selected now."""
    self.history.append(record)
    split, metric = task.eval_splits[0], task.selection_metric
    improved = self.selected is None or record["metrics"][split][metric] > self.selected["metrics"][split][metric]
    self.evaluations_since_best = 0 if improved else self.evaluations_since_best + 1
    if keep_last or improved:
      self.selected = record
    return keep_last or improved


def predict_outputs(predict_step, params, features: dict[str, np.ndarray], make_batch: BatchMaker) -> np.ndarray:
  """Raw head outputs for every feature row, in order, padding rows dropped."""
  num_rows = len(features["input_ids"])
  pending = []
  for start in range(0, num_rows, make_batch.batch_size):
    rows = np.arange(start, min(start + make_batch.batch_size, num_rows))
    pending.append((len(rows), predict_step(params, make_batch(features, rows, 0))))
  return np.concatenate([np.asarray(outputs)[:count] for count, outputs in pending])


def evaluate_splits(task: Task, predict_step, params, eval_sets: Sequence[EvalSet],
                    make_batch: BatchMaker) -> dict[str, dict[str, float]]:
  """{split: task metrics} for each evaluation split."""
  return {eval_set.split: task.evaluate(predict_outputs(predict_step, params, eval_set.features, make_batch),
                                        eval_set.features, eval_set.examples)
          for eval_set in eval_sets}


def summarize_seeds(task: Task, seed_results: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
  """{split: {metric: {mean, median, std, min, max, values}}} over seeds (std with n - 1; 0 for one seed)."""
  summary: dict[str, dict[str, dict[str, Any]]] = {}
  for split in task.eval_splits:
    summary[split] = {}
    for metric in task.metric_names:
      values = [result["selected"]["metrics"][split][metric] for result in seed_results]
      summary[split][metric] = {
          "mean": statistics.fmean(values), "median": statistics.median(values),
          "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values),
          "values": values}
  return summary


def results_markdown(results: dict[str, Any]) -> str:
  """results.md: the run's header and one table row per (split, metric)."""
  seeds = [r["seed"] for r in results["seeds"]]
  train_seconds = [r["train_seconds"] for r in results["seeds"]]
  lines = [f"# {results['task']} fine-tuning", "",
           f"- initial model: {results['init']['path']} ({results['init']['source']})",
           *([f"- distilled from: {results['distill']['teacher']} ("
              + ", ".join(f"{k}={v}" for k, v in results["distill"].items() if k != "teacher") + ")"]
             if results.get("distill") else []),
           f"- seeds: {', '.join(map(str, seeds))}; best seed: {results['best_seed']}",
           f"- selection: {results['selection_rule']}",
           f"- train time per seed (s): {', '.join(f'{seconds:.1f}' for seconds in train_seconds)}",
           *[f"- {phase} (s): {seconds:.1f}" for phase, seconds in results.get("timings", {}).items()], "",
           f"| split | metric | mean | median | std | min | max | per seed ({', '.join(map(str, seeds))}) |",
           "|---|---|---|---|---|---|---|---|"]
  for split, metrics in results["summary"].items():
    for metric, stats in metrics.items():
      lines.append(f"| {split} | {metric} | {stats['mean']:.2f} | {stats['median']:.2f} | {stats['std']:.2f} | "
                   f"{stats['min']:.2f} | {stats['max']:.2f} | {', '.join(f'{v:.2f}' for v in stats['values'])} |")
  return "\n".join(lines) + "\n"


def _test_splits(task: Task) -> tuple[str, ...]:
  return tuple(task.spec.submissions) if isinstance(task, GlueTask) else ("test",)


def evaluate_run(workdir: str | os.PathLike, split: str = "dev", seeds: Sequence[int] | None = None,
                 data_dir: str | None = None) -> dict[int, dict[str, Any]]:
  """Re-scores the saved checkpoints of a fine-tuning run.

  Args:
    workdir: a finished `finetune` workdir, or a `bert-jax quantize` folder (it holds quantization.json).
    split: "dev" scores the task's evaluation splits and writes
      evaluate_dev.json; "test" predicts the test splits and writes GLUE
      submission files (submission/seed_<s>/TASK.tsv) or, for other tasks,
      predictions/seed_<s>/<split>.json.
    seeds: which seeds; None for all of the run's.
    data_dir: where the task's files are; None for the run's config.data_dir.

  Returns:
    {seed: {split: metrics}} for dev, {seed: {split: written file}} for test.
  """
  if split not in ("dev", "test"):
    raise ValueError(f"split must be 'dev' or 'test', got {split!r}")
  model = load_for_inference(workdir, seeds[0] if seeds else None)
  workdir, task = model.source, model.task
  run_info = json.loads((workdir / RUN_FILE).read_text())
  data_dir = data_dir or run_lib.saved_config(workdir, finetune_defaults()).data_dir
  splits = task.eval_splits if split == "dev" else _test_splits(task)
  eval_sets = []
  for name in splits:
    examples = load_split(task, data_dir, name)
    features = featurize(task, examples, model.tokenizer, model.max_len, name)
    # The fine-tuning evaluation's padded length (or longer, for longer rows), so its scores come back exactly.
    seq_len = max(run_info["seq_len"], padded_length([features], model.max_len))
    eval_sets.append(EvalSet(name, examples, trim_features(features, task.kind, model.max_len, seq_len)))
  make_batch = BatchMaker(device_fields(task.kind), model.batch_size, model.partitioning.mesh)
  outcome: dict[int, dict[str, Any]] = {}
  for seed in seeds or run_info["seeds"]:
    model = model.with_seed(seed) if seed != model.seed else model
    predict_step, params = model.predict_step, model.params
    if split == "dev":
      outcome[seed] = evaluate_splits(task, predict_step, params, eval_sets, make_batch)
      continue
    outcome[seed] = {}
    for eval_set in eval_sets:
      outputs = predict_outputs(predict_step, params, eval_set.features, make_batch)
      predictions = task.predict(outputs, eval_set.features, eval_set.examples)
      if isinstance(task, GlueTask):
        path = task.write_submission(workdir / "submission" / f"seed_{seed}", eval_set.split, eval_set.examples,
                                     predictions)
      else:
        path = workdir / "predictions" / f"seed_{seed}" / f"{eval_set.split}.json"
        if jax.process_index() == 0:
          path.parent.mkdir(parents=True, exist_ok=True)
          paths.write_json(path, predictions)
      outcome[seed][eval_set.split] = str(path)
  if split == "dev" and jax.process_index() == 0:
    paths.write_json(workdir / "evaluate_dev.json", outcome)
  return outcome


def main(argv: list[str]) -> int:
  """bert-jax evaluate --workdir DIR [--split dev|test] [--seed S] [--data-dir DIR]."""
  parser = argparse.ArgumentParser(prog="bert-jax evaluate", description=main.__doc__, allow_abbrev=False)
  parser.add_argument("--workdir", required=True, help="a finished fine-tuning run")
  parser.add_argument("--split", default="dev", choices=("dev", "test"))
  parser.add_argument("--seed", type=int, action="append", help="seed to score (repeatable; default all)")
  parser.add_argument("--data-dir", help="task files (default: the run's config.data_dir)")
  args = parser.parse_args(argv)
  outcome = evaluate_run(args.workdir, args.split, args.seed, args.data_dir)
  if jax.process_index() == 0:
    for seed, per_split in outcome.items():
      for split, value in per_split.items():
        shown = ", ".join(f"{k}={v:.2f}" for k, v in value.items()) if isinstance(value, dict) else value
        print(f"seed {seed} {split}: {shown}")
  return 0
