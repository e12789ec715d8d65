"""End-to-end pre-training on CPU: every objective learns, exact resume, NaN stop, checkpoints (corrupt, replica
slices), config errors."""

import gc
import json
import logging
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from multiprocess_util import CHEAP_CODEGEN_FLAGS, FAST_COMPILE_FLAGS

from bert_jax.data import builtin_corpus, prepare, tokenizers
from bert_jax.train import config_lib, pretrain_data, trainer
from bert_jax.train.checkpoint import restore_params

REPO = pathlib.Path(__file__).resolve().parents[1]


def cli_env(**extra: str) -> dict[str, str]:
  """The environment of a CLI process a test starts: one CPU device, the suite's compile flags and compilation cache
  (conftest.py); a test that gives BERT_JAX_COMPILATION_CACHE gets the CLI's own cache there instead."""
  flags = " ".join(["--xla_force_host_platform_device_count=1", *FAST_COMPILE_FLAGS])
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)
  if "BERT_JAX_COMPILATION_CACHE" in extra:
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # it would win over the CLI's variable
  return env


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
  """The built-in corpus with a small WordPiece vocabulary, prepared once for the run (xdist's workers share it, so
  runs that one worker writes and another continues name the same corpus)."""
  from conftest import built_once  # here: the processes that tests start import this module, never conftest

  def build(root):
    corpus = builtin_corpus.build_builtin_corpus(root / "corpus.txt")
    tokenizers.train_tokenizer("wordpiece", [str(corpus)], 2000, root / "tokenizer")
    prepare.prepare_corpus([str(corpus)], root / "tokenizer", root / "prepared", eval_fraction=0.05, num_workers=1,
                           log=lambda *a: None)

  return built_once(tmp_path_factory, "builtin", build) / "prepared"


FORMATS = {"mlm+nsp": "segment_pair", "mlm+sop": "sop", "mlm": "full_sentences", "mlm+sbo": "doc_sentences",
           "ltr": "full_sentences", "rtd": "full_sentences", "replace_mlm": "full_sentences",
           "all_tokens_mlm": "full_sentences"}


def tiny_config(prepared_dir, objective="mlm+nsp", steps=40, schedule="linear", **train):
  config = config_lib.pretrain_defaults()
  config.objective = objective
  config.model = config_lib.model_section("bert", "tiny", num_layers=2, hidden_size=64, num_heads=2,
                                          intermediate_size=128, max_position_embeddings=64, dtype="float32")
  if objective in ("rtd", "replace_mlm", "all_tokens_mlm"):
    config.model.embedding_size = 64
    config.model.generator_fraction = 0.5
  if objective == "mlm+sbo":
    config.masking.granularity = "span"
  config.data.prepared = str(prepared_dir)
  config.data.format = FORMATS[objective]
  config.data.seq_len = 64
  config.masking.max_predictions = 10
  config.optim.lr = 2e-3
  config.optim.warmup_steps = 10
  config.optim.schedule = schedule
  config.train.batch_size = 16
  config.train.steps = steps
  config.train.log_every = 10
  config.train.eval_every = steps
  config.train.eval_batches = 4
  config.train.checkpoint_every = steps
  for key, value in train.items():
    config.train[key] = value
  config.lock()
  return config


# A 200-step run in a process of its own with one CPU device: the numbers are those of the 8 fake devices (sharded
# steps equal the single-device one: tests/test_train_step.py), which share the same cores and only slow each step.
# The run is compared with no other, so XLA optimises it: its first level without LLVM's expensive passes runs the
# steps as fast as the full optimisation and compiles faster.
LEARNING_FLAGS = " ".join(["--xla_backend_optimization_level=1", "--xla_llvm_disable_expensive_passes=true",
                           *CHEAP_CODEGEN_FLAGS])
_LEARNING_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from test_trainer import tiny_config
from bert_jax.train import trainer
result = trainer.train_and_evaluate(tiny_config({prepared!r}, {objective!r}, steps=200), {workdir!r})
print("RESULT " + json.dumps({{"history": result["history"], "eval": result["eval"]}}, default=float))
"""


@pytest.mark.slow
# Replace MLM trains All-Tokens MLM's networks on a subset of its positions (its loss: tests/test_objectives.py).
@pytest.mark.parametrize("objective", sorted(set(FORMATS) - {"replace_mlm"}))
def test_every_objective_learns(prepared, tmp_path, objective):
  code = _LEARNING_RUN.format(tests=str(REPO / "tests"), prepared=str(prepared), objective=objective,
                              workdir=str(tmp_path / "run"))
  env = dict(cli_env(), XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {LEARNING_FLAGS}")
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
  history = result["history"]
  assert history[-1]["loss"] < 0.85 * history[0]["loss"], (history[0]["loss"], history[-1]["loss"])
  evaluation = result["eval"]
  # Chance for a 2000-word vocabulary is 0.05%; require 40x that after 200 tiny steps.
  term = "lm" if objective == "ltr" else "mlm"  # LTR's next-token figures have their own names.
  assert evaluation[f"{term}_accuracy"] > 0.02, evaluation
  assert evaluation[f"{term}_perplexity"] < 2000 / 2, evaluation
  if objective in ("mlm+nsp", "mlm+sop"):
    # NSP/SOP need more than 200 tiny steps to beat their majority class here (the demo's 800 steps
    # reach 0.83 NSP accuracy); this run checks the sentence head is trained and evaluated.
    assert np.isfinite(evaluation["sentence_loss"]) and 0.0 < evaluation["sentence_accuracy"] < 1.0, evaluation
    assert "sentence_loss" in history[-1], history[-1]
  if objective == "rtd":
    assert evaluation["rtd_accuracy"] > 0.85, evaluation
  if objective == "mlm+sbo":
    assert evaluation["sbo_accuracy"] > 0.01, evaluation


def short_config(prepared_dir, steps, **train):
  """`tiny_config` for the short runs that test checkpoints, resumes and logs: a constant rate after the warmup
  leaves `steps` out of the compiled step, so runs of every length load it from the suite's compilation cache."""
  return tiny_config(prepared_dir, steps=steps, schedule="constant", **train)


@pytest.fixture(scope="session")
def four_steps(prepared, tmp_path_factory):
  """A finished 4-step run (checkpoints at 2 and 4, every step logged), run once for xdist's workers: the resume
  tests continue copies of it."""
  from conftest import built_once

  def build(root):
    trainer.train_and_evaluate(short_config(prepared, steps=4, checkpoint_every=2, eval_every=0, log_every=1),
                               root / "run")

  return built_once(tmp_path_factory, "four_steps", build) / "run"


def _continued(workdir: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  """A copy of the finished run `workdir` for a test to continue, corrupt or refuse."""
  return pathlib.Path(shutil.copytree(workdir, tmp_path / "run"))


def _continue(prepared, steps, **train):
  """`short_config` of `four_steps`'s experiment, run to `steps`."""
  return short_config(prepared, steps=steps, checkpoint_every=2, eval_every=0, log_every=1, **train)


def _corrupt(checkpoint: pathlib.Path):
  """Overwrites every data file of a checkpoint's state (its manifest stays, so it still looks complete)."""
  for path in (checkpoint / "state").rglob("*"):
    if path.is_file() and path.stat().st_size > 0 and "manifest" not in path.name:
      path.write_bytes(b"\0" * 7)


def _losses_by_step(workdir):
  losses = {}
  for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if "train/loss" in record:
      losses[record["step"]] = record["train/loss"]
  return losses


def _tiny_config_file(tmp_path, prepared, steps: int) -> pathlib.Path:
  """A config file giving `short_config(prepared, steps=steps)`, for a test that runs the CLI in a process: runs of
  every length compile the same steps, which `_cli_cache_env`'s cache gives the tests' later processes."""
  path = tmp_path / "tiny.py"
  path.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_trainer import short_config\n"
                  "def get_config(arg):\n  c = short_config(%r, steps=%d)\n  c.unlock()\n  return c\n"
                  % (str(REPO / "tests"), str(prepared), steps))
  return path


def _cli_cache_env() -> dict[str, str]:
  """`cli_env` with the CLI's own compilation cache (BERT_JAX_COMPILATION_CACHE, as users have it) in the suite's
  cache directory, so the CLI processes of every test here load the steps the first one compiled."""
  return cli_env(BERT_JAX_COMPILATION_CACHE=os.environ["BERT_JAX_TEST_COMPILATION_CACHE"])


@pytest.mark.slow
def test_sigterm_saves_and_resume_is_exact(prepared, tmp_path):
  """A run stopped by SIGTERM mid-way and started again gives the uninterrupted run's losses; the interrupted run
  builds its batches in 2 worker processes, the resumed one in 1, the uninterrupted one in its thread."""
  steps = 30
  overrides = [f"--config.train.{k}={v}" for k, v in dict(log_every=1, checkpoint_every=1000, eval_every=0).items()]
  config_file = _tiny_config_file(tmp_path, prepared, steps)
  command = [sys.executable, "-m", "bert_jax.cli", "pretrain", "--config", str(config_file)] + overrides
  # The CLI's compilation cache, as users have it: the interrupted and the resumed runs load the straight run's
  # compiled steps.
  env = _cli_cache_env()

  straight = tmp_path / "straight"
  subprocess.run(command + ["--workdir", str(straight), "--config.data.workers=0"], check=True, env=env, cwd=REPO, capture_output=True)

  interrupted = tmp_path / "interrupted"
  process = subprocess.Popen(command + ["--workdir", str(interrupted), "--config.data.workers=2"], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  metrics = interrupted / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
      break
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=300)
  assert process.returncode == 0, output
  assert "Preempted at step" in output, output
  stopped_at = len(_losses_by_step(interrupted))
  assert 5 <= stopped_at < steps, output
  subprocess.run(command + ["--workdir", str(interrupted), "--config.data.workers=1"], check=True, env=env, cwd=REPO,
                 capture_output=True)

  expected, resumed = _losses_by_step(straight), _losses_by_step(interrupted)
  assert sorted(resumed) == list(range(1, steps + 1))
  np.testing.assert_allclose([resumed[s] for s in range(1, steps + 1)], [expected[s] for s in range(1, steps + 1)],
                             rtol=1e-6)


@pytest.mark.slow
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(prepared, four_steps, tmp_path, monkeypatch):
  workdir = _continued(four_steps, tmp_path)
  # The NaN comes from a changed loss weight, which the resume check would refuse: allow it here.
  monkeypatch.setattr(trainer.workdir_lib, "check_resume_config", lambda *args, **kwargs: None)
  config = _continue(prepared, steps=8)
  config.unlock()
  config.loss.sentence_weight = float("nan")
  with pytest.raises(trainer.NonFiniteLossError, match=r"non-finite loss or gradients at step 5.*checkpoint: 4"):
    trainer.train_and_evaluate(config, workdir)
  step, params = restore_params(workdir)
  assert step == 4
  assert all(np.isfinite(np.asarray(x)).all() for x in __import__("jax").tree.leaves(params))


def test_pending_metrics_reads_a_log_step_at_the_next_add():
  from bert_jax.train import metrics as metrics_lib
  reads = []
  pending = metrics_lib.PendingMetrics(lambda step, averaged, nonfinite: reads.append((step, averaged, nonfinite)))
  for step in (1, 2):
    pending.add({"loss": np.float32(step), "nonfinite": np.int32(0)})
  pending.log_next(2)
  assert reads == []  # not yet: step 3 is not dispatched
  pending.add({"loss": np.float32(3), "nonfinite": np.int32(0)})
  assert reads == [(2, {"loss": 1.5}, None)]
  pending.log_next(3)
  pending.flush(3)  # at once (evaluation, checkpoint, last step); the log step is done with
  pending.flush(3)
  pending.add({"loss": np.float32(4), "nonfinite": np.int32(0)})
  assert reads == [(2, {"loss": 1.5}, None), (3, {"loss": 3.0}, None)]
  for step in (5, 6):
    pending.add({"loss": np.float32(np.nan), "nonfinite": np.int32(1)})
  pending.flush(6)  # steps 4-6: the first non-finite one is 5
  step, averaged, (bad_step, bad) = reads[-1]
  assert step == 6 and bad_step == 5 and np.isnan(bad["loss"]) and np.isnan(averaged["loss"])
  pending.add({"loss": np.float32(7), "nonfinite": np.int32(0)})
  pending.add({"loss": np.float32(8), "extra": np.float32(1), "nonfinite": np.int32(0)})  # keys differ: still read
  pending.flush(8)
  step, averaged, nonfinite = reads[-1]
  assert step == 8 and averaged["loss"] == 7.5 and np.isnan(averaged["extra"]) and nonfinite is None


def test_pending_metrics_of_calls_of_several_steps_name_the_step_inside_a_call():
  from bert_jax.train import metrics as metrics_lib
  reads = []
  pending = metrics_lib.PendingMetrics(lambda step, averaged, nonfinite: reads.append((step, averaged, nonfinite)))
  pending.add({"loss": np.float32(1), "nonfinite": np.int32(0)})  # step 1 alone, then a call of steps 2-4
  pending.add({"loss": np.float32([2, np.nan, 4]), "nonfinite": np.int32([0, 1, 0])}, steps=3)
  pending.flush(4)
  step, averaged, (bad_step, bad) = reads[-1]
  assert step == 4 and bad_step == 3 and np.isnan(bad["loss"]) and bad["nonfinite"] == 1
  pending.add({"loss": np.float32([5, 6]), "nonfinite": np.int32([0, 0])}, steps=2)
  pending.add({"loss": np.float32(8), "extra": np.float32(1), "nonfinite": np.int32(0)})  # keys differ: still read
  pending.flush(7)
  step, averaged, nonfinite = reads[-1]
  assert step == 7 and averaged["loss"] == 19 / 3 and nonfinite is None
  assert np.isnan(averaged["extra"])


@pytest.mark.slow
def test_several_steps_per_call_equal_single_steps_and_resume_exactly(prepared, tmp_path):
  """`train.steps_per_call=4` over 10 steps (calls of steps 1-4 and 5-8, then single steps 9 and 10) reads the same
  batches and ends with the single steps' parameters and losses; a copy of it cut back to its step-8 checkpoint,
  resumed, equals the uninterrupted run exactly; logs and checkpoints keep their steps, and the checkpoint's iterator
  state is the same. An interval that is not a multiple of steps_per_call is refused, naming the key."""
  runs = {}
  for name, steps_per_call in (("single", 1), ("grouped", 4), ("resumed", 4)):
    if name == "resumed":  # the grouped run as if stopped after its checkpoint at step 8
      workdir = pathlib.Path(shutil.copytree(tmp_path / "grouped", tmp_path / name))
      shutil.rmtree(workdir / "checkpoints" / "10")
      rows = (workdir / "metrics.jsonl").read_text().splitlines()
      (workdir / "metrics.jsonl").write_text("".join(row + "\n" for row in rows if json.loads(row)["step"] <= 8))
    config = short_config(prepared, steps=10, checkpoint_every=4, eval_every=0, log_every=4,
                          steps_per_call=steps_per_call)
    runs[name] = trainer.train_and_evaluate(config, tmp_path / name)
  assert runs["resumed"]["history"][0]["step"] == 10  # it resumed after step 8
  losses = {name: _losses_by_step(tmp_path / name) for name in runs}
  assert sorted(losses["single"]) == sorted(losses["grouped"]) == sorted(losses["resumed"]) == [4, 8, 10]
  assert losses["resumed"] == losses["grouped"]
  np.testing.assert_allclose([losses["grouped"][s] for s in (4, 8, 10)], [losses["single"][s] for s in (4, 8, 10)],
                             rtol=1e-5)
  saved = {name: _checkpoint(tmp_path / name) for name in runs}
  assert [step for step, _, _ in saved.values()] == [10, 10, 10]
  assert saved["single"][2] == saved["grouped"][2] == saved["resumed"][2]  # the data iterator's position
  for grouped, resumed, single in zip(saved["grouped"][1], saved["resumed"][1], saved["single"][1]):
    np.testing.assert_array_equal(resumed, grouped)
    np.testing.assert_allclose(grouped, single, rtol=1e-4, atol=2e-6)
  with pytest.raises(ValueError, match=r"config.train.log_every=2 is not a multiple of config.train.steps_per_call=4"):
    trainer.train_and_evaluate(short_config(prepared, steps=8, log_every=2, steps_per_call=4), tmp_path / "bad")


def _checkpoint(workdir):
  """(the newest checkpoint's step, its parameters as numpy leaves, the data iterator's state saved with them)."""
  import jax
  import orbax.checkpoint as ocp
  from bert_jax.train import checkpoint as checkpoint_lib
  step, params = restore_params(workdir)
  checkpointer = checkpoint_lib.Checkpointer(workdir, async_save=False)
  try:
    data = checkpointer.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
  finally:
    checkpointer.close()
  return step, [np.asarray(x) for x in jax.tree.leaves(params)], dict(data)


@pytest.mark.slow
def test_log_steps_fetch_metrics_after_the_next_step_is_dispatched(prepared, tmp_path, monkeypatch):
  """A log step's metrics are read once the following step is on its way (the device stays busy); evaluation,
  checkpoints and the last step read them at once. The logged steps are the same. From the second step on, the
  setup's objects are frozen out of full garbage collections, and returned to the collector at the end. The step
  functions and batches are counted through the run's `loop.Instruments`, as a benchmark times them."""
  from bert_jax.train import metrics as metrics_lib
  dispatched, fetched_at, frozen, read, ended = [0], [], [], [0], []
  before = gc.get_freeze_count()

  def counting(step):
    def counted(state, batch):
      dispatched[0] += 1
      frozen.append(gc.get_freeze_count() > before)
      return step(state, batch)
    return counted

  def counting_batches(batches):
    for batch in batches:
      read[0] += 1
      yield batch

  fetch = metrics_lib.fetch
  monkeypatch.setattr(metrics_lib, "fetch",
                      lambda steps: fetched_at.extend([dispatched[0]] * len(steps)) or fetch(steps))
  instruments = trainer.loop.Instruments(step=counting, batches=counting_batches,
                                         on_loop_end=lambda: ended.append(dispatched[0]))
  result = trainer.train_and_evaluate(short_config(prepared, steps=9, log_every=2, checkpoint_every=6, eval_every=0),
                                      tmp_path, instruments=instruments)
  assert [h["step"] for h in result["history"]] == [2, 4, 6, 8, 9]
  assert read == [9] and ended == [9]
  # Steps 1-2 read when step 3 was dispatched, 3-4 at 5, 5-6 at once (checkpoint), 7-8 at 9, then 9 (last).
  assert fetched_at == [3, 3, 5, 5, 6, 6, 9, 9, 9], fetched_at
  assert frozen == [False] + [True] * 8 and gc.get_freeze_count() == 0


def test_frozen_setup_freezes_once_a_phase_and_returns_the_objects_on_exit(monkeypatch):
  import gc as real_gc
  from bert_jax.train import heap
  calls = []
  # Counted through a spy: other threads (a checkpoint writer, a lock's heartbeat) may free frozen objects at any
  # moment, so the frozen-object count itself only bounds what happened.
  freeze_all, unfreeze_all = real_gc.freeze, real_gc.unfreeze
  monkeypatch.setattr(heap.gc, "freeze", lambda: calls.append("freeze") or freeze_all())
  monkeypatch.setattr(heap.gc, "unfreeze", lambda: calls.append("unfreeze") or unfreeze_all())
  before = real_gc.get_freeze_count()  # another library may have frozen objects (gc.unfreeze returns those too)
  with pytest.raises(RuntimeError), heap.frozen_setup() as freeze:
    freeze()
    assert calls == ["freeze"] and real_gc.get_freeze_count() > before
    freeze()  # the same phase again freezes nothing
    assert calls == ["freeze"]
    freeze("evaluation")  # a new phase (the first evaluation's compilation) freezes what came since
    assert calls == ["freeze", "freeze"]
    raise RuntimeError("the loop failed")
  assert calls == ["freeze", "freeze", "unfreeze"] and real_gc.get_freeze_count() == 0


def test_replicated_small_arrays_are_saved_whole_and_large_ones_in_replica_slices(tmp_path, monkeypatch):
  """Checkpointer's Orbax array handler: replica-parallel writes only for slices of MIN_REPLICA_SLICE_BYTES or
  more (a compiled slice per shape and device made first saves of small states slow); both kinds read back."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec
  from bert_jax.train import checkpoint
  sliced = []
  slice_in_dim = jax.lax.slice_in_dim
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
  replicated = NamedSharding(mesh, PartitionSpec())
  large_rows = 2 * checkpoint.MIN_REPLICA_SLICE_BYTES * len(jax.devices()) // (4 * 128)
  state = {name: jax.device_put(jnp.arange(rows * 128, dtype=jnp.float32).reshape(rows, 128), replicated)
           for name, rows in (("small", 64), ("large", large_rows))}
  saver = checkpoint.Checkpointer(tmp_path, async_save=False)
  monkeypatch.setattr(jax.lax, "slice_in_dim", lambda x, *a, **k: sliced.append(x.shape) or slice_in_dim(x, *a, **k))
  saver.save(1, state, {})
  monkeypatch.undo()
  assert sliced and all(shape == (large_rows, 128) for shape in sliced), sliced
  step, restored, _, _ = saver.restore_latest(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state))
  assert step == 1 and all(np.array_equal(restored[k], state[k]) for k in state)


@pytest.mark.slow
def test_corrupt_checkpoint_falls_back_to_previous(prepared, four_steps, tmp_path, caplog):
  workdir = _continued(four_steps, tmp_path)
  _corrupt(workdir / "checkpoints" / "4")
  with caplog.at_level(logging.WARNING):
    result = trainer.train_and_evaluate(_continue(prepared, steps=6), workdir)
  assert "checkpoint at step 4" in caplog.text and "cannot be restored" in caplog.text
  assert list((workdir / "corrupt_checkpoints").iterdir())  # set aside, not deleted
  assert result["step"] == 6
  assert result["history"][0]["step"] == 3  # resumed from step 2: steps 3..4 redone


def test_config_errors_name_the_key(prepared, tmp_path):
  with pytest.raises(config_lib.ConfigError, match="optim.lrr"):
    config_lib.load_config(str(REPO / "configs" / "demo.py"), ["--config.optim.lrr=1"])
  with pytest.raises(config_lib.ConfigError, match="unknown config argument 'stepz'"):
    config_lib.load_config(str(REPO / "configs" / "demo.py") + ":stepz=3")
  with pytest.raises(ValueError, match=r"config.train.batch_size=12 is not divisible"):
    trainer.train_and_evaluate(tiny_config(prepared, batch_size=12), tmp_path / "a")
  config = tiny_config(prepared)
  config.unlock()
  config.model.vocab_size = 1234
  with pytest.raises(ValueError, match=r"config.model.vocab_size=1234 does not match the tokenizer"):
    trainer.train_and_evaluate(config, tmp_path / "b")
  config = tiny_config(prepared, "mlm+nsp")
  config.unlock()
  config.data.format = "full_sentences"
  with pytest.raises(ValueError, match="needs config.data.format='segment_pair' or 'sentence_pair'"):
    trainer.train_and_evaluate(config, tmp_path / "c")


def test_every_shipped_config_loads():
  for path in sorted((REPO / "configs").rglob("*.py")):
    # Table configs' rows have names and may name missing capabilities: tests/test_ablation.py checks them.
    if path.name.startswith("_") or path.parent.name == "ablations":
      continue
    module = config_lib._load_module(path)
    config = config_lib.load_config(str(path))
    assert config is not None
    if hasattr(module, "get_sweep"):
      for overrides in module.get_sweep(None):
        copy = config_lib.load_config(str(path))
        for key, value in overrides.items():
          config_lib.set_by_path(copy, key, str(value))


@pytest.mark.slow
def test_demo_cli_runs(tmp_path):
  """The README's demo command, shortened: built-in corpus -> vocab -> shards -> pretrain -> fill-mask."""
  env = cli_env()
  out = subprocess.run([sys.executable, "-m", "bert_jax.cli", "pretrain", "--config", "configs/demo.py:steps=8",
                        "--workdir", str(tmp_path / "demo"), "--config.train.eval_every=8",
                        "--config.train.log_every=4"], env=env, cwd=REPO, capture_output=True, text=True)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "Fill-mask predictions" in out.stdout and "MLM loss" in out.stdout
  baseline = re.search(r"the model predicts ([\d.]+)% right; the best frequency guess, always '(.+)' \(their most "
                       r"frequent answer\), gets ([\d.]+)%", out.stdout)
  assert baseline and 0 < float(baseline[3]) < 50, out.stdout
  assert (tmp_path / "demo" / "metrics.jsonl").exists() and (tmp_path / "demo" / "plots" / "loss.png").exists()
  assert "\r" not in out.stdout and "pretrain: 8/8 step (100%)" in out.stdout  # lines, not a bar, in a pipe
  fill = subprocess.run([sys.executable, "-m", "bert_jax.cli", "fill-mask", "--model", str(tmp_path / "demo"),
                         "A [MASK] is a sequence."], env=env, cwd=REPO, capture_output=True, text=True)
  assert fill.returncode == 0, fill.stderr
  assert "[MASK] #1:" in fill.stdout
  shutil.rmtree(tmp_path / "demo")


def test_single_sentence_documents_are_flagged_for_sentence_pair_formats(prepared, tmp_path, caplog):
  lines = "\n\n".join(f"Sentence number {i} stands alone in its document." for i in range(20))
  (tmp_path / "flat.txt").write_text(lines + "\n")
  prepare.prepare_corpus([str(tmp_path / "flat.txt")], prepared.parent / "tokenizer", tmp_path / "flat",
                         num_workers=1, log=lambda *a: None)
  flat = prepare.open_prepared(tmp_path / "flat")
  with caplog.at_level(logging.WARNING):
    pretrain_data.warn_single_sentence_documents(flat, "full_sentences")
    assert not caplog.records
    pretrain_data.warn_single_sentence_documents(flat, "segment_pair")
  assert "100% of the documents" in caplog.text and "single sentence" in caplog.text
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    pretrain_data.warn_single_sentence_documents(prepare.open_prepared(prepared), "segment_pair")
  assert not caplog.records


@pytest.mark.slow
def test_one_loop_runs_a_pretraining_and_a_finetuning_job(prepared, tmp_path, monkeypatch):
  """`train/loop.run` steps both commands: a short pre-training run, then fine-tuning from its workdir."""
  from bert_jax.tasks import finetune
  from bert_jax.train import loop

  runs = []
  real_run = loop.run
  monkeypatch.setattr(loop, "run", lambda *args, **kwargs: runs.append(kwargs["total_steps"]) or real_run(
      *args, **kwargs))
  trainer.train_and_evaluate(short_config(prepared, steps=4, checkpoint_every=4, eval_every=0), tmp_path / "pre")
  glue = tmp_path / "glue" / "SST-2"
  glue.mkdir(parents=True)
  rng = np.random.default_rng(0)
  for split, count in (("train", 32), ("dev", 16)):
    labels = rng.integers(2, size=count)
    glue.joinpath(f"{split}.tsv").write_text("sentence\tlabel\n" + "".join(
        f"{'a good one' if label else 'a bad one'}\t{label}\n" for label in labels))
  config = config_lib.load_config(str(REPO / "configs/finetune/glue.py:task=sst2"), [
      f"--config.init.model={tmp_path / 'pre'}", f"--config.data_dir={tmp_path / 'glue'}", "--config.seeds=(1,)",
      "--config.train.batch_size=16", "--config.train.eval_batch_size=16", "--config.max_len=16",
      "--config.train.epochs=1", "--config.train.save_checkpoint=False"])
  results = finetune.finetune(config, tmp_path / "finetune")
  assert runs == [4, 2]
  assert results["seeds"][0]["steps"] == 2


def _imports(path: pathlib.Path, top_level_only: bool) -> set[str]:
  """Modules a source file imports (absolute names; relative imports resolved against bert_jax)."""
  import ast
  tree = ast.parse(path.read_text())
  nodes = tree.body if top_level_only else list(ast.walk(tree))
  names = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def test_import_graph_train_never_imports_tasks():
  """Data flows one way: the training machinery knows objectives only through their interface."""
  for path in sorted((REPO / "bert_jax" / "train").glob("*.py")):
    bad = sorted(name for name in _imports(path, top_level_only=False)
                 if name == "bert_jax.tasks" or name.startswith("bert_jax.tasks."))
    assert not bad, f"{path.name} imports {bad}"


def test_import_graph_models_import_kernels_only_lazily():
  """The plain model imports no kernel at module level; fast paths load behind the seams when chosen."""
  if not (REPO / "bert_jax" / "kernels").is_dir():
    pytest.skip("no bert_jax/kernels package yet")
  for path in sorted((REPO / "bert_jax" / "models").glob("*.py")):
    bad = sorted(name for name in _imports(path, top_level_only=True)
                 if name == "bert_jax.kernels" or name.startswith("bert_jax.kernels."))
    assert not bad, f"{path.name} imports {bad} at module level"


@pytest.mark.slow
def test_changed_config_in_a_workdir_is_refused_and_loses_nothing(prepared, four_steps, tmp_path):
  workdir = _continued(four_steps, tmp_path)
  saved = (workdir / "config.json").read_text()
  config = _continue(prepared, steps=4)
  config.unlock()
  config.model.num_layers = 3
  with pytest.raises(ValueError, match=r"model.num_layers: 2 in the workdir, 3 now.*--config.model.num_layers=2"):
    trainer.train_and_evaluate(config, workdir)
  assert (workdir / "config.json").read_text() == saved
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
  assert not (workdir / "corrupt_checkpoints").exists()
  # A longer run of the same experiment is a resume, not a change.
  assert trainer.train_and_evaluate(_continue(prepared, steps=6), workdir)["history"][0]["step"] == 5


@pytest.mark.slow
def test_every_checkpoint_unreadable_stops_unless_a_restart_is_asked_for(prepared, four_steps, tmp_path):
  workdir = _continued(four_steps, tmp_path)
  for step in (2, 4):
    _corrupt(workdir / "checkpoints" / str(step))
  with pytest.raises(ValueError, match="can be read.*restart_if_unreadable=True"):
    trainer.train_and_evaluate(_continue(prepared, steps=4), workdir)
  result = trainer.train_and_evaluate(_continue(prepared, steps=4, restart_if_unreadable=True), workdir)
  assert result["step"] == 4 and result["history"][0]["step"] == 1  # from the start


@pytest.mark.slow
def test_resumed_run_drops_the_rows_it_logs_again(prepared, four_steps, tmp_path):
  workdir = _continued(four_steps, tmp_path)
  with open(workdir / "metrics.jsonl", "a") as metrics:  # Rows a run killed after its last checkpoint logged.
    metrics.write(json.dumps({"step": 5, "train/loss": 1.0}) + "\n" + json.dumps({"step": 6, "train/loss": 1.0}))
  trainer.train_and_evaluate(_continue(prepared, steps=6), workdir)
  steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
           if "train/loss" in line]
  assert steps == [1, 2, 3, 4, 5, 6]


def test_a_second_run_on_a_busy_workdir_refuses(prepared, tmp_path):
  from bert_jax.train import workdir as workdir_lib
  holder = workdir_lib.WorkdirLock.acquire(tmp_path)
  try:
    with pytest.raises(ValueError, match=rf"in use by another run \(host .*, pid {os.getpid()}"):
      trainer.train_and_evaluate(short_config(prepared, steps=2, eval_every=0), tmp_path)
  finally:
    holder.release()
  assert not (tmp_path / "checkpoints").exists()


def test_ctrl_c_asks_for_a_checkpoint_like_sigterm_and_a_second_one_stops_at_once():
  from bert_jax.train import loop
  outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (an xdist worker ignores it)
  try:
    with loop.Preemption() as preemption:
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.1)
      assert preemption.should_stop(1)
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
  finally:
    signal.signal(signal.SIGINT, outer)


def test_a_failure_after_a_stop_request_is_the_stop():
  """SIGTERM reaches the processes a run started too (XLA's ptxas compiling a step): their failure after the
  request must end the run as a stop, which a sweep resumes, not as the run's error; before a request an error is
  the error."""
  from bert_jax.train import loop
  before = signal.getsignal(signal.SIGTERM)
  with pytest.raises(loop.Stopped, match=r"while RuntimeError: ptxas exited with non-zero error code 15") as stopped:
    with loop.Preemption():
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.1)
      raise RuntimeError("ptxas exited with non-zero error code 15")
  assert isinstance(stopped.value.__cause__, RuntimeError)
  assert signal.getsignal(signal.SIGTERM) == before
  with pytest.raises(RuntimeError, match="ptxas"):
    with loop.Preemption():
      raise RuntimeError("ptxas exited with non-zero error code 15")


@pytest.mark.slow
def test_cloud_storage_workdir_survives_kill_9_and_resumes(prepared, tmp_path, gcs_bucket):
  """A gs:// workdir (an emulated bucket): killed with SIGKILL after a checkpoint, the same command resumes from it
  and finishes; checkpoints, metrics (each step once), TensorBoard, configs and the tokenizer are in the bucket."""
  from etils import epath
  steps = 12
  overrides = [f"--config.train.{k}={v}" for k, v in dict(log_every=1, checkpoint_every=4, eval_every=0).items()]
  config_file = _tiny_config_file(tmp_path, prepared, steps)
  workdir = f"{gcs_bucket}/runs/tiny"
  command = [sys.executable, "-m", "bert_jax.cli", "pretrain", "--config", str(config_file), "--workdir", workdir,
             *overrides]
  env = _cli_cache_env()  # the emulator's variables included
  remote = epath.Path(workdir)
  process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None:
    if (remote / "metrics.jsonl").exists() and (remote / "checkpoints" / "4" / "commit_success.txt").exists():
      break
    time.sleep(0.2)
  process.kill()
  output, _ = process.communicate(timeout=60)
  assert (remote / "checkpoints" / "4").exists(), output
  assert (remote / "workdir.lock").exists()  # left by the killed run; it must not block the resume

  resumed = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert "resumed from checkpoint at step" in resumed.stderr
  rows = [json.loads(line) for line in (remote / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in rows if "train/loss" in row] == list(range(1, steps + 1))
  assert all(np.isfinite(row["train/loss"]) for row in rows if "train/loss" in row)
  assert list((remote / "tensorboard").glob("events.out.tfevents.*"))
  for name in ("config.json", "model_config.json", "environment.json", "tokenizer"):
    assert (remote / name).exists(), name
  assert not (remote / "workdir.lock").exists()
  assert not (tmp_path / "gs:").exists() and not (REPO / "gs:").exists()


@pytest.mark.slow
def test_a_full_disk_during_an_async_checkpoint_stops_the_run_at_once_in_a_few_lines(prepared, tmp_path):
  """The file-size limit of the running trainer drops to a few bytes after its first checkpoint (every later write
  fails, as on a full disk): the run stops within a few steps with one line naming the checkpoint it resumes from,
  and that checkpoint still restores."""
  import resource
  steps = 400
  config_file = _tiny_config_file(tmp_path, prepared, steps)
  workdir = tmp_path / "run"
  command = [sys.executable, "-m", "bert_jax.cli", "pretrain", "--config", str(config_file), "--workdir",
             str(workdir), "--config.train.checkpoint_every=5", "--config.train.eval_every=0",
             "--config.train.log_every=1"]
  process = subprocess.Popen(command, env=_cli_cache_env(), cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 300
  while time.time() < deadline and process.poll() is None and not (workdir / "checkpoints" / "5").is_dir():
    time.sleep(0.05)
  resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (16, 16))
  stdout, stderr = process.communicate(timeout=300)
  assert process.returncode == 1, stdout + stderr
  error_lines = [line for line in stderr.splitlines() if "bert-jax pretrain: error" in line]
  assert len(error_lines) == 1 and "failed (OSError: File too large)" in error_lines[0], stderr
  # TensorStore's write callbacks into Orbax's asyncio loop, closed by the first failure, print "Event loop is
  # closed" tracebacks from library threads (more of them under load); any other traceback fails the test.
  noise = ("Traceback (most recent call last):", "base_events.py", "_check_closed", "Event loop is closed")
  ours = [line for line in stderr.splitlines() if line.strip() and not any(part in line for part in noise)]
  assert "the last complete checkpoint is step 5" in error_lines[0], stderr
  assert not any('File "' in line or ("Error:" in line and "bert-jax pretrain" not in line) for line in ours), stderr
  assert len(ours) < 40, stderr
  stopped = max(json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines())
  assert stopped < 30, stopped  # at once, not at a later save
  assert restore_params(workdir)[0] == 5


@pytest.mark.slow
def test_evaluate_run_rescoring_a_run_and_scoring_it_on_another_sentence_task(mlm_run):
  """`evaluate_run` with no change gives the run's own final evaluation (conftest.py's MLM run); with another
  objective and format it scores the checkpoint on that sentence task (ALBERT's cross-evaluation), a missing sentence
  head fresh."""
  again = trainer.evaluate_run(mlm_run)
  assert again == pytest.approx(json.loads((mlm_run.parent / "eval.json").read_text()), rel=1e-6)
  sop = trainer.evaluate_run(mlm_run, ["objective=mlm+sop", "data.format=sop"])
  assert 0.2 < sop["sentence_accuracy"] < 0.8 and np.isfinite(sop["mlm_loss"])
