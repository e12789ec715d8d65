"""Faults around checkpoints (issue 74: a full disk during a save, a second Ctrl-C, fine-tuning from a run whose
newest checkpoint is unreadable, a flipped bit in a saved array). Each ends in one line naming the path and the cause
with a nonzero exit, trusts nothing partial, keeps the last complete checkpoint, and a rerun ends bit-identical (array
by array) to the uninterrupted run.

Every run is one experiment of 8 steps with a checkpoint every 2: `straight` runs it without a fault, and each test
continues a copy of it cut back to step 4 (`after_step_4`: checkpoints 2 and 4, as a run killed there leaves it).
"""

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from orbax.checkpoint._src.serialization import serialization as orbax_serialization

from bert_jax import cli
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train import loop, trainer
from test_trainer import REPO, _continue, _tiny_config_file, prepared  # noqa: F401 - a fixture

STEPS = 8
TRAIN = dict(checkpoint_every=2, eval_every=0, log_every=1, keep_checkpoints=4)
OVERRIDES = [f"--config.train.{key}={value}" for key, value in TRAIN.items()]


def _config(prepared_dir):
  return _continue(prepared_dir, STEPS, keep_checkpoints=TRAIN["keep_checkpoints"])


@pytest.fixture(scope="session")
def straight(prepared, tmp_path_factory):
  """The uninterrupted run (checkpoints 2, 4, 6 and 8)."""
  from conftest import built_once

  return built_once(tmp_path_factory, "straight_8_steps",
                    lambda root: trainer.train_and_evaluate(_config(prepared), root / "run")) / "run"


@pytest.fixture
def after_step_4(straight, tmp_path) -> pathlib.Path:
  """A copy of `straight` as a run killed after its checkpoint at step 4 leaves it (the rerun drops later rows)."""
  workdir = pathlib.Path(shutil.copytree(straight, tmp_path / "run"))
  for step in (6, 8):
    shutil.rmtree(workdir / "checkpoints" / str(step))
  return workdir


@pytest.fixture
def cli_state():
  """Puts back what `cli.main` sets for its process (log levels, the hooks it quiets after a storage error)."""
  import logging
  names = ("jax", "orbax", "absl", "fsspec", "asyncio")
  levels = {name: logging.getLogger(name).level for name in names}
  hooks = sys.unraisablehook, threading.excepthook
  yield
  for name, level in levels.items():
    logging.getLogger(name).setLevel(level)
  sys.unraisablehook, threading.excepthook = hooks


def _saved_state(workdir: pathlib.Path, step: int) -> dict:
  """Checkpoint `step`'s state as saved (numpy arrays in the saved layout), read with Orbax alone: no checksum."""
  item = pathlib.Path(workdir) / "checkpoints" / str(step) / "state"
  metadata = ocp.StandardCheckpointer().metadata(item)
  tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata
  target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  return ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))


def _saved_arrays(workdir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
  return {jax.tree_util.keystr(path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(_saved_state(workdir, step))}


def _assert_bit_identical(workdir: pathlib.Path, reference: pathlib.Path, step: int = STEPS) -> None:
  ours, theirs = _saved_arrays(workdir, step), _saved_arrays(reference, step)
  assert ours.keys() == theirs.keys()
  for name, array in ours.items():
    assert array.dtype == theirs[name].dtype and array.shape == theirs[name].shape, name
    assert array.tobytes() == theirs[name].tobytes(), name


def _one_error_line(stderr: str, command: str) -> str:
  """The single line `bert-jax COMMAND: error: ...` that is all of stderr, no traceback anywhere."""
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert "Traceback" not in stderr and len(lines) == 1, stderr
  assert lines[0].startswith(f"bert-jax {command}: error: "), stderr
  return lines[0]


def test_host_checksums_equal_the_compiled_ones_for_every_dtype_and_a_sharded_array():
  """On a CPU backend checksums are computed in numpy (compiling the tree's hashing program costs seconds); they are
  the compiled program's values bit for bit, so a checkpoint saved on one backend verifies on another."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec

  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((len(jax.devices()),), ("data",))
  sharded = jax.device_put(rng.standard_normal((len(jax.devices()) * 2, 3)).astype(np.float32),
                           NamedSharding(mesh, PartitionSpec("data")))
  tree = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
          "bf16": jnp.asarray(rng.standard_normal(7), jnp.bfloat16),
          "i32": rng.integers(0, 100, (2, 3, 4)).astype(np.int32), "bool": np.array([True, False, True]),
          "u8": rng.integers(0, 255, 5).astype(np.uint8), "scalar": np.float32(3.5), "key": jax.random.key(3),
          "i64": np.arange(6, dtype=np.int64), "sharded": sharded}
  host = checkpoint_lib.checksums(tree)
  leaves = [np.arange(6, dtype=np.int64).view(np.uint32) if name == "i64" else leaf for name, leaf in tree.items()]
  program = {name: int(value) for name, value in zip(tree, jax.device_get(checkpoint_lib._checksums_jit(leaves)))}
  assert host == program
  assert len(set(host.values())) == len(host)  # distinct arrays, distinct sums


def test_tensorstore_status_text_gives_the_os_error_and_the_file():
  """The text TensorStore raises for a full disk (from a real one) reads as ENOSPC at the innermost file."""
  text = ('RESOURCE_EXHAUSTED: Error writing "w0/0.0" in OCDBT database at local file "/data/run/checkpoints/1.orbax-'
          'checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: "/data/run/checkpoints/1.orbax-'
          'checkpoint-tmp/state.orbax-checkpoint-tmp/ocdbt.process_0/d/9c92d0995dfcf6b74c97c3ffc929a89d": Failed to '
          "write 477716 bytes to file 4: No space left on device [os_error_code='28']")
  assert checkpoint_lib.os_error(RuntimeError("commit failed")) is None
  wrapped = RuntimeError("commit failed")
  wrapped.__cause__ = ValueError(text)
  cause = checkpoint_lib.os_error(wrapped)
  assert cause.errno == errno.ENOSPC and cause.strerror == os.strerror(errno.ENOSPC)
  assert cause.filename.endswith("ocdbt.process_0/d/9c92d0995dfcf6b74c97c3ffc929a89d")


@pytest.mark.slow
def test_a_full_disk_during_a_checkpoint_write_stops_the_run_in_one_line(prepared, after_step_4, straight, tmp_path,
                                                                          monkeypatch, capfd, caplog, cli_state):
  """The background write of checkpoint 6 fails with ENOSPC: one line naming the file and the cause, exit 1, the run
  stopped at the first step after the failure (once Orbax has reported it), checkpoint 6 never trusted, 4 kept; the
  rerun resumes from 4 and ends bit-identical to the uninterrupted run."""
  workdir = after_step_4
  fault = {"armed": False, "fired_at": None, "where": None}
  seen = {"step": None}
  write = orbax_serialization.async_serialize_from_host

  async def full_disk(value, tensorstore_spec, *args, **kwargs):
    if not fault["armed"]:
      return await write(value, tensorstore_spec, *args, **kwargs)
    fault["fired_at"] = seen["step"]
    fault["where"] = tensorstore_spec["kvstore"]["base"]["path"] + "d"
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), fault["where"])

  save, due = checkpoint_lib.Checkpointer.save, loop.CheckpointHook.due

  def arm_at_6(self, step, *args, **kwargs):
    fault["armed"] = step == 6
    return save(self, step, *args, **kwargs)

  def record_step(self, step, last):
    seen["step"] = step
    thread = self.checkpointer._finalizing()
    if fault["fired_at"] is not None and thread is not None:  # Orbax's own threads hand the error on first.
      _wait_dead(thread)
    return due(self, step, last)

  monkeypatch.setattr(orbax_serialization, "async_serialize_from_host", full_disk)
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", arm_at_6)
  monkeypatch.setattr(loop.CheckpointHook, "due", record_step)
  config_file = _tiny_config_file(tmp_path, prepared, STEPS)
  capfd.readouterr()
  assert cli.main(["pretrain", "--config", str(config_file), "--workdir", str(workdir), *OVERRIDES]) == 1
  line = _one_error_line(capfd.readouterr().err, "pretrain")
  assert (f"writing checkpoint step 6 to {fault['where']} failed (OSError: No space left on device); the last "
          "complete checkpoint is step 4" in line), line
  assert not [record for record in caplog.records if record.exc_info], "a library logged a traceback"
  # The write of checkpoint 6 runs in the background, during step 6 or 7 on a loaded machine; the run stops at the
  # first step after it failed.
  assert fault["fired_at"] in (6, 7) and seen["step"] == fault["fired_at"] + 1, (fault, seen)
  assert checkpoint_lib.complete_steps(workdir) == [2, 4]

  monkeypatch.undo()
  resumed = trainer.train_and_evaluate(_config(prepared), workdir)
  assert resumed["history"][0]["step"] == 5
  assert not (workdir / "checkpoints" / "6.orbax-checkpoint-tmp").exists()
  _assert_bit_identical(workdir, straight)


def _wait_dead(thread: threading.Thread) -> None:
  """Waits for `thread` to end without joining it (Orbax's finalize thread raises its error into a joiner)."""
  deadline = time.monotonic() + 60
  while thread.is_alive() and time.monotonic() < deadline:
    time.sleep(0.01)


# A CLI process whose first Ctrl-C comes after step 5 and whose second comes while that stop's checkpoint is written.
_SECOND_CTRL_C = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from bert_jax import cli
from bert_jax.train import checkpoint, loop

due, wait = loop.CheckpointHook.due, checkpoint.Checkpointer.wait

def first_ctrl_c(self, step, last):
  if step == 5 and not self.preemption.requested:
    os.kill(os.getpid(), signal.SIGINT)
  return due(self, step, last)

def second_ctrl_c(self):
  os.kill(os.getpid(), signal.SIGINT)
  return wait(self)

loop.CheckpointHook.due, checkpoint.Checkpointer.wait = first_ctrl_c, second_ctrl_c
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_second_ctrl_c_says_no_checkpoint_was_saved_and_the_rerun_resumes_from_the_last_complete_one(
    prepared, after_step_4, straight, tmp_path):
  """A real process and real signals: the second Ctrl-C cuts the stop's checkpoint (step 5) short. One line says so
  and names step 4 as the last complete one, exit 1; step 5's partial files stay unread and the rerun resumes from 4,
  ending bit-identical to the uninterrupted run."""
  workdir = after_step_4
  config_file = _tiny_config_file(tmp_path, prepared, STEPS)
  command = [sys.executable, "-c", _SECOND_CTRL_C.format(tests=str(REPO / "tests")), "pretrain", "--config",
             str(config_file), "--workdir", str(workdir), *OVERRIDES]
  out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stdout + out.stderr
  # The process logs its start-up at INFO; every other line of stderr is the error.
  stderr = "\n".join(line for line in out.stderr.splitlines() if "distributed.initialize" not in line)
  line = _one_error_line(stderr, "pretrain")
  assert ("stopped by a second Ctrl-C: no checkpoint was saved (the one of step 5 was not complete" in line
          and f"the last complete checkpoint is step 4 in {workdir / 'checkpoints'}" in line), line
  assert "saved checkpoint" not in out.stdout, out.stdout
  assert checkpoint_lib.complete_steps(workdir) == [2, 4]

  resumed = trainer.train_and_evaluate(_config(prepared), workdir)
  assert resumed["history"][0]["step"] == 5
  _assert_bit_identical(workdir, straight)


def test_ctrl_c_during_start_up_is_one_line(prepared, tmp_path, monkeypatch, capfd, cli_state):
  """Ctrl-C while the run sets up (the data, the model, compilation): one line, exit 1, the workdir's lock let go."""
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(trainer, "_setup", interrupted)
  workdir = tmp_path / "run"
  capfd.readouterr()
  args = ["pretrain", "--config", str(_tiny_config_file(tmp_path, prepared, STEPS)), "--workdir", str(workdir)]
  assert cli.main(args) == 1
  line = _one_error_line(capfd.readouterr().err, "pretrain")
  assert f"stopped by Ctrl-C; no complete checkpoint exists in {workdir / 'checkpoints'}" in line, line
  assert not (workdir / "workdir.lock").exists()


@pytest.mark.slow
def test_a_flipped_bit_in_saved_optimizer_state_is_a_corrupt_checkpoint(prepared, after_step_4, straight, tmp_path,
                                                                        caplog):
  """One bit of an Adam moment in checkpoint 4 flips on storage, in a form Orbax reads back without a word: the
  recorded checksum refuses it, the checkpoint is set aside as corrupt, the run resumes from 2 and ends
  bit-identical to the uninterrupted run."""
  workdir = after_step_4
  name = "['opt_state'][1]['mu']['encoder']['embeddings']['word_embeddings']['embedding']"
  state = _saved_state(workdir, 4)
  moment = dict((jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state))[name]
  moment.view(np.uint32).flat[int(np.flatnonzero(moment)[0])] ^= 1 << 3
  item = workdir / "checkpoints" / "4" / "state"
  shutil.rmtree(item)
  ocp.PyTreeCheckpointer().save(item, state)  # the same layout, one bit different
  assert _saved_arrays(workdir, 4)[name].tobytes() == moment.tobytes()  # Orbax alone reads it back without a word

  with caplog.at_level("WARNING"):
    resumed = trainer.train_and_evaluate(_config(prepared), workdir)
  assert ("checkpoint at step 4" in caplog.text and "opt_state/1/mu/encoder/embeddings/word_embeddings/embedding "
          "does not hold the saved bits" in caplog.text), caplog.text
  assert [path.name.split("-")[0] for path in (workdir / "corrupt_checkpoints").iterdir()] == ["4"]
  assert resumed["history"][0]["step"] == 3  # from checkpoint 2
  _assert_bit_identical(workdir, straight)


@pytest.mark.slow
def test_finetuning_from_a_run_whose_newest_checkpoint_is_truncated_needs_the_step(tmp_path, capfd, cli_state):
  """A pre-training run with checkpoints 7 and 9, 9 truncated: fine-tuning from it stops in one line naming
  checkpoint 9, its cause and --config.init.step (exit 1, nothing fine-tuned); with --config.init.step=7 it starts
  from step 7's exact parameters and records the step in finetune_run.json and results.json."""
  import flax.linen as nn

  from bert_jax.models import PretrainingModel
  from bert_jax.tasks.finetune_model import load_initial_model
  from test_finetune import FAST, TINY, _glue_sst2, _write_tokenizer

  run = tmp_path / "pretrain"
  model, saved = PretrainingModel(TINY), {}
  checkpointer = checkpoint_lib.Checkpointer(run, async_save=False)
  for step in (7, 9):
    variables = jax.jit(model.init)(jax.random.key(step), np.zeros((1, 8), np.int32), np.zeros((1, 2), np.int32))
    saved[step] = jax.tree.map(np.asarray, nn.unbox(variables["params"]))
    checkpointer.save(step, {"params": saved[step]}, {}, {"step": step}, force=True)
  checkpointer.close()
  (run / "config.json").write_text(json.dumps({"objective": "mlm+nsp", "model": {"family": "bert"}}))
  (run / "model_config.json").write_text(json.dumps(TINY.__dict__))
  _write_tokenizer(run / "tokenizer")
  largest = max((path for path in (run / "checkpoints" / "9" / "state").rglob("*") if path.is_file()),
                key=lambda path: path.stat().st_size)
  largest.write_bytes(largest.read_bytes()[:largest.stat().st_size // 2])

  tuned = tmp_path / "tuned"
  args = ["finetune", "--config", f"{REPO / 'configs' / 'finetune' / 'glue.py'}:task=sst2", "--workdir", str(tuned),
          f"--config.init.model={run}", f"--config.data_dir={_glue_sst2(tmp_path / 'glue', np.random.default_rng(0))}",
          *FAST, "--config.train.epochs=1"]
  capfd.readouterr()
  assert cli.main(args) == 1
  line = _one_error_line(capfd.readouterr().err, "finetune")
  assert (f"checkpoint 9 in {run / 'checkpoints'} cannot be read (" in line
          and "set --config.init.step=STEP to start from another of its checkpoints (7)" in line), line
  assert not (tuned / "config.json").exists()

  assert cli.main(args + ["--config.init.step=7"]) == 0
  assert json.loads((tuned / "finetune_run.json").read_text())["init"] == {
      "path": str(run), "source": "pretraining_run", "step": 7}
  assert json.loads((tuned / "results.json").read_text())["init"]["step"] == 7
  started = load_initial_model(run, step=7).params["encoder"]
  jax.tree.map(lambda ours, theirs: np.testing.assert_array_equal(ours, theirs), started, saved[7]["encoder"])
