"""Multi-host pre-training with real processes on this machine, checked against one process.

Each run below is `bert-jax pretrain` (the real CLI) in N processes with 2
CPU devices each, joined by `jax.distributed` on localhost, all writing one
shared workdir as hosts would on shared storage. The reference is one process
with 4 devices: the same global devices, batch and steps. A small driver wraps
the data pipeline to record the `example_ids` each process fed into each step.

  reference    1 process x 4 devices, data parallel, 6 steps (checkpoints at 3 and 6)
  two_process  2 processes x 2 devices, data parallel, 6 steps
  four_process 4 processes x 1 device, FSDP (every parameter split over the 4 processes), 6 steps, checked for
               everything two_process is
  resumed      the step-3 checkpoint of one run continued to step 6 by another
               process count (resharding on restore): 1 -> 2 and 4 -> 1
  preempted    2 processes, SIGTERM to process 0 only: both stop after the same
               step with a checkpoint; the same command again finishes the run (also
               with two steps a jitted call: both stop at the end of the same call)
"""

import dataclasses
import json
import pathlib
import shutil
import sys
import textwrap

import numpy as np
import pytest

import multiprocess_util
from test_trainer import prepared  # noqa: F401 - the session fixture (prepared built-in corpus)

pytestmark = pytest.mark.slow

TESTS = pathlib.Path(__file__).resolve().parent
STEPS, CHECKPOINT_EVERY, GLOBAL_BATCH = 6, 3, 16
MESHES = {"data": dict(data=-1, fsdp=1), "fsdp": dict(data=1, fsdp=-1)}

# Runs the CLI with the train pipeline wrapped to record the example ids of
# every batch this process fed, then reports them on a RESULT line. With
# SIGTERM_AT_BATCH=k, process 0 alone sends itself SIGTERM when it takes batch k.
_DRIVER = textwrap.dedent("""
    import json, os, signal, sys
    from bert_jax import cli
    from bert_jax.data import pipeline

    fed = []
    make_iterator = pipeline.pretraining_iterator
    sigterm_at = int(os.environ.get("SIGTERM_AT_BATCH", "0"))

    class Recording:
      def __init__(self, inner):
        self.inner = inner

      def __iter__(self):
        return self

      def __next__(self):
        batch = next(self.inner)
        # The batch is on the devices already: this process's rows are its shards', in row order.
        shards = {shard.index[0].start or 0: shard.data for shard in batch["example_ids"].addressable_shards}
        fed.append([int(i) for start in sorted(shards) for i in shards[start]])
        if len(fed) == sigterm_at and os.environ["BERT_JAX_PROCESS_ID"] == "0":
          os.kill(os.getpid(), signal.SIGTERM)
        return batch

      def __getattr__(self, name):
        return getattr(self.inner, name)

    def recording_iterator(*args, split, **kwargs):
      iterator = make_iterator(*args, split=split, **kwargs)
      return Recording(iterator) if split == "train" else iterator

    pipeline.pretraining_iterator = recording_iterator
    code = cli.main(sys.argv[1:])
    print("RESULT " + json.dumps({"exit": code, "fed": fed}), flush=True)
""")

_CONFIG = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_trainer import tiny_config

    def get_config(arg):
      config = tiny_config({prepared!r}, steps={steps}, log_every=1, eval_every={steps}, eval_batches=1,
                           checkpoint_every={checkpoint_every}, batch_size={batch})
      config.unlock()
      return config
""")


class Runner:
  """Starts `bert-jax pretrain` in N processes on the tiny config that `write_config` wrote in `root`; one
  compilation cache for the module."""

  @staticmethod
  def write_config(root: pathlib.Path, prepared_dir: pathlib.Path):
    (root / "tiny_multihost.py").write_text(_CONFIG.format(tests=str(TESTS), prepared=str(prepared_dir), steps=STEPS,
                                                           checkpoint_every=CHECKPOINT_EVERY, batch=GLOBAL_BATCH))

  def __init__(self, root: pathlib.Path):
    self.config_file = root / "tiny_multihost.py"
    # JAX reads and writes this cache on process 0 only, which still spares
    # that process's compile (and a CPU core) for programs seen before.
    self.env = {"JAX_COMPILATION_CACHE_DIR": str(root / "jax_cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}

  def __call__(self, workdir: pathlib.Path, num_processes: int, mesh: str, sigterm_at_batch: int = 0,
               overrides: tuple[str, ...] = ()) -> list[multiprocess_util.ProcessResult]:
    overrides = [f"--config.mesh.sizes.{axis}={size}" for axis, size in MESHES[mesh].items()] + list(overrides)
    command = [sys.executable, "-c", _DRIVER, "pretrain", "--config", str(self.config_file), "--workdir",
               str(workdir)] + overrides
    return multiprocess_util.run_processes(command, num_processes, local_devices=4 // num_processes,
                                           timeout_s=300,
                                           extra_env={**self.env, "SIGTERM_AT_BATCH": str(sigterm_at_batch)})


def metrics(workdir: pathlib.Path) -> list[dict]:
  """The run's metrics.jsonl records, in order."""
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def train_losses(workdir: pathlib.Path) -> dict[int, float]:
  """step -> train loss; fails on a step logged twice."""
  records = [r for r in metrics(workdir) if "train/loss" in r]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"duplicated metrics lines: steps {steps}"
  return {r["step"]: r["train/loss"] for r in records}


def fed_per_process(results) -> list[list[list[int]]]:
  """[process][step] -> example ids that process fed."""
  return [r.json()["fed"] for r in results]


def resume_copy(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
  """`source` as it was at the step-3 checkpoint: the later checkpoint and the metrics go."""
  shutil.copytree(source, target)
  shutil.rmtree(target / "checkpoints" / str(STEPS))
  (target / "metrics.jsonl").unlink()
  return target


def run_once(tmp_path_factory, name, run) -> tuple[pathlib.Path, list[multiprocess_util.ProcessResult]]:
  """(workdir, results) of `run(workdir)`, run once for xdist's workers (conftest.py's built_once): the tests of
  this module that read one run may be spread over both."""
  from conftest import built_once

  def build(root):
    results = run(root / "run")
    (root / "results.json").write_text(json.dumps([dataclasses.asdict(result) for result in results]))

  root = built_once(tmp_path_factory, name, build)
  return root / "run", [multiprocess_util.ProcessResult(**r) for r in json.loads((root / "results.json").read_text())]


@pytest.fixture(scope="session")
def runner(prepared, tmp_path_factory):  # noqa: F811
  from conftest import built_once
  return Runner(built_once(tmp_path_factory, "multihost", lambda root: Runner.write_config(root, prepared)))


@pytest.fixture(scope="session")
def reference(runner, tmp_path_factory):
  workdir, (result,) = run_once(tmp_path_factory, "multihost_reference", lambda workdir: runner(workdir, 1, "data"))
  return workdir, result.json()["fed"]


# Data parallel only: FSDP over processes from the first step is the four-process run's (same checks, below).
@pytest.fixture(scope="session")
def two_process(runner, tmp_path_factory):
  return run_once(tmp_path_factory, "multihost_two_process", lambda workdir: runner(workdir, 2, "data"))


def assert_losses_match(workdir, reference_dir, steps):
  """The run logged each of `steps` once, with the single-process run's loss."""
  expected, losses = train_losses(reference_dir), train_losses(workdir)
  assert sorted(losses) == list(steps)
  np.testing.assert_allclose([losses[s] for s in steps], [expected[s] for s in steps], rtol=1e-5)


def assert_rows_split_by_process(fed, reference_fed, steps):
  """Process p fed exactly rows [p*G/n, (p+1)*G/n) of each global batch the single process fed."""
  num_processes = len(fed)
  local = GLOBAL_BATCH // num_processes
  for process, batches in enumerate(fed):
    assert len(batches) == len(steps)
    for batch, step in zip(batches, steps):
      assert batch == reference_fed[step - 1][process * local:(process + 1) * local], (process, step)


def test_each_process_feeds_only_its_own_rows(two_process, reference):
  (_, results), (_, reference_fed) = two_process, reference
  assert_rows_split_by_process(fed_per_process(results), reference_fed, range(1, STEPS + 1))


def assert_evaluation_matches(workdir, reference_dir):
  """The run logged one evaluation, with the single-process run's MLM loss."""
  evaluation = [r for r in metrics(workdir) if "eval/mlm_loss" in r]
  reference_eval = [r for r in metrics(reference_dir) if "eval/mlm_loss" in r]
  assert len(evaluation) == 1
  np.testing.assert_allclose(evaluation[0]["eval/mlm_loss"], reference_eval[0]["eval/mlm_loss"], rtol=1e-5)


def assert_primary_only_side_effects_happen_once(workdir, results):
  """Files and reports of the whole run are written and printed once, by process 0."""
  assert len(metrics(workdir)) == STEPS + 1  # one line per train step and one eval line, no duplicates
  assert json.loads((workdir / "environment.json").read_text())["process_count"] == len(results)
  assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == STEPS
  assert len(list((workdir / "tensorboard").iterdir())) == 1  # one event file
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [str(CHECKPOINT_EVERY), str(STEPS)]
  primary = results[0].stdout
  assert primary.count("bert_jax pretrain:") == 1
  assert f"pretrain: {STEPS}/{STEPS} step (100%)" in primary  # the progress lines (not a terminal)
  assert primary.count("Checkpoints: ") == 1  # the CLI's closing report
  for result in results[1:]:
    for text in ("pretrain", "eval @", "Checkpoints", "MLM loss"):
      assert text not in result.stdout, f"process {result.process_id} printed {text!r}:\n{result.stdout}"


def test_losses_equal_the_single_process_run(two_process, reference):
  (workdir, _), (reference_dir, _) = two_process, reference
  assert_losses_match(workdir, reference_dir, range(1, STEPS + 1))
  assert_evaluation_matches(workdir, reference_dir)


def test_primary_only_side_effects_happen_once(two_process):
  assert_primary_only_side_effects_happen_once(*two_process)


def test_one_process_checkpoint_continues_in_two_processes_with_fsdp(reference, runner, tmp_path):
  """Written by 1 process with replicated parameters, restored sharded (FSDP) over 2 processes."""
  reference_dir, reference_fed = reference
  workdir = resume_copy(reference_dir, tmp_path / "resumed")
  results = runner(workdir, 2, "fsdp")
  assert_rows_split_by_process(fed_per_process(results), reference_fed, range(CHECKPOINT_EVERY + 1, STEPS + 1))
  assert_losses_match(workdir, reference_dir, range(CHECKPOINT_EVERY + 1, STEPS + 1))


@pytest.mark.slow
def test_four_processes_with_fsdp_equal_the_single_process_run_and_continue_in_one(reference, runner, tmp_path):
  """4 processes with one device each, FSDP from the first step: rows, losses, evaluation and side effects as one
  process; the checkpoint, each process holding its own parameter shards, is restored and continued by 1 process
  (replicated)."""
  reference_dir, reference_fed = reference
  workdir = tmp_path / "four_process"
  results = runner(workdir, 4, "fsdp")
  assert_rows_split_by_process(fed_per_process(results), reference_fed, range(1, STEPS + 1))
  assert_losses_match(workdir, reference_dir, range(1, STEPS + 1))
  assert_evaluation_matches(workdir, reference_dir)
  assert_primary_only_side_effects_happen_once(workdir, results)

  resumed = resume_copy(workdir, tmp_path / "resumed")
  (result,) = runner(resumed, 1, "data")
  assert_rows_split_by_process([result.json()["fed"]], reference_fed, range(CHECKPOINT_EVERY + 1, STEPS + 1))
  assert_losses_match(resumed, reference_dir, range(CHECKPOINT_EVERY + 1, STEPS + 1))


def test_sigterm_with_two_steps_a_call_stops_all_at_the_end_of_the_same_call_and_resumes(reference, runner, tmp_path):
  """A preemption notice reaching only process 0 still stops both processes at the end of the same call, with a
  checkpoint (`train.steps_per_call=2`: JAX's preemption service counts calls); the run resumes on the reference's
  batches, and each logged loss is the mean of the reference's two steps."""
  reference_dir, reference_fed = reference
  workdir = tmp_path / "preempted_two_a_call"
  overrides = ("--config.train.steps_per_call=2", "--config.train.log_every=2", "--config.train.checkpoint_every=2")
  results = runner(workdir, 2, "data", sigterm_at_batch=2, overrides=overrides)
  stopped = {len(fed) for fed in fed_per_process(results)}
  assert len(stopped) == 1, f"processes stopped after different steps: {stopped}"
  (stop,) = stopped
  assert stop % 2 == 0 and 2 <= stop <= STEPS, stop
  assert f"Preempted at step {stop}" in results[0].stdout
  assert all(f"stop requested (SIGTERM or Ctrl-C): saved checkpoint at step {stop}" in r.stdout for r in results)
  assert_rows_split_by_process(fed_per_process(results), reference_fed, range(1, stop + 1))
  results = runner(workdir, 2, "data", overrides=overrides)  # the same command again
  assert_rows_split_by_process(fed_per_process(results), reference_fed, range(stop + 1, STEPS + 1))
  expected, losses = train_losses(reference_dir), train_losses(workdir)
  assert sorted(losses) == list(range(2, STEPS + 1, 2))
  np.testing.assert_allclose([losses[s] for s in sorted(losses)],
                             [(expected[s - 1] + expected[s]) / 2 for s in sorted(losses)], rtol=1e-5)
