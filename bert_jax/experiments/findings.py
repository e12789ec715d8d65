"""The reproduction protocol: each table's published findings, judged over pre-training runs by one fixed rule.

A table config (`configs/ablations/*.py`) declares beside `PUBLISHED` the findings it tests, `FINDINGS`: two of
its rows, the order the paper puts them in, the columns, and whether the finding is a headline. The rule, fixed
before the runs that judge it:

- A *run* is one pre-training of a row with the table's fine-tuning suite. Its score on a task is the median over
  its fine-tuning seeds (at the suite's best learning rate); its score on a finding is the mean of those over the
  finding's columns, a lower-is-better column (perplexity) counted negated, so that larger is always the paper's
  better side. Runs of one pre-training seed (repeats on a non-deterministic GPU) are one run, averaged.
- Runs are *pooled* by what they computed, not by the table they ran in: every run whose resolved pre-training
  config (model preset and overrides resolved, the steps it actually trained, keys that do not change a run
  ignored) and fine-tuning recipe equal a row's is that row's, in any table.
- The *main budget* is the table config at `scale=gpu` as it stands (`ablation.base_config`: a 4-layer, width-512
  encoder, 3,000 steps of 256 x 128 tokens, the suite at 1e-4 with three fine-tuning seeds). Why: four rows with
  their suites run side by side on one GPU within a ten-minute call, so three runs of a table's rows cost a few
  calls; what it cannot show: effects that need longer training (at 3,000 steps ELECTRA's discriminator is still on
  the replaced-token plateau, span masking trails token masking on SQuAD). Only runs of exactly that config judge a
  finding; every other budget or recipe that ran is a *try*, counted and shown beside the verdict, never as it.
- Our difference is mean(better row) - mean(worse row) over runs, its standard error sqrt(s_a^2/n_a + s_b^2/n_b)
  over runs (never over fine-tuning seeds), z their ratio. Verdict: *reproduces* (the published sign) or
  *contradicts* (the other sign) where the difference survives Holm's step-down over the findings of one paper at
  level `ALPHA`, the two-sided normal tail beyond 2 standard errors (so that a paper's only finding is judged by
  "beyond 2 SE"); otherwise *not resolved*. A finding with fewer than `MIN_RUNS` runs in either row is not
  resolved whatever its sign, and is counted in its paper's Holm family all the same.
- Scores on a carved dev set (`CARVED`) count only from runs that recorded their dev files (`results.json`'s
  `dev_sets`), i.e. from the carve that shares no text with its train split.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import statistics
from typing import Any, Iterable, Mapping, Sequence

from bert_jax.experiments import scores as scores_lib
from bert_jax.experiments import suite as suite_lib

MAIN_SCALE = "gpu"
MIN_RUNS = 3
# The two-sided normal tail beyond 2 standard errors: Holm at this level is "beyond 2 SE" for a lone finding.
ALPHA = math.erfc(2 / math.sqrt(2))
VERDICTS = ("reproduces", "contradicts", "not resolved")
# A paper's column we cannot score -> the task of ours that stands in for it, named before any run: MNLI and QNLI
# -> RTE (the sentence-pair inference task we have), QQP -> MRPC (paraphrase), SQuAD 2.0 -> SQuAD 1.1; RACE: none.
STAND_INS = {"mnli_m": "rte", "qnli": "rte", "qqp": "mrpc", "squad2.0_f1": "squad1.1_f1"}
# Tasks whose dev set is carved from their train file (the official dev is not here).
CARVED = ("sst2",)
# A carved task's score on the random carve that leaked, kept apart under its own column (never a finding's).
OLD_CARVE = "@old_carve"
# Fine-tuning overrides that change how fast a suite runs, not what it computes.
SPEED_ONLY = ("train.steps_per_call=", "pad_to_max_len=", "train.eval_batch_size=")


@dataclasses.dataclass(frozen=True)
class Finding:
  """One published claim a table tests: row `better` scores above row `worse`.

  Attributes:
    name: the claim in a few words, as the paper makes it.
    better, worse: the table's row names, in the paper's order.
    columns: our columns scored (tasks, "glue", or a pre-training column such as "mlm_ppl"); empty: every column
      the paper prints for both rows, each as itself where we score it, else as its stand-in (`STAND_INS`).
    headline: the finding the reproduction of this table stands or falls by.
  """
  name: str
  better: str
  worse: str
  columns: tuple[str, ...] = ()
  headline: bool = False


def _available() -> set[str]:
  return {*suite_lib.GPU_TASKS, "glue", *scores_lib.INTRINSIC}


def _intrinsic() -> set[str]:
  return set(scores_lib.INTRINSIC)


def resolve_columns(finding: Finding, published: Mapping[str, Any]) -> tuple[list[str], list[str]]:
  """(our columns, the paper's columns its published difference is read from) of `finding`."""
  rows = published.get("rows", {})
  printed = [column for column in published.get("columns", {})
             if rows.get(finding.better, {}).get(column) is not None
             and rows.get(finding.worse, {}).get(column) is not None]
  if finding.columns:
    ours = list(finding.columns)
    mapped = {column: STAND_INS.get(column, column) for column in printed}
    return ours, [column for column in printed if mapped[column] in ours]
  ours, paper = [], []
  # A figure prints no numbers: its axis, the table's columns, is what it compares.
  for column in printed or list(published.get("columns", {})):
    if column in _intrinsic():  # Pre-training columns are findings of their own, named explicitly.
      continue
    mine = column if column in _available() else STAND_INS.get(column)
    if mine is None:
      continue
    if printed:
      paper.append(column)
    if mine not in ours:
      ours.append(mine)
  return ours, paper


def _sign(column: str, published: Mapping[str, Any]) -> float:
  return 1.0 if published.get("higher_is_better", {}).get(column, column != "mlm_ppl") else -1.0


def published_delta(finding: Finding, published: Mapping[str, Any]) -> float | None:
  """The paper's better row minus its worse one, mean over the paper's columns of the finding (lower-is-better
  columns negated); None where the paper prints no numbers for them (a figure)."""
  _, paper = resolve_columns(finding, published)
  rows = published.get("rows", {})
  if not paper:
    return None
  return statistics.fmean(_sign(c, published) * (rows[finding.better][c] - rows[finding.worse][c]) for c in paper)


def check(findings: Sequence[Finding], published: Mapping[str, Any], row_names: Iterable[str], where: str) -> None:
  """A table's findings name its rows, columns we score, and run the paper's way (its published difference,
  where it prints one, positive); raises ValueError naming the finding otherwise."""
  names = set(row_names)
  for finding in findings:
    for row in (finding.better, finding.worse):
      if row not in names:
        raise ValueError(f"{where}: finding {finding.name!r} names row {row!r}; the table's rows are {sorted(names)}")
    ours, _ = resolve_columns(finding, published)
    unknown = [column for column in ours if column not in _available()]
    if not ours or unknown:
      raise ValueError(f"{where}: finding {finding.name!r} has no column we score"
                       + (f" ({unknown} unknown; known: {sorted(_available())})" if unknown else ""))
    delta = published_delta(finding, published)
    if delta is not None and delta <= 0:
      raise ValueError(f"{where}: finding {finding.name!r}: the paper puts {finding.worse!r} at or above "
                       f"{finding.better!r} ({delta:+.2f}); name the better row first")


# Runs -----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
  """One row's pre-training and suite in one published folder.

  Attributes:
    table: the table config's name (e.g. "bert_table5"); folder: the published folder, relative to the root.
    row: the row's name in that table. seed: its pre-training seed.
    key: what the run computed (resolved pre-training config, fine-tuning recipe), canonical JSON: runs with one
      key pool. differences: where the run's config differs from its row's main-budget config ("key=value").
    scores: column -> the run's score (median over fine-tuning seeds), only columns it finished and may count.
    steps: pre-training steps. card: the device it ran on.
  """
  table: str
  folder: str
  row: str
  seed: int
  key: str
  differences: tuple[str, ...]
  scores: dict[str, float]
  steps: int
  card: str


def _table_name(spec: str) -> str:
  return pathlib.Path(spec.partition(":")[0]).stem


def _our_spec(spec: str, where: pathlib.Path) -> str:
  """This repository's table config of the name a results file records, with its argument: never the file the
  results name (reading results must not run code that came with them)."""
  from bert_jax.experiments import ablation

  ours = ablation.CONFIGS / "ablations" / f"{_table_name(spec)}.py"
  if not ours.is_file():
    raise ValueError(f"{where}: its table {spec.partition(':')[0]} is not one of configs/ablations/")
  arg = spec.partition(":")[2]
  return f"{ours}:{arg}" if arg else str(ours)


def _recipe(suite: Mapping[str, Any], finetune: Mapping[str, Any]) -> dict[str, Any]:
  """A suite's fine-tuning recipe, without its task list and the overrides that change only speed."""
  recipe = {key: list(value) if isinstance(value, (list, tuple)) else value for key, value in suite.items()
            if key not in ("tasks", "tiny_task")}
  recipe["overrides"] = [item for item in recipe.get("overrides", []) if not item.startswith(SPEED_ONLY)]
  return {"suite": recipe, "finetune": dict(finetune)}


def _pretraining(config: dict[str, Any]) -> dict[str, Any]:
  """The flat pre-training config of what a run computes: no seed, no corpus location, no resume-safe keys."""
  from bert_jax.experiments import ablation
  from bert_jax.train import workdir

  flat = workdir.flatten(json.loads(json.dumps(ablation.comparable_config(config), default=str)))
  safe = tuple(key for key in workdir.RESUME_SAFE_KEYS if key != "train.steps")
  return {key: value for key, value in flat.items()
          if key not in ("seed", "data.prepared") and not any(
              key == s or (s.endswith(".") and key.startswith(s)) for s in safe)}


@functools.lru_cache(maxsize=None)
def _row_setting(spec: str, overrides: tuple[str, ...], row_name: str, steps: int | None) -> tuple[dict, int]:
  """(flat pre-training config, seed) of `row_name` of the table `spec` with `overrides`; `steps` (what the run
  trained) in place of the config's where given. A row that fine-tunes another row's model has that row's."""
  from bert_jax.experiments import ablation
  from bert_jax.train import config_lib

  table = ablation.load_table(spec, list(overrides))
  rows = {row.name: row for row in table.rows}
  if row_name not in rows:
    raise ValueError(f"{spec}: no row {row_name!r}; its rows are {sorted(rows)}")
  row = rows[row_name]
  config = ablation.row_config(table, rows[row.pretrained] if row.pretrained else row)
  if steps is not None:
    config_lib.set_by_path(config, "train.steps", str(steps))
  setting = _pretraining(config.to_dict())
  source = rows[row.pretrained] if row.pretrained else row
  if source.continues is not None:  # what it starts from is part of what it computes
    setting["continues"] = json.dumps(_row_setting(spec, overrides, source.continues, None)[0], sort_keys=True)
  return setting, int(config.seed)


@functools.lru_cache(maxsize=None)
def main_setting(table_name: str, row_name: str) -> tuple[dict, dict]:
  """(flat pre-training config, fine-tuning recipe) of a row of `configs/ablations/TABLE.py` at the main budget."""
  from bert_jax.experiments import ablation

  spec = str(ablation.CONFIGS / "ablations" / f"{table_name}.py") + f":scale={MAIN_SCALE}"
  table = ablation.load_table(spec)
  row = {row.name: row for row in table.rows}[row_name]
  pretraining, _ = _row_setting(spec, (), row_name, None)
  return pretraining, _recipe(dataclasses.asdict(table.suite), row.finetune)


def _key(pretraining: dict, recipe: dict) -> str:
  return json.dumps({"pretraining": pretraining, "recipe": recipe}, sort_keys=True, default=str)


def _differences(pretraining: dict, recipe: dict, main: tuple[dict, dict]) -> tuple[str, ...]:
  main_pretraining, main_recipe = main
  out = [f"{key}={pretraining.get(key, '<absent>')}" for key in sorted(set(pretraining) | set(main_pretraining))
         if pretraining.get(key, "<absent>") != main_pretraining.get(key, "<absent>")]
  suite, main_suite = recipe["suite"], main_recipe["suite"]
  for key in sorted(set(suite) | set(main_suite)):
    if key == "overrides":
      out += [f"finetune {item}" for item in suite.get(key, []) if item not in main_suite.get(key, [])]
      out += [f"finetune without {item}" for item in main_suite.get(key, []) if item not in suite.get(key, [])]
    elif suite.get(key) != main_suite.get(key):
      out.append(f"finetune {key}={suite.get(key)}")
  if recipe["finetune"] != main_recipe["finetune"]:
    out.append(f"finetune {recipe['finetune']}")
  return tuple(out)


def scores(row: Mapping[str, Any], results: Mapping[str, Any]) -> dict[str, float]:
  """Column -> a run's score: each task it finished with every fine-tuning seed (median over them), the GLUE score
  where every GLUE task of its suite counts, the pre-training columns it has. A carved dev's task counts only where
  the run recorded its dev files (the leak-free carve); elsewhere it is TASK@old_carve, shown apart."""
  suite = results["suite"]
  leak_free = set(results.get("dev_sets", {}))
  counts = lambda task: task not in CARVED or task in leak_free  # noqa: E731
  out = {}
  for task, summary in row.get("tasks", {}).items():
    if task in suite_lib.TASKS and len(summary.get("values", [])) == len(suite["seeds"]):
      out[task if counts(task) else task + OLD_CARVE] = summary["median"]
  # The GLUE score over the same tasks for every run: the GLUE tasks of the main budget's suite.
  glue = [task for task in suite_lib.GPU_TASKS if task in suite_lib.GLUE]
  if glue and all(task in out for task in glue):
    out["glue"] = scores_lib.glue_score(row, glue)["median"]
  elif glue and all(task in out or task + OLD_CARVE in out for task in glue):
    out["glue" + OLD_CARVE] = scores_lib.glue_score(row, glue)["median"]
  for column in scores_lib.INTRINSIC:
    value = scores_lib.ours(row, column)
    if value is not None:
      out[column] = value["median"]
  return out


def load_runs(root: str | pathlib.Path) -> list[Run]:
  """Every run published under `root` (each `results.json` below it, any depth). A row that another table's run
  was taken into (`publish --row-from`) is that run, not a second one."""
  root = pathlib.Path(root)
  runs = []
  for path in sorted(root.rglob("results.json")):
    results = json.loads(path.read_text())
    if "config" not in results or "rows" not in results:
      continue
    name, spec = _table_name(results["config"]), _our_spec(results["config"], path)
    overrides = tuple(item for item in results.get("overrides", [])
                      if not item.removeprefix("--").removeprefix("config.").startswith("data.prepared="))
    card = json.loads((path.parent / "reproduce.json").read_text()).get("card", "") if (
        path.parent / "reproduce.json").exists() else ""
    for row in results["rows"]:
      pretrain = row.get("pretrain") or {}
      if row.get("from") or pretrain.get("step") is None:
        continue
      pretraining, seed = _row_setting(spec, overrides, row["name"], int(pretrain["step"]))
      recipe = _recipe(results["suite"], row.get("finetune") or {})
      runs.append(Run(table=name, folder=str(path.parent.relative_to(root)), row=row["name"], seed=seed,
                      key=_key(pretraining, recipe),
                      differences=_differences(pretraining, recipe, main_setting(name, row["name"])),
                      scores=scores(row, results), steps=int(pretrain["step"]), card=pretrain.get("device") or card))
  return runs


# The rule -------------------------------------------------------------------------------------------------------

def run_scores(runs: Iterable[Run], columns: Sequence[str], signs: Sequence[float],
               old_carve: bool = False) -> list[tuple[int, float]]:
  """(seed, score) per pre-training seed: each column averaged over that seed's repeats, then the signed mean
  over `columns`; a seed without every column is left out. `old_carve`: a run without a carved column's leak-free
  score gives its old carve's (for tries shown beside the verdict, never for it)."""
  by_seed: dict[int, dict[str, list[float]]] = {}
  for run in runs:
    for column in columns:
      score = run.scores.get(column, run.scores.get(column + OLD_CARVE) if old_carve else None)
      if score is not None:
        by_seed.setdefault(run.seed, {}).setdefault(column, []).append(score)
  out = []
  for seed, values in sorted(by_seed.items()):
    if all(column in values for column in columns):
      out.append((seed, statistics.fmean(sign * statistics.fmean(values[column])
                                         for column, sign in zip(columns, signs))))
  return out


def difference(better: Sequence[float], worse: Sequence[float]) -> dict[str, Any]:
  """mean(better) - mean(worse), its standard error over runs (None under 2 runs a side), z, two-sided p."""
  out: dict[str, Any] = {"n_better": len(better), "n_worse": len(worse), "delta": None, "se": None, "z": None,
                         "p": None}
  if better and worse:
    out["delta"] = statistics.fmean(better) - statistics.fmean(worse)
  if len(better) >= 2 and len(worse) >= 2:
    out["se"] = math.sqrt(statistics.variance(better) / len(better) + statistics.variance(worse) / len(worse))
    if out["se"] > 0:
      out["z"] = out["delta"] / out["se"]
      out["p"] = math.erfc(abs(out["z"]) / math.sqrt(2))
    else:  # Every run of each side scored the same.
      out["p"] = 0.0 if out["delta"] else 1.0
  return out


def holm(p_values: Sequence[float | None], alpha: float = ALPHA) -> list[bool]:
  """Holm's step-down over one family: which hypotheses are rejected at family-wise level `alpha`. None (a
  finding not tested) counts in the family and is never rejected."""
  order = sorted(range(len(p_values)), key=lambda i: (p_values[i] is None, p_values[i] or 0.0))
  rejected = [False] * len(p_values)
  for rank, index in enumerate(order):
    p = p_values[index]
    if p is None or p > alpha / (len(p_values) - rank):
      break
    rejected[index] = True
  return rejected


def verdict(result: Mapping[str, Any], rejected: bool) -> str:
  if (not rejected or result["delta"] is None or min(result["n_better"], result["n_worse"]) < MIN_RUNS):
    return "not resolved"
  return "reproduces" if result["delta"] > 0 else "contradicts"


@dataclasses.dataclass(frozen=True)
class TableFindings:
  """A table config's findings with what they need: its name, paper, published numbers."""
  table: str
  published: dict[str, Any]
  findings: tuple[Finding, ...]


def load_tables(names: Iterable[str] | None = None) -> list[TableFindings]:
  """Every table config under configs/ablations/ that declares FINDINGS (or those of `names`), checked."""
  from bert_jax.experiments import ablation
  from bert_jax.train import config_lib

  folder = ablation.CONFIGS / "ablations"
  out = []
  for path in sorted(folder.glob("*.py")) if names is None else [folder / f"{name}.py" for name in names]:
    module = config_lib._load_module(path)
    found = tuple(getattr(module, "FINDINGS", ()))
    if not found:
      continue
    table = ablation.load_table(f"{path}:scale={MAIN_SCALE}")
    check(found, module.PUBLISHED, [row.name for row in table.rows], str(path))
    out.append(TableFindings(path.stem, module.PUBLISHED, found))
  return out


def _setting_label(rows: Mapping[str, Sequence[Run]]) -> str:
  """What a folder's runs of two rows changed from the main budget: what both rows changed, then each row's own."""
  changed = {row: {d for run in runs for d in run.differences} for row, runs in rows.items()}
  common = set.intersection(*changed.values())
  own = [f"{row}: {d}" for row, differences in changed.items() for d in sorted(differences - common)]
  return "; ".join([*sorted(common), *own]) or "main budget"


def main_key(table_name: str, row_name: str) -> str:
  """The key (`Run.key`) of a row's runs at the main budget."""
  return _key(*main_setting(table_name, row_name))


def judge(tables: Sequence[TableFindings], runs: Sequence[Run], key_of=main_key) -> list[dict[str, Any]]:
  """Every finding of `tables` judged over `runs` by the rule (module docstring), in the tables' order. Each
  result: the table, paper, finding, columns, published and our difference with its standard error and n, p,
  verdict, the folders pooled, and the tries: every budget or recipe under which both rows ran in one folder,
  with its own difference (the main budget among them where it ran)."""
  by_key: dict[str, list[Run]] = {}
  for run in runs:
    by_key.setdefault(run.key, []).append(run)
  results = []
  for table in tables:
    for finding in table.findings:
      columns, paper_columns = resolve_columns(finding, table.published)
      signs = [_sign(column, table.published) for column in columns]
      pooled = {}
      for side in ("better", "worse"):
        pooled[side] = by_key.get(key_of(table.table, getattr(finding, side)), [])
      scored = {side: run_scores(pooled[side], columns, signs) for side in pooled}
      result = difference([s for _, s in scored["better"]], [s for _, s in scored["worse"]])
      tries = _tries(table.table, finding, runs, columns, signs)
      results.append({
          "table": table.table, "paper": table.published.get("paper", ""),
          "table_title": table.published.get("table", table.table), "finding": finding.name,
          "better": finding.better, "worse": finding.worse, "headline": finding.headline,
          "columns": columns, "paper_columns": paper_columns,
          "published_delta": published_delta(finding, table.published), **result,
          "seeds_better": [seed for seed, _ in scored["better"]], "seeds_worse": [seed for seed, _ in scored["worse"]],
          "pooled_from": sorted({f"{run.folder} ({run.row})" for side in pooled.values() for run in side}),
          "tries": tries})
  papers: dict[str, list[int]] = {}
  for index, result in enumerate(results):
    papers.setdefault(result["paper"], []).append(index)
  for indices in papers.values():
    tested = [results[i]["p"] if min(results[i]["n_better"], results[i]["n_worse"]) >= MIN_RUNS else None
              for i in indices]
    for index, rejected in zip(indices, holm(tested)):
      results[index]["holm_family"] = len(indices)
      results[index]["verdict"] = verdict(results[index], rejected)
  return results


def _tries(table_name: str, finding: Finding, runs: Sequence[Run], columns, signs) -> list[dict[str, Any]]:
  """Per budget or recipe under which the finding's two rows ran side by side in one folder of their table: the
  setting (what differs from the main budget), the folders, and the difference over those folders' runs."""
  folders: dict[str, dict[str, list[Run]]] = {}
  for run in runs:
    if run.table == table_name and run.row in (finding.better, finding.worse):
      folders.setdefault(run.folder, {}).setdefault(run.row, []).append(run)
  settings: dict[str, dict[str, Any]] = {}
  for folder, rows in sorted(folders.items()):
    if finding.better not in rows or finding.worse not in rows:
      continue
    label = _setting_label({row: rows[row] for row in (finding.better, finding.worse)})
    entry = settings.setdefault(label, {"setting": label, "folders": [], "better": [], "worse": [],
                                        "steps": max(run.steps for run in rows[finding.better])})
    entry["folders"].append(folder)
    entry["better"] += rows[finding.better]
    entry["worse"] += rows[finding.worse]
  out = []
  for entry in settings.values():
    result = difference([s for _, s in run_scores(entry["better"], columns, signs)],
                        [s for _, s in run_scores(entry["worse"], columns, signs)])
    old = result["delta"] is None
    if old:  # Runs before the leak-free carve: their old carve's scores, marked as such.
      result = difference([s for _, s in run_scores(entry["better"], columns, signs, old_carve=True)],
                          [s for _, s in run_scores(entry["worse"], columns, signs, old_carve=True)])
    out.append({"setting": entry["setting"], "folders": entry["folders"], "steps": entry["steps"], **result,
                "old_carve": old and result["delta"] is not None})
  return sorted(out, key=lambda entry: (entry["setting"] != "main budget", entry["steps"], entry["setting"]))
