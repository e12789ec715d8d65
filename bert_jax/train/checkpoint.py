"""Orbax checkpoints holding the train state *and* the data-iterator state.

`Checkpointer` wraps an `ocp.CheckpointManager` in `<workdir>/checkpoints` (or another folder of the workdir):
async saves, keep-N, restore of the newest checkpoint that reads back. A
corrupt or partial checkpoint (a save interrupted mid-way, a truncated file)
is skipped with a warning and the previous one is used. The workdir may be
local or `gs://` (an `etils.epath.Path`, as Orbax takes it).

Every save records a checksum of each array (`checksums`: a position-keyed hash
of its bits, computed where the array lives) in the checkpoint's "meta" item;
a restore recomputes them, and a checkpoint whose arrays read back other bits
(a flipped bit in a data file, which Orbax's zstd-compressed zarr chunks do not
detect) is corrupt. A failed write raises `CheckpointWriteError`, one line
naming the file, the OS cause and the checkpoint a rerun resumes from.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import re
import sys
import time
import warnings
from typing import Any

import jax
from etils import epath
import jax.numpy as jnp
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


class CheckpointWriteError(paths.StorageError):
  """A checkpoint (or another file of the run) could not be written (a full disk, lost storage); the earlier
  checkpoints are intact."""


# TensorStore reports the OS error of a failed read or write inside its status text.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_QUOTED_PATH = re.compile(r'"((?:/|[a-z][a-z0-9+.-]*://)[^"]+)"')
# Status codes of a remote store (no OS error behind them), as the OS error a user knows.
_STATUS_ERRNO = {"RESOURCE_EXHAUSTED": errno.EDQUOT, "PERMISSION_DENIED": errno.EACCES,
                 "UNAUTHENTICATED": errno.EACCES}


def os_error(error: BaseException) -> OSError | None:
  """The OS error behind `error` (Orbax's and TensorStore's wrapping undone), with the file it names; None when
  there is none."""
  for link in _chain(error):
    if isinstance(link, OSError) and link.errno:
      return link
  for link in _chain(error):
    text = str(link)
    code = _OS_ERROR_CODE.search(text)
    number = int(code.group(1)) if code else _STATUS_ERRNO.get(text.split(":", 1)[0].strip())
    if number:
      named = _QUOTED_PATH.findall(text)
      return OSError(number, os.strerror(number), named[-1] if named else None)
  return None


class _FailedIoReports(logging.Filter):
  """Drops asyncio's "exception was never retrieved" reports of storage errors: Orbax leaves the other writes of a
  failed save unawaited, and the run reports the failure itself in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and "never retrieved" in record.getMessage() and os_error(error) is not None)


def _quiet_failed_io_reports() -> None:
  """Keeps the reports that library threads print after a failed (or abandoned) save or restore off the terminal:
  the "Event loop is closed" tracebacks of TensorStore operations that finish after Orbax closed the event loop
  awaiting them, and asyncio's unretrieved storage errors. The run reports the failure itself, in one line."""
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _FailedIoReports) for f in asyncio_log.filters):
    asyncio_log.addFilter(_FailedIoReports())
  previous = sys.unraisablehook
  if getattr(previous, "drops_late_loop_callbacks", False):
    return

  def hook(unraisable):
    frames, traceback = set(), unraisable.exc_traceback
    while traceback is not None:
      frames.add(traceback.tb_frame.f_code.co_name)
      traceback = traceback.tb_next
    if not (isinstance(unraisable.exc_value, RuntimeError) and "call_soon_threadsafe" in frames
            and str(unraisable.exc_value) == "Event loop is closed"):
      previous(unraisable)

  hook.drops_late_loop_callbacks = True
  sys.unraisablehook = hook


def _words(x: jax.Array) -> jax.Array:
  """`x`'s bits as uint32, one word per element ([*shape, 2] for a 64-bit type)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
  """uint32 sum over elements of a hash of (position, bits): any change of one element changes it, a reordering
  too; built from elementwise ops and one sum, so a sharded array is hashed where it lives."""
  words = _words(x)
  position = jnp.zeros(words.shape, jnp.uint32)
  for axis, size in enumerate(words.shape):
    position = position * jnp.uint32(size) + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
  return _mixed_sum(words, position, jnp)


def _mixed_sum(words: Any, position: Any, xp: Any) -> Any:
  """The uint32 sum of a hash of each (word, row-major position), in `xp` (jax.numpy on device, numpy on host)."""
  mixed = words ^ (position * xp.uint32(0x9E3779B9) + xp.uint32(0x7F4A7C15))
  for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):  # MurmurHash3's finaliser: a bijection
    mixed = (mixed ^ (mixed >> xp.uint32(shift))) * xp.uint32(multiplier)
  return xp.sum(mixed ^ (mixed >> xp.uint32(16)), dtype=xp.uint32)


_checksums_jit = jax.jit(lambda leaves: [_checksum(leaf) for leaf in leaves])


def _host_checksum(x: np.ndarray) -> int:
  """`_checksum` of a host array in numpy: the same bits, without compiling a program for the tree's shapes (on
  a CPU backend that compilation costs more than the hashing)."""
  if x.dtype == np.bool_:
    x = x.astype(np.uint8)
  unsigned = {1: np.uint8, 2: np.uint16}.get(x.dtype.itemsize, np.uint32)
  words = np.ascontiguousarray(x).view(unsigned).astype(np.uint32).ravel()
  with np.errstate(over="ignore"):
    return int(_mixed_sum(words, np.arange(words.size, dtype=np.uint32), np))


# The meta item's key of `checksums` ('/'-joined leaf names; a checkpoint without it predates them).
CHECKSUMS = "array_checksums"


def _leaf_name(path: tuple) -> str:
  """A leaf's path as '/'-joined names, the same for a dict, a dataclass or a named tuple holding it."""
  return "/".join(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)


def checksums(tree: Any) -> dict[str, int]:
  """{leaf path ('/'-joined): its checksum} for the array leaves of `tree` (device or host arrays)."""
  named = [(_leaf_name(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
           if hasattr(leaf, "dtype") and hasattr(leaf, "shape")]
  # A host array of a 64-bit type goes in as its 32-bit words: JAX without x64 would narrow its values first.
  leaves = [leaf.view(np.uint32) if isinstance(leaf, np.ndarray) and leaf.dtype.itemsize == 8 else leaf
            for _, leaf in named]
  if all(_on_host(leaf) for leaf in leaves):
    return {name: _host_checksum(np.asarray(_host_words(leaf))) for (name, _), leaf in zip(named, leaves)}
  return {name: int(value) for (name, _), value in zip(named, jax.device_get(_checksums_jit(leaves)))}


def _on_host(leaf: Any) -> bool:
  """A numpy array, or a JAX array whose every shard is in this process's CPU memory."""
  if isinstance(leaf, np.ndarray):
    return True
  return (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
          and all(device.platform == "cpu" for device in leaf.devices()))


def _host_words(leaf: Any) -> Any:
  """A leaf as numpy holds its bits: a PRNG key as its key data."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(leaf)
  return leaf


def verify_checksums(tree: Any, recorded: dict[str, int] | None, step: int) -> None:
  """Raises ValueError naming the first array of `tree` whose bits differ from those saved at `step`
  (`recorded`: `checksums` of what was saved; None for a checkpoint written before they were recorded)."""
  if not recorded:
    return
  for name, value in checksums(tree).items():
    if name not in recorded:
      raise ValueError(f"checkpoint {step}: no checksum was saved for {name}")
    if recorded[name] != value:
      raise ValueError(f"checkpoint {step}: {name} does not hold the saved bits (checksum {value:#010x}, saved "
                       f"{recorded[name]:#010x})")


class Checkpointer:
  """Saves and restores {state, data iterator state, run metadata} per step."""

  def __init__(self, workdir: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
               folder: str = "checkpoints"):
    _use_array_handler()
    _quiet_failed_io_reports()
    self.directory = paths.as_path(workdir) / folder
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
                                           cleanup_tmp_directories=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data", "meta"))

  def save(self, step: int, state: Any, data_state: dict[str, Any], meta: dict[str, Any] | None = None,
           force: bool = False) -> None:
    """Starts writing checkpoint `step` (asynchronously unless `async_save` is off); `meta` gets the arrays'
    `checksums`."""
    self.check()  # An earlier save that failed is reported as its own, not as this one.
    meta = {**(meta or {}), CHECKSUMS: checksums(state)}
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                              meta=ocp.args.JsonSave(meta))
    try:
      self.manager.save(step, args=args, force=force)
    except Exception as error:  # noqa: BLE001 - a failed write (this one or the previous async one) is reported.
      raise self.storage_error(error, step=step) from None

  def _finalizing(self):
    """Orbax's thread that finishes the newest asynchronous save (None when there is none to see)."""
    finalize = getattr(self.manager, "_finalize_thread", None)  # Orbax's own; absent: saves are not checked early.
    return finalize.map(lambda t: t) if hasattr(finalize, "map") else None

  def check(self) -> None:
    """Raises CheckpointWriteError as soon as an asynchronous save has failed, without waiting for one in progress
    (Orbax itself reports it only at the next save, many steps later)."""
    thread = self._finalizing()
    if thread is not None and not thread.is_alive() and getattr(thread, "exception", None) is not None:
      error, thread.exception = thread.exception, None
      raise self.storage_error(error, step=thread.step() if hasattr(thread, "step") else None)

  def writing(self) -> int | None:
    """The step of a save still being written in the background, or None."""
    thread = self._finalizing()
    return thread.step() if thread is not None and thread.is_alive() and hasattr(thread, "step") else None

  def storage_error(self, error: BaseException, what: str | None = None, step: int | None = None
                    ) -> CheckpointWriteError:
    """One line for a failed write (checkpoint `step`, or `what`): the file, the OS cause (under Orbax's and
    TensorStore's wrapping) and the checkpoint a rerun resumes from."""
    if isinstance(error, CheckpointWriteError):
      return error
    cause = os_error(error)
    reason = cause.strerror if cause is not None else (str(error).splitlines() or [""])[0]
    where = os.fspath((cause.filename if cause is not None else None) or what or self.directory)
    target = f"checkpoint step {step} to {where}" if step is not None else where
    wrapped = CheckpointWriteError(
        f"writing {target} failed ({type(cause or error).__name__}: {reason}); {self.last_complete()}. Free space "
        "or fix the storage, then run the same command to resume")
    if cause is not None:
      wrapped.errno, wrapped.strerror, wrapped.filename = cause.errno, cause.strerror, where
    return wrapped

  def complete_steps(self) -> list[int]:
    """The steps complete on storage now (a save in progress or failed is not among them)."""
    try:
      self.manager.reload()
      return self.steps()
    except Exception:  # noqa: BLE001 - the storage may be failing for reads too.
      return []

  def last_complete(self) -> str:
    """Where a rerun resumes, in words."""
    return resume_point(self.complete_steps())

  def wait(self) -> None:
    """Blocks until every save started is complete on storage."""
    step = self.writing()
    try:
      self.manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001
      raise self.storage_error(error, step=step) from None

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def drop_after(self, step: int) -> list[int]:
    """Deletes the checkpoints after `step` (a rerun computes those steps again); returns their steps."""
    dropped = [later for later in self.steps() if later > step]
    for later in dropped:
      self.manager.delete(later)
    return dropped

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
        meta = dict(restored["meta"] or {})
        verify_checksums(restored["state"], meta.get(CHECKSUMS), step)
        _check_finite(restored["state"], step)
        return step, restored["state"], dict(restored["data"] or {}), meta
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

  def abandon(self) -> None:
    """Leaves a save in progress unfinished, as the process exits at once (a second Ctrl-C): its partial files are
    never read (Orbax finalizes a step only when every write is done, and removes what is left at the next start),
    and the writes it leaves unawaited are not reported one by one as never awaited."""
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)


class SaveCheck:
  """A `loop.run` hook that is never due: asking it raises the error of a failed asynchronous save of
  `checkpointer` (`Checkpointer.check`), so the run stops at the end of the call after the failure."""

  def __init__(self, checkpointer: Checkpointer):
    self.checkpointer = checkpointer

  def due(self, step: int, last: bool) -> bool:
    del step, last
    self.checkpointer.check()
    return False

  def __call__(self, step: int, state: Any) -> bool:
    return False


def resume_point(steps: list[int]) -> str:
  """ "the last complete checkpoint is step N", or that there is none, for `steps` (the complete ones)."""
  return f"the last complete checkpoint is step {steps[-1]}" if steps else "no complete checkpoint exists"


def complete_steps(workdir: str | os.PathLike) -> list[int]:
  """The steps of the complete checkpoints in `workdir` (a partial write is not one), without opening it for
  writing."""
  directory = paths.as_path(workdir) / "checkpoints"
  if not directory.is_dir():
    return []
  manager = ocp.CheckpointManager(directory, item_names=("state", "data", "meta"),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  try:
    return sorted(manager.all_steps())
  finally:
    manager.close()


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


def restore_params(workdir: str | os.PathLike, step: int | None = None, step_key: str | None = None
                   ) -> tuple[int, Any]:
  """Reads only the model parameters of a run's checkpoint `step` (None: its newest), as host numpy arrays (any
  device count), their checksums verified.

  Used to start fine-tuning or a later pre-training phase from a run, and by
  tools (fill-mask, features) that read a workdir. A checkpoint that cannot be
  read is an error, never a silent step back to an older one: `step_key` names
  the setting that picks another (its message says so).
  """
  _quiet_failed_io_reports()
  directory = paths.as_path(workdir) / "checkpoints"
  if not directory.is_dir():
    raise FileNotFoundError(f"{workdir} has no checkpoints/ directory (not a bert_jax run?)")
  manager = ocp.CheckpointManager(directory, item_names=("state", "data", "meta"),
                                  options=ocp.CheckpointManagerOptions(read_only=True))
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  if step is not None and step not in steps:
    raise ValueError(f"{step_key or 'step'}={step}: {directory} has no checkpoint at that step (it has {steps})")
  chosen = steps[-1] if step is None else step
  try:
    item_dir = directory / str(chosen) / "state"
    metadata = ocp.StandardCheckpointer().metadata(item_dir)
    tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree["params"])
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    restored = ocp.PyTreeCheckpointer().restore(
        item_dir, args=ocp.args.PyTreeRestore(item={"params": target}, restore_args={"params": restore_args},
                                              partial_restore=True))
    meta = manager.restore(chosen, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"] or {}
    verify_checksums({"params": restored["params"]}, meta.get(CHECKSUMS), chosen)
  except Exception as error:  # noqa: BLE001 - any failure to read means "unusable", named with its cause.
    detail = (str(error).splitlines() or [""])[0]
    others = [s for s in steps if s != chosen]
    hint = (f"; set {step_key}=STEP to start from another of its checkpoints ({', '.join(map(str, others))})"
            if step_key and others else "")
    raise ValueError(f"checkpoint {chosen} in {directory} cannot be read ({type(error).__name__}: {detail})"
                     f"{hint}") from None
  finally:
    manager.close()
  return chosen, restored["params"]


def read_run_config(workdir: str | os.PathLike) -> dict[str, Any]:
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    raise FileNotFoundError(f"{path} not found: is {workdir} a bert_jax run directory?")
  return json.loads(path.read_text())


def match_params(loaded: Any, reference: Any, mismatch: str, missing_ok: bool = False) -> Any:
  """`loaded` as `reference`'s tree and dtypes, once each parameter's shape is checked: a mismatch raises a
  ValueError of `mismatch` (what was read does not fit what) and every parameter that does not fit (`missing_ok`: a
  parameter `loaded` lacks keeps `reference`'s value)."""
  flat_loaded = dict(jax.tree_util.tree_flatten_with_path(loaded)[0])
  flat_ref, treedef = jax.tree_util.tree_flatten_with_path(reference)
  out, problems = [], []
  for path, ref in flat_ref:
    name = jax.tree_util.keystr(path)
    if path not in flat_loaded:
      if not missing_ok:
        problems.append(f"missing {name}")
      out.append(ref)
    elif tuple(flat_loaded[path].shape) != tuple(ref.shape):
      problems.append(f"{name}: shape {tuple(flat_loaded[path].shape)} != {tuple(ref.shape)}")
      out.append(ref)
    else:
      out.append(np.asarray(flat_loaded[path], ref.dtype))
  if problems:
    raise ValueError(f"{mismatch}:\n  " + "\n  ".join(problems))
  return jax.tree_util.tree_unflatten(treedef, out)
