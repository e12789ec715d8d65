"""Data-parallel and FSDP scaling of the pre-training step over the GPUs of one host (issue 7).

  NCCL_NVLS_ENABLE=0 python -m bench.scaling                        # 1, 2, 4 GPUs, both rows, largest FSDP fit
  NCCL_NVLS_ENABLE=0 python -m bench.scaling --rows base-128 --largest none
  python -m bench.scaling --gpus 1,2 --dry-run                      # print the child commands only
  python -m bench.scaling --tiny --gpus 1,2,4                       # CPU check on fake host devices

Every measurement is its own `bench/train_step.py --json` process (the
trainer's step on synthetic full rows, timed after warm-up), so each sees only
its GPUs (`CUDA_VISIBLE_DEVICES=0..n-1`) and reports its own peak memory. Per
row (model, seq, per-GPU batch) it runs n = 1 once ("single", the baseline of
both strategies), then for every other n the global batch per-GPU batch x n on
a mesh of data=n (data parallel, parameters replicated, gradients all-reduced)
and of fsdp=n (parameters, gradients and optimizer state sharded, weights
all-gathered). Efficiency = seq/s per GPU at n / seq/s on one GPU.

Then the largest FSDP fit on the most GPUs: bigger-than-large BERT layouts
('L<layers>-H<hidden>', 4 x H feed-forward, 64-wide heads) at a fixed per-GPU
batch, and the largest per-GPU batch of BERT-large seq 512, both with full
rematerialisation; candidates are tried largest first and the search stops at
the first that runs. Each child's allocator is capped at --budget-gib (the same
on an H100 or an H200), and a failure (OOM, timeout) is a row of the table, not
an error.

On a CPU-only machine (or with --platform cpu) n becomes
`--xla_force_host_platform_device_count=n`, which checks the plumbing, not the
speed. Every result is appended to a .jsonl under --out-dir as it arrives; the
markdown table (card, driver, versions, command) is printed last and written
beside it with the JSON of all runs. Where one command may not run long
enough for everything, split it (--rows, --largest) and join the pieces:

  NCCL_NVLS_ENABLE=0 python -m bench.scaling --largest none --max-minutes 9
  NCCL_NVLS_ENABLE=0 python -m bench.scaling --rows none --max-minutes 9
  python -m bench.scaling --render A/scaling_*.jsonl B/scaling_*.jsonl [--stem NAME]   # one table, no device
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import time
from typing import Any

from bert_jax.models.config import model_config
from bench.pretrain_vs_reference import gib, render

HERE = pathlib.Path(__file__).resolve().parent
# name -> (BERT size, seq, per-GPU batch).
ROWS = {"base-128": ("base", 128, 256), "large-512": ("large", 512, 32)}
TINY_ROWS = {"tiny-64": ("tiny", 64, 4), "mini-128": ("mini", 128, 2)}
# Largest-fit candidates, largest first: layouts at seq 512 and a per-GPU batch, and BERT-large seq-512 batches.
LARGEST_MODELS, LARGEST_MODEL_BATCH, LARGEST_BATCHES = "L48-H4096,L36-H3072,L24-H2560", 8, "384,192"
TINY_LARGEST_MODELS, TINY_LARGEST_MODEL_BATCH, TINY_LARGEST_BATCHES = "L4-H256,L2-H128", 2, "8,4"
GOAL, STRETCH = 0.90, 0.95
PEAK_TFLOPS = 989.0  # H100 / H200 SXM dense bf16, as bench/train_step.py.
OOM_PATTERN = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM")


def probe(env: dict[str, str]) -> dict[str, Any]:
  """Platform, device count and kind, JAX / CUDA / cuDNN / NCCL versions, read in a child process."""
  code = (
      "import json, importlib.metadata as md, jax\n"
      "d = jax.devices()[0]\n"
      "info = {'platform': d.platform, 'devices': jax.device_count(), 'card': d.device_kind, 'jax': jax.__version__,"
      " 'jaxlib': md.version('jaxlib'), 'platform_version': d.client.platform_version.replace(chr(10), ' ')}\n"
      "try:\n"
      "  from jax._src.lib import cuda_versions as v\n"
      "  info['cudnn'] = str(v.cudnn_get_version()) if v else '-'\n"
      "except Exception:\n"
      "  info['cudnn'] = '-'\n"
      "for name in ('nvidia-nccl-cu13', 'nvidia-nccl-cu12'):\n"
      "  try:\n"
      "    info['nccl'] = md.version(name); break\n"
      "  except md.PackageNotFoundError:\n"
      "    pass\n"
      "print(json.dumps(info))\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                        env={**os.environ, **env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if not lines:
    raise RuntimeError(f"JAX probe failed: {proc.stderr.strip()[-2000:]}")
  return json.loads(lines[-1])


def nvidia_smi(*args: str) -> str:
  """nvidia-smi's output, or '' where there is none."""
  try:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def child_env(n: int, platform: str, mem_fraction: float | None, cache_dir: str | None) -> dict[str, str]:
  """The environment of a child that sees n devices: the first n GPUs, or n fake CPU devices.

  With `cache_dir`, JAX's persistent cache, which also turns on XLA's
  per-fusion autotuning cache there: a later child whose GEMM shapes were
  tuned before (data parallel and FSDP keep the per-GPU shapes) skips that
  part of compiling. Compile time is not part of any figure.
  """
  env = {"JAX_COMPILATION_CACHE_DIR": cache_dir} if cache_dir else {}
  if platform == "cpu":
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return env | {"JAX_PLATFORMS": "cpu",
                  "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}".strip()}
  env |= {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n)),
          "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}  # NVLink multicast off unless asked.
  if mem_fraction is not None:
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.4f}"
  return env


def child_command(size: str, seq: int, global_batch: int, strategy: str, n: int, steps: int, warmup: int,
                  objective: str, extra: list[str]) -> list[str]:
  """`bench/train_step.py --json` for one measurement; strategy picks the mesh (data=n or fsdp=n)."""
  data, fsdp = (1, n) if strategy == "fsdp" else (n, 1)
  return [sys.executable, "-m", "bench.train_step", "--size", size, "--seq", str(seq), "--batch",
          str(global_batch), "--objective", objective, "--steps", str(steps), "--warmup", str(warmup), "--json",
          f"--config.mesh.sizes.data={data}", f"--config.mesh.sizes.fsdp={fsdp}", "--config.mesh.sizes.tensor=1",
          *extra]


def run_child(command: list[str], env: dict[str, str], timeout: int) -> dict[str, Any]:
  """Runs a child; returns its JSON line, or {"error": "OOM" | "timeout" | its last stderr line}."""
  start = time.perf_counter()
  try:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
  except subprocess.TimeoutExpired:
    return {"error": f"timeout after {timeout} s", "wall_s": time.perf_counter() - start}
  wall_s = time.perf_counter() - start
  for line in reversed(proc.stdout.strip().splitlines()):
    if line.startswith("{"):
      return {**json.loads(line), "wall_s": wall_s}
  output = (proc.stderr or proc.stdout).strip()
  if OOM_PATTERN.search(output):
    match = re.search(r"[^\n]*(RESOURCE_EXHAUSTED|[Oo]ut of memory)[^\n]*", output)
    return {"error": "OOM", "detail": match.group(0)[-400:] if match else "", "wall_s": wall_s}
  return {"error": (output.splitlines() or ["no output"])[-1][-400:], "wall_s": wall_s}


def shell_line(env: dict[str, str], command: list[str]) -> str:
  return " ".join([f"{k}={v!r}" if " " in v else f"{k}={v}" for k, v in env.items()] + command)


def plan(args: argparse.Namespace, rows: dict[str, tuple[str, int, int]], gpus: list[int]) -> list[dict[str, Any]]:
  """Every scaling measurement: per row, n=1 once ("single"), then data and fsdp for every other n.

  `--only row:strategy:n,...` keeps just those measurements (plus each row's n=1 baseline).
  """
  only = {tuple(item.split(":")) for item in args.only.split(",")} if getattr(args, "only", None) else None
  runs = []
  for name, (size, seq, per_gpu) in rows.items():
    for n in gpus:
      for strategy in ("single",) if n == 1 else ("data", "fsdp"):
        if only is not None and n != 1 and (name, strategy, str(n)) not in only:
          continue
        runs.append(dict(row=name, size=size, seq=seq, per_gpu_batch=per_gpu, global_batch=per_gpu * n, gpus=n,
                         strategy=strategy, remat="none", search=None))
  return runs


def largest_candidates(args: argparse.Namespace, n: int) -> list[list[dict[str, Any]]]:
  """The two searches (model size, then BERT-large seq-512 batch), each a list of candidates largest first."""
  models = [m for m in args.largest_models.split(",") if m]
  batches = [int(b) for b in args.largest_batches.split(",") if b]
  batch_size = "L2-H128" if args.tiny else "large"
  searches = []
  if args.largest in ("model", "both") and models:
    searches.append([dict(row=f"largest model seq {args.largest_seq}", size=m, seq=args.largest_seq,
                          per_gpu_batch=args.largest_model_batch, global_batch=args.largest_model_batch * n, gpus=n,
                          strategy="fsdp", remat="full", search="model") for m in models])
  if args.largest in ("batch", "both") and batches:
    searches.append([dict(row=f"largest batch bert-{batch_size} seq {args.largest_seq}", size=batch_size,
                          seq=args.largest_seq, per_gpu_batch=b, global_batch=b * n, gpus=n, strategy="fsdp",
                          remat="full", search="batch") for b in sorted(batches, reverse=True)])
  return searches


def params_text(size: str) -> str:
  """Encoder parameters of a BERT size (the pre-training heads add little), as '4.2B' or '11M'."""
  try:
    params = model_config("bert", size).num_params()
  except ValueError:
    return "-"
  return f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def mfu_per_gpu(result: dict[str, Any]) -> str:
  """Model FLOP/s per device over the peak, from the child's FLOPs per token.

  Recomputed rather than read from the child's "mfu": children from before
  bench/train_step.py reported MFU per device gave it per mesh, and --render
  still reads their results.
  """
  flops = result["flops_per_token"] * result["batch"] * result["seq"] / result["step_s"] / result["device_count"]
  return f"{100 * flops / (PEAK_TFLOPS * 1e12):.1f}%"


def baseline(runs: list[dict[str, Any]], row: str) -> float | None:
  one = next((r for r in runs if r["row"] == row and r["gpus"] == 1 and "error" not in r["result"]), None)
  return one["result"]["seq_per_s"] if one else None


def scaling_table(runs: list[dict[str, Any]]) -> str:
  header = ("model", "seq", "strategy", "GPUs", "global batch", "step ms", "seq/s", "seq/s per GPU", "efficiency",
            "MFU per GPU", "peak GiB (GPU 0)")
  rows = []
  for run in runs:
    result, n = run["result"], run["gpus"]
    cells = (f"bert-{run['size']}", str(run["seq"]), run["strategy"], str(n), str(run["global_batch"]))
    if "error" in result:
      rows.append(cells + (f"failed: {result['error'][:60]}",) + ("-",) * 5)
      continue
    per_gpu = result["seq_per_s"] / n
    one = baseline(runs, run["row"])
    rows.append(cells + (f"{1e3 * result['step_s']:.1f}", f"{result['seq_per_s']:,.0f}", f"{per_gpu:,.0f}",
                         f"{100 * per_gpu / one:.1f}%" if one else "-", mfu_per_gpu(result),
                         gib(result.get("peak_bytes"))))
  return render(header, rows)


def largest_table(runs: list[dict[str, Any]]) -> str:
  header = ("search", "model", "params", "seq", "GPUs", "per-GPU batch", "global batch", "remat", "result",
            "step ms", "seq/s", "MFU per GPU", "peak GiB (GPU 0)")
  rows = []
  for run in runs:
    result = run["result"]
    cells = (run["search"], f"bert-{run['size']}", params_text(run["size"]), str(run["seq"]),
             str(run["gpus"]), str(run["per_gpu_batch"]), str(run["global_batch"]), run["remat"])
    if "error" in result:
      rows.append(cells + (f"failed: {result['error'][:60]}",) + ("-",) * 4)
    else:
      rows.append(cells + ("fits", f"{1e3 * result['step_s']:.1f}", f"{result['seq_per_s']:,.0f}",
                           mfu_per_gpu(result), gib(result.get("peak_bytes"))))
  return render(header, rows)


def goal_lines(runs: list[dict[str, Any]], gpus: int) -> list[str]:
  lines = []
  for row in dict.fromkeys(r["row"] for r in runs):
    run = next((r for r in runs if r["row"] == row and r["gpus"] == gpus and r["strategy"] == "data"), None)
    one = baseline(runs, row)
    if run is None or "error" in run["result"] or not one:
      lines.append(f"- {row}: data parallel at {gpus} GPUs not measured")
      continue
    efficiency = run["result"]["seq_per_s"] / gpus / one
    verdict = "stretch met" if efficiency >= STRETCH else "met" if efficiency >= GOAL else "NOT met"
    lines.append(f"- {row}: data parallel at {gpus} GPUs {100 * efficiency:.1f}% per-GPU efficiency ({verdict})")
  return lines


def report(headers: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:
  """The markdown: versions and commands of every piece, the scaling table, the goal, the largest-fit table."""
  first = headers[0]
  scaling = [r for r in runs if not r["search"]]
  largest = [r for r in runs if r["search"]]
  most = max([r["gpus"] for r in runs] or [1])
  versions = []
  for header in headers:
    info = header["versions"]
    line = (f"{info.get('card')} (driver {info.get('driver', '-')}); JAX {info.get('jax')} / jaxlib "
            f"{info.get('jaxlib')} ({info.get('platform_version')}, cuDNN {info.get('cudnn', '-')}, NCCL "
            f"{info.get('nccl', '-')}); {header['cap']}")
    if line not in versions:
      versions.append(line)
  parts = [
      f"# Pre-training step scaling: data parallel and FSDP on 1-{most} x {first['versions'].get('card')}",
      "",
      *[f"{header['date']}: `{header['command']}` ({header['minutes']:.1f} min)" for header in headers],
      "",
      *versions,
      "",
      f"Step: bench/train_step.py --json (objective {first['objective']}, synthetic full rows, bf16 compute, "
      f"float32 params, AdamW, dropout 0.1; {first['steps']} timed steps after {first['warmup']} warm-up), one "
      "process per measurement on GPUs 0..n-1 (children get NCCL_NVLS_ENABLE=0 unless set otherwise). data = mesh "
      "data=n (parameters replicated, gradients all-reduced); fsdp = mesh fsdp=n (parameters, gradients and "
      "optimizer state sharded); global batch = per-GPU batch x n.",
      "Efficiency = seq/s per GPU / seq/s on 1 GPU. MFU per GPU = FLOP/s per GPU / 989 TFLOP/s (dense bf16). "
      "Peak memory is GPU 0's.",
  ]
  if scaling:
    widest = max(r["gpus"] for r in scaling)
    parts += ["", scaling_table(scaling), "",
              f"Goal: >= {100 * GOAL:.0f}% per-GPU efficiency for data parallel at {widest} GPUs "
              f"(stretch {100 * STRETCH:.0f}%):", *goal_lines(scaling, widest)]
  if largest:
    parts += [
        "", f"## Largest FSDP fit on {max(r['gpus'] for r in largest)} GPUs", "",
        f"Candidates largest first, stopping at the first that runs ({first['search_steps']} timed steps after 1 "
        "warm-up); remat full. Layouts 'L<layers>-H<hidden>': 64-wide heads, 4 x H feed-forward, BERT's "
        "vocabulary; params = encoder parameters.", "",
        largest_table(largest)]
  topology = next((h["topology"] for h in headers if h.get("topology")), "")
  if topology:
    parts += ["", "GPU topology (nvidia-smi topo -m):", "", "```", topology, "```"]
  return "\n".join(parts) + "\n"


def write(out_dir: pathlib.Path, stem: str, headers: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
  text = report(headers, runs)
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.md").write_text(text)
  (out_dir / f"{stem}.json").write_text(json.dumps({"headers": headers, "runs": runs}, indent=1))
  print(text)


def render_files(paths: list[str], out_dir: pathlib.Path, stem: str | None = None) -> None:
  """Joins the .jsonl of earlier calls into one table (`stem`.md/.json; default scaling_<card>_<date>_joined)."""
  headers, runs = [], []
  for path in paths:
    for line in pathlib.Path(path).read_text().splitlines():
      record = json.loads(line)
      (headers if record.pop("kind") == "header" else runs).append(record)
  if not headers:
    raise SystemExit(f"no header line in {paths}")
  write(out_dir, stem or f"{headers[0]['stem']}_joined", headers, runs)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gpus", default="1,2,4", help="device counts; 1 is the baseline and is always run")
  parser.add_argument("--rows", default="all", help=f"'all', 'none' (searches only) or comma-separated names of "
                      f"{list(ROWS)} (with --tiny: {list(TINY_ROWS)})")
  parser.add_argument("--only", help="keep only these row:strategy:GPUs runs, e.g. base-128:data:4,large-512:fsdp:4")
  parser.add_argument("--steps", type=int, help="timed steps per measurement (default 15; 3 with --tiny)")
  parser.add_argument("--warmup", type=int, help="untimed steps after compiling (default 3; 1 with --tiny)")
  parser.add_argument("--objective", default="mlm+nsp")
  parser.add_argument("--largest", choices=("both", "model", "batch", "none"), default="both",
                      help="which largest-FSDP-fit searches to run, on the most GPUs of --gpus")
  parser.add_argument("--largest-models", help=f"BERT layouts, largest first (default {LARGEST_MODELS})")
  parser.add_argument("--largest-model-batch", type=int, help=f"their per-GPU batch (default {LARGEST_MODEL_BATCH})")
  parser.add_argument("--largest-batches", help=f"BERT-large per-GPU batches (default {LARGEST_BATCHES})")
  parser.add_argument("--largest-seq", type=int, help="sequence length of both searches (default 512; 64 with --tiny)")
  parser.add_argument("--search-steps", type=int, default=3, help="timed steps of a search candidate (1 warm-up)")
  parser.add_argument("--budget-gib", type=float, default=72.0,
                      help="allocator cap per GPU for every child (72 GiB = 90%% of an 80 GB H100), at most 95%%")
  parser.add_argument("--compile-cache", default="/tmp/bert_jax_scaling_cache",
                      help="JAX_COMPILATION_CACHE_DIR of the children (and XLA's autotuning cache); 'none' for off")
  parser.add_argument("--timeout", type=int, default=480, help="seconds per child process")
  parser.add_argument("--max-minutes", type=float,
                      help="stop starting children after this long; a child's timeout is cut to what is left")
  parser.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                      help="cpu: n fake host devices instead of n GPUs (auto: what JAX finds)")
  parser.add_argument("--tiny", action="store_true", help="BERT-tiny/mini rows and searches, for a CPU check")
  parser.add_argument("--out-dir", default=os.environ.get("OUT") or str(HERE / "results"))
  parser.add_argument("--dry-run", action="store_true", help="print the child commands and exit")
  parser.add_argument("--render", nargs="+", metavar="JSONL", help="join earlier calls' .jsonl into one table")
  parser.add_argument("--stem", help="file name (no suffix) of the --render table; default <first stem>_joined")
  args, rest = parser.parse_known_args(argv)
  extra = [a for a in rest if a.startswith("--config.")]  # Passed to every child (train_step's overrides).
  if len(extra) != len(rest):
    parser.error(f"unrecognised arguments {[a for a in rest if not a.startswith('--config.')]}")
  if args.render:
    render_files(args.render, pathlib.Path(args.out_dir), args.stem)
    return
  args.steps = args.steps or (3 if args.tiny else 15)
  args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
  args.largest_models = args.largest_models or (TINY_LARGEST_MODELS if args.tiny else LARGEST_MODELS)
  args.largest_model_batch = args.largest_model_batch or (TINY_LARGEST_MODEL_BATCH if args.tiny
                                                          else LARGEST_MODEL_BATCH)
  args.largest_batches = args.largest_batches or (TINY_LARGEST_BATCHES if args.tiny else LARGEST_BATCHES)
  args.largest_seq = args.largest_seq or (64 if args.tiny else 512)
  table = TINY_ROWS if args.tiny else ROWS
  names = {"all": list(table), "none": []}.get(args.rows, args.rows.split(","))
  unknown = [name for name in names if name not in table]
  if unknown:
    parser.error(f"unknown rows {unknown}; choose from {list(table)}")
  rows = {name: table[name] for name in names}
  gpus = sorted({1, *(int(g) for g in args.gpus.split(","))})

  platform = args.platform
  info: dict[str, Any] = {}
  if platform == "auto" or not args.dry_run:
    info = probe({"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")})
    platform = "cpu" if info["platform"] == "cpu" or platform == "cpu" else "gpu"
  mem_fraction = None
  if platform == "gpu":
    if info and max(gpus) > info["devices"]:
      print(f"only {info['devices']} GPUs present: dropping n > {info['devices']}", file=sys.stderr)
      gpus = [g for g in gpus if g <= info["devices"]]
    total_mib = nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits").splitlines()
    if total_mib:
      mem_fraction = min(0.95, args.budget_gib * 1024 / float(total_mib[0]))
  cache_dir = None if args.compile_cache == "none" else args.compile_cache
  runs = plan(args, rows, gpus)
  searches = largest_candidates(args, max(gpus)) if max(gpus) > 1 else []

  def command_of(run: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    steps, warmup = (args.search_steps, 1) if run["search"] else (args.steps, args.warmup)
    remat = [f"--config.model.remat={run['remat']}"] if run["remat"] != "none" else []
    return (child_env(run["gpus"], platform, mem_fraction, cache_dir),
            child_command(run["size"], run["seq"], run["global_batch"], "data" if run["strategy"] == "single"
                          else run["strategy"], run["gpus"], steps, warmup, args.objective, extra + remat))

  if args.dry_run:
    for run in runs + [c for search in searches for c in search]:
      print(shell_line(*command_of(run)))
    print(f"# {len(runs)} scaling runs; largest-fit searches of up to {[len(s) for s in searches]} candidates, "
          "stopping at the first that fits")
    return

  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  if platform == "gpu":
    info["driver"] = (nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").splitlines() or ["-"])[0]
  else:
    info["card"] = "CPU (fake host devices)"
  stem = f"scaling_{re.sub(r'[^A-Za-z0-9.-]+', '_', info['card'].split(' (')[0])}_{date[:10]}"
  env_prefix = " ".join(f"{k}={os.environ[k]}" for k in ("NCCL_NVLS_ENABLE", "XLA_FLAGS") if k in os.environ)
  header = {"kind": "header", "stem": stem, "date": date, "versions": info, "platform": platform,
            "command": f"{env_prefix} python -m bench.scaling {' '.join(argv)}".strip(),
            "cap": (f"allocator capped at {args.budget_gib:.0f} GiB per GPU (XLA_PYTHON_CLIENT_MEM_FRACTION="
                    f"{mem_fraction:.3f})" if mem_fraction else "no allocator cap"),
            "objective": args.objective, "steps": args.steps, "warmup": args.warmup,
            "search_steps": args.search_steps, "compile_cache": cache_dir, "topology": nvidia_smi("topo", "-m") if platform == "gpu" else "",
            "minutes": 0.0}
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  progress = out_dir / f"{stem}.jsonl"
  progress.write_text(json.dumps(header) + "\n")
  start = time.perf_counter()

  def measure(run: dict[str, Any]) -> dict[str, Any]:
    env, command = command_of(run)
    run["command"] = shell_line(env, command)
    left = None if args.max_minutes is None else args.max_minutes * 60 - (time.perf_counter() - start)
    if left is not None and left < 30:
      run["result"] = {"error": f"skipped: --max-minutes {args.max_minutes} reached"}
    else:
      run["result"] = run_child(command, env, args.timeout if left is None else int(min(args.timeout, left)))
      seen = run["result"].get("device_count", run["gpus"])
      if seen != run["gpus"]:  # E.g. a CUDA_VISIBLE_DEVICES that the child did not honour.
        run["result"]["error"] = f"the child saw {seen} devices, not {run['gpus']}"
    with progress.open("a") as stream:
      stream.write(json.dumps({"kind": "run", **run}) + "\n")
    short = {k: run["result"][k] for k in ("error", "step_s", "seq_per_s", "peak_bytes", "compile_s", "wall_s",
                                           "device_count") if k in run["result"]}
    print(json.dumps({k: run[k] for k in ("row", "size", "strategy", "gpus", "global_batch", "remat")} | short),
          flush=True)
    return run

  done = [measure(run) for run in runs]
  for search in searches:
    for candidate in search:
      done.append(measure(candidate))
      if "error" not in candidate["result"]:
        break
  header["minutes"] = (time.perf_counter() - start) / 60
  lines = progress.read_text().splitlines()
  progress.write_text("\n".join([json.dumps(header)] + lines[1:]) + "\n")  # With the total time.
  header.pop("kind")
  write(out_dir, stem, [header], done)


if __name__ == "__main__":
  main(sys.argv[1:])
