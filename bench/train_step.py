"""Times the jitted pre-training train step on whatever device is present.

  python -m bench.train_step --family bert --size base --seq 128 --batch 256 --objective mlm+nsp
  python -m bench.train_step --config configs/demo.py --config.train.batch_size=64
  python -m bench.train_step --size tiny --seq 64 --batch 8 --steps 3        # CPU smoke run
  python -m bench.train_step --size large --seq 512 --batch 32 --data .carry_bench/wiki_prepared

The step is the trainer's own (`make_train_step`: masking inside the step,
the config's optimizer, bf16 compute with float32 params unless the config
says otherwise, donated state). Inputs are synthetic token ids of the batch
contract's shapes (`bert_jax.data.batch`): full rows, [CLS] A [SEP] B [SEP],
so every token is real. With `--data DIR` the rows come from the real input
pipeline over a prepared corpus instead, fetched from the host every step.

Prints one table: step time, seq/s, tokens/s (real, non-padding tokens), MFU
(`ModelConfig.flops_per_token`, the MLM head charged for the predicted
positions only, against --peak-tflops) and peak device memory. `--json`
prints one JSON line instead (for `pretrain_vs_reference.py`).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import queue
import re
import sys
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from bert_jax.data.batch import validate_batch
from bert_jax.models import model_config
from bert_jax.kernels.attention import resolve_implementation
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import config_lib, heap, objectives, optim
from bert_jax.train.step import Partitioning, create_state, make_train_step

H100_BF16_DENSE_TFLOPS = 989.0
BERT_VOCAB = 30522
BERT_MASK_ID = 103  # [MASK] in BERT's uncased vocabulary.


def build_config(args: argparse.Namespace, overrides: list[str]) -> ml_collections.ConfigDict:
  """The experiment config: a config file, or BERT's defaults with family/size/seq/batch/objective."""
  if args.config:
    return config_lib.load_config(args.config, overrides)
  config = config_lib.pretrain_defaults()
  config.objective = args.objective
  config.model = config_lib.model_section(args.family, args.size, dtype="bfloat16")
  config.data.seq_len = args.seq
  config.data.format = objectives.SENTENCE_FORMATS.get(args.objective, "full_sentences")
  # BERT's budget: 15% of the tokens, 20 slots at 128 and 76 at 512.
  config.masking.max_predictions = max(1, int(round(config.masking.rate * args.seq)))
  config.train.batch_size = args.batch
  config.lock()
  config_lib.apply_overrides(config, overrides)
  return config


def synthetic_batch(rows: int, seq_len: int, vocab_size: int, seed: int = 0, cls_id: int = 101,
                    sep_id: int = 102) -> dict[str, np.ndarray]:
  """Full rows [CLS] A [SEP] B [SEP] of random ids, in the batch contract (one example per row)."""
  rng = np.random.default_rng(seed)
  input_ids = rng.integers(1000, vocab_size, (rows, seq_len), dtype=np.int32)
  half = seq_len // 2
  special = np.zeros((rows, seq_len), np.int32)
  for position, token in ((0, cls_id), (half, sep_id), (seq_len - 1, sep_id)):
    input_ids[:, position] = token
    special[:, position] = 1
  segment_ids = np.zeros((rows, seq_len), np.int32)
  segment_ids[:, half + 1:] = 1
  batch = {
      "input_ids": input_ids, "segment_ids": segment_ids,
      "position_ids": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)).copy(),
      "pack_ids": np.ones((rows, seq_len), np.int32), "word_starts": np.ones((rows, seq_len), np.int32),
      "special_mask": special, "cls_positions": np.zeros((rows, 1), np.int32),
      "sentence_labels": rng.integers(0, 2, (rows, 1), dtype=np.int32),
      "sentence_weights": np.ones((rows, 1), np.float32),
      "example_ids": np.arange(rows, dtype=np.int32) + seed * rows, "epoch": np.zeros((rows,), np.int32)}
  validate_batch(batch)
  return batch


def peak_memory_bytes() -> int | None:
  """Peak bytes in use on the first device, or None where the backend does not say (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def idle_summary(kernels: list[dict[str, Any]], steps: int, largest: int = 6) -> list[str]:
  """How long the device sat idle between kernels: the traced span less the union of the kernels' intervals,
  then the largest gaps' total by the kernels either side of them.

  Inside a CUDA-graph command buffer each kernel's launch waits for the one before it, so this is mostly
  the launch latency between dependent kernels (and any gap between steps), which only fewer kernels reduce.
  """
  spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]) for e in kernels)
  if not spans:
    return ["no device kernels traced"]
  busy, gaps, (start, end, last) = 0.0, [], spans[0]
  by_neighbours: collections.Counter = collections.Counter()
  for lo, hi, name in spans[1:]:
    if lo > end:
      busy += end - start
      gaps.append(lo - end)
      by_neighbours[(last[:40], name[:40])] += lo - end
      start, end = lo, hi
    elif hi > end:
      end = hi
    if hi >= end:
      last = name
  busy += end - start
  span = end - spans[0][0]
  median = float(np.median(gaps)) if gaps else 0.0
  lines = [f"device span {span / steps / 1e3:.2f} ms/step: busy {busy / steps / 1e3:.2f}, idle "
           f"{(span - busy) / steps / 1e3:.2f} in {len(gaps) / steps:g} gaps/step (median {median:.1f} us)"]
  for (before, after), us in by_neighbours.most_common(largest):
    lines.append(f"  idle {us / steps / 1e3:.3f} ms/step between {before} and {after}")
  return lines


def device_kernels(trace_dir: str | pathlib.Path) -> tuple[pathlib.Path, list[dict[str, Any]]] | None:
  """The last Perfetto trace `jax.profiler` wrote under `trace_dir` and its device events (kernels), or None
  where no trace was written."""
  paths = sorted(pathlib.Path(trace_dir).glob("**/perfetto_trace.json.gz"))
  if not paths:
    return None
  trace = json.load(gzip.open(paths[-1]))
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  device_pids = {pid for pid, name in processes.items() if "/device:" in name}
  return paths[-1], [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]


def profile_summary(trace_dir: str, hlo_text: str, steps: int, top: int = 30) -> list[str]:
  """Device time per HLO op and per kernel over a `jax.profiler` trace, largest first, with JAX source names.

  Reads the Perfetto JSON the profiler writes; ops are named by the `hlo_op`
  argument of device events, kernels by the event name, and both described by
  the `op_name` metadata of the compiled HLO (inside a CUDA-graph command
  buffer only kernels are named: a fusion's kernel carries the fusion's name,
  and identical fusions share one kernel, hence the calls per step). Every
  kernel is also written to `kernels.tsv` in `trace_dir`.
  """
  path, device_events = device_kernels(trace_dir)
  op_names = dict(re.findall(r"%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]+)\"", hlo_text))
  # A kernel is named after its fusion with "." and "-" written "_" (loop_add_fusion.11 -> loop_add_fusion_11).
  kernel_sources = {re.sub(r"[.\-]", "_", name): source for name, source in op_names.items()}
  totals: collections.Counter = collections.Counter()
  kernels: collections.Counter = collections.Counter()
  calls: collections.Counter = collections.Counter()
  for event in device_events:
    args = event.get("args", {})
    totals[args.get("hlo_op", event["name"])] += event.get("dur", 0.0)
    kernels[event["name"]] += event.get("dur", 0.0)
    calls[event["name"]] += 1
  total_us = sum(totals.values())
  lines = [f"device time {total_us / steps / 1e3:.2f} ms/step over {steps} traced steps ({path.parent.name})"]
  lines += idle_summary(device_events, steps)
  for op, us in totals.most_common(top):
    lines.append(f"{us / steps / 1e3:8.3f} ms {100 * us / total_us:5.1f}%  {op:28.28s} {op_names.get(op, '')[-110:]}")
  lines.append("by kernel (ms/step, share, calls/step, kernel, JAX source of the fusion of that name):")
  table = []
  for name, us in kernels.most_common():
    row = (f"{us / steps / 1e3:.4f}", f"{100 * us / total_us:.2f}", f"{calls[name] / steps:g}", name,
           op_names.get(name) or kernel_sources.get(name, ""))
    table.append("\t".join(row))
    if len(table) <= top:
      lines.append(f"{row[0]:>9} ms {row[1]:>5}% {row[2]:>5}x  {name[:50]:50.50s} {row[4][-90:]}")
  (pathlib.Path(trace_dir) / "kernels.tsv").write_text("\n".join(table) + "\n")
  return lines


class CompletionTimes:
  """When each step of a loop finished on the device, seen from a thread that waits on each step's output in turn
  while the loop goes on dispatching.

  The timed loop (start, N steps, wait for the last) also counts the time before the device gets busy: the
  first step's dispatch, from an idle device (as the reference's loop does). The time between the first and the
  last step's completion is the rate of a long run, where the host is a step ahead.
  """

  def __init__(self):
    self.times: list[float] = []
    self._queue: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while (outputs := self._queue.get()) is not None:
      jax.block_until_ready(outputs)
      self.times.append(time.perf_counter())

  def watch(self, outputs: Any) -> None:
    self._queue.put(outputs)

  def seconds_per_step(self) -> float | None:
    """Mean time between consecutive completions (None for fewer than 2 steps)."""
    self._queue.put(None)
    self._thread.join()
    return (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None


def _real_tokens(batch: dict[str, Any]) -> int:
  return int(np.sum(np.asarray(batch["pack_ids"]) > 0))


def measure(config: ml_collections.ConfigDict, *, steps: int = 20, warmup: int = 3, data_dir: str | None = None,
            vocab_size: int | None = None, mask_id: int | None = None,
            peak_tflops: float = H100_BF16_DENSE_TFLOPS, profile_dir: str | None = None) -> dict[str, Any]:
  """Compiles the config's train step and times `steps` steps after `warmup`.

  Args:
    config: an experiment config (`pretrain_defaults()` keys).
    steps, warmup: timed and untimed steps.
    data_dir: a prepared corpus: rows come from `pretraining_iterator` (host
      batching every step, prefetch as in the config) instead of synthetic ids.
    vocab_size, mask_id: the vocabulary (default BERT's, or the corpus' own).
    peak_tflops: the device's dense bf16 peak, for MFU.
    profile_dir: also trace 10 more steps there, write the optimised HLO (gzipped) beside the
      trace and summarise device time per op.

  Returns:
    A dict of the settings and measurements (seconds, seq/s, real tokens/s,
    model TFLOP/s, MFU, peak bytes, compile seconds (`compile_s`, tracing and
    lowering included; `lower_s` those alone), final loss).
  """
  data = config.data
  iterator = None
  if data_dir is not None:
    from bert_jax.data import pipeline
    from bert_jax.data.prepare import open_prepared
    tokenizer = open_prepared(data_dir).load_tokenizer()
    vocab_size, mask_id = tokenizer.vocab_size, tokenizer.mask_id
    iterator = pipeline.pretraining_iterator(
        data_dir, example_format=data.format, seq_len=data.seq_len, batch_size=config.train.batch_size,
        seed=config.seed, short_seq_prob=data.short_seq_prob, random_next_prob=data.random_next_prob,
        packing=data.packing, max_packs=data.max_packs, prefetch=data.prefetch, workers=data.workers)
  vocab_size = vocab_size or config.model.vocab_size or BERT_VOCAB
  mask_id = BERT_MASK_ID if mask_id is None else mask_id
  fields = {k: v for k, v in config.model.items() if k not in ("family", "size", "generator_fraction")
            and v is not None}
  fields["vocab_size"] = vocab_size
  model_cfg = model_config(config.model.family, config.model.size, **fields)
  objective = objectives.make_objective(config, model_cfg, mask_id)
  tx, schedule = optim.make_optimizer(config.optim, config.train.steps)
  mesh = sharding_lib.create_mesh(dict(config.mesh.sizes))
  partitioning = Partitioning(mesh, sharding_lib.rules_from_config(config.mesh.rules))
  rows, seq_len = config.train.batch_size, data.seq_len

  if iterator is None:
    host_batches = [synthetic_batch(rows, seq_len, vocab_size, seed=i) for i in range(2)]
  else:
    host_batches = [next(iterator)]
  device_batches = [sharding_lib.global_batch(b, mesh) for b in host_batches]
  init_batch = jax.tree.map(lambda x: x[:1], device_batches[0])
  state, state_shardings = create_state(lambda key: objective.init_variables(key, init_batch), tx,
                                        jax.random.key(config.seed), partitioning)
  train_step = make_train_step(objective, tx, schedule, accum_steps=config.train.accum_steps,
                               rng=jax.random.key(config.seed + 1), partitioning=partitioning,
                               state_shardings=state_shardings, param_norms=config.train.log_param_norms)

  def next_batch(index):
    if iterator is None:
      return device_batches[index % len(device_batches)], rows * seq_len
    host = next(iterator)
    return sharding_lib.global_batch(host, mesh), _real_tokens(host)

  start = time.perf_counter()
  lowered = train_step.lower(state, device_batches[0])
  lower_s = time.perf_counter() - start
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  for index in range(warmup):
    state, metrics = compiled(state, next_batch(index)[0])
  jax.block_until_ready(metrics)
  # The trainer's loop freezes its setup's objects out of the garbage collector's full collections (`heap`).
  with heap.frozen_setup() as freeze_setup:
    freeze_setup()
    tokens = 0
    finished = CompletionTimes()
    start = time.perf_counter()
    dispatched = []
    for index in range(steps):
      batch, real = next_batch(index)
      state, metrics = compiled(state, batch)
      dispatched.append(time.perf_counter())
      finished.watch(metrics)
      tokens += real
    loss = float(metrics["loss"])  # Waits for the last step.
    seconds = (time.perf_counter() - start) / steps
    steady = finished.seconds_per_step()
    profile = None
    if profile_dir is not None:
      traced = 10
      with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
        traced_start = time.perf_counter()
        for index in range(traced):
          state, metrics = compiled(state, next_batch(index)[0])
        jax.block_until_ready(metrics)
        traced_s = (time.perf_counter() - traced_start) / traced
      hlo_text = compiled.as_text()
      with gzip.open(pathlib.Path(profile_dir) / "train_step.hlo.txt.gz", "wt") as handle:
        handle.write(hlo_text)
      profile = profile_summary(profile_dir, hlo_text, steps=traced)
      intervals = np.diff([start] + finished.times) * 1e3
      profile.insert(1, f"host wall time of the traced steps {traced_s * 1e3:.2f} ms/step (timed loop: "
                        f"{seconds * 1e3:.2f}, steady: {steady * 1e3 if steady else float('nan'):.2f}; the timed "
                        f"loop's completions after its start, then after each other: "
                        f"{' '.join(f'{t:.1f}' for t in intervals)} ms; its calls returned after "
                        f"{' '.join(f'{t:.1f}' for t in np.diff([start] + dispatched) * 1e3)} ms)")
  if iterator is not None:
    iterator.close()

  predictions = min(config.masking.max_predictions, int(round(config.masking.rate * (seq_len - 3))))
  flops_per_token = model_cfg.flops_per_token(seq_len, predictions_per_token=predictions / seq_len)
  tokens_per_s = tokens / steps / seconds
  achieved = flops_per_token * rows * seq_len / seconds  # MFU counts every position of the rows.
  devices = jax.device_count()
  return {
      "family": config.model.family, "size": config.model.size, "objective": config.objective,
      "seq": seq_len, "batch": rows, "remat": model_cfg.remat, "attention_dropout": model_cfg.attention_dropout,
      "attention_path": "plain" if model_cfg.kernels == "off" else resolve_implementation(
          "auto", dtype=model_cfg.compute_dtype, head_dim=model_cfg.head_dim,
          dropout_active=model_cfg.attention_dropout > 0, return_probs=False, length=seq_len, training=True),
      "data": "synthetic" if data_dir is None else data_dir,
      "packing": bool(data.packing), "step_s": seconds, "steady_step_s": steady,
      "first_step_s": finished.times[0] - start if finished.times else None, "seq_per_s": rows / seconds,
      "tokens_per_s": tokens_per_s, "real_token_fraction": tokens / (steps * rows * seq_len),
      "tflops": achieved / 1e12, "mfu": achieved / (peak_tflops * 1e12 * devices), "peak_bytes": peak_memory_bytes(),
      "compile_s": compile_s, "lower_s": lower_s, "loss": loss, "flops_per_token": flops_per_token,
      "device": jax.devices()[0].device_kind, "device_count": devices, "jax": jax.__version__,
      "profile": profile}


def format_table(results: list[dict[str, Any]]) -> str:
  """One row per measurement."""
  header = ("model", "seq", "batch", "data", "step ms", "steady ms", "seq/s", "tokens/s", "TFLOP/s", "MFU",
            "peak GiB")
  lines = []
  for r in results:
    peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.1f}"
    data = "synthetic" if r["data"] == "synthetic" else ("packed" if r["packing"] else "real")
    lines.append((f"{r['family']}-{r['size']}", str(r["seq"]), str(r["batch"]), data, f"{r['step_s'] * 1e3:.1f}",
                  "-" if r.get("steady_step_s") is None else f"{r['steady_step_s'] * 1e3:.1f}",
                  f"{r['seq_per_s']:,.0f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.0f}",
                  f"{100 * r['mfu']:.1f}%", peak))
  widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]
  render = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
  return "\n".join([render(header), render(["-" * w for w in widths])] + [render(line) for line in lines])


def main(argv: list[str]) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="configs/<name>.py[:arg]; --config.key=value overrides follow")
  parser.add_argument("--family", default="bert")
  parser.add_argument("--size", default="base")
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--objective", default="mlm+nsp")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--data", help="a prepared corpus directory: time the real input pipeline")
  parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS)
  parser.add_argument("--profile", help="trace 10 steps into this directory and print device time per op")
  parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
  args, rest = parser.parse_known_args(argv)
  overrides = [a for a in rest if a.startswith("--config.")]
  unknown = [a for a in rest if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognised arguments {unknown}")
  config = build_config(args, overrides)
  result = measure(config, steps=args.steps, warmup=args.warmup, data_dir=args.data, peak_tflops=args.peak_tflops,
                   profile_dir=args.profile)
  if result["profile"] and not args.json:
    print("\n".join(result["profile"]))
  print(json.dumps(result) if args.json else format_table([result]))


if __name__ == "__main__":
  main(sys.argv[1:])
