"""The downstream suite of an ablation table: which tasks, seeds, learning-rate grid, epochs and max length.

Each table config (`configs/ablations/*.py`) holds a `SUITE` with its paper's
protocol; `scaled(SUITE, scale)` gives the budget of a scale ("paper": the protocol;
"gpu": every task whose data is public (`GPU_TASKS`), whatever the paper reported, on at most
`GPU_TRAIN_EXAMPLES` training examples each, 3 seeds, one learning rate, scored at the end of training;
"tiny": one small task, 2 seeds, one epoch). For every task the runner fine-tunes each (learning rate, seed) from
the row's final pre-training checkpoint; `summarize` picks the learning rate
with the best dev median over seeds and reports that learning rate's median
with its spread (std, min, max) over the seeds.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Mapping, Sequence

SCALES = ("paper", "gpu", "tiny")
# The tasks a `scale=gpu` row fine-tunes: the GLUE tasks with at most ~70k training rows (SST-2's dev carved from
# its train file, see `bert_jax/experiments/carry.py`), SQuAD v1.1 (an article split of its dev file) and CoNLL-2003
# NER.
GPU_TASKS = ("cola", "sst2", "mrpc", "stsb", "rte", "squad1.1_f1", "conll2003_f1")
# Small encoders trained briefly fine-tune best at the top of the BERT grid (Turc et al. 2019 use 1e-4 to 3e-5).
GPU_LR = 1e-4
# The same fixed subset of every larger training set (SST-2, SQuAD, CoNLL-2003, CoLA), so that four rows' suites
# run side by side on one GPU after their pre-training within one ten-minute call.
GPU_TRAIN_EXAMPLES = 6000


@dataclasses.dataclass(frozen=True)
class SuiteTask:
  """One downstream column.

  Attributes:
    name: our column name (e.g. "mnli_m", "squad1.1_f1").
    config: fine-tuning config spec (`configs/finetune/...py:arg`).
    metric: the metric of `split` reported (the task's `summary` key).
    split: the evaluation split read.
    data: which `--data-dir KIND=PATH` root the task reads ("glue", "squad", "conll2003", "race").
    label: the column's heading where a table's PUBLISHED names none.
  """
  name: str
  config: str
  metric: str
  split: str = "dev"
  data: str = "glue"
  label: str = ""


GLUE = {
    "mnli_m": SuiteTask("mnli_m", "finetune/glue.py:task=mnli", "accuracy", "dev_matched", label="MNLI-m (Acc)"),
    "qnli": SuiteTask("qnli", "finetune/glue.py:task=qnli", "accuracy", label="QNLI (Acc)"),
    "qqp": SuiteTask("qqp", "finetune/glue.py:task=qqp", "accuracy", label="QQP (Acc)"),
    "mrpc": SuiteTask("mrpc", "finetune/glue.py:task=mrpc", "accuracy", label="MRPC (Acc)"),
    "sst2": SuiteTask("sst2", "finetune/glue.py:task=sst2", "accuracy", label="SST-2 (Acc)"),
    "cola": SuiteTask("cola", "finetune/glue.py:task=cola", "mcc", label="CoLA (MCC)"),
    "stsb": SuiteTask("stsb", "finetune/glue.py:task=stsb", "spearman", label="STS-B (Spearman)"),
    "rte": SuiteTask("rte", "finetune/glue.py:task=rte", "accuracy", label="RTE (Acc)"),
}
SQUAD = {
    "squad1.1_f1": SuiteTask("squad1.1_f1", "finetune/squad.py:version=1.1", "f1", data="squad",
                             label="SQuAD 1.1 (F1)"),
    "squad2.0_f1": SuiteTask("squad2.0_f1", "finetune/squad.py:version=2.0", "best_f1", data="squad",
                             label="SQuAD 2.0 (F1)"),
}
OTHER = {
    "conll2003_f1": SuiteTask("conll2003_f1", "finetune/ner.py", "f1", data="conll2003", label="CoNLL-2003 NER (F1)"),
    # RACE has no task in bert_jax/tasks yet: this column fails with that error (a row's other tasks still run).
    "race": SuiteTask("race", "finetune/race.py", "accuracy", data="race", label="RACE (Acc)"),
}
TASKS = {**GLUE, **SQUAD, **OTHER}


# A table's sentence-task columns -> (objective, example format) that scores them. A row trained with another
# objective is scored on them too (ALBERT's cross-evaluation; `trainer.evaluate_run`).
SENTENCE_COLUMNS = {"nsp_acc": ("mlm+nsp", "segment_pair"), "sop_acc": ("mlm+sop", "sop")}


@dataclasses.dataclass(frozen=True)
class Suite:
  """A table's fine-tuning protocol.

  Attributes:
    tasks: column names (keys of `TASKS`).
    seeds: one fine-tuning run per seed and learning rate.
    lrs: the learning-rate grid; the best is chosen by the dev median over seeds.
    epochs, max_len, batch_size: fine-tuning length, longest row and global batch (None: the task
      config's own recipe, BERT's protocol: 3 epochs, 128 tokens for GLUE, 384 for SQuAD, batch 32).
    train_examples: train on a fixed subset of this many examples of each task (None: all).
    overrides: further `key=value` fine-tuning config overrides for every task.
    tiny_task: the one task a `scale=tiny` run fine-tunes.
  """
  tasks: tuple[str, ...]
  seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
  lrs: tuple[float, ...] = (5e-5, 3e-5, 2e-5)
  epochs: int | None = None
  max_len: int | None = None
  batch_size: int | None = None
  train_examples: int | None = None
  overrides: tuple[str, ...] = ()
  tiny_task: str = "rte"

  def __post_init__(self):
    unknown = [name for name in (*self.tasks, self.tiny_task) if name not in TASKS]
    if unknown:
      raise ValueError(f"suite tasks {unknown} are unknown; known: {sorted(TASKS)}")


def scaled(suite: Suite, scale: str) -> Suite:
  """The suite at a scale: the paper's protocol, three seeds for one GPU, or one quick task for a CPU."""
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
  if scale == "paper":
    return suite
  if scale == "gpu":
    # The same tasks for every table, three seeds, one lr, the last evaluation (no pick of the best epoch on dev);
    # 4 steps a jitted call, as the rows' pre-training: small models' steps are shorter than the host's cost of a call.
    # Rows padded to max_len: a row's four binary GLUE tasks then share one compilation, which costs more than
    # their training at this size.
    return dataclasses.replace(suite, tasks=GPU_TASKS, seeds=suite.seeds[:3], lrs=(GPU_LR,),
                               train_examples=GPU_TRAIN_EXAMPLES,
                               overrides=(*suite.overrides, "train.eval_every=end", "train.selection=last",
                                          "train.steps_per_call=4", "pad_to_max_len=True"))
  return dataclasses.replace(suite, tasks=(suite.tiny_task,), seeds=(1, 2), lrs=(3e-3,), epochs=1, max_len=64,
                             batch_size=16, overrides=(*suite.overrides, "train.eval_batch_size=32"))


def summarize(scores: Mapping[float, Sequence[float]], higher_is_better: bool = True) -> dict[str, Any]:
  """{lr: [score per seed]} -> the best learning rate by median, its median and spread over seeds."""
  medians = {lr: statistics.median(values) for lr, values in scores.items() if values}
  if not medians:
    raise ValueError("no fine-tuning scores to summarise")
  pick = max if higher_is_better else min
  best_lr = pick(medians, key=lambda lr: (medians[lr], -lr))
  values = list(scores[best_lr])
  return {"best_lr": best_lr, "median": medians[best_lr], "mean": statistics.fmean(values),
          "std": statistics.stdev(values) if len(values) > 1 else 0.0, "min": min(values), "max": max(values),
          "values": values, "median_per_lr": {str(lr): median for lr, median in medians.items()}}
