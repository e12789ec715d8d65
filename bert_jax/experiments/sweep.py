"""Run a config's sweep and render the paper-style table.

  bert-jax sweep --config configs/spanbert.py:size=tiny --workdir runs/spanbert_table \
      --config.data.prepared=data/wiki --config.train.steps=20000

The config file's `get_sweep(arg)` returns a list of override dicts (one per
table row). Each row runs in `<workdir>/<row name>` (so an interrupted sweep
resumes row by row), and the final evaluation metrics of every row are written
to `<workdir>/results.md` and `results.json` and printed.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
from typing import Any, Callable

from bert_jax.train import config_lib


def row_name(overrides: dict[str, Any]) -> str:
  text = ",".join(f"{k}={v}" for k, v in overrides.items()) or "base"
  return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", text)


def render_table(rows: list[tuple[str, dict[str, float]]]) -> str:
  """Markdown table: one row per sweep point, one column per metric any row reported."""
  columns = sorted({k for _, metrics in rows for k in metrics})
  lines = ["| run | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
  for name, metrics in rows:
    cells = [_format(metrics[c]) if c in metrics else "" for c in columns]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _format(value: float) -> str:
  return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4g}"


def _pretrain(config, workdir) -> dict[str, float]:
  from bert_jax.train import trainer

  return dict(trainer.train_and_evaluate(config, workdir)["eval"])


def run_sweep(spec: str, workdir: str | pathlib.Path, base_overrides: list[str] = (),
              run: Callable[[Any, pathlib.Path], dict[str, float]] | None = None) -> list[tuple[str, dict]]:
  """Runs every row of the sweep of `spec` ('path.py[:arg]'); returns [(row name, metrics)]."""
  path, arg = config_lib.resolve_config_path(spec)
  module = config_lib._load_module(path)
  if not hasattr(module, "get_sweep"):
    raise config_lib.ConfigError(f"{path} defines no get_sweep(arg)")
  if run is None:
    probe = config_lib.load_config(spec, base_overrides)
    if "task" in probe:
      from bert_jax.tasks import finetune

      def run(config, directory):
        # Fine-tuning rows report the median over seeds of each split's metrics.
        summary = finetune.finetune(config, directory)["summary"]
        return {f"{split}/{metric}": stats["median"] for split, metrics in summary.items()
                for metric, stats in metrics.items()}
    else:
      run = _pretrain
  workdir = pathlib.Path(workdir)
  rows = []
  for overrides in module.get_sweep(arg):
    config = config_lib.load_config(spec, list(base_overrides))
    for key, value in overrides.items():
      config_lib.set_by_path(config, key, str(value))
    name = row_name(overrides)
    metrics = {k: float(v) for k, v in run(config, workdir / name).items() if isinstance(v, (int, float))}
    rows.append((name, metrics))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "results.json").write_text(json.dumps(dict(rows), indent=2))
    (workdir / "results.md").write_text(render_table(rows) + "\n")
  return rows


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(prog="bert-jax sweep", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="configs/NAME.py[:arg] defining get_sweep")
  parser.add_argument("--workdir", required=True)
  args, rest = parser.parse_known_args(argv)
  unknown = [a for a in rest if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognised arguments {unknown}")
  rows = run_sweep(args.config, args.workdir, rest)
  print(render_table(rows))
  print(f"\nTable: {pathlib.Path(args.workdir) / 'results.md'}")
  return 0
