"""Multi-process start-up: decide whether and how to call `jax.distributed.initialize`.

Every entry point calls `initialize()` before any other JAX call. It looks at
the environment, in this order, and takes the first rule that applies:

1. `BERT_JAX_DISTRIBUTED=off`: single process, no call (escape hatch, e.g. a
   debugging run inside a multi-task SLURM allocation).
   `BERT_JAX_DISTRIBUTED=auto` (the default) goes on to the rules below;
   `BERT_JAX_DISTRIBUTED=jax` calls `jax.distributed.initialize()` with no
   arguments and lets JAX's own cluster detection decide (Open MPI, mpi4py,
   Kubernetes, ...).
2. Explicit: any of `BERT_JAX_COORDINATOR` (`host:port` of process 0),
   `BERT_JAX_NUM_PROCESSES`, `BERT_JAX_PROCESS_ID`,
   `BERT_JAX_LOCAL_DEVICE_IDS` (optional, comma-separated, e.g. `0,1`) is set.
   The first three must then all be set; JAX's cluster auto-detection is
   switched off so nothing is silently filled in from SLURM or TPU metadata.
3. SLURM: `SLURM_JOB_ID` is set and the job step has more than one task
   (`SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS`). JAX's SLURM detection
   derives the coordinator (first node of the step, a port from the job id),
   the process count and id, and on GPU one device per task. It needs the
   variables `srun` sets; without them (python started directly in a
   multi-task allocation) this is an error, not a silent single-process run.
4. Cloud TPU with several workers (a pod slice): the worker list from
   `TPU_WORKER_HOSTNAMES` / `TPU_PROCESS_ADDRESSES`, `MEGASCALE_NUM_SLICES`
   > 1, or, on a TPU VM, the `worker-network-endpoints` metadata entry.
   `jax.distributed.initialize()` is called with no arguments: JAX reads the
   same metadata. On a TPU VM whose worker count cannot be read, JAX decides.
5. Otherwise: single process, no call.

`initialize()` is idempotent and logs what it decided.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import glob
import logging
import os
import sys
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

_T = TypeVar("_T")

ENV_MODE = "BERT_JAX_DISTRIBUTED"
ENV_COORDINATOR = "BERT_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "BERT_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "BERT_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "BERT_JAX_LOCAL_DEVICE_IDS"
EXPLICIT_VARS = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICE_IDS)
_REQUIRED_EXPLICIT_VARS = EXPLICIT_VARS[:3]

_TPU_METADATA_URL = "http://{host}/computeMetadata/v1/instance/attributes/{key}"
_TPU_METADATA_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `initialize()` will do.

  Attributes:
    method: 'single' (no call), 'explicit', 'slurm', 'tpu' or 'jax' (JAX's own
      detection).
    kwargs: keyword arguments for `jax.distributed.initialize`; None for
      'single'.
    reason: one line for the log saying why.
  """
  method: str
  kwargs: dict[str, Any] | None
  reason: str


_plan_taken: Plan | None = None


def _parse_int(environ: Mapping[str, str], name: str) -> int:
  value = environ[name]
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name}={value!r} is not an integer.") from None


def _explicit_plan(environ: Mapping[str, str]) -> Plan:
  """Plan from the BERT_JAX_* variables; raises when they are half-set or invalid."""
  missing = [name for name in _REQUIRED_EXPLICIT_VARS if not environ.get(name)]
  if missing:
    present = [name for name in EXPLICIT_VARS if environ.get(name)]
    raise ValueError(
        f"Explicit multi-process set-up is half-set: {', '.join(present)} "
        f"{'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} missing. Set all of "
        f"{', '.join(_REQUIRED_EXPLICIT_VARS)} (and optionally "
        f"{ENV_LOCAL_DEVICE_IDS}), or none of them.")
  coordinator = environ[ENV_COORDINATOR]
  host, _, port = coordinator.rpartition(":")
  if not host or not port.isdigit():
    raise ValueError(f"{ENV_COORDINATOR}={coordinator!r} must be host:port.")
  num_processes = _parse_int(environ, ENV_NUM_PROCESSES)
  process_id = _parse_int(environ, ENV_PROCESS_ID)
  if num_processes < 1 or not 0 <= process_id < num_processes:
    raise ValueError(
        f"Need {ENV_NUM_PROCESSES} >= 1 and 0 <= {ENV_PROCESS_ID} < "
        f"{ENV_NUM_PROCESSES}; got {num_processes} and {process_id}.")
  kwargs: dict[str, Any] = dict(
      coordinator_address=coordinator, num_processes=num_processes,
      process_id=process_id, cluster_detection_method="deactivate")
  if environ.get(ENV_LOCAL_DEVICE_IDS):
    try:
      kwargs["local_device_ids"] = [
          int(i) for i in environ[ENV_LOCAL_DEVICE_IDS].split(",")]
    except ValueError:
      raise ValueError(
          f"{ENV_LOCAL_DEVICE_IDS}={environ[ENV_LOCAL_DEVICE_IDS]!r} must be "
          "comma-separated integers such as 0,1.") from None
  return Plan("explicit", kwargs,
              f"{ENV_COORDINATOR}={coordinator}, process {process_id} of {num_processes}")


def _slurm_plan(environ: Mapping[str, str]) -> Plan | None:
  """Plan for a multi-task SLURM step, None when not in one."""
  if "SLURM_JOB_ID" not in environ:
    return None
  tasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
  if tasks_var not in environ or _parse_int(environ, tasks_var) <= 1:
    return None
  needed = ("SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
  missing = [name for name in needed if name not in environ]
  if missing:
    raise RuntimeError(
        f"SLURM job {environ['SLURM_JOB_ID']} has {tasks_var}="
        f"{environ[tasks_var]} but {', '.join(missing)} is not set: start one "
        f"process per task with srun (see launch/gpu/slurm.sbatch), or set "
        f"{ENV_MODE}=off for a single-process run.")
  return Plan(
      "slurm", dict(cluster_detection_method="slurm"),
      f"SLURM job {environ['SLURM_JOB_ID']}, task {environ['SLURM_PROCID']} "
      f"of {environ[tasks_var]}")


def _on_tpu_vm() -> bool:
  """True on a Cloud TPU VM (TPU device files present)."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _tpu_metadata(environ: Mapping[str, str], key: str) -> str:
  host = environ.get("GCE_METADATA_IP", "metadata.google.internal")
  request = urllib.request.Request(
      _TPU_METADATA_URL.format(host=host, key=key),
      headers={"Metadata-Flavor": "Google"})
  with urllib.request.urlopen(request, timeout=_TPU_METADATA_TIMEOUT_S) as response:
    return response.read().decode()


def _tpu_plan(environ: Mapping[str, str],
              on_tpu_vm: Callable[[], bool] = _on_tpu_vm) -> Plan | None:
  """Plan for a multi-worker Cloud TPU slice, None when not on one."""
  hostnames = environ.get("TPU_PROCESS_ADDRESSES") or environ.get("TPU_WORKER_HOSTNAMES")
  num_slices = int(environ.get("MEGASCALE_NUM_SLICES") or 1)
  if hostnames is not None or num_slices > 1:
    num_workers = len(hostnames.split(",")) if hostnames else 1
    if num_workers * num_slices <= 1:
      return None
    return Plan("tpu", {}, f"Cloud TPU, {num_workers} worker(s) x {num_slices} slice(s) "
                           "from the environment")
  if not on_tpu_vm():
    return None
  try:
    endpoints = _tpu_metadata(environ, "worker-network-endpoints")
  except (OSError, urllib.error.URLError) as error:
    return Plan("tpu", {}, f"Cloud TPU VM whose worker list could not be read "
                           f"({error}); JAX's TPU detection decides")
  num_workers = len([e for e in endpoints.split(",") if e.strip()])
  if num_workers <= 1:
    return None
  return Plan("tpu", {}, f"Cloud TPU VM, {num_workers} workers from metadata")


def plan(environ: Mapping[str, str] | None = None,
         on_tpu_vm: Callable[[], bool] | None = None) -> Plan:
  """Decides how to start from the environment, without calling JAX.

  Args:
    environ: the environment; `os.environ` when None.
    on_tpu_vm: says whether this is a Cloud TPU VM; checks the TPU device
      files when None.

  Returns:
    The plan; see the module docstring for the rules.

  Raises:
    ValueError: explicit variables half-set or invalid, or an unknown
      BERT_JAX_DISTRIBUTED value.
    RuntimeError: a multi-task SLURM job not started through srun.
  """
  environ = os.environ if environ is None else environ
  on_tpu_vm = on_tpu_vm or _on_tpu_vm
  mode = environ.get(ENV_MODE, "auto").strip().lower() or "auto"
  if mode not in ("auto", "off", "jax"):
    raise ValueError(f"{ENV_MODE}={environ[ENV_MODE]!r}; expected auto, off or jax.")
  if mode == "off":
    return Plan("single", None, f"{ENV_MODE}=off")
  if mode == "jax":
    return Plan("jax", {}, f"{ENV_MODE}=jax: JAX's cluster detection")
  if any(environ.get(name) for name in EXPLICIT_VARS):
    return _explicit_plan(environ)
  for detect in (_slurm_plan, functools.partial(_tpu_plan, on_tpu_vm=on_tpu_vm)):
    found = detect(environ)
    if found is not None:
      return found
  return Plan("single", None, "no multi-process environment found")


def initialize() -> None:
  """Starts JAX's distributed runtime when the environment asks for it.

  Call it first, before anything touches JAX devices. A second call does
  nothing. See the module docstring for the rules.

  Raises:
    ValueError, RuntimeError: see `plan`; RuntimeError also when a
      multi-process start is needed but JAX's backend is already in use.
  """
  global _plan_taken
  if _plan_taken is not None:
    logging.debug("distributed.initialize: already done (%s)", _plan_taken.method)
    return
  if jax.distributed.is_initialized():
    _plan_taken = Plan("external", None, "jax.distributed was initialized by the caller")
    logging.info("distributed.initialize: %s", _plan_taken.reason)
    return
  decided = plan()
  if decided.kwargs is None:
    logging.info("distributed.initialize: single process (%s)", decided.reason)
  else:
    logging.info("distributed.initialize: %s (%s); calling jax.distributed.initialize(%s)",
                 decided.method, decided.reason,
                 ", ".join(f"{k}={v!r}" for k, v in decided.kwargs.items()))
    jax.distributed.initialize(**decided.kwargs)
    logging.info("distributed.initialize: process %d of %d, %d local / %d global devices",
                 jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count())
    atexit.register(_shutdown_at_exit)
  _plan_taken = decided


def _shutdown_at_exit() -> None:
  """At a normal exit, every process enters JAX's shutdown barrier (`jax.distributed.shutdown`).

  Otherwise process 0, which hosts the coordination service, can reach the
  end of its interpreter after a peer has already gone and wait out the
  heartbeat timeout (seen: a finished process 0 hanging at exit), or leave
  while its peers still tear down. After an uncaught exception the barrier is
  skipped: the peers are still running, and the failed process should exit
  at once so that the launcher sees the failure.
  """
  if getattr(sys, "last_value", None) is not None:
    return
  jax.distributed.shutdown()


def is_primary() -> bool:
  """True on process 0, the one that writes logs, plots and other side effects."""
  return jax.process_index() == 0


def primary_only(fn: Callable[..., _T]) -> Callable[..., _T | None]:
  """Decorator: run `fn` on process 0 only; elsewhere return None.

  For side effects that must happen once (writing a config copy, a plot, a
  metrics line). Not for anything that takes part in collectives: every
  process must enter those.
  """
  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return fn(*args, **kwargs) if is_primary() else None
  return wrapper


def sync_global_devices(name: str) -> None:
  """Barrier across all processes (no-op with one process).

  Every device contributes a hash of `name` to one all-gather over all
  devices, and the call returns once every local device's copy of the result
  is ready. `jax.experimental.multihost_utils.sync_global_devices` is not
  used: it gathers over processes once per local-device index and waits only
  for the first local device's gather. The others could still be running when
  the caller went on and, at the end of a program, exited; a peer then
  waited forever at exit for gloo to connect to a process that was gone (seen
  on CPU: process 0 hanging in the CPU client's destructor).

  Args:
    name: identifies the barrier; all processes must use the same name at the
      same point, which catches processes that went down different paths.

  Raises:
    RuntimeError: when some process arrived with a different name.
  """
  if jax.process_count() == 1:
    return
  tag = np.array([zlib.crc32(name.encode())], np.uint32)
  mesh = Mesh(np.array(jax.devices()), ("devices",))
  tags = jax.make_array_from_single_device_arrays(
      (jax.device_count(),), NamedSharding(mesh, PartitionSpec("devices")),
      [jax.device_put(tag, d) for d in jax.local_devices()])
  gathered = _replicate(tags, NamedSharding(mesh, PartitionSpec()))
  gathered.block_until_ready()  # every local copy, not only the first
  seen = np.asarray(gathered.addressable_data(0))
  if (seen != tag).any():
    others = sorted({d.process_index for d, t in zip(mesh.devices, seen) if t != tag[0]})
    raise RuntimeError(
        f"sync_global_devices({name!r}): processes {others} reached a barrier with "
        f"a different name at the same point; the processes have gone down "
        f"different paths")


@functools.partial(jax.jit, static_argnums=1)
def _replicate(x: jax.Array, sharding: Any) -> jax.Array:
  return jax.lax.with_sharding_constraint(x, sharding)
