"""The workdir lock, the resume-config check and the de-duplication of resumed metrics rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from bert_jax.train import workdir as workdir_lib


def _holder_process(workdir) -> subprocess.Popen:
  """A process that takes the lock of `workdir`, says so, and sleeps."""
  code = textwrap.dedent(f"""
      import sys, time
      from bert_jax.train.workdir import WorkdirLock
      lock = WorkdirLock.acquire({str(workdir)!r}, heartbeat=0.2)
      print("locked", flush=True)
      time.sleep(60)
  """)
  process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  assert process.stdout.readline().strip() == "locked"
  return process


def test_second_run_refuses_naming_the_holder(tmp_path):
  holder = _holder_process(tmp_path)
  try:
    with pytest.raises(workdir_lib.WorkdirBusyError, match=rf"pid {holder.pid}, started .* UTC"):
      workdir_lib.WorkdirLock.acquire(tmp_path)
  finally:
    holder.kill()
    holder.wait()


def test_lock_of_a_killed_run_does_not_block(tmp_path, caplog):
  holder = _holder_process(tmp_path)
  holder.send_signal(signal.SIGKILL)
  holder.wait()
  assert (tmp_path / workdir_lib.LOCK_FILE).exists()
  with workdir_lib.WorkdirLock.acquire(tmp_path) as lock:
    assert json.loads((tmp_path / workdir_lib.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert lock.record["pid"] == os.getpid()
  assert "no longer running" in caplog.text
  assert not (tmp_path / workdir_lib.LOCK_FILE).exists()


def test_remote_holder_is_stale_only_after_its_heartbeat_stops(tmp_path):
  record = {"host": "another-host", "pid": 1, "started": time.time(), "heartbeat": time.time(), "token": "x"}
  (tmp_path / workdir_lib.LOCK_FILE).write_text(json.dumps(record))
  with pytest.raises(workdir_lib.WorkdirBusyError, match="host another-host, pid 1"):
    workdir_lib.WorkdirLock.acquire(tmp_path, stale_after=60)
  record["heartbeat"] = time.time() - 120
  (tmp_path / workdir_lib.LOCK_FILE).write_text(json.dumps(record))
  workdir_lib.WorkdirLock.acquire(tmp_path, stale_after=60).release()


def test_heartbeat_refreshes_the_lock(tmp_path):
  lock = workdir_lib.WorkdirLock.acquire(tmp_path, heartbeat=0.05)
  first = json.loads((tmp_path / workdir_lib.LOCK_FILE).read_text())["heartbeat"]
  time.sleep(0.3)
  assert json.loads((tmp_path / workdir_lib.LOCK_FILE).read_text())["heartbeat"] > first
  lock.release()


def test_config_changes_name_the_keys_and_skip_resume_safe_ones(tmp_path):
  saved = {"model": {"num_layers": 2, "hidden_size": 64}, "train": {"steps": 100, "batch_size": 8},
           "mesh": {"sizes": {"data": -1}}, "data": {"fill": (1, 2)}}
  current = {"model": {"num_layers": 3, "hidden_size": 64}, "train": {"steps": 500, "batch_size": 8},
             "mesh": {"sizes": {"data": 4}}, "data": {"fill": [1, 2]}}
  assert workdir_lib.config_changes(saved, current) == [("model.num_layers", 2, 3)]
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(workdir_lib.ConfigMismatchError,
                     match=r"model.num_layers: 2 in the workdir, 3 now.*--config.model.num_layers=2.*new --workdir"):
    workdir_lib.check_resume_config(tmp_path, current)
  workdir_lib.check_resume_config(tmp_path, {**saved, "train": {"steps": 900, "batch_size": 8}})


def test_a_key_newer_than_the_workdir_counts_only_away_from_its_default():
  saved = {"loss": {"rtd_weight": 50.0}}
  defaults = {"loss": {"rtd_weight": 50.0, "rtd_positions": "all"}}
  same = {"loss": {"rtd_weight": 50.0, "rtd_positions": "all"}}
  assert workdir_lib.config_changes(saved, same, defaults=defaults) == []
  changed = {"loss": {"rtd_weight": 50.0, "rtd_positions": "masked"}}
  assert workdir_lib.config_changes(saved, changed, defaults=defaults) == [
      ("loss.rtd_positions", "<absent>", "masked")]


def test_drop_rows_after_keeps_the_steps_a_checkpoint_holds(tmp_path):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": s, "loss": 1.0} for s in (10, 20, 30, 40)] + [{"event": "start"}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5')  # The last line cut by a kill.
  assert workdir_lib.drop_rows_after(path, 20) == 3
  assert [json.loads(line).get("step") for line in path.read_text().splitlines()] == [10, 20, None]
  assert workdir_lib.drop_rows_after(path, 20) == 0


def test_lock_and_metrics_rows_on_cloud_storage(gcs_bucket):
  workdir = f"{gcs_bucket}/run"
  lock = workdir_lib.WorkdirLock.acquire(workdir, settle=0.1)
  try:
    with pytest.raises(workdir_lib.WorkdirBusyError, match="is in use by another run"):
      workdir_lib.WorkdirLock.acquire(workdir, settle=0.1)
  finally:
    lock.release()
  workdir_lib.WorkdirLock.acquire(workdir, settle=0.1).release()
  path = workdir_lib.epath.Path(workdir) / "metrics.jsonl"
  path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
  assert workdir_lib.drop_rows_after(path, 1) == 2
  assert path.read_text() == '{"step": 1}\n'

