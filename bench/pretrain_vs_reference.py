"""Our pre-training step vs the PyTorch reference, side by side on one GPU, in one command.

  python -m bench.pretrain_vs_reference --reference ../shared/bench/anchor_hf_torch.py
  python -m bench.pretrain_vs_reference --extras --data DIR   # + input pipeline, packing, largest batch
  python -m bench.pretrain_vs_reference --parallel 4 --extras --data DIR   # a 4-GPU host: 4 jobs at once
  python -m bench.pretrain_vs_reference --render A.json B.json               # join earlier runs' rows
  python -m bench.pretrain_vs_reference --fp8 --rows 0,2   # + ours with float8 matmuls (`model.fp8`)

Ours: `bench/train_step.py` (MLM+NSP, 15% token masking inside the jitted
step, AdamW with clipping, bf16 compute, float32 params, BERT's dropout 0.1 on
hidden states and attention probabilities; the pre-training configs' speed
options, among them the last block computed only at the heads' rows,
`ModelConfig.sparse_last_layer`). The reference:
`anchor_hf_torch.py` (Hugging Face BertForPreTraining in train mode, SDPA
attention, bf16 autocast, fused AdamW; eager and torch.compile). Every
measurement runs in its own process, so each peak-memory figure is its own.

MFU: FLOPs per token = 6 x non-embedding params + 12 x layers x seq x hidden +
the MLM head on the predicted positions only, over 989 TFLOP/s (H100 SXM
dense bf16; the H200 has the same peak). The count charges every row of the
last block, which `sparse_last_layer` skips: the step executes 5.4% fewer
FLOPs at BERT-base seq 128, 2.8% at BERT-large seq 128.

--parallel N runs N measurements at once on a host of N identical GPUs, each
job on its own GPU (CUDA_VISIBLE_DEVICES) and pinned to its 1/N share of the
host's cores, so a job sees what a one-GPU machine of that share would: a
row's reference and ours run one after the other on one GPU, rows on
different GPUs. The largest-batch search then tries N candidates at a time
(largest first, stopping after the first round that has one that runs) and
reports the largest that ran and the smallest that did not above it.

The table is printed last and written under --out-dir with the card, date,
JAX, CUDA, cuDNN and PyTorch versions.

--fp8 measures ours a second time with `--config.model.fp8=True` (every block's dense layers multiplying in
float8, `ModelConfig.fp8`) in the same job, beside the bf16 step and the reference: its seq/s, its ratio to the
compiled reference, and its MFU over the bf16 peak and over the float8 peak (1979 TFLOP/s dense on an H100 SXM and
an H200), the FLOPs counted alike.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import queue
import subprocess
import sys
from typing import Any, Callable

ROWS = (("base", 128, 256), ("base", 512, 64), ("large", 128, 128), ("large", 512, 32))
TINY_ROWS = (("tiny", 64, 8), ("tiny", 128, 4), ("mini", 64, 4), ("mini", 128, 2))  # --tiny: a CPU plumbing check.
HERE = pathlib.Path(__file__).resolve().parent
GOAL_RATIO = 1.5
FP8_PEAK_OVER_BF16 = 2.0  # Hopper's dense float8 rate (1979 TFLOP/s) over its bf16 one (989).


Place = dict  # {"env": {...}, "cores": {...}}: where a job runs; {} = this process's GPUs and cores.


class Pool:
  """Runs jobs on `n` GPUs at once, one job per GPU, each pinned to its share of this host's cores."""

  def __init__(self, n: int):
    self.n = n
    self._free: queue.Queue[int] = queue.Queue()
    for gpu in range(n):
      self._free.put(gpu)
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // n)
    self._cores = [set(cores[i * share:(i + 1) * share]) or set(cores) for i in range(n)]

  def map(self, jobs: list[Callable[[Place], Any]]) -> list[Any]:
    """Results of `jobs` in order; each is called with the place it runs in."""
    if self.n == 1:
      return [job({}) for job in jobs]

    def run(job):
      gpu = self._free.get()
      try:
        return job({"env": {"CUDA_VISIBLE_DEVICES": str(gpu)}, "cores": self._cores[gpu]})
      finally:
        self._free.put(gpu)

    with concurrent.futures.ThreadPoolExecutor(self.n) as executor:
      return list(executor.map(run, jobs))


def run_json(command: list[str], env: dict[str, str] | None = None, timeout: int = 900,
             place: Place | None = None) -> dict:
  """Runs a command that prints a JSON line last; returns it, or {"error": ...}."""
  place = place or {}
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {}), **place.get("env", {})})
  if place.get("cores"):  # Set on the started child (no preexec_fn: this process has threads); its threads inherit it.
    os.sched_setaffinity(proc.pid, place["cores"])
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.communicate()
    return {"error": [f"timeout after {timeout} s"]}
  for line in reversed(stdout.strip().splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return {"error": (stderr or stdout).strip().splitlines()[-1:] or ["no output"]}


def ours(size: str, seq: int, batch: int, *extra: str, env: dict[str, str] | None = None, steps: int = 20,
         place: Place | None = None) -> dict:
  return run_json([sys.executable, "-m", "bench.train_step", "--size", size, "--seq", str(seq), "--batch",
                   str(batch), "--steps", str(steps), "--json", *extra], env=env, place=place)


def reference(path: str, size: str, seq: int, batch: int, steps: int = 20, place: Place | None = None) -> dict:
  return run_json([sys.executable, path, "--size", size, "--seq", str(seq), "--batch", str(batch), "--steps",
                   str(steps)], place=place)


def versions() -> dict[str, str]:
  """Card, driver, JAX / CUDA / cuDNN / PyTorch versions, read in a child process (no GPU held here)."""
  probe = ("import json, jax, torch\n"
           "from jax._src.lib import cuda_versions as v\n"
           "d = jax.devices()[0]\n"
           "print(json.dumps({'card': d.device_kind, 'jax': jax.__version__, 'jax_cuda': d.client.platform_version,"
           " 'cudnn': str(v.cudnn_get_version()) if v else '-', 'torch': torch.__version__,"
           " 'torch_cuda': torch.version.cuda, 'torch_cudnn': str(torch.backends.cudnn.version())}))")
  info = run_json([sys.executable, "-c", probe])
  try:
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip().splitlines()[0]
  except (OSError, IndexError):
    info["driver"] = "-"
  return info


def gib(value) -> str:
  return "-" if not value else f"{value / 2**30:.1f}"


def render(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
  widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
  line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
  return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def comparison_table(results: list[tuple[tuple, dict, dict]]) -> str:
  header = ("model", "seq", "batch", "ours seq/s", "ref eager seq/s", "ref compiled seq/s", "ours / compiled",
            "ours MFU", "ours peak GiB", "ours step ms")
  with_fp8 = any("fp8" in mine for _, mine, _ in results)
  if with_fp8:
    header += ("fp8 seq/s", "fp8 / compiled", "fp8 / ours bf16", "fp8 MFU (bf16 peak)", "fp8 MFU (fp8 peak)",
               "fp8 peak GiB")
  rows = []
  for (size, seq, batch), mine, ref in results:
    ok = "error" not in mine
    compiled = ref.get("compile_seq_per_s")
    ratio = f"{mine['seq_per_s'] / compiled:.2f}x" if ok and compiled else "-"
    row = (f"bert-{size}", str(seq), str(batch), f"{mine['seq_per_s']:,.0f}" if ok else "failed",
           f"{ref['eager_seq_per_s']:,.0f}" if "eager_seq_per_s" in ref else "failed",
           f"{compiled:,.0f}" if compiled else "failed", ratio,
           f"{100 * mine['mfu']:.1f}%" if ok else "-", gib(mine.get("peak_bytes")),
           f"{1e3 * mine['step_s']:.1f}" if ok else "-")
    if with_fp8:
      fp8 = mine.get("fp8") or {"error": "not measured"}
      if "error" in fp8:
        row += ("failed" if "fp8" in mine else "-",) + ("-",) * 5
      else:
        row += (f"{fp8['seq_per_s']:,.0f}", f"{fp8['seq_per_s'] / compiled:.2f}x" if compiled else "-",
                f"{fp8['seq_per_s'] / mine['seq_per_s']:.2f}x" if ok else "-", f"{100 * fp8['mfu']:.1f}%",
                f"{100 * fp8['mfu'] / FP8_PEAK_OVER_BF16:.1f}%", gib(fp8.get("peak_bytes")))
    rows.append(row)
  return render(header, rows)


def total_device_bytes() -> int | None:
  probe = "import json, torch; print(json.dumps({'bytes': torch.cuda.get_device_properties(0).total_memory}))"
  return run_json([sys.executable, "-c", probe]).get("bytes")


def largest_batches(size: str, seq: int, budget_gib: float, searches: dict[str, list[int]], pool: Pool,
                    first_jobs: list[Callable[[Place], Any]] = ()) -> tuple[dict[str, dict], list[Any]]:
  """The largest batch of each search (remat -> candidates) whose step runs in `budget_gib` (an 80 GB card).

  Candidates are tried largest first, a round at a time: a round gives each
  unfinished search its share of the pool's GPUs (one candidate on one GPU),
  and a search stops after the round in which one of its candidates ran.
  `first_jobs` run in the first round beside the candidates.

  Returns ({remat: {"batch", "result", "failed": [(batch, error), ...]}}, the first_jobs' results).
  """
  total = total_device_bytes()
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{min(1.0, budget_gib * 2**30 / total):.4f}"} if total else {}
  pending = {remat: sorted(candidates, reverse=True) for remat, candidates in searches.items() if candidates}
  found = {remat: {"batch": 0, "result": {}, "failed": []} for remat in pending}
  first_results = None
  while pending or first_results is None:
    first = list(first_jobs if first_results is None else [])
    per_search = max(1, (pool.n - len(first)) // max(1, len(pending)))
    tried = [(remat, batch) for remat, candidates in pending.items() for batch in candidates[:per_search]]
    jobs = first + [
        lambda place, remat=remat, batch=batch: ours(size, seq, batch, f"--config.model.remat={remat}", "--warmup",
                                                     "1", steps=2, env=env, place=place) for remat, batch in tried]
    results = pool.map(jobs)
    if first_results is None:
      first_results, results = results[:len(first)], results[len(first):]
      for result in first_results:  # Printed as they come, so a run cut short keeps what it measured.
        print(json.dumps({"first_job": result}), flush=True)
    for (remat, batch), result in zip(tried, results):
      print(json.dumps({"largest_try": {"remat": remat, "batch": batch, "result": result}}), flush=True)
      entry = found[remat]
      if "error" in result:
        entry["failed"].append((batch, " ".join(result["error"])[:160]))
      elif batch > entry["batch"]:
        entry["batch"], entry["result"] = batch, result
    for remat in list(pending):
      pending[remat] = pending[remat][per_search:]
      if found[remat]["batch"] or not pending[remat]:
        del pending[remat]
  return found, first_results


def extras(data_dir: str, row: tuple[str, int, int], synthetic: dict, largest_row: tuple[str, int, int],
           budget_gib: float, batches_none: list[int], batches_full: list[int], pool: Pool) -> str:
  """Input pipeline vs synthetic, packed vs unpacked real tokens/s, and the largest batch of `largest_row`."""
  size, seq, batch = row
  pipeline = [lambda place: ours(size, seq, batch, "--data", data_dir, steps=30, place=place),
              lambda place: ours(size, seq, batch, "--data", data_dir, "--config.data.packing=True", steps=30,
                                 place=place)]
  searches = {"none": batches_none, "full": batches_full}
  found, (real, packed) = largest_batches(largest_row[0], largest_row[1], budget_gib, searches, pool, pipeline)
  lines = []
  if "error" not in real and "error" not in synthetic:
    lines.append(f"input pipeline (bert-{size} seq {seq} batch {batch}, segment pairs, host batching every step): "
                 f"{real['seq_per_s']:,.0f} seq/s vs synthetic {synthetic['seq_per_s']:,.0f} "
                 f"({100 * (real['seq_per_s'] / synthetic['seq_per_s'] - 1):+.1f}%)")
  for name, result in (("unpacked", real), ("packed", packed)):
    if "error" in result:
      lines.append(f"{name}: failed {result['error']}")
    else:
      lines.append(f"{name} real data: {result['tokens_per_s']:,.0f} real tokens/s "
                   f"({100 * result['real_token_fraction']:.0f}% of positions are real), {result['seq_per_s']:,.0f} rows/s")
  size, seq, _ = largest_row
  for remat, entry in found.items():
    result = entry["result"]
    above = sorted((b, e) for b, e in entry["failed"] if b > entry["batch"])
    lines.append(f"largest bert-{size} seq-{seq} batch in {budget_gib:.0f} GiB, remat={remat}: {entry['batch']} (tried "
                 f"{searches[remat]}; peak {gib(result.get('peak_bytes'))} GiB, {result.get('seq_per_s', 0):,.0f} seq/s"
                 + (f"; {above[0][0]} did not run: {above[0][1]}" if above else "; nothing larger was tried") + ")")
  return "\n".join(lines)


def report(info: dict, date: str, command: str, results: list[tuple[tuple, dict, dict]], extra_text: str) -> str:
  """The markdown report: versions, command, the comparison table and the extras."""
  attention = ("ours: dropout 0.1 on hidden states and attention probabilities, masking 15% inside the step, "
               "attention path = " + ", ".join(sorted({str(m.get("attention_path", "?")) for _, m, _ in results})))
  return "\n".join([
      f"# Pretraining step vs Hugging Face PyTorch reference ({info.get('card', '?')})",
      "",
      f"{date}; card {info.get('card')} (driver {(info.get('driver') or '-').splitlines()[0]}); JAX {info.get('jax')} "
      f"({info.get('jax_cuda', '').replace(chr(10), ' ')}, cuDNN {info.get('cudnn')}); "
      f"PyTorch {info.get('torch')} (CUDA {info.get('torch_cuda')}, cuDNN {info.get('torch_cudnn')}).",
      f"Command: {command}",
      "Reference: HF BertForPreTraining in train mode (dropout 0.1 incl. SDPA attention dropout), bf16 autocast, "
      "fused AdamW, labels on 15% of positions with the MLM head over every position.",
      attention + ".",
      f"Goal: ours / compiled >= {GOAL_RATIO}x on every row; MFU peak 989 TFLOP/s.",
      "",
      comparison_table(results),
      "",
      extra_text,
  ]).rstrip() + "\n"


def write(out_dir: pathlib.Path, stem: str, text: str, payload: dict) -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / f"{stem}.md").write_text(text)
  (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
  print(text)


def payload(info: dict, date: str, results: list[tuple[tuple, dict, dict]], extra_text: str,
            command: str | None = None) -> dict:
  """The .json beside a report: versions, date, (command,) rows and extras; what --render reads back."""
  return {"versions": info, "date": date, **({"command": command} if command else {}), "rows": [
      {"row": list(r), "ours": m, "reference": ref} for r, m, ref in results], "extras": extra_text}


def read_runs(paths: list[str]) -> list[dict]:
  """The JSON documents of earlier runs' .json files (one or several per file, as written or concatenated)."""
  decoder, runs = json.JSONDecoder(), []
  for path in paths:
    text, index = pathlib.Path(path).read_text(), 0
    while True:
      while index < len(text) and text[index].isspace():
        index += 1
      if index == len(text):
        break
      try:
        run, index = decoder.raw_decode(text, index)
      except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not a pretrain_vs_reference .json ({error})") from error
      runs.append(run)
  return runs


def render_files(paths: list[str], out_dir: pathlib.Path, stem: str | None) -> None:
  """Joins earlier runs' rows (and their extras) into one table, in the order of ROWS."""
  runs = read_runs(paths)
  if not runs:
    raise SystemExit(f"no runs in {paths}")
  results = [(tuple(r["row"]), r["ours"], r["reference"]) for run in runs for r in run["rows"]]
  order = {row: i for i, row in enumerate(ROWS + TINY_ROWS)}
  results.sort(key=lambda item: order.get(item[0], len(order)))
  dates = sorted({run["date"] for run in runs})
  commands = [f"python -m bench.pretrain_vs_reference --render {' '.join(paths)}"] + [
      run["command"] for run in runs if run.get("command")]
  extras_text = "\n".join(run["extras"] for run in runs if run.get("extras"))
  text = report(runs[0]["versions"], ", ".join(dates), "; ".join(commands), results, extras_text)
  card = runs[0]["versions"].get("card", "unknown").replace(" ", "_")
  write(out_dir, stem or f"pretrain_vs_reference_{card}_{dates[0][:10]}_joined", text,
        payload(runs[0]["versions"], ", ".join(dates), results, extras_text))


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reference", default=str(HERE.parents[1] / "shared" / "bench" / "anchor_hf_torch.py"))
  parser.add_argument("--rows", default="all", help="'all' or comma-separated indices into the four rows")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out-dir", default=str(HERE / "results"))
  parser.add_argument("--parallel", type=int, default=1, metavar="N",
                      help="jobs at once, one per GPU (GPUs 0..N-1, each with 1/N of the cores); default 1")
  parser.add_argument("--extras", action="store_true", help="also the pipeline, packing and largest-batch figures")
  parser.add_argument("--data", help="prepared corpus for --extras")
  parser.add_argument("--budget-gib", type=float, default=79.0, help="memory of the card --extras sizes batches for")
  parser.add_argument("--batches-none", default="32,40,48,56", help="candidates without remat ('' skips)")
  parser.add_argument("--batches-full", default="256,384,512,768", help="candidates with remat='full' ('' skips)")
  parser.add_argument("--render", nargs="+", metavar="JSON", help="join earlier runs' .json into one table")
  parser.add_argument("--stem", help="file name (no suffix) of the --render table")
  parser.add_argument("--fp8", action="store_true", help="ours with float8 matmuls too (`model.fp8`), same job")
  parser.add_argument("--tiny", action="store_true", help="BERT-tiny/mini rows and largest-batch search (CPU check)")
  args = parser.parse_args(argv)
  if args.render:
    render_files(args.render, pathlib.Path(args.out_dir), args.stem)
    return
  if args.extras and not args.data:
    parser.error("--extras needs --data (a prepared corpus directory)")

  table = TINY_ROWS if args.tiny else ROWS
  rows = table if args.rows == "all" else [table[int(i)] for i in args.rows.split(",")]
  pool = Pool(args.parallel)
  info = versions()

  def measure_row(row, place):
    ref = reference(args.reference, *row, args.steps, place=place)
    mine = ours(*row, steps=args.steps, place=place)
    if args.fp8:
      mine["fp8"] = ours(*row, "--config.model.fp8=True", steps=args.steps, place=place)
    print(json.dumps({"row": list(row), "ours": mine, "reference": ref}), flush=True)
    return row, mine, ref

  results = pool.map([lambda place, row=row: measure_row(row, place) for row in rows])
  extra_text = ""
  if args.extras:
    synthetic = next((m for r, m, _ in results if r == table[0]), None) or ours(*table[0], steps=args.steps)
    extra_text = extras(args.data, table[0], synthetic, table[-1], args.budget_gib,
                        [int(b) for b in args.batches_none.split(",") if b],
                        [int(b) for b in args.batches_full.split(",") if b], pool)

  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  command = f"python -m bench.pretrain_vs_reference {' '.join(argv)}"
  text = report(info, date, command, results, extra_text)
  stem = f"pretrain_vs_reference_{info.get('card', 'unknown').replace(' ', '_')}_{date[:10]}"
  write(pathlib.Path(args.out_dir), stem, text, payload(info, date, results, extra_text, command))


if __name__ == "__main__":
  main(sys.argv[1:])
