"""Run N real JAX processes on this machine, joined through BERT_JAX_* variables.

Each process is a fresh Python with `JAX_PLATFORMS=cpu` and
`--xla_force_host_platform_device_count=<local_devices>` (any inherited
device-count flag is removed), started with the explicit environment contract
of `bert_jax.parallel.distributed.initialize()`: a coordinator on localhost
with a free port, the process count and this process's id. They all run the
same command; a process finds its id in `BERT_JAX_PROCESS_ID`.

    results = run_processes([sys.executable, "-c", CODE], num_processes=2)
    assert all(r.json()["ok"] for r in results)

A child reports back by printing one line `RESULT <json>` (see
`ProcessResult.json`). If any process fails, the others are killed (they
would otherwise wait for it up to the coordinator timeout) and
`MultiprocessError` carries every process's output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULT_PREFIX = "RESULT "
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
# Cheaper CPU code generation: no fusion emitters and one code-generation thread (the
# suite's workers already take every core) halve a tiny model's compile times and run
# its programs as fast, at any optimisation level.
CHEAP_CODEGEN_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
# With the lowest optimisation level a tiny training step compiles in about a third
# of the time. Numerics change slightly, so every run that a test compares needs the
# same flags: conftest.py sets them for the whole suite (processes inherit them).
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                      *CHEAP_CODEGEN_FLAGS)


def free_port() -> int:
  """A TCP port on localhost that was free a moment ago."""
  try:
    import portpicker  # pylint: disable=g-import-not-at-top
    return portpicker.pick_unused_port()
  except ImportError:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
      sock.bind(("localhost", 0))
      return sock.getsockname()[1]


def process_env(process_id: int, num_processes: int, port: int,
                local_devices: int = 2,
                extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
  """Environment of one child process.

  Args:
    process_id: this process's id, 0..num_processes-1.
    num_processes: how many processes take part.
    port: coordinator port on localhost.
    local_devices: fake CPU devices per process.
    extra_env: added last (may override anything above).

  Returns:
    A copy of os.environ with the BERT_JAX_* variables, JAX_PLATFORMS=cpu and
    XLA_FLAGS set, and the repository on PYTHONPATH.
  """
  env = dict(os.environ)
  for name in ("BERT_JAX_DISTRIBUTED", "BERT_JAX_LOCAL_DEVICE_IDS"):
    env.pop(name, None)
  flags = _DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
  flags.append(f"--xla_force_host_platform_device_count={local_devices}")
  env.update(
      XLA_FLAGS=" ".join(flags),
      JAX_PLATFORMS="cpu",
      BERT_JAX_COORDINATOR=f"localhost:{port}",
      BERT_JAX_NUM_PROCESSES=str(num_processes),
      BERT_JAX_PROCESS_ID=str(process_id),
      PYTHONPATH=os.pathsep.join(
          p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p),
  )
  env.update(extra_env or {})
  return env


@dataclasses.dataclass
class ProcessResult:
  """Outcome of one child process."""
  process_id: int
  returncode: int | None  # None: killed because another process failed or time ran out.
  stdout: str
  stderr: str

  def json(self) -> Any:
    """The payload of the last `RESULT <json>` line on stdout."""
    lines = [line for line in self.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
      raise ValueError(f"process {self.process_id} printed no {RESULT_PREFIX!r} line:\n"
                       f"{self.stdout}\n{self.stderr}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


class MultiprocessError(RuntimeError):
  """A child failed or timed out; the message holds every child's output."""

  def __init__(self, message: str, results: list[ProcessResult]):
    details = "\n".join(
        f"--- process {r.process_id}: returncode {r.returncode}\n"
        f"[stdout]\n{r.stdout[-4000:]}\n[stderr]\n{r.stderr[-4000:]}"
        for r in results)
    super().__init__(f"{message}\n{details}")
    self.results = results


def run_processes(command: Sequence[str], num_processes: int, *,
                  local_devices: int = 2, timeout_s: float = 120.0,
                  extra_env: Mapping[str, str] | None = None,
                  cwd: str | os.PathLike[str] | None = None,
                  check: bool = True) -> list[ProcessResult]:
  """Starts `command` in `num_processes` processes joined as one JAX job.

  Args:
    command: argv run by every process (e.g. `[sys.executable, "-c", code]`
      or `[sys.executable, "-m", "bert_jax.cli", "pretrain", ...]`).
    num_processes: how many processes.
    local_devices: fake CPU devices per process.
    timeout_s: wall-clock limit for the whole group.
    extra_env: extra variables for every process.
    cwd: working directory (the repository root when None).
    check: raise MultiprocessError unless every process exits with 0.

  Returns:
    One ProcessResult per process, ordered by process id.
  """
  port = free_port()
  # Output goes to temporary files, not pipes, so a chatty child never blocks.
  outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
             for _ in range(num_processes)]
  procs = []
  for process_id, (stdout, stderr) in enumerate(outputs):
    procs.append(subprocess.Popen(
        list(command), cwd=cwd or REPO_ROOT, stdout=stdout, stderr=stderr,
        env=process_env(process_id, num_processes, port, local_devices, extra_env)))
  deadline = time.monotonic() + timeout_s
  failure = None
  while failure is None and any(p.poll() is None for p in procs):
    if any(p.poll() not in (None, 0) for p in procs):
      failure = "a process failed; the others were stopped"
    elif time.monotonic() > deadline:
      failure = f"timed out after {timeout_s:.0f} s"
    else:
      time.sleep(0.1)
  results = []
  for process_id, (proc, files) in enumerate(zip(procs, outputs)):
    killed = proc.poll() is None
    if killed:
      proc.kill()
    proc.wait()
    texts = []
    for file in files:
      file.seek(0)
      texts.append(file.read())
      file.close()
    results.append(ProcessResult(process_id, None if killed else proc.returncode, *texts))
  if failure is None and any(r.returncode != 0 for r in results):
    failure = "a process failed"
  if check and failure is not None:
    raise MultiprocessError(failure, results)
  return results
