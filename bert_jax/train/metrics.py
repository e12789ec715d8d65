"""Metrics out: JSON lines, TensorBoard event files, and a progress bar with tokens/s and MFU.

Only process 0 writes; other processes get a writer that does nothing. In a
`gs://` workdir (objects cannot be appended to) both are written to a local
folder and uploaded whole by `flush`, which the trainer calls after every
checkpoint: what a killed run had not uploaded is logged again on resume.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from bert_jax import paths

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device, for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {
    "H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12,
}


def device_peak_flops(device: jax.Device | None = None) -> float | None:
  kind = (device or jax.devices()[0]).device_kind
  for name, flops in PEAK_FLOPS.items():
    if name.lower() in kind.lower():
      return flops
  return None


def to_python(metrics: Mapping[str, Any]) -> dict[str, float]:
  return {k: float(np.asarray(v)) for k, v in metrics.items()}


@jax.jit
def _stacked(steps: list[dict[str, Any]]) -> dict[str, jax.Array]:
  # One array per metric: a log step transfers a handful of arrays, not (steps x metrics) scalars one by one.
  return {key: jax.numpy.concatenate([jax.numpy.atleast_1d(metrics[key]) for metrics in steps])
          for key in steps[-1]}


def fetch(steps: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
  """The metrics of several steps on the host, each metric an array over the steps.

  An entry of `steps` holds one step's scalars or, from a call that took several steps, arrays over its steps.
  """
  if all(metrics.keys() == steps[-1].keys() for metrics in steps):
    return {key: np.asarray(value) for key, value in jax.device_get(_stacked(list(steps))).items()}
  rows = [{key: np.atleast_1d(np.asarray(value, np.float64)) for key, value in metrics.items()}
          for metrics in jax.device_get(list(steps))]
  counts = [len(next(iter(row.values()))) for row in rows]
  return {key: np.concatenate([row.get(key, np.full(count, np.nan)) for row, count in zip(rows, counts)])
          for key in rows[-1]}


class PendingMetrics:
  """The device metrics of the steps the host has not read yet, for a training loop that logs every few steps.

  After each call of the step the loop calls `add` with its metrics (of one step, or arrays over the several steps
  of one call, with `steps`). At a log step it calls `log_next`: the
  host reads those metrics only once the following step is dispatched (in that `add`), so the device has
  work queued while the host waits for them: a step dispatched to an idle GPU starts late (docs/performance.md).
  `flush` reads them at once, where the loop needs the state anyway (evaluation, checkpoints, the last step).
  Each read calls `on_read(step, averaged, nonfinite)`: the step being logged; each metric's mean over the
  steps read since the last read (the "nonfinite" flag left out); and (step, its metrics) of the first of those
  steps whose "nonfinite" flag is set, or None.
  """

  def __init__(self, on_read: Callable[[int, dict[str, float], tuple[int, dict[str, float]] | None], None]):
    self._on_read = on_read
    self._pending: list[Mapping[str, Any]] = []
    self._steps = 0  # steps in `_pending`
    self._log_step: int | None = None

  def add(self, metrics: Mapping[str, Any], steps: int = 1) -> None:
    if self._log_step is not None:
      self.flush(self._log_step)
    self._pending.append(metrics)
    self._steps += steps

  def log_next(self, step: int) -> None:
    self._log_step = step

  def flush(self, step: int) -> None:
    self._log_step = None
    if self._pending:
      fetched = fetch(self._pending)
      count = self._steps
      self._pending.clear()
      self._steps = 0
      first = step - count + 1  # the steps read are first, ..., step
      bad = np.flatnonzero(fetched["nonfinite"])
      nonfinite = ((first + int(bad[0]), {k: float(v[bad[0]]) for k, v in fetched.items()}) if bad.size else None)
      averaged = {k: float(np.mean(v)) for k, v in fetched.items() if k != "nonfinite"}
      self._on_read(step, averaged, nonfinite)


class MetricWriter:
  """Appends {"step": s, **scalars} to metrics.jsonl and writes TensorBoard scalars.

  A failed write raises an OSError naming the file (the trainer reports it in one line with the checkpoint a rerun
  resumes from); after one, `close` finishes quietly.
  """

  # A remote workdir's files are uploaded at least this often (seconds), besides every `flush`.
  UPLOAD_EVERY = 300.0

  def __init__(self, workdir: str | os.PathLike, enabled: bool = True):
    self.enabled, self.failed = enabled, False
    if not enabled:
      return
    self.workdir = paths.as_path(workdir)
    self.workdir.mkdir(parents=True, exist_ok=True)
    self.remote = paths.is_remote(self.workdir)
    local = pathlib.Path(tempfile.mkdtemp(prefix="bert_jax-metrics-")) if self.remote else pathlib.Path(self.workdir)
    if self.remote and (self.workdir / "metrics.jsonl").exists():
      (local / "metrics.jsonl").write_bytes((self.workdir / "metrics.jsonl").read_bytes())
    self.local, self.uploaded = local, time.monotonic()
    self.jsonl = open(local / "metrics.jsonl", "a", buffering=1)
    summary_writer = _tensorboard_writer_class()
    self.tensorboard = summary_writer(str(local / "tensorboard")) if summary_writer else None

  @contextlib.contextmanager
  def _writing(self, path: str | os.PathLike) -> Iterator[None]:
    """An OS error inside names `path` (a bare write error names no file)."""
    try:
      yield
    except OSError as error:
      self.failed = True
      raise OSError(error.errno, error.strerror or str(error), os.fspath(path)) from error

  def write(self, step: int, scalars: Mapping[str, float], prefix: str = "") -> None:
    if not self.enabled:
      return
    named = {f"{prefix}{k}": v for k, v in scalars.items()}
    with self._writing(self.local / "metrics.jsonl"):
      self.jsonl.write(json.dumps({"step": int(step), **{k: _json_number(v) for k, v in named.items()}}) + "\n")
    if self.tensorboard is not None:
      with self._writing(self.local / "tensorboard"):
        for name, value in named.items():
          self.tensorboard.add_scalar(name, value, step)
    if self.remote and time.monotonic() - self.uploaded > self.UPLOAD_EVERY:
      self.flush()

  def flush(self) -> None:
    """Makes everything written so far durable in the workdir (an upload when it is remote)."""
    if not self.enabled:
      return
    with self._writing(self.local / "metrics.jsonl"):
      self.jsonl.flush()
    if self.tensorboard is not None:
      with self._writing(self.local / "tensorboard"):
        self.tensorboard.flush()
    if self.remote:
      with self._writing(self.workdir):
        paths.upload(self.local, self.workdir)
      self.uploaded = time.monotonic()

  def close(self, quiet: bool = False) -> None:
    """Closes both files (and uploads them when remote). The first storage error is raised, naming its file, once
    every file was given its turn; after a failed write, or with `quiet` (the run already fails), none is."""
    if not self.enabled:
      return
    closers = [(self.jsonl.close, self.local / "metrics.jsonl")]
    if self.tensorboard is not None:
      closers.append((self.tensorboard.close, self.local / "tensorboard"))
    if self.remote:
      closers += [(lambda: paths.upload(self.local, self.workdir), self.workdir),
                  (lambda: shutil.rmtree(self.local), self.local)]
    quiet, first = quiet or self.failed, None
    for close, path in closers:
      try:
        with self._writing(path):
          close()
      except OSError as error:
        log.debug("cannot finish writing the metrics of %s: %s", self.workdir, error)
        first = first or error
    if first is not None and not quiet:
      raise first


def _tensorboard_writer_class():
  """tensorboardX's SummaryWriter (None when it is not installed), imported without PyTorch.

  tensorboardX imports torch whenever it is installed, only to accept torch
  tensors; we write floats, and on a GPU machine that import costs seconds
  of every run's start-up.
  """
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX handles.
  try:
    from tensorboardX import SummaryWriter
    return SummaryWriter
  except ImportError:
    return None
  finally:
    if blocked:
      del sys.modules["torch"]


def _json_number(value: float) -> float | str:
  return value if math.isfinite(value) else str(value)


class Throughput:
  """Tokens/s and MFU over the interval since the last call."""

  def __init__(self, tokens_per_step: int, flops_per_token: float, num_devices: int):
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    peak = device_peak_flops()
    self.peak_total = peak * num_devices if peak else None
    self.last_time, self.last_step = time.perf_counter(), None

  def update(self, step: int) -> dict[str, float]:
    now = time.perf_counter()
    out = {}
    if self.last_step is not None and step > self.last_step:
      seconds = now - self.last_time
      tokens_per_second = (step - self.last_step) * self.tokens_per_step / seconds
      out["tokens_per_second"] = tokens_per_second
      out["steps_per_second"] = (step - self.last_step) / seconds
      if self.peak_total:
        out["mfu"] = tokens_per_second * self.flops_per_token / self.peak_total
    self.last_time, self.last_step = now, step
    return out
