"""The scaffold every run shares: pre-training (`trainer`) and fine-tuning (`bert_jax.tasks.finetune`) alike.

  with locked(workdir, interrupted) as (workdir, primary):   # distributed start, the workdir's lock, Ctrl-C
    mesh, partitioning = mesh_and_partitioning(config, validate)
    ...
    if primary:
      write_run_files(workdir, config, model_config, tokenizer)   # config.json, model_config.json, tokenizer/
      banner("pretrain", subject, num_params, sizes, workdir)     # what runs, where
    train_step, multi_step = make_steps(objective, tx, schedule, config.train, ...)
    train_log = TrainLog(workdir, start_step, primary, throughput, progress)   # the loop's `on_log`

`saved_config` reads a run's config back for its evaluation, the keys newer than the run at their defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

from etils import epath
import jax
import ml_collections

from bert_jax import paths
from bert_jax import progress as progress_lib
from bert_jax.models import ModelConfig
from bert_jax.parallel import distributed
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import metrics as metrics_lib
from bert_jax.train import workdir as workdir_lib
from bert_jax.train.step import Partitioning, make_train_step

log = logging.getLogger(__name__)


@contextlib.contextmanager
def locked(workdir: str | os.PathLike, interrupted: Callable[[epath.Path], str]
           ) -> Iterator[tuple[epath.Path, bool]]:
  """Starts the distributed runtime and holds the workdir's lock (on the primary process) around a run.

  Yields:
    (the workdir as a path, whether this is the primary process, the one that writes the run's files).

  Raises:
    InterruptedError: "stopped by Ctrl-C; " and `interrupted(workdir)` (what is kept, how to go on), for a Ctrl-C
      that the steps' own handling did not take (start-up, the last evaluation).
  """
  distributed.initialize()
  workdir = paths.as_path(workdir)
  primary = jax.process_index() == 0
  # One writer a workdir: a second run refuses at once, naming the holder; a killed run's lock does not block.
  lock = workdir_lib.WorkdirLock.acquire(workdir) if primary else None
  try:
    yield workdir, primary
  except KeyboardInterrupt:  # One line, as errors are.
    raise InterruptedError(f"stopped by Ctrl-C; {interrupted(workdir)}") from None
  finally:
    if lock is not None:
      lock.release()


def mesh_and_partitioning(config: ml_collections.ConfigDict, validate: Callable[[ml_collections.ConfigDict, int], None]
                          ) -> tuple[jax.sharding.Mesh, Partitioning]:
  """The device mesh of `config.mesh.sizes` and its partitioning by `config.mesh.rules`, once `validate(config,
  data_parallel)` has checked the derived values (the batch against the mesh's data-parallel size)."""
  mesh = sharding_lib.create_mesh(dict(config.mesh.sizes))
  validate(config, sharding_lib.data_parallel_size(mesh))
  return mesh, Partitioning(mesh, sharding_lib.rules_from_config(config.mesh.rules))


def write_run_files(workdir: epath.Path, config: ml_collections.ConfigDict, model_config: ModelConfig, tokenizer: Any,
                    extra: dict[str, Any] | None = None, *, end: str = "\n") -> None:
  """Writes what a run's readers need besides its checkpoints: config.json, model_config.json, `extra` ({file name:
  JSON value}), each as indented JSON followed by `end`, and tokenizer/."""
  workdir.mkdir(parents=True, exist_ok=True)
  files = {"config.json": config.to_dict(), "model_config.json": dataclasses.asdict(model_config), **(extra or {})}
  for name, value in files.items():
    (workdir / name).write_text(json.dumps(value, indent=2, default=str) + end)
  tokenizer.save(workdir / "tokenizer")


def batch_sizes(batch_size: int) -> str:
  """The global and per-host batch, as a banner shows them."""
  return f"global batch={batch_size} per-host batch={batch_size // jax.process_count()}"


def banner(command: str, subject: str, num_params: int, sizes: str, workdir: epath.Path,
           distilling: tuple[str, Any] | None = None) -> None:
  """Prints a run's start: `bert_jax COMMAND: SUBJECT params=...M`, its sizes (`batch_sizes`, lengths, devices,
  steps), the workdir, and with `distilling` ((teacher, loss weights)) the teacher it learns from."""
  print(f"bert_jax {command}: {subject} params={num_params / 1e6:.2f}M\n  {sizes}\n  workdir={workdir}", flush=True)
  if distilling is not None:
    teacher, weights = distilling
    print(f"  distilling from {teacher}: loss weights {weights}", flush=True)


def make_steps(objective: Any, tx: Any, schedule: Any, train: ml_collections.ConfigDict, partitioning: Partitioning,
               state_shardings: Any, rng: jax.Array, make_step: Callable[..., Callable] = make_train_step
               ) -> tuple[Callable, Callable | None]:
  """The jitted train step of the `train` config section, and with `train.steps_per_call` > 1 the step taking that
  many steps a call (else None); `make_step` stands in for `step.make_train_step` (a benchmark's instrument)."""
  settings = dict(accum_steps=train.accum_steps, partitioning=partitioning, rng=rng, state_shardings=state_shardings,
                  param_norms=train.log_param_norms)
  multi_step = (make_step(objective, tx, schedule, steps_per_call=train.steps_per_call, **settings)
                if train.steps_per_call > 1 else None)
  return make_step(objective, tx, schedule, **settings), multi_step


def throughput(tokens_per_step: int, flops_per_token: float, devices: int,
               teacher_flops_per_token: float | None = None) -> metrics_lib.Throughput:
  """Tokens/s and MFU of a run's steps; a distillation teacher's forward pass counts a third of its training FLOPs."""
  if teacher_flops_per_token is not None:
    flops_per_token += teacher_flops_per_token / 3
  return metrics_lib.Throughput(tokens_per_step, flops_per_token, devices)


class TrainLog:
  """The loop's `on_log`: each log step's train metrics with the throughput added, written (JSON lines and
  TensorBoard, on the primary process) into `folder`, shown on the progress bar, kept as `history` and `last`.

  Opening it drops the rows an interrupted run logged after `start_step`: the resumed run computes those steps again.
  """

  def __init__(self, folder: epath.Path, start_step: int, primary: bool, throughput: metrics_lib.Throughput,
               progress: progress_lib.Progress | None):
    if primary and (dropped := workdir_lib.drop_rows_after(folder / "metrics.jsonl", start_step)):
      log.info("dropped %d rows of metrics.jsonl logged after step %d by the interrupted run", dropped, start_step)
    self.writer = metrics_lib.MetricWriter(folder, enabled=primary)
    self.throughput, self.progress = throughput, progress
    self.history: list[dict[str, float]] = []
    self.last: dict[str, float] = {}

  def __call__(self, step: int, averaged: dict[str, float]) -> None:
    averaged.update(self.throughput.update(step))
    self.last = averaged
    self.history.append({"step": step, **averaged})
    self.writer.write(step, averaged, prefix="train/")
    if self.progress is not None:
      self.progress.set_postfix(progress_lib.metrics_postfix(averaged))


def with_defaults(defaults: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
  """A run's saved config (as a dict) with the keys newer than the run at their `defaults`, at every depth."""
  return {**defaults, **{key: with_defaults(defaults[key], value) if isinstance(value, dict) and
                         isinstance(defaults.get(key), dict) else value for key, value in saved.items()}}


def saved_config(workdir: str | os.PathLike, defaults: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config a run in `workdir` was started with (its config.json), the keys newer than the run at `defaults`."""
  return ml_collections.ConfigDict(with_defaults(defaults.to_dict(), checkpoint_lib.read_run_config(workdir)))


def environment() -> dict[str, Any]:
  """Where a run ran: Python, platform, JAX and its devices, the code's git commit, the start time."""
  try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                            cwd=pathlib.Path(__file__).parent).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = ""
  return {"python": sys.version, "platform": platform.platform(), "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
          "device_kind": jax.devices()[0].device_kind, "process_count": jax.process_count(),
          "git_commit": commit, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
