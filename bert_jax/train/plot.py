"""`bert-jax plot WORKDIR [WORKDIR ...]`: PNG figures of runs' own metrics.jsonl, several runs on one axis.

  bert-jax plot runs/demo runs/rte --out plots/

Each workdir's `metrics.jsonl` is one run (a fine-tuning workdir's seed
folders, `seed_*/metrics.jsonl`, are one run each). Rows that a resumed run
logged again are de-duplicated: when a run's steps go back, the rows of the
interrupted run from that step on are dropped, so every step is drawn once, as
the run that continued computed it. Figures (against steps, and against
tokens where the run's config gives the tokens per step):

  loss.png           train and eval losses
  accuracy.png       every *accuracy metric (MLM, NSP/SOP, RTD, task dev scores)
  learning_rate.png  the schedule
  throughput.png     tokens/s
  loss_vs_tokens.png the losses against tokens seen

Scores are fractions (0-1) in every command's logs (`bert_jax.tasks.metrics`'s
unit rule); a fine-tuning run logged before that rule has its dev scores in
percent, which no fraction exceeds: a score stream above 1 is drawn divided by 100.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any, Sequence

from etils import epath

PANELS = {
    "loss": lambda key: key.endswith("loss") and "/" in key,
    "accuracy": lambda key: "accuracy" in key or key.endswith(("/f1", "/mcc", "/pearson", "/exact_match")),
    "learning_rate": lambda key: key.endswith("learning_rate"),
    "throughput": lambda key: key.endswith("tokens_per_second"),
}
# Each panel's y axis, with its unit.
Y_LABELS = {
    "loss": "loss (log scale)",
    "accuracy": "accuracy / score (fraction, 0-1)",
    "learning_rate": "learning rate",
    "throughput": "tokens per second",
}


def _points(rows: list[dict[str, Any]], key: str, panel: str) -> list[tuple[int, float]]:
  """(step, value) of `key`'s finite values; a score stream logged in percent (above 1) as fractions."""
  points = [(row["step"], row[key]) for row in rows
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]
  if panel == "accuracy" and any(value > 1.0 for _, value in points):
    points = [(step, value / 100.0) for step, value in points]
  return points


def read_rows(path: str | epath.Path) -> list[dict[str, Any]]:
  """The rows of one metrics.jsonl, resumed runs' repeated steps de-duplicated (the later run's rows kept).

  Rows are grouped by kind (the prefix before "/" of their metric names: train, eval, ...); within a kind,
  a step at or below the previous row's step marks a resume, and the earlier rows from that step on go.
  """
  by_kind: dict[str, list[dict[str, Any]]] = {}
  for line in epath.Path(path).read_text().splitlines():
    try:
      row = json.loads(line)
    except ValueError:  # A line cut by a kill.
      continue
    if "step" not in row:
      continue
    kind = next((key.split("/")[0] for key in row if "/" in key), "")
    rows = by_kind.setdefault(kind, [])
    while rows and rows[-1]["step"] >= row["step"]:
      rows.pop()
    rows.append(row)
  return sorted((row for rows in by_kind.values() for row in rows), key=lambda row: row["step"])


def find_runs(workdirs: Sequence[str]) -> list[tuple[str, epath.Path, int | None]]:
  """(label, metrics.jsonl, tokens per step or None) of every run under the given workdirs."""
  runs = []
  for workdir in workdirs:
    root = epath.Path(workdir)
    files = [root / "metrics.jsonl"] if (root / "metrics.jsonl").exists() else sorted(root.glob("*/metrics.jsonl"))
    if not files:
      raise FileNotFoundError(f"{workdir}: no metrics.jsonl (not a bert_jax workdir, or no step logged yet)")
    tokens = _tokens_per_step(root)
    for file in files:
      label = workdir.rstrip("/") if file.parent == root else f"{workdir.rstrip('/')}/{file.parent.name}"
      runs.append((label, file, tokens))
  return runs


def _tokens_per_step(workdir: epath.Path) -> int | None:
  try:
    config = json.loads((workdir / "config.json").read_text())
    return int(config["train"]["batch_size"]) * int(config["data"]["seq_len"])
  except (FileNotFoundError, KeyError, TypeError, ValueError):
    return None


def plot(workdirs: Sequence[str], out: str | pathlib.Path) -> list[pathlib.Path]:
  """Writes the figures of the runs in `workdirs` into `out`; returns their paths."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = [(label, read_rows(path), tokens) for label, path, tokens in find_runs(workdirs)]
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  panels = [(name, match, "step") for name, match in PANELS.items()]
  if any(tokens for _, _, tokens in runs):
    panels.append(("loss_vs_tokens", PANELS["loss"], "tokens"))
  for name, match, axis in panels:
    figure, ax = plt.subplots(figsize=(8, 5))
    drawn = 0
    for label, rows, tokens in runs:
      if axis == "tokens" and not tokens:
        continue
      keys = sorted({key for row in rows for key in row if match(key)})
      for key in keys:
        points = _points(rows, key, name.replace("_vs_tokens", ""))
        if not points:
          continue
        xs = [step * (tokens if axis == "tokens" else 1) for step, _ in points]
        style = "o-" if key.startswith("eval") or len(points) < 30 else "-"
        ax.plot(xs, [value for _, value in points], style, markersize=3,
                label=f"{label}: {key}" if len(runs) > 1 else key)
        drawn += 1
    if not drawn:
      plt.close(figure)
      continue
    ax.set_xlabel("tokens seen" if axis == "tokens" else "step")
    ax.set_ylabel(Y_LABELS[name.replace("_vs_tokens", "")])
    if name.startswith("loss"):
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{name.replace('_', ' ')}: " + ", ".join(label for label, _, _ in runs)[:100])
    figure.tight_layout()
    path = out / f"{name}.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    written.append(path)
  return written


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="bert-jax plot", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("workdirs", nargs="+", help="pre-training or fine-tuning workdirs (local or gs://)")
  parser.add_argument("--out", default="plots", help="folder for the PNG files (default: %(default)s)")
  args = parser.parse_args(argv)
  written = plot(args.workdirs, args.out)
  if not written:
    print("bert-jax plot: error: no metric to draw in " + ", ".join(args.workdirs), file=sys.stderr)
    return 1
  print("wrote " + ", ".join(str(path) for path in written))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
