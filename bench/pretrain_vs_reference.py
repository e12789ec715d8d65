"""Our pre-training step vs the PyTorch reference, side by side on one GPU, in one command.

  python bench/pretrain_vs_reference.py --reference ../shared/bench/anchor_hf_torch.py
  python bench/pretrain_vs_reference.py --extras --data DIR   # + input pipeline, packing, largest batch

Ours: `bench/train_step.py` (MLM+NSP, 15% token masking inside the jitted
step, AdamW with clipping, bf16 compute, float32 params, BERT's dropout 0.1 on
hidden states and attention probabilities). The reference:
`anchor_hf_torch.py` (Hugging Face BertForPreTraining in train mode, SDPA
attention, bf16 autocast, fused AdamW; eager and torch.compile). Every
measurement runs in its own process, so each peak-memory figure is its own.

MFU: FLOPs per token = 6 x non-embedding params + 12 x layers x seq x hidden +
the MLM head on the predicted positions only, over 989 TFLOP/s (H100 SXM
dense bf16; the H200 has the same peak).

The table is printed last and written under --out-dir with the card, date,
JAX, CUDA, cuDNN and PyTorch versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

ROWS = (("base", 128, 256), ("base", 512, 64), ("large", 128, 128), ("large", 512, 32))
HERE = pathlib.Path(__file__).resolve().parent
GOAL_RATIO = 1.5


def run_json(command: list[str], env: dict[str, str] | None = None, timeout: int = 900) -> dict:
  """Runs a command that prints a JSON line last; returns it, or {"error": ...}."""
  proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
  for line in reversed(proc.stdout.strip().splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]}


def ours(size: str, seq: int, batch: int, *extra: str, env: dict[str, str] | None = None, steps: int = 20) -> dict:
  return run_json([sys.executable, str(HERE / "train_step.py"), "--size", size, "--seq", str(seq), "--batch",
                   str(batch), "--steps", str(steps), "--json", *extra], env=env)


def reference(path: str, size: str, seq: int, batch: int, steps: int = 20) -> dict:
  return run_json([sys.executable, path, "--size", size, "--seq", str(seq), "--batch", str(batch), "--steps",
                   str(steps)])


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
                                    capture_output=True, text=True).stdout.strip()
  except OSError:
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
  rows = []
  for (size, seq, batch), mine, ref in results:
    ok = "error" not in mine
    compiled = ref.get("compile_seq_per_s")
    ratio = f"{mine['seq_per_s'] / compiled:.2f}x" if ok and compiled else "-"
    rows.append((f"bert-{size}", str(seq), str(batch), f"{mine['seq_per_s']:,.0f}" if ok else "failed",
                 f"{ref['eager_seq_per_s']:,.0f}" if "eager_seq_per_s" in ref else "failed",
                 f"{compiled:,.0f}" if compiled else "failed", ratio,
                 f"{100 * mine['mfu']:.1f}%" if ok else "-", gib(mine.get("peak_bytes")),
                 f"{1e3 * mine['step_s']:.1f}" if ok else "-"))
  return render(header, rows)


def largest_batch(size: str, seq: int, remat: str, budget_gib: float, candidates: list[int]) -> tuple[int, dict]:
  """The largest of `candidates` whose step runs with the allocator capped at `budget_gib` (an 80 GB card)."""
  fraction = min(1.0, budget_gib * 2**30 / total_device_bytes())
  for batch in sorted(candidates, reverse=True):
    result = ours(size, seq, batch, f"--config.model.remat={remat}", "--warmup", "1", steps=2,
                  env={"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.4f}"})
    if "error" not in result:
      return batch, result
  return 0, {}


def total_device_bytes() -> int:
  probe = "import json, torch; print(json.dumps({'bytes': torch.cuda.get_device_properties(0).total_memory}))"
  return run_json([sys.executable, "-c", probe])["bytes"]


def extras(data_dir: str, row: tuple[str, int, int], synthetic: dict, largest_row: tuple[str, int, int],
           budget_gib: float, batches_none: list[int], batches_full: list[int]) -> str:
  """Input pipeline vs synthetic, packed vs unpacked real tokens/s, and the largest batch of `largest_row`."""
  size, seq, batch = row
  lines = []
  real = ours(size, seq, batch, "--data", data_dir, steps=30)
  packed = ours(size, seq, batch, "--data", data_dir, "--config.data.packing=True", steps=30)
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
  for remat, candidates in (("none", batches_none), ("full", batches_full)):
    if not candidates:
      continue
    batch, result = largest_batch(size, seq, remat, budget_gib, candidates)
    lines.append(f"largest bert-{size} seq-{seq} batch in {budget_gib:.0f} GiB, remat={remat}: {batch} (tried "
                 f"{candidates}; peak {gib(result.get('peak_bytes'))} GiB, {result.get('seq_per_s', 0):,.0f} seq/s)")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reference", default=str(HERE.parents[1] / "shared" / "bench" / "anchor_hf_torch.py"))
  parser.add_argument("--rows", default="all", help="'all' or comma-separated indices into the four rows")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out-dir", default=str(HERE / "results"))
  parser.add_argument("--extras", action="store_true", help="also the pipeline, packing and largest-batch figures")
  parser.add_argument("--data", help="prepared corpus for --extras")
  parser.add_argument("--budget-gib", type=float, default=79.0, help="memory of the card --extras sizes batches for")
  parser.add_argument("--batches-none", default="32,40,48,56", help="candidates without remat ('' skips)")
  parser.add_argument("--batches-full", default="256,384,512,768", help="candidates with remat='full' ('' skips)")
  args = parser.parse_args(argv)

  rows = ROWS if args.rows == "all" else [ROWS[int(i)] for i in args.rows.split(",")]
  info = versions()
  results = []
  for size, seq, batch in rows:
    ref = reference(args.reference, size, seq, batch, args.steps)
    mine = ours(size, seq, batch, steps=args.steps)
    results.append(((size, seq, batch), mine, ref))
    print(json.dumps({"row": [size, seq, batch], "ours": mine, "reference": ref}), flush=True)
  extra_text = ""
  if args.extras:
    synthetic = next((m for r, m, _ in results if r == ROWS[0]), None) or ours(*ROWS[0], steps=args.steps)
    extra_text = extras(args.data, ROWS[0], synthetic, ROWS[-1], args.budget_gib,
                        [int(b) for b in args.batches_none.split(",") if b], [int(b) for b in args.batches_full.split(",") if b])

  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  attention = ("ours: dropout 0.1 on hidden states and attention probabilities, masking 15% inside the step, "
               "attention path = " + ", ".join(sorted({str(m.get("attention_path", "?")) for _, m, _ in results})))
  text = "\n".join([
      f"# Pretraining step vs Hugging Face PyTorch reference ({info.get('card', '?')})",
      "",
      f"{date}; card {info.get('card')} (driver {info.get('driver')}); JAX {info.get('jax')} "
      f"({info.get('jax_cuda', '').replace(chr(10), ' ')}, cuDNN {info.get('cudnn')}); "
      f"PyTorch {info.get('torch')} (CUDA {info.get('torch_cuda')}, cuDNN {info.get('torch_cudnn')}).",
      f"Command: python bench/pretrain_vs_reference.py {' '.join(argv)}",
      "Reference: HF BertForPreTraining in train mode (dropout 0.1 incl. SDPA attention dropout), bf16 autocast, "
      "fused AdamW, labels on 15% of positions with the MLM head over every position.",
      attention + ".",
      f"Goal: ours / compiled >= {GOAL_RATIO}x on every row; MFU peak 989 TFLOP/s.",
      "",
      comparison_table(results),
      "",
      extra_text,
  ]).rstrip() + "\n"
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  stem = f"pretrain_vs_reference_{info.get('card', 'unknown').replace(' ', '_')}_{date[:10]}"
  (out_dir / f"{stem}.md").write_text(text)
  (out_dir / f"{stem}.json").write_text(json.dumps({"versions": info, "date": date, "rows": [
      {"row": list(r), "ours": m, "reference": ref} for r, m, ref in results], "extras": extra_text}, indent=1))
  print(text)


if __name__ == "__main__":
  main(sys.argv[1:])
