"""What keeps a workdir's work safe: one writer at a time, no silent change of experiment, no duplicate rows.

A workdir may be local or `gs://` (every path here is an `etils.epath.Path`,
the path library Orbax uses), so the lock is a small JSON file rather than an
OS lock:

  lock = WorkdirLock.acquire(workdir)   # raises WorkdirBusyError naming the holder
  ...
  lock.release()

The holder refreshes the file's heartbeat from a background thread. A lock is
stale, and is taken over with a warning, when its heartbeat is older than
`stale_after` seconds (a holder on any host that died without releasing), or
when its holder ran on this host and its process is gone (kill -9, a crash).
A PID alone proves nothing (a restarted container repeats PIDs, PID 1 too):
the lock records its process's start time, and a live PID whose start time
differs, this run's own included, is another process.
On local disks the file is created exclusively; object stores have no
exclusive create, so the new holder writes its token, waits and reads the file
back: of two runs that race, only the last writer keeps the lock.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pathlib
import socket
import threading
import time
import uuid
from typing import Any, Iterable

from etils import epath

from bert_jax import paths

log = logging.getLogger(__name__)

LOCK_FILE = "workdir.lock"
# Keys whose change between runs of one workdir keeps the experiment the same (its length, logging, eval and
# checkpoint cadence, the mesh it runs on, how the host builds the same batches, float8 matmuls on float32
# parameters); any other key must match the checkpoints' config.
RESUME_SAFE_KEYS = ("train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
                    "train.eval_batch_size", "train.checkpoint_every", "train.keep_checkpoints",
                    "train.async_checkpoint", "train.fill_mask", "train.report_baseline", "train.log_param_norms",
                    "train.restart_if_unreadable", "train.steps_per_call", "mesh.", "data.prefetch",
                    "data.workers", "model.fp8")


class WorkdirBusyError(ValueError):
  """Another live run holds the workdir."""


class ConfigMismatchError(ValueError):
  """The config differs from the one the workdir's checkpoints were trained with."""


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # Alive, owned by another user.
    return True
  return True


def _process_start(pid: int) -> str | None:
  """When process `pid` started, as "BOOT_ID:TICKS" (Linux /proc, field 22 of its stat); None where unknown."""
  try:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}:{int(stat.rpartition(')')[2].split()[19])}"  # The name in (...) may hold spaces.
  except (OSError, IndexError, ValueError):
    return None


def _now() -> float:
  return time.time()


def _when(timestamp: float) -> str:
  return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class WorkdirLock:
  """The lock file of one workdir, held by this process until `release`."""

  def __init__(self, path: epath.Path, record: dict[str, Any], heartbeat: float):
    self.path = path
    self.record = record
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, args=(heartbeat,), daemon=True, name="workdir-lock")
    self._thread.start()

  @classmethod
  def acquire(cls, workdir: str | os.PathLike, *, stale_after: float = 180.0, heartbeat: float = 30.0,
              settle: float | None = None) -> "WorkdirLock":
    """Takes the workdir's lock, or raises WorkdirBusyError naming its live holder (host, pid, start time)."""
    workdir = epath.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / LOCK_FILE
    now = _now()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
              "started": now, "heartbeat": now, "token": uuid.uuid4().hex}
    holder = _read(path)
    if holder is not None:
      reason = _stale_reason(holder, stale_after)
      if reason is None:
        raise WorkdirBusyError(_busy_message(workdir, holder))
      log.warning("taking over the lock of %s: %s", workdir, reason)
      _remove(path)
    if not paths.is_remote(path):
      try:
        fd = os.open(os.fspath(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:  # Another run created it between our read and now.
        raise WorkdirBusyError(_busy_message(workdir, _read(path) or {})) from None
      with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    else:
      path.write_text(json.dumps(record))
      time.sleep(2.0 if settle is None else settle)
      current = _read(path)
      if not current or current.get("token") != record["token"]:
        raise WorkdirBusyError(_busy_message(workdir, current or {}))
    return cls(path, record, heartbeat)

  def _beat(self, interval: float) -> None:
    while not self._stop.wait(interval):
      try:
        current = _read(self.path)
        if current is None or current.get("token") != self.record["token"]:
          log.error("the lock of %s was taken by another run (%s); this run no longer holds it",
                    self.path.parent, _describe(current or {}))
          return
        self.record["heartbeat"] = _now()
        self.path.write_text(json.dumps(self.record))
      except OSError as error:  # A storage hiccup must not kill the run; the next beat retries.
        log.warning("cannot refresh the lock %s: %s", self.path, error)

  def release(self) -> None:
    self._stop.set()
    self._thread.join(timeout=5)
    current = _read(self.path)
    if current is not None and current.get("token") == self.record["token"]:
      _remove(self.path)

  def __enter__(self) -> "WorkdirLock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _read(path: epath.Path) -> dict[str, Any] | None:
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    return None
  except (ValueError, OSError):  # A lock half-written by a killed run: treat it as stale.
    return {}


def _remove(path: epath.Path) -> None:
  try:
    path.unlink()
  except FileNotFoundError:
    pass


def _stale_reason(holder: dict[str, Any], stale_after: float) -> str | None:
  """Why the lock `holder` is stale, or None when its run may be alive."""
  try:
    pid, heartbeat = int(holder["pid"]), float(holder["heartbeat"])
  except (KeyError, TypeError, ValueError):
    pid, heartbeat = 0, 0.0
  if not holder.get("token") or pid <= 0:  # os.kill(0 or -1) would probe whole process groups.
    return "the lock file is unreadable (left by a run killed while writing it)"
  age = _now() - heartbeat
  if age > stale_after:  # A live holder refreshes it every `heartbeat` seconds, on any host.
    return f"its holder ({_describe(holder)}) has not been heard from for {age:.0f} s"
  if holder.get("host") != socket.gethostname():
    return None
  recorded = holder.get("pid_start")
  current = _process_start(pid)
  if pid == os.getpid():
    if recorded is not None and current is not None and recorded != current:
      return f"its holder ({_describe(holder)}) is gone: pid {pid} is now this run's"
    return None
  if not _process_alive(pid):
    return f"its holder ({_describe(holder)}) is no longer running"
  if recorded is not None and current is not None and recorded != current:
    return f"its holder ({_describe(holder)}) is gone: pid {pid} now belongs to another process"
  return None


def _describe(holder: dict[str, Any]) -> str:
  try:
    started = _when(float(holder["started"]))
  except (KeyError, TypeError, ValueError, OverflowError, OSError):
    started = "?"
  return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {started}"


def _busy_message(workdir: epath.Path, holder: dict[str, Any]) -> str:
  return (f"{workdir} is in use by another run ({_describe(holder)}); wait for it to finish or use another "
          f"--workdir. If that run is gone, delete {workdir / LOCK_FILE}.")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """{"a": {"b": 1}} -> {"a.b": 1}; tuples and lists compare as lists (JSON round trips)."""
  flat = {}
  for key, value in tree.items():
    name = f"{prefix}{key}"
    if isinstance(value, dict):
      flat.update(flatten(value, name + "."))
    else:
      flat[name] = list(value) if isinstance(value, tuple) else value
  return flat


def config_changes(saved: dict[str, Any], current: dict[str, Any], safe: Iterable[str] = RESUME_SAFE_KEYS,
                   defaults: dict[str, Any] | None = None) -> list[tuple[str, Any, Any]]:
  """(key, saved value, current value) of every key that differs and is not resume-safe. A key the saved config
  lacks (added to the code since) counts only when its current value is not its default in `defaults`."""
  old, new = flatten(saved), flatten(json.loads(json.dumps(current, default=str)))
  default = flatten(json.loads(json.dumps(defaults or {}, default=str)))
  safe = tuple(safe)
  changed = []
  for key in sorted(set(old) | set(new)):
    if any(key == s or (s.endswith(".") and key.startswith(s)) for s in safe):
      continue
    if key not in old and key in default and new.get(key) == default[key]:
      continue
    if old.get(key, "<absent>") != new.get(key, "<absent>"):
      changed.append((key, old.get(key, "<absent>"), new.get(key, "<absent>")))
  return changed


def check_resume_config(workdir: str | os.PathLike, current: dict[str, Any],
                        defaults: dict[str, Any] | None = None, safe: Iterable[str] = RESUME_SAFE_KEYS) -> None:
  """Raises ConfigMismatchError when `current` is not the experiment the workdir's `config.json` records
  (`defaults`: the config defaults, for keys newer than the workdir; `safe`: keys free to change; see
  `config_changes`)."""
  path = epath.Path(workdir) / "config.json"
  if not path.exists():
    return
  changes = config_changes(json.loads(path.read_text()), current, safe=safe, defaults=defaults)
  if not changes:
    return
  listed = "; ".join(f"{key}: {old!r} in the workdir, {new!r} now" for key, old, new in changes[:8])
  more = f" (and {len(changes) - 8} more)" if len(changes) > 8 else ""
  restore = " ".join(f"--config.{key}={old}" for key, old, _ in changes[:8] if old != "<absent>")
  raise ConfigMismatchError(
      f"{workdir} holds a run of another config: {listed}{more}. Go on with the workdir's config "
      f"({restore}) or start the changed experiment in a new --workdir; nothing was changed in {workdir}.")


def drop_rows_after(path: str | os.PathLike, step: int) -> int:
  """Removes the rows of `path` (metrics JSON lines) logged after `step`: a resumed run logs them again.

  Returns the number of rows removed. The file is rewritten only when there is one to remove.
  """
  path = epath.Path(path)
  if not path.exists():
    return 0
  lines = path.read_text().splitlines(keepends=True)
  kept = []
  for line in lines:
    try:
      row_step = json.loads(line).get("step")
    except ValueError:  # A line cut by a kill: the resumed run rewrites its step.
      continue
    if row_step is None or row_step <= step:
      kept.append(line)
  removed = len(lines) - len(kept)
  if removed:
    paths.write_text(path, "".join(kept))
  return removed
