"""`bert-jax table WORKDIR`: a sweep's paper-style table, ours beside the published numbers, and its figures.

  bert-jax table runs/bert_table5            # writes runs/bert_table5/table.{md,csv}, *.png
  bert-jax table --findings docs/reproductions   # every table's findings judged by the protocol (report.py)

Reads WORKDIR/results.json (collected anew from the rows' state files, so a
sweep still running or partly failed renders what has finished; the table's
rows and published numbers as sweep.json records them, so that rendering a
folder never runs code that came with it) and writes:

  table.md             one row per paper row: for every column ours (median
                       over seeds at the best learning rate, ± std) and the
                       paper's; a last row saying per column whether the
                       published ordering of the rows is reproduced (every
                       pair of rows the paper orders, ordered the same way);
                       then each row's tokens seen, epochs, wall time, device
                       and error
  table.csv            the same numbers, one column per value
  pretrain_loss.png    every row's pre-training loss against tokens seen
  downstream.png       every task's score per row, bars at the median with
                       min-max whiskers over seeds, the published numbers as
                       markers
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import statistics
import sys
import textwrap
from typing import Any, Sequence

from etils import epath

from bert_jax import paths
from bert_jax.experiments import suite as suite_lib
from bert_jax.experiments.scores import INTRINSIC, glue_score, ours
from bert_jax.experiments.scores import label as _label


def columns(results: dict[str, Any]) -> list[str]:
  """The published columns in the paper's order, then any other task a row was scored on."""
  out = list(results["published"].get("columns", {}))
  for task in [*results["suite"]["tasks"], *(task for row in results["rows"] for task in row["tasks"])]:
    if task not in out:
      out.append(task)
  return out


def ordering(results: dict[str, Any], column: str) -> tuple[int, int, int] | None:
  """(pairs ordered as published, pairs the paper orders, of those tied in ours) over rows with both numbers.

  None when no pair of rows has two different published numbers.
  """
  published_rows = results["published"].get("rows", {})
  points = []
  for row in results["rows"]:
    paper = published_rows.get(row["name"], {}).get(column)
    mine = ours(row, column, results["suite"]["tasks"])
    if paper is not None and mine is not None:
      points.append((paper, mine["median"]))
  agree = total = tied = 0
  for i in range(len(points)):
    for j in range(i + 1, len(points)):
      (paper_i, mine_i), (paper_j, mine_j) = points[i], points[j]
      if paper_i == paper_j:
        continue
      total += 1
      agree += (paper_i - paper_j) * (mine_i - mine_j) > 0
      tied += mine_i == mine_j
  return (agree, total, tied) if total else None


def _number(value: float | None, digits: int = 1) -> str:
  return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _digits(column: str) -> int:
  return 2 if column == "mlm_ppl" else 1


def _ordering_cell(result: tuple[int, int, int] | None) -> str:
  if result is None:
    return "n/a"
  agree, total, tied = result
  return f"{'yes' if agree == total else 'no'} ({agree}/{total} pairs" + (f", {tied} tied)" if tied else ")")


def render_markdown(results: dict[str, Any]) -> str:
  published = results["published"]
  names = published.get("columns", {})
  cols = columns(results)
  suite = results["suite"]
  lines = [f"# {published.get('table', 'Sweep')}: {published.get('paper', results['config'])}", "",
           f"- config: `{results['config']}`" + (f" with {' '.join(results['overrides'])}"
                                                   if results["overrides"] else ""),
           *([f"- rerun (one row: add `--rows I`): `{results['rerun']}`"] if results.get("rerun") else []),
           f"- downstream: {', '.join(suite['tasks']) or 'none'}; seeds {tuple(suite['seeds'])}; "
           f"learning rates {tuple(suite['lrs'])}; ours = median over seeds at the learning rate with the best "
           "dev median, ± std over those seeds",
           *(["- fine-tuning overrides, every task: " + ", ".join(f"`{o}`" for o in suite["overrides"])]
             if suite.get("overrides") else []),
           f"- published numbers: {published.get('source', 'none given')}"]
  if "glue" in names:
    run = [task for task in suite["tasks"] if task in suite_lib.GLUE]
    lines.append(f"- GLUE score: ours is the median over seeds of each seed's mean over the GLUE tasks run "
                 f"({', '.join(run) or 'none'}; CoLA MCC, STS-B Spearman, accuracy otherwise), the paper's over "
                 "all eight GLUE tasks")
  lines.append("")
  header = ["row", "status"]
  for column in cols:
    label = names.get(column) or _label(column)
    header += [f"{label} ours", f"{label} paper"]
  lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in results["rows"]:
    cells = [row["name"], (row["status"] or "") + (f" (run as {row['from']})" if row.get("from") else "")]
    paper = published.get("rows", {}).get(row["name"], {})
    for column in cols:
      mine = ours(row, column, results["suite"]["tasks"])
      digits = _digits(column)
      if mine is None:
        cells.append("")
      elif column in INTRINSIC:  # One pre-training run: no spread over seeds.
        cells.append(_number(mine["median"], digits))
      else:
        cells.append(f"{_number(mine['median'], digits)} ± {_number(mine['std'], digits)}")
      cells.append(_number(paper.get(column), digits))
    lines.append("| " + " | ".join(cells) + " |")
  order = ["published ordering reproduced", ""]
  for column in cols:
    order += [_ordering_cell(ordering(results, column)), ""]
  lines.append("| " + " | ".join(order) + " |")
  lines += ["", "## Runs", "", "| row | tokens seen | epochs | pre-training wall (s) | device | params | error |",
            "|---|---|---|---|---|---|---|"]
  for row in results["rows"]:
    pretrain = row.get("pretrain") or {}
    error = (f"{row.get('phase')}: {row['error']}" if row.get("error") else "").replace("|", "/").replace("\n", " ")
    wall = (f"the model of {pretrain['pretrained_by']}" if pretrain.get("pretrained_by")
            else _number(pretrain.get("wall_seconds")))
    if pretrain.get("segments"):
      wall += f" ({len(pretrain['segments'])} calls)"
    tokens = f"{pretrain.get('tokens_seen', '')}" + (f", after {row['continues']}'s" if row.get("continues") else "")
    lines.append(f"| {row['name']} | {tokens} | {_number(pretrain.get('epochs'), 2)} | "
                 f"{wall} | {pretrain.get('device', '')} | "
                 f"{pretrain.get('num_params', '')} | {error} |")
  return "\n".join(lines) + "\n"


def write_csv(results: dict[str, Any], path: epath.Path) -> None:
  cols = columns(results)
  header = ["row", "status"]
  for column in cols:
    header += [f"{column}_median", f"{column}_std", f"{column}_min", f"{column}_max", f"{column}_best_lr",
               f"{column}_published"]
  header += ["tokens_seen", "epochs", "pretrain_wall_seconds", "device", "error"]
  published = results["published"].get("rows", {})
  handle = io.StringIO(newline="")
  writer = csv.writer(handle)
  writer.writerow(header)
  for row in results["rows"]:
    pretrain = row.get("pretrain") or {}
    values = [row["name"], row["status"]]
    for column in cols:
      mine = ours(row, column, results["suite"]["tasks"]) or {}
      values += [mine.get("median"), mine.get("std"), mine.get("min"), mine.get("max"), mine.get("best_lr"),
                 published.get(row["name"], {}).get(column)]
    values += [pretrain.get("tokens_seen"), pretrain.get("epochs"), pretrain.get("wall_seconds"),
               pretrain.get("device"), row.get("error")]
    writer.writerow(["" if value is None else value for value in values])
  order = ["published ordering reproduced", ""]
  for column in cols:
    order += [_ordering_cell(ordering(results, column)), "", "", "", "", ""]
  writer.writerow(order + [""] * 5)
  paths.write_text(path, handle.getvalue())


def _loss_curve(metrics_file: epath.Path) -> list[tuple[int, float]]:
  """(step, train loss) of a metrics.jsonl, a resumed run's repeated steps drawn once (the later kept)."""
  points: dict[int, float] = {}
  if metrics_file.exists():
    for line in metrics_file.read_text().splitlines():
      try:
        row = json.loads(line)
      except ValueError:  # A line cut by a kill.
        continue
      if "train/loss" in row:
        points[int(row["step"])] = float(row["train/loss"])
  return sorted(points.items())


def _tokens_per_step(row: dict[str, Any], pretrain_dir: epath.Path) -> int:
  """Batch x sequence length of a row's pre-training: from its recorded state, or, for a row stopped before it
  finished, from the config its run wrote; 0 when neither says."""
  pretrain = row.get("pretrain") or {}
  if pretrain.get("batch_size") and pretrain.get("seq_len"):
    return pretrain["batch_size"] * pretrain["seq_len"]
  try:
    config = json.loads((pretrain_dir / "config.json").read_text())
    return int(config["train"]["batch_size"]) * int(config["data"]["seq_len"])
  except (OSError, ValueError, KeyError, TypeError):
    return 0


def _save_png(figure, out: str | os.PathLike) -> epath.Path:
  """Writes `figure` to `out` (local or `gs://`) as a PNG and closes it."""
  import matplotlib.pyplot as plt

  out = paths.as_path(out)
  paths.write_bytes_with(out, lambda handle: figure.savefig(handle, format="png", dpi=120))
  plt.close(figure)
  return out


def plot(results: dict[str, Any], workdir: epath.Path, out: epath.Path) -> list[epath.Path]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  title = _title(results)
  written = []
  figure, axis = plt.subplots(figsize=(8, 5))
  drawn = 0
  for row in results["rows"]:
    pretrain_dir = workdir / "rows" / row["slug"] / "pretrain"
    curve = _loss_curve(pretrain_dir / "metrics.jsonl")
    if not curve:
      continue
    per_step = _tokens_per_step(row, pretrain_dir)
    xs = [step * per_step for step, _ in curve] if per_step else [step for step, _ in curve]
    label = row["name"] if row.get("status") == "done" else f"{row['name']} ({row.get('status', 'incomplete')})"
    axis.plot(xs, [loss for _, loss in curve], marker="o" if len(curve) < 20 else None, label=label)
    drawn += 1
  axis.set_xlabel("tokens seen (batch x sequence length x steps)")
  axis.set_ylabel("pre-training loss (train, all objectives)")
  axis.set_title(f"Pre-training loss per row\n{title}", fontsize=10)
  if drawn:
    axis.legend(fontsize=8)
  axis.grid(alpha=0.3)
  figure.tight_layout()
  written.append(_save_png(figure, out / "pretrain_loss.png"))
  written.append(plot_downstream(results, out))
  return written


def _title(results: dict[str, Any]) -> str:
  paper = results["published"].get("paper", results["config"]).split(":")[0]  # "Authors year, NAME".
  title = f"{results['published'].get('table', 'Sweep')} — {paper}"
  return title if len(title) < 90 else title[:87] + "..."


def plot_downstream(results: dict[str, Any], out: epath.Path) -> epath.Path:
  """`out`/downstream.png: each row's median dev score per task (whiskers min-max over seeds) beside the
  published numbers; from `results` alone, so a published table's figure can be drawn again from its JSON."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tasks = [column for column in columns(results) if column not in INTRINSIC]
  names = dict(results["published"].get("columns", {}))
  if "glue" in names:
    names["glue"] = f"{names['glue']} (ours: {', '.join(t for t in results['suite']['tasks'] if t in suite_lib.GLUE)})"
  published = results["published"].get("rows", {})
  figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(tasks) + 2) + 2.5, 5))
  width = 0.8 / max(1, len(results["rows"]))
  for index, row in enumerate(results["rows"]):
    xs, heights, low, high, paper_x, paper_y = [], [], [], [], [], []
    for position, task in enumerate(tasks):
      x = position - 0.4 + width * (index + 0.5)
      mine = ours(row, task, results["suite"]["tasks"])
      if mine is not None:
        xs.append(x)
        heights.append(mine["median"])
        low.append(mine["median"] - mine["min"])
        high.append(mine["max"] - mine["median"])
      if published.get(row["name"], {}).get(task) is not None:
        paper_x.append(x)
        paper_y.append(published[row["name"]][task])
    color = f"C{index % 10}"  # One colour per row, its published markers included.
    if xs:
      axis.bar(xs, heights, width, yerr=[low, high], capsize=3, color=color, label=f"{row['name']} (ours)")
    if paper_x:
      axis.scatter(paper_x, paper_y, marker="D", s=40, color=color, edgecolors="black", zorder=3,
                   label=f"{row['name']} (published)")
  axis.set_xticks(range(len(tasks)))
  # Long names wrapped, and the legend beside the axes, so that neither runs into the tick labels.
  axis.set_xticklabels([textwrap.fill(names.get(task) or _label(task), 24) for task in tasks], rotation=20)
  axis.set_ylabel("dev score (median over seeds; whiskers: min-max)")
  axis.set_title(f"Downstream scores per row\n{_title(results)}", fontsize=10)
  if axis.get_legend_handles_labels()[0]:
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
  axis.grid(axis="y", alpha=0.3)
  figure.tight_layout()
  return _save_png(figure, out / "downstream.png")


def gap_by_budget(tables: Sequence[tuple[str, dict[str, Any]]], first: str, second: str) -> dict[str, list]:
  """Per downstream task, [(steps, first - second, spread)] over runs of one table at several budgets: `tables`
  holds (name, results.json) pairs; steps are the first row's pre-training steps, spread the two medians'
  seed standard deviations added in quadrature. A task either row lacks in a run is left out of that run."""
  gaps: dict[str, list] = {}
  for name, results in tables:
    by_name = {row["name"]: row for row in results["rows"]}
    for wanted in (first, second):
      if wanted not in by_name:
        raise ValueError(f"{name}: no row named {wanted!r}; its rows are {', '.join(map(repr, by_name))}")
    steps = (by_name[first].get("pretrain") or {}).get("step")
    if steps is None:
      raise ValueError(f"{name}: row {first!r} has no finished pre-training")
    for task in results["suite"]["tasks"]:
      a, b = by_name[first]["tasks"].get(task), by_name[second]["tasks"].get(task)
      if a and b:
        gaps.setdefault(task, []).append((steps, a["median"] - b["median"], math.hypot(a["std"], b["std"])))
  return {task: sorted(points) for task, points in gaps.items()}


def plot_gap_by_budget(tables: Sequence[tuple[str, dict[str, Any]]], first: str, second: str,
                       out: str | os.PathLike) -> epath.Path:
  """One line per task: `first`'s score minus `second`'s against pre-training steps (gap_by_budget), as a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  gaps = gap_by_budget(tables, first, second)
  figure, axis = plt.subplots(figsize=(8, 5))
  for index, (task, points) in enumerate(gaps.items()):
    steps, gap, spread = zip(*points)
    axis.errorbar(steps, gap, yerr=spread, marker="o", capsize=3, color=f"C{index % 10}", label=_label(task))
  axis.axhline(0.0, color="black", linewidth=0.8)
  axis.set_xscale("log")
  budgets = sorted({steps for points in gaps.values() for steps, _, _ in points})
  axis.set_xticks(budgets, [f"{steps:,}" for steps in budgets])
  axis.minorticks_off()
  axis.set_xlabel(f"pre-training steps ({first})")
  axis.set_ylabel(f"{first} minus {second} (dev, median over seeds)")
  table = tables[0][1]["published"].get("table", "")
  axis.set_title(f"{table}: {first} against {second} as the budget grows\n(whiskers: the two rows' seed standard "
                 "deviations in quadrature)", fontsize=10)
  axis.legend(fontsize=8)
  axis.grid(alpha=0.3)
  figure.tight_layout()
  return _save_png(figure, out)


def across_runs(tables: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, list[tuple[str, float]]]]:
  """Per row and task, [(run, median over seeds)] over several runs of one table at one budget (pre-training seeds,
  or repeats): `tables` holds (run, results.json) pairs; a table with a GLUE-score column adds "glue", the row's
  GLUE score in each run where it has every GLUE task. A row must have pre-trained the same number of steps in
  every run that has it (runs at several budgets are `gap_by_budget`'s); a task a run lacks is left out of it."""
  scores: dict[str, dict[str, list[tuple[str, float]]]] = {}
  steps: dict[str, tuple[str, int]] = {}
  for run, results in tables:
    columns_named = results.get("published", {}).get("columns", {})
    for row in results["rows"]:
      step = (row.get("pretrain") or {}).get("step")
      if step is None:
        continue
      first = steps.setdefault(row["name"], (run, step))
      if first[1] != step:
        raise ValueError(f"row {row['name']!r}: {step} pre-training steps in {run}, {first[1]} in {first[0]}; "
                         "runs at several budgets compare with `gap`")
      for task in results["suite"]["tasks"]:
        if task in row["tasks"]:
          scores.setdefault(row["name"], {}).setdefault(task, []).append((run, row["tasks"][task]["median"]))
      glue = glue_score(row, results["suite"]["tasks"]) if "glue" in columns_named else None
      if glue:
        scores.setdefault(row["name"], {}).setdefault("glue", []).append((run, glue["median"]))
  if not scores:
    raise ValueError(f"no row of {', '.join(run for run, _ in tables)} has finished a downstream task")
  return scores


def _tasks_across_runs(tables: Sequence[tuple[str, dict[str, Any]]], scores: dict[str, dict]) -> list[str]:
  """The GLUE score first where some row has one, then the suite's tasks, in its order, that some row of
  across_runs' `scores` has."""
  return [task for task in ["glue", *tables[0][1]["suite"]["tasks"]] if any(task in row for row in scores.values())]


def _run_label(tables: Sequence[tuple[str, dict[str, Any]]], column: str) -> str:
  """A column's name in the runs' table and figure: the published table's name for it, else the task's label."""
  return tables[0][1].get("published", {}).get("columns", {}).get(column) or _label(column)


def _mean_and_error(values: Sequence[float]) -> tuple[float, float]:
  """The mean over two or more runs and its standard error."""
  return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def runs_markdown(tables: Sequence[tuple[str, dict[str, Any]]]) -> str:
  """across_runs as two markdown tables. First, per row and task, the mean over runs, the range and the number of
  runs (a task one run has: its score). Second, per pair of rows (the later minus the earlier) and task, the
  difference of their means ± its standard error (the two means' standard errors in quadrature; blank where a row
  has one run, and a pair left out where every task is), so that the gaps between rows read against the spread
  between runs of one row."""
  scores = across_runs(tables)
  tasks = _tasks_across_runs(tables, scores)
  values = {name: {task: [value for _, value in by_task.get(task, [])] for task in tasks}
            for name, by_task in scores.items()}
  labels, header = " | ".join(_run_label(tables, task) for task in tasks), "|---" * (len(tasks) + 1) + "|"
  lines = [f"| row | {labels} |", header]
  for name, by_task in values.items():
    cells = []
    for runs in by_task.values():
      if len(runs) > 1:
        cells.append(f"{statistics.fmean(runs):.1f} ({min(runs):.1f} to {max(runs):.1f}, {len(runs)} runs)")
      else:
        cells.append(f"{runs[0]:.1f} (1 run)" if runs else "")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  pairs = []
  for earlier, later in itertools.combinations(values, 2):
    cells = []
    for task in tasks:
      if min(len(values[later][task]), len(values[earlier][task])) < 2:
        cells.append("")
        continue
      (a, a_error), (b, b_error) = _mean_and_error(values[later][task]), _mean_and_error(values[earlier][task])
      cells.append(f"{a - b:+.1f} ± {math.hypot(a_error, b_error):.1f}")
    if any(cells):
      pairs.append(f"| {later} minus {earlier} | " + " | ".join(cells) + " |")
  if pairs:
    lines += ["", f"| difference of means ± standard error | {labels} |", header, *pairs]
  return "\n".join(lines) + "\n"


def plot_across_runs(tables: Sequence[tuple[str, dict[str, Any]]], out: str | os.PathLike) -> epath.Path:
  """One panel per task: each row's median over seeds in every run (one marker per run), a bar at their mean."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  scores = across_runs(tables)
  tasks = _tasks_across_runs(tables, scores)
  runs = [run for run, _ in tables]
  columns = min(4, len(tasks))
  lines = -(-len(tasks) // columns)
  figure, axes = plt.subplots(lines, columns, figsize=(3.6 * columns, 3.4 * lines), squeeze=False)
  names = list(scores)
  for axis, task in zip(axes.flat, tasks):
    for x, name in enumerate(names):
      points = scores[name].get(task, [])
      if points:
        axis.hlines(statistics.fmean(value for _, value in points), x - 0.3, x + 0.3, color="black", linewidth=1.5)
      for run, value in points:
        index = runs.index(run)
        axis.plot(x + 0.12 * (index - (len(runs) - 1) / 2), value, marker="os^Dv<>"[index % 7], linestyle="none",
                  color=f"C{index % 10}", label=run)
    axis.set_xticks(range(len(names)), names, rotation=25, fontsize=7, ha="right")
    axis.set_title(_run_label(tables, task), fontsize=9)
    axis.grid(axis="y", alpha=0.3)
  for axis in list(axes.flat)[len(tasks):]:
    axis.axis("off")
  handles = {label: handle for axis in axes.flat for handle, label in zip(*axis.get_legend_handles_labels())}
  handles = {run: handles[run] for run in runs if run in handles}
  figure.legend(handles.values(), handles.keys(), fontsize=8, loc="lower center", ncol=min(len(handles), 4))
  table = tables[0][1]["published"].get("table", "")
  figure.suptitle(f"{table}: each row over {len(runs)} runs (dev, median over fine-tuning seeds; bar: mean over "
                  "runs)", fontsize=10)
  figure.tight_layout(rect=(0, 0.08, 1, 0.96))
  return _save_png(figure, out)


def render(workdir: str | os.PathLike, out: str | os.PathLike | None = None,
           config: str | None = None) -> dict[str, epath.Path]:
  """Collects WORKDIR's results and writes table.md, table.csv and the figures into `out` (default WORKDIR);
  either may be local or `gs://`. The table is the one sweep.json records, or `config` (`ablation.collect`)."""
  from bert_jax.experiments import ablation

  workdir = paths.as_path(workdir)
  out = paths.as_path(out) if out else workdir
  out.mkdir(parents=True, exist_ok=True)
  results = ablation.collect(workdir, config)
  paths.write_text(out / "table.md", render_markdown(results))
  write_csv(results, out / "table.csv")
  figures = plot(results, workdir, out)
  return {"markdown": out / "table.md", "csv": out / "table.csv",
          **{path.stem: path for path in figures}}


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="bert-jax table", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdir", nargs="?", help="the workdir of a `bert-jax sweep` run")
  parser.add_argument("--out", help="directory for table.md, table.csv and the PNGs (default: WORKDIR)")
  parser.add_argument("--config", help="the sweep's table config, for a sweep.json that records no table (it is "
                      "run to read it: give only one you trust); otherwise the recorded table is read, no code run")
  parser.add_argument("--findings", metavar="ROOT", help="instead: judge every table's findings over the runs "
                      "published under ROOT (docs/reproductions) by the protocol's rule and print the summary")
  parser.add_argument("--page", help="with --findings: rewrite this page's generated summary (docs/reproductions.md) "
                      "and each table's ROOT/TABLE/README.md")
  args = parser.parse_args(list(argv))
  if (args.findings is None) == (args.workdir is None):
    parser.error("give a sweep's WORKDIR, or --findings ROOT")
  if args.page and not args.findings:
    parser.error("--page goes with --findings ROOT")
  try:
    if args.findings:
      from bert_jax.experiments import report

      return report.main(args.findings, args.page)
    written = render(args.workdir, args.out, args.config)
  except (FileNotFoundError, ValueError) as error:
    print(f"bert-jax table: error: {error}", file=sys.stderr)
    return 1
  print(written["markdown"].read_text())
  print("Written: " + ", ".join(str(path) for path in written.values()))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
