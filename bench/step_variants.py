"""Variants of the pre-training step side by side: XLA flags and config overrides (issue 6).

  python -m bench.step_variants                                     # base-128 b256, default variants, 1 GPU
  python -m bench.step_variants --parallel 4 --size large --seq 128 --batch 128
  python -m bench.step_variants --variant lt=--xla_gpu_enable_cublaslt=true --variant ...   # your own
  python -m bench.step_variants --tiny --parallel 2 --variant off=--config.model.kernels=off  # CPU

Every variant is one `bench/train_step.py --json` process (the trainer's
step on synthetic full rows); a variant is a list of options: `--xla_...`
flags are appended to XLA_FLAGS, `--config.key=value` overrides go to the
step's config (e.g. `--config.model.kernels=off`).
The baseline (no extra options) runs first and again last, so the table shows
how far two identical runs drift; with --parallel N the variants run N at a
time, one per GPU, each pinned to its share of the cores (as
`pretrain_vs_reference.py --parallel`). A flag this XLA does not know fails
its child, which is a row of the table, not an error. The loss after the
timed steps is printed to show that a variant changed only the speed (bf16
noise aside); "first step ms" is the time from the timed loop's start to its
first step's completion (a step and the wait before an idle device starts
it). The table is printed last and written under --out-dir.

XLA flags are version-dependent: the defaults below are code-generation flags
of the XLA in jax 0.11 that the GPU machine runs, plus this codebase's own
speed options: the opt-in ones, and the GPU defaults switched back (what each
default buys). An XLA_FLAGS setting of an option the steps also set
(`step.GPU_COMPILER_OPTIONS`) overrides theirs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys

from bench.pretrain_vs_reference import Pool, gib, ours, render, versions, write

DEFAULT_VARIANTS = {
    # The steps compile with Triton GEMM fusions off on GPU (step.GPU_COMPILER_OPTIONS); this puts them back.
    "triton-gemm-on": "--xla_gpu_enable_triton_gemm=true",
    "triton-gemm-any": "--xla_gpu_enable_triton_gemm=true --xla_gpu_triton_gemm_any=true",
    "cublaslt": "--xla_gpu_enable_cublaslt=true",
    "command-buffer-off": "--xla_gpu_enable_command_buffer=",
    "exhaustive-tiling": "--xla_gpu_exhaustive_tiling_search=true",
    "latency-hiding": "--xla_gpu_enable_latency_hiding_scheduler=true",
    # XLA merges dots that share an operand (x @ Wq, x @ Wk, x @ Wv) only below this size (MiB). The steps set
    # 0 on GPU (step.GPU_COMPILER_OPTIONS: no merging, so each projection's bias add stays inside its GEMM);
    # 32 is XLA's default, which merged the query and key projections of BERT-Base (seen in a profile of the step); 4096
    # merges all three.
    "dot-merger-32m": "--xla_gpu_dot_merger_threshold_mb=32",
    "dot-merger-4g": "--xla_gpu_dot_merger_threshold_mb=4096",
    "kernels-off": "--config.model.kernels=off",  # the plain model: no hand-written kernel or custom gradient
    # Every row of the last block (the pre-training configs compute only the heads' rows).
    "full-last-layer": "--config.model.sparse_last_layer=False",
}
BASELINE = "baseline"


def parse_variants(items: list[str] | None) -> dict[str, str]:
  """'name=--option[ --option...]' items -> {name: options}; the defaults when none are given."""
  if not items:
    return dict(DEFAULT_VARIANTS)
  variants = {}
  for item in items:
    name, sep, options = item.partition("=")
    if not sep or not name or not options.startswith("--"):
      raise SystemExit(f"--variant {item!r}: expected NAME=--xla_flag[=value] or --config.key=value[ --another...]")
    if name in variants or name == BASELINE:
      raise SystemExit(f"--variant {item!r}: the name {name!r} is taken")
    variants[name] = options
  return variants


def table(runs: list[tuple[str, str, dict]]) -> str:
  base = [r["step_s"] for name, _, r in runs if name == BASELINE and "error" not in r]
  reference = sum(base) / len(base) if base else None
  rows = []
  for name, options, result in runs:
    if "error" in result:
      error = " ".join(result["error"])
      error = error.split("] ", 1)[-1]  # Drop a glog prefix ("F1126 10:03:46.697 ... file.cc:234] ").
      rows.append((name, options or "-", "failed: " + error[:100], "-", "-", "-", "-", "-", "-"))
      continue
    change = f"{100 * (result['step_s'] / reference - 1):+.1f}%" if reference else "-"
    first = result.get("first_step_s")
    rows.append((name, options or "-", f"{1e3 * result['step_s']:.2f}", change,
                 "-" if first is None else f"{1e3 * first:.1f}", f"{result['seq_per_s']:,.0f}",
                 f"{result['compile_s']:.1f}", gib(result.get("peak_bytes")), f"{result['loss']:.4f}"))
  header = ("variant", "options", "step ms", "vs baseline", "first step ms", "seq/s", "compile s", "peak GiB",
            "loss")
  return render(header, rows)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--size", default="base")
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--variant", action="append", metavar="NAME=OPTIONS", help="replaces the default variants")
  parser.add_argument("--parallel", type=int, default=1, metavar="N", help="variants at once, one per GPU")
  parser.add_argument("--tiny", action="store_true", help="BERT-tiny seq 64 batch 8 (a CPU plumbing check)")
  parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).resolve().parent / "results"))
  args, rest = parser.parse_known_args(argv)
  overrides = [a for a in rest if a.startswith("--config.")]  # Passed to every child (train_step's overrides).
  if len(overrides) != len(rest):
    parser.error(f"unrecognised arguments {[a for a in rest if not a.startswith('--config.')]}")
  if args.tiny:
    args.size, args.seq, args.batch, args.steps = "tiny", 64, 8, 3
  variants = parse_variants(args.variant)
  plan = [(BASELINE, "")] + list(variants.items()) + [(BASELINE, "")]
  inherited = os.environ.get("XLA_FLAGS", "")

  def job(options):
    flags = " ".join(o for o in options.split() if not o.startswith("--config."))
    configs = [o for o in options.split() if o.startswith("--config.")]
    env = {"XLA_FLAGS": f"{inherited} {flags}".strip()} if flags else None
    return lambda place: ours(args.size, args.seq, args.batch, *overrides, *configs, env=env, steps=args.steps,
                              place=place)

  info = versions()
  results = Pool(args.parallel).map([job(options) for _, options in plan])
  runs = [(name, options, result) for (name, options), result in zip(plan, results)]
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  text = "\n".join([
      f"# Variants of the pre-training step ({info.get('card', '?')})",
      "",
      f"{date}; JAX {info.get('jax')} ({str(info.get('jax_cuda', '')).replace(chr(10), ' ')}); "
      f"bert-{args.size} seq {args.seq} batch {args.batch}, MLM+NSP, {args.steps} timed steps; "
      f"XLA_FLAGS of this process: {inherited or '(none)'}.",
      f"Command: python -m bench.step_variants {' '.join(argv)}",
      "",
      table(runs),
  ]) + "\n"
  stem = f"step_variants_{info.get('card', 'unknown').replace(' ', '_')}_{date[:10]}_{args.size}_{args.seq}"
  write(pathlib.Path(args.out_dir), stem, text, {"date": date, "versions": info, "runs": [
      {"variant": name, "options": options, "result": result} for name, options, result in runs]})


if __name__ == "__main__":
  main(sys.argv[1:])
