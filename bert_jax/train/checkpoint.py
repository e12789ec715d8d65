"""Orbax checkpoints holding the train state *and* the data-iterator state.

`Checkpointer` wraps an `ocp.CheckpointManager` in `<workdir>/checkpoints`:
async saves, keep-N, restore of the newest checkpoint that reads back. A
corrupt or partial checkpoint (a save interrupted mid-way, a truncated file)
is skipped with a warning and the previous one is used. The workdir may be
local or `gs://` (an `etils.epath.Path`, as Orbax takes it).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
from typing import Any

import jax
from etils import epath
import numpy as np
import orbax.checkpoint as ocp

from bert_jax import paths
from bert_jax.parallel.distributed import sync_global_devices

log = logging.getLogger(__name__)

# Orbax's replica-parallel saving slices every replicated array on every device first (one compiled slice per
# shape and device), which costs small arrays far more than it saves: those are written whole by one replica.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _use_array_handler() -> None:
  """Registers (once) Orbax's jax.Array handler with `MIN_REPLICA_SLICE_BYTES`, its other settings as before
  (an Orbax without the option keeps its handler)."""
  current = ocp.type_handlers.get_type_handler(jax.Array)
  options = inspect.signature(ocp.type_handlers.ArrayHandler).parameters
  if ("min_slice_bytes_for_replica_parallel" not in options
      or getattr(current, "_min_slice_bytes_for_replica_parallel", None) == MIN_REPLICA_SLICE_BYTES):
    return
  kwargs = {"min_slice_bytes_for_replica_parallel": MIN_REPLICA_SLICE_BYTES}
  if "array_metadata_store" in options:
    kwargs["array_metadata_store"] = getattr(current, "_array_metadata_store", None)
  ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(**kwargs), override=True)


class CheckpointWriteError(OSError):
  """A checkpoint could not be written (a full disk, lost storage); the earlier checkpoints are intact."""


class Checkpointer:
  """Saves and restores {state, data iterator state, run metadata} per step."""

  def __init__(self, workdir: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
    _use_array_handler()
    self.directory = paths.as_path(workdir) / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                                           cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))

  def save(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any] | None = None,
           force: bool = False) -> None:
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                              meta=ocp.args.JsonSave(meta or {}))
    try:
      self.manager.save(step, args=args, force=force)
    except Exception as error:  # noqa: BLE001 - a failed write (this one or the previous async one) is reported.
      raise self.storage_error(error) from None

  def check(self) -> None:
    """Raises CheckpointWriteError as soon as an asynchronous save has failed, without waiting for one in progress
    (Orbax itself reports it only at the next save, many steps later)."""
    finalize = getattr(self.manager, "_finalize_thread", None)  # Orbax's background thread; absent: not checked.
    thread = finalize.map(lambda t: t) if hasattr(finalize, "map") else None
    if thread is not None and not thread.is_alive() and getattr(thread, "exception", None) is not None:
      error, thread.exception = thread.exception, None
      raise self.storage_error(error)

  def storage_error(self, error: BaseException, what: str | None = None) -> CheckpointWriteError:
    """One line for a failed write (a checkpoint, or `what`): the cause (the OS error under Orbax's and
    TensorStore's wrapping) and the checkpoint a rerun resumes from."""
    if isinstance(error, CheckpointWriteError):
      return error
    cause = next((e for e in _chain(error) if isinstance(e, OSError) and e.strerror), error)
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause).splitlines()[0][:300]
    try:
      self.manager.reload()  # Drops the step that did not complete.
      complete = self.steps()
    except Exception:  # noqa: BLE001 - the storage may be failing for reads too.
      complete = []
    last = f"the last complete checkpoint is step {complete[-1]}" if complete else "no complete checkpoint exists"
    return CheckpointWriteError(
        f"writing {what or f'a checkpoint to {self.directory}'} failed ({type(cause).__name__}: {reason}); {last}. "
        f"Free space or fix the storage, then run the same command to resume")

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001
      raise self.storage_error(error) from None

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any], dict[str, Any]] | None:
    """Restores the newest readable checkpoint into `abstract_state`'s shapes and shardings.

    Returns:
      (step, state, data_state, meta), or None when there is no checkpoint.
    """
    for step in reversed(self.steps()):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        _check_finite(restored["state"], step)
        return step, restored["state"], dict(restored["data"] or {}), dict(restored["meta"] or {})
      except Exception as error:  # noqa: BLE001 - any failure to read means "unusable".
        kept = self._set_aside(step)
        log.warning("checkpoint at step %d in %s cannot be restored (%s: %s); moved it to %s and trying the "
                    "previous one", step, self.directory, type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "", kept)
    return None

  def _set_aside(self, step: int) -> epath.Path:
    """Moves an unreadable checkpoint out of the manager's way (kept for inspection, never deleted)."""
    source = self.directory / str(step)
    target = self.directory.parent / "corrupt_checkpoints" / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      paths.move(source, target)
    sync_global_devices(f"set_aside_checkpoint_{step}")
    self.manager.reload()
    return target

  def close(self) -> None:
    self.wait()
    self.manager.close()


def _chain(error: BaseException):
  """An exception and its causes and contexts."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def _check_finite(state: Any, step: int) -> None:
  for leaf in jax.tree.leaves(state):
    if hasattr(leaf, "dtype") and np.issubdtype(leaf.dtype, np.floating):
      if not bool(jax.numpy.isfinite(leaf).all()):
        raise ValueError(f"checkpoint {step} holds non-finite values")


def restore_params(workdir: str | os.PathLike, step: int | None = None) -> tuple[int, Any]:
  """Reads only the model parameters of a run's checkpoint, as host numpy arrays (any device count).

  Used to start fine-tuning or a later pre-training phase from a run, and by
  tools (fill-mask, features) that read a workdir.
  """
  directory = paths.as_path(workdir) / "checkpoints"
  if not directory.is_dir():
    raise FileNotFoundError(f"{workdir} has no checkpoints/ directory (not a bert_jax run?)")
  manager = ocp.CheckpointManager(directory, item_names=("state", "data", "meta"),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  steps = sorted(manager.all_steps()) if step is None else [step]
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  errors = []
  for candidate in reversed(steps):
    try:
      item_dir = directory / str(candidate) / "state"
      metadata = ocp.StandardCheckpointer().metadata(item_dir)
      tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
      params_meta = tree["params"]
      target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), params_meta)
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
      restored = ocp.PyTreeCheckpointer().restore(
          item_dir, args=ocp.args.PyTreeRestore(item={"params": target}, restore_args={"params": restore_args},
                                                partial_restore=True))
      return candidate, restored["params"]
    except Exception as error:  # noqa: BLE001
      errors.append(f"step {candidate}: {type(error).__name__}: {error}")
      log.warning("cannot read params of checkpoint %d in %s: %s", candidate, directory, error)
  raise ValueError(f"no readable checkpoint in {directory}:\n" + "\n".join(errors))


def read_run_config(workdir: str | os.PathLike) -> dict[str, Any]:
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {workdir} a bert_jax run directory?")
  return json.loads(path.read_text())
