"""Does the optimised step train like the unoptimised one? Loss curves of two revisions, several seeds each.

  python -m bench.loss_curve                              # HEAD vs d892eab (before the speed work), bf16
  python -m bench.loss_curve --baseline REV --seeds 1,2,3 --steps 400 --config configs/demo.py --out FILE

Both revisions pre-train the same config (the demo: BERT-Tiny, MLM + NSP on the
built-in corpus) with the same seeds, so data order, masking and initial
parameters match; what differs is the step's implementation (dropout masks
are drawn differently: RNG bits before, hashes now; LayerNorm / GELU /
cross-entropy gradients; embedding-lookup gradients; attention path). The
baseline runs from a `git worktree` of REV. Per logged step the table gives
each revision's mean train MLM loss over seeds and the paired difference
(current - baseline) against its seed-to-seed spread (z); the last line
averages each seed's difference over the whole curve and gives its paired t
over seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
# The last commit before issue 6's speed changes (embedding lookups, RNG, attention kernels, hashed dropout, ops).
BEFORE_SPEED_WORK = "d892eab"


def run_curve(tree: pathlib.Path, config: str, seed: int, steps: int, dtype: str, workdir: pathlib.Path) -> dict:
  """Pre-trains in `tree` (its own bert_jax first on the path); returns {step: train MLM loss}."""
  shutil.rmtree(workdir, ignore_errors=True)
  env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
         "BERT_JAX_COMPILATION_CACHE": "none"}
  command = [sys.executable, "-m", "bert_jax.cli", "pretrain", "--config", config, "--workdir", str(workdir),
             f"--config.seed={seed}", f"--config.train.steps={steps}", f"--config.model.dtype={dtype}",
             "--config.train.fill_mask=()"]
  completed = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
  if completed.returncode:
    raise RuntimeError(f"{tree} seed {seed} failed:\n{completed.stderr[-3000:]}")
  curve = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if "train/mlm_loss" in record:
      curve[record["step"]] = record["train/mlm_loss"]
  return curve


def compare(baseline: dict[int, dict], current: dict[int, dict]) -> tuple[list[str], float, str]:
  """Markdown rows per step, the largest per-step |z|, and the whole-curve paired difference in words."""
  seeds = sorted(baseline)
  steps = sorted(set.intersection(*(set(baseline[s]) & set(current[s]) for s in seeds)))
  rows = ["| step | baseline mean | current mean | mean diff | sd of diff | z |", "|---|---|---|---|---|---|"]
  worst = 0.0
  for step in steps:
    before = [baseline[s][step] for s in seeds]
    after = [current[s][step] for s in seeds]
    diffs = [a - b for a, b in zip(after, before)]
    spread = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
    z = statistics.mean(diffs) / (spread / math.sqrt(len(diffs))) if spread > 0 else float("nan")
    worst = max(worst, abs(z)) if not math.isnan(z) else worst
    rows.append(f"| {step} | {statistics.mean(before):.4f} | {statistics.mean(after):.4f} | "
                f"{statistics.mean(diffs):+.4f} | {spread:.4f} | {z:+.2f} |")
  # One number per seed: its difference averaged over the logged steps; then a paired t over seeds.
  per_seed = [statistics.mean(current[s][step] - baseline[s][step] for step in steps) for s in seeds]
  mean = statistics.mean(per_seed)
  se = statistics.stdev(per_seed) / math.sqrt(len(per_seed)) if len(per_seed) > 1 else float("nan")
  identical = sum(current[s][step] == baseline[s][step] for s in seeds for step in steps)
  t = f"{mean / se:+.2f}" if se > 0 else "undefined: no spread"
  whole = (f"curve-averaged difference {mean:+.4f} +- {se:.4f} (t = {t}, {len(seeds) - 1} dof); "
           f"{identical} of {len(seeds) * len(steps)} logged losses identical")
  return rows, worst, whole


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--baseline", default=BEFORE_SPEED_WORK, help="git revision of the unoptimised step")
  parser.add_argument("--config", default="configs/demo.py")
  parser.add_argument("--seeds", default="1,2,3,4,5,6")
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--scratch", default=str(pathlib.Path(tempfile.gettempdir()) / "bert_jax_loss_curve"))
  parser.add_argument("--out", help="also write the table to this file")
  args = parser.parse_args()
  scratch = pathlib.Path(args.scratch)
  seeds = [int(s) for s in args.seeds.split(",")]
  worktree = scratch / "baseline_tree"
  if worktree.exists():
    subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
  subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.baseline], cwd=REPO, check=True,
                 capture_output=True)
  try:
    curves = {"baseline": {}, "current": {}}
    for seed in seeds:
      for name, tree in (("baseline", worktree), ("current", REPO)):
        curves[name][seed] = run_curve(tree, args.config, seed, args.steps, args.dtype, scratch / f"{name}_{seed}")
        print(f"{name} seed {seed}: final train MLM loss {curves[name][seed][max(curves[name][seed])]:.4f}",
              flush=True)
  finally:
    subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, check=False)
  rows, worst, whole = compare(curves["baseline"], curves["current"])
  head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                        text=True).stdout.strip()
  verdict = (f"{whole}; largest per-step |z| {worst:.2f} over {len(rows) - 2} logged steps. Read: |t| under "
             f"Student's two-sided 5% point at those dof (2.57 at 5) means agreement within seed noise.")
  text = (f"# Train MLM loss: {head} (current, with local changes if any) vs {args.baseline} (baseline)\n\n"
          f"Command: python -m bench.loss_curve --baseline {args.baseline} --config {args.config} --seeds "
          f"{args.seeds} --steps {args.steps} --dtype {args.dtype}\n\n" + "\n".join(rows) + f"\n\n{verdict}\n")
  if args.out:
    pathlib.Path(args.out).write_text(text)
  print(text)


if __name__ == "__main__":
  main()
