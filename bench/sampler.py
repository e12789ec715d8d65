"""A sampling profiler of every Python thread in this process, for the benches' loops.

  sampler = StackSampler(hz=1000).start()
  ...                                   # the part to profile
  print(format_profile(sampler.stop()))

A daemon thread reads `sys._current_frames()` about `hz` times a second and counts, per thread, each function on
the stack once (inclusive share: the samples whose stack holds it) and the innermost one (self share). A thread
whose innermost Python function is a known wait (a queue, a lock, a sleep, a select) counts as idle in that
sample. The sampler holds the interpreter's lock while it reads the stacks, so it takes some of every other
thread's time (a few percent at 1 kHz); a thread blocked in C code (a jitted call, a transfer, waiting for the
lock) shows as the Python function that called it.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

# Innermost Python functions of a thread that waits rather than works.
IDLE_FUNCTIONS = frozenset({
    "wait", "_wait_for_tstate_lock", "sleep", "select", "poll", "_poll", "get", "recv", "recv_bytes", "_recv",
    "_recv_bytes", "accept", "read", "readinto", "join", "acquire", "_worker", "wait_for", "epoll", "_handle_workers",
})


class StackSampler:
  """Samples the stacks of every thread but its own; `stop` returns the counts (see `summary`)."""

  def __init__(self, hz: float = 1000.0):
    self.interval = 1.0 / hz
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
    self._labels: dict[Any, str] = {}  # code object -> "function (file:line)"
    self._names: dict[int, str] = {}
    self._threads: dict[int, dict[str, Any]] = {}
    self.seconds = 0.0
    self._cpu_start: dict[int, tuple[str, float]] = {}
    self._cores: dict[int, tuple[str, float]] = {}  # native thread id -> (its name, cores it kept busy)

  def _label(self, code) -> str:
    label = self._labels.get(code)
    if label is None:
      label = self._labels[code] = f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
    return label

  def _sample(self) -> None:
    own = threading.get_ident()
    for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
      if ident == own:
        continue
      if ident not in self._names:
        self._names = {thread.ident: thread.name for thread in threading.enumerate()}
      counts = self._threads.get(ident)
      if counts is None:
        counts = self._threads[ident] = {"samples": 0, "busy": 0, "inclusive": collections.Counter(),
                                         "self": collections.Counter()}
      counts["samples"] += 1
      if frame.f_code.co_name in IDLE_FUNCTIONS:
        continue
      counts["busy"] += 1
      counts["self"][self._label(frame.f_code)] += 1
      seen = set()
      while frame is not None:
        seen.add(self._label(frame.f_code))
        frame = frame.f_back
      counts["inclusive"].update(seen)

  def _run(self) -> None:
    started = time.perf_counter()
    while not self._stop.wait(self.interval):
      self._sample()
    self.seconds = time.perf_counter() - started

  def start(self) -> "StackSampler":
    self._cpu_start = thread_cpu_seconds()
    self._thread.start()
    return self

  def stop(self) -> dict[str, Any]:
    self._stop.set()
    self._thread.join()
    cpu_end = thread_cpu_seconds()
    self._cores = {tid: ((name, (seconds - self._cpu_start.get(tid, (name, 0.0))[1]) / max(self.seconds, 1e-9)))
                   for tid, (name, seconds) in cpu_end.items()}
    return self.summary()

  def summary(self, top: int = 25, min_busy: float = 0.02) -> dict[str, Any]:
    """{"seconds", "threads": [{"name", "samples", "busy", "inclusive": [(function, share)], "self": [...]}]}:
    the main thread first, then every thread busy in at least `min_busy` of its samples, busiest first; shares
    are of the thread's samples, the top `top` functions each."""
    main = threading.main_thread().ident
    native = {thread.ident: thread.native_id for thread in threading.enumerate()}
    threads = []
    for ident, counts in self._threads.items():
      samples = max(counts["samples"], 1)
      busy = counts["busy"] / samples
      cores = self._cores.get(native.get(ident), ("", None))[1]
      if ident != main and (busy < min_busy if cores is None else cores < min_busy):
        continue
      threads.append({"name": "main" if ident == main else self._names.get(ident, str(ident)),
                      "samples": counts["samples"], "busy": busy, "cores": cores,
                      "inclusive": [(f, n / samples) for f, n in counts["inclusive"].most_common(top)],
                      "self": [(f, n / samples) for f, n in counts["self"].most_common(top)]})
    threads.sort(key=lambda thread: (thread["name"] != "main", -(thread["cores"] or thread["busy"])))
    # Every thread of the process by the CPU it used, Python's or not (XLA's, the runtime's), busiest first.
    cpu = sorted(((name, cores) for name, cores in self._cores.values() if cores >= min_busy), key=lambda x: -x[1])
    return {"seconds": self.seconds, "hz": 1.0 / self.interval, "threads": threads, "thread_cores": cpu,
            "process_cores": sum(cores for _, cores in self._cores.values())}


def thread_cpu_seconds() -> dict[int, tuple[str, float]]:
  """Native thread id -> (its name, CPU seconds it has used), for every thread of this process (Linux /proc)."""
  names = {thread.native_id: thread.name for thread in threading.enumerate()}
  names[threading.main_thread().native_id] = "main"
  ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
  out = {}
  try:
    tasks = os.listdir("/proc/self/task")
  except OSError:
    return out
  for task in tasks:
    try:
      with open(f"/proc/self/task/{task}/stat") as stat:
        text = stat.read()
    except OSError:
      continue
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    out[int(task)] = (names.get(int(task), comm), (int(fields[11]) + int(fields[12])) / ticks)  # utime + stime
  return out


def format_profile(summary: dict[str, Any], title: str = "", top: int = 25, top_other: int = 12) -> str:
  """The summary as text: per thread, its `top` functions (`top_other` for threads other than the main one)."""
  lines = [f"sampled stacks{' of ' + title if title else ''}: {summary['seconds']:.1f} s at "
           f"{summary['hz']:.0f} Hz; the process's threads kept {summary['process_cores']:.2f} cores busy: " +
           ", ".join(f"{name[:40]} {cores:.2f}" for name, cores in summary["thread_cores"][:10]),
           "per Python thread, share of its samples (inclusive / innermost function):"]
  for thread in summary["threads"]:
    if thread["name"] != "main" and not top_other:
      continue
    cores = "" if thread["cores"] is None else f", {thread['cores']:.2f} cores"
    lines.append(f"  thread {thread['name']}: {thread['samples']} samples, not waiting {thread['busy']:.1%}{cores}")
    own = dict(thread["self"])
    # Functions on every stack of the thread (its entry point down to the loop) say nothing: left out.
    shown = [(function, share) for function, share in thread["inclusive"][:top if thread["name"] == "main" else
                                                                           top_other]
             if (share < thread["busy"] - 1e-9 or own.get(function, 0.0) >= 0.01) and share >= 0.005]
    for function, share in shown:
      lines.append(f"    {share:6.1%} {own.get(function, 0.0):6.1%}  {function}")
    listed = {function for function, _ in shown}
    for function, share in thread["self"][:5 if top_other else 3]:
      if function not in listed and share >= 0.005:
        lines.append(f"    {'':6} {share:6.1%}  {function}")
  return "\n".join(lines)
