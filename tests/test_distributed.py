"""Multi-process start-up: real processes on localhost, and the detection rules."""

import sys
import textwrap

import pytest

from bert_jax.parallel import distributed
import multiprocess_util

# Each process contributes rows filled with (process_id + 1) * 10 + row, so the
# global sum checks that every process's own rows landed in the global array.
_GLOBAL_SUM_CHILD = textwrap.dedent("""
    import json, logging
    logging.basicConfig(level=logging.INFO)
    from bert_jax.parallel import distributed
    distributed.initialize()
    distributed.initialize()  # idempotent
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    rows_per_process, width = 2 * jax.local_device_count(), 4
    pid = jax.process_index()
    local = np.stack([np.full((width,), (pid + 1) * 10 + r, np.float32)
                      for r in range(rows_per_process)])
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    global_rows = local.shape[0] * jax.process_count()
    batch = jax.make_array_from_process_local_data(
        sharding, local, (global_rows, width))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(batch)
    row_sums = jax.jit(lambda x: x.sum(axis=1),
                       out_shardings=NamedSharding(mesh, P()))(batch)
    distributed.sync_global_devices("end")
    print("RESULT " + json.dumps(dict(
        process_index=pid, process_count=jax.process_count(),
        device_count=jax.device_count(),
        local_device_count=jax.local_device_count(),
        global_shape=list(batch.shape), total=float(total),
        row_sums=np.asarray(row_sums).tolist(),
        is_primary=distributed.is_primary(),
        primary_only=distributed.primary_only(lambda: "wrote")())))
""")


def _expected_row_sums(num_processes, local_devices, width=4):
  return [((p + 1) * 10 + r) * width
          for p in range(num_processes) for r in range(2 * local_devices)]


@pytest.mark.parametrize("num_processes", [2, 4])
@pytest.mark.slow
def test_processes_join_and_sum_a_global_array(num_processes):
  local_devices = 2
  results = multiprocess_util.run_processes(
      [sys.executable, "-c", _GLOBAL_SUM_CHILD], num_processes,
      local_devices=local_devices, timeout_s=90)
  expected_row_sums = _expected_row_sums(num_processes, local_devices)
  for result in results:
    out = result.json()
    assert out["process_index"] == result.process_id
    assert out["process_count"] == num_processes
    assert out["device_count"] == num_processes * local_devices
    assert out["local_device_count"] == local_devices
    assert out["global_shape"] == [len(expected_row_sums), 4]
    assert out["total"] == sum(expected_row_sums)
    # Rows are laid out process by process, in process order.
    assert out["row_sums"] == expected_row_sums
    assert out["is_primary"] == (result.process_id == 0)
    assert out["primary_only"] == ("wrote" if result.process_id == 0 else None)
    assert "explicit" in result.stderr  # initialize() logged its decision


@pytest.mark.slow
def test_barrier_names_that_differ_between_processes_raise():
  # Each process catches the error and reports it, so neither is stopped
  # early by the other's failure.
  child = textwrap.dedent("""
      import json, os
      from bert_jax.parallel import distributed
      distributed.initialize()
      distributed.sync_global_devices("same")
      try:
        distributed.sync_global_devices("b" if os.environ["BERT_JAX_PROCESS_ID"] == "1" else "a")
        error = None
      except RuntimeError as e:
        error = str(e)
      print("RESULT " + json.dumps(error))
  """)
  results = multiprocess_util.run_processes([sys.executable, "-c", child], 2, timeout_s=90)
  assert results[0].json().startswith("sync_global_devices('a'): processes [1] reached")
  assert results[1].json().startswith("sync_global_devices('b'): processes [0] reached")


def test_a_failing_process_stops_the_group_with_every_output():
  child = ("import os, sys\n"
           "if os.environ['BERT_JAX_PROCESS_ID'] == '1': sys.exit('boom')\n"
           "import time; time.sleep(60)")
  with pytest.raises(multiprocess_util.MultiprocessError, match="boom"):
    multiprocess_util.run_processes([sys.executable, "-c", child], 2, timeout_s=30)


def test_process_env_replaces_inherited_device_count(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --foo")
  env = multiprocess_util.process_env(1, 2, 1234, local_devices=3)
  assert env["XLA_FLAGS"].split() == ["--foo", "--xla_force_host_platform_device_count=3"]
  assert env["BERT_JAX_COORDINATOR"] == "localhost:1234"
  assert (env["BERT_JAX_NUM_PROCESSES"], env["BERT_JAX_PROCESS_ID"]) == ("2", "1")
  assert env["JAX_PLATFORMS"] == "cpu"


# Detection rules, on fake environments (no JAX calls).

_EXPLICIT = dict(BERT_JAX_COORDINATOR="10.0.0.1:1234", BERT_JAX_NUM_PROCESSES="4",
                 BERT_JAX_PROCESS_ID="2")


def _plan(**environ):
  return distributed.plan(environ, on_tpu_vm=lambda: False)


def test_nothing_set_is_single_process():
  assert _plan().method == "single"
  assert _plan().kwargs is None


def test_explicit_variables_become_the_initialize_arguments():
  plan = _plan(**_EXPLICIT, BERT_JAX_LOCAL_DEVICE_IDS="0,1")
  assert plan.method == "explicit"
  assert plan.kwargs == dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                             process_id=2, local_device_ids=[0, 1],
                             cluster_detection_method="deactivate")


def test_explicit_variables_win_over_slurm():
  plan = _plan(**_EXPLICIT, SLURM_JOB_ID="7", SLURM_NTASKS="8")
  assert plan.method == "explicit"


@pytest.mark.parametrize("drop", ["BERT_JAX_COORDINATOR", "BERT_JAX_NUM_PROCESSES",
                                  "BERT_JAX_PROCESS_ID"])
def test_half_set_explicit_variables_raise_naming_the_missing_one(drop):
  environ = {k: v for k, v in _EXPLICIT.items() if k != drop}
  with pytest.raises(ValueError, match=f"half-set.*{drop} is missing"):
    _plan(**environ)


def test_only_local_device_ids_is_half_set():
  with pytest.raises(ValueError, match="half-set"):
    _plan(BERT_JAX_LOCAL_DEVICE_IDS="0")


@pytest.mark.parametrize("change, message", [
    (dict(BERT_JAX_COORDINATOR="10.0.0.1"), "host:port"),
    (dict(BERT_JAX_NUM_PROCESSES="four"), "not an integer"),
    (dict(BERT_JAX_PROCESS_ID="4"), "0 <= BERT_JAX_PROCESS_ID"),
    (dict(BERT_JAX_LOCAL_DEVICE_IDS="0;1"), "comma-separated"),
    (dict(BERT_JAX_DISTRIBUTED="maybe"), "auto, off or jax"),
])
def test_invalid_explicit_values_raise(change, message):
  with pytest.raises(ValueError, match=message):
    _plan(**{**_EXPLICIT, **change})


def test_off_wins_over_everything():
  assert _plan(**_EXPLICIT, BERT_JAX_DISTRIBUTED="off").method == "single"


def test_jax_mode_defers_to_jax_detection():
  plan = _plan(BERT_JAX_DISTRIBUTED="jax")
  assert (plan.method, plan.kwargs) == ("jax", {})


_SRUN = dict(SLURM_JOB_ID="7", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8",
             SLURM_STEP_NODELIST="gpu[001-002]", SLURM_PROCID="3", SLURM_LOCALID="3")


def test_slurm_step_with_several_tasks_uses_jax_slurm_detection():
  plan = _plan(**_SRUN)
  assert (plan.method, plan.kwargs) == ("slurm", dict(cluster_detection_method="slurm"))


def test_single_task_slurm_job_is_single_process():
  assert _plan(**{**_SRUN, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"}).method == "single"


def test_multi_task_slurm_job_without_srun_raises():
  with pytest.raises(RuntimeError, match="srun"):
    _plan(SLURM_JOB_ID="7", SLURM_NTASKS="8")


@pytest.mark.parametrize("environ, method", [
    (dict(TPU_WORKER_HOSTNAMES="w0,w1,w2,w3"), "tpu"),
    (dict(TPU_WORKER_HOSTNAMES="w0"), "single"),
    (dict(TPU_WORKER_HOSTNAMES="w0", MEGASCALE_NUM_SLICES="2"), "tpu"),
])
def test_tpu_worker_environment(environ, method):
  plan = _plan(**environ)
  assert plan.method == method
  if method == "tpu":
    assert plan.kwargs == {}  # JAX's TPU detection fills everything in


def test_tpu_vm_with_unreadable_metadata_defers_to_jax():
  plan = distributed.plan({"GCE_METADATA_IP": "127.0.0.1:9"}, on_tpu_vm=lambda: True)
  assert plan.method == "tpu"
  assert "could not be read" in plan.reason


def test_initialize_without_environment_is_a_logged_noop(monkeypatch, caplog):
  for name in distributed.EXPLICIT_VARS + (distributed.ENV_MODE, "SLURM_JOB_ID",
                                          "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(distributed, "_plan_taken", None)
  monkeypatch.setattr(distributed, "_on_tpu_vm", lambda: False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda **kw: pytest.fail("must not be called"))
  with caplog.at_level("INFO"):
    distributed.initialize()
    distributed.initialize()
  assert "single process" in caplog.text
  assert distributed.is_primary()
  assert distributed.primary_only(lambda x: x + 1)(1) == 2
  distributed.sync_global_devices("noop")


def test_initialize_raises_on_half_set_variables(monkeypatch):
  monkeypatch.setattr(distributed, "_plan_taken", None)
  monkeypatch.delenv(distributed.ENV_MODE, raising=False)
  monkeypatch.setenv("BERT_JAX_COORDINATOR", "localhost:1234")
  monkeypatch.delenv("BERT_JAX_NUM_PROCESSES", raising=False)
  monkeypatch.delenv("BERT_JAX_PROCESS_ID", raising=False)
  with pytest.raises(ValueError, match="BERT_JAX_NUM_PROCESSES, BERT_JAX_PROCESS_ID are missing"):
    distributed.initialize()
