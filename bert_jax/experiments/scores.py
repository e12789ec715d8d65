"""A sweep's row scored on one column: what `bert-jax table` prints, the findings judge and their pages label.

Below table.py, findings.py and report.py, which all read rows through it; it imports none of them.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from bert_jax.experiments import suite as suite_lib

# Columns read from the pre-training evaluation: our name -> (eval key, scale to the paper's units).
INTRINSIC = {"mlm_ppl": ("mlm_perplexity", 1.0), "mlm_acc": ("mlm_accuracy", 100.0),
             "nsp_acc": ("sentence_accuracy", 100.0), "sop_acc": ("sentence_accuracy", 100.0)}


def glue_score(row: dict[str, Any], tasks: Sequence[str]) -> dict[str, float] | None:
  """The GLUE score as ELECTRA reports it, the mean over GLUE tasks (CoLA's MCC, STS-B's Spearman, the others'
  accuracy), over the suite's GLUE `tasks`: per seed, then {median, std, min, max} over the seeds. None unless the
  row has every one of them with the same number of seeds."""
  glue = [task for task in tasks if task in suite_lib.GLUE]
  scored = [row["tasks"].get(task) for task in glue]
  if not glue or any(s is None or len(s.get("values", [])) != len(scored[0].get("values", [])) for s in scored):
    return None
  per_seed = [sum(values) / len(values) for values in zip(*(s["values"] for s in scored))]
  if not per_seed:
    return None
  return {"median": statistics.median(per_seed), "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
          "min": min(per_seed), "max": max(per_seed)}


def ours(row: dict[str, Any], column: str, tasks: Sequence[str] = ()) -> dict[str, float] | None:
  """{median, std, min, max} of our value of `column` for `row`, or None when it was not measured; `tasks` are
  the suite's (the "glue" column averages its GLUE tasks)."""
  if column == "glue":
    return glue_score(row, tasks)
  if column in INTRINSIC:
    pretrain = row.get("pretrain") or {}
    key, scale = INTRINSIC[column]
    evaluation = pretrain.get("eval") or {}
    if column in suite_lib.SENTENCE_COLUMNS and pretrain.get("objective") != suite_lib.SENTENCE_COLUMNS[column][0]:
      evaluation = (pretrain.get("cross_eval") or {}).get(suite_lib.SENTENCE_COLUMNS[column][0]) or {}
    value = evaluation.get(key)
    if value is None:
      return None
    return {"median": value * scale, "std": 0.0, "min": value * scale, "max": value * scale}
  return row["tasks"].get(column)


def label(column: str) -> str:
  """A column's name for a reader: its task's label (e.g. "CoLA (MCC)"), else the column itself."""
  tasks = suite_lib.TASKS
  return tasks[column].label if column in tasks and tasks[column].label else column
