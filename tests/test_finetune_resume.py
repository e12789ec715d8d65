"""Fine-tuning stops on SIGTERM as pre-training does and a rerun resumes the stopped seed: a real process gets a
real signal in the middle of seed 2's second epoch (after its first evaluation; seed 1 is finished), saves the seed's
training state, says so in one line and exits 1 with its workdir lock let go; the same run started again keeps seed
1, continues seed 2 from that step, and ends with the scores, evaluation history, logged rows and selected
parameters of the run that was never stopped, bit for bit.
"""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from bert_jax.train import checkpoint as checkpoint_lib
from test_finetune import FAST, REPO, _finetune, _glue_sst2

SPEC = "configs/finetune/glue.py:task=sst2"
# 192 training rows in batches of 16: 12 steps an epoch, dev scored after each; two seeds. A row every step: a stop
# logs the steps since the last row, so a coarser interval would split one row of the uninterrupted run in two.
OVERRIDES = ["--config.train.epochs=3", "--config.seeds=(1,2)", "--config.train.save_checkpoint=True",
             "--config.train.log_every=1"]
STOP_AT = 17  # seed 2, epoch 2, after the evaluation at step 12 and before the better one at 24

# The CLI in a process that sends itself SIGTERM after seed 2's step STOP_AT, the way a scheduler's preemption comes.
_SIGTERM_AT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from bert_jax import cli
from bert_jax.train import loop

due = loop.CheckpointHook.due

def preempted(self, step, last):
  if step == {step} and not self.preemption.requested and self.checkpointer.directory.parent.name == "seed_2":
    os.kill(os.getpid(), signal.SIGTERM)
  return due(self, step, last)

loop.CheckpointHook.due = preempted
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
  return _glue_sst2(tmp_path_factory.mktemp("resume_data") / "glue", np.random.default_rng(0))


def _selected_params(seed_dir: pathlib.Path) -> dict[str, np.ndarray]:
  _, params = checkpoint_lib.restore_params(seed_dir)
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _rows(seed_dir: pathlib.Path, prefix: str) -> list[dict]:
  """metrics.jsonl's rows of `prefix` (train/ or eval/), timing columns left out: those differ run to run."""
  rows = [json.loads(line) for line in (seed_dir / "metrics.jsonl").read_text().splitlines()]
  return [{key: value for key, value in row.items() if not key.endswith(("_per_second", "mfu"))}
          for row in rows if any(key.startswith(prefix) for key in row)]


@pytest.mark.slow
def test_sigterm_saves_the_seed_and_the_rerun_ends_as_the_uninterrupted_run(tiny_model, data, tmp_path):
  straight = _finetune(SPEC, tiny_model, data, tmp_path / "straight", *OVERRIDES)

  workdir = tmp_path / "stopped"
  args = ["finetune", "--config", f"{REPO / 'configs/finetune/glue.py'}:task=sst2", "--workdir", str(workdir),
          f"--config.init.model={tiny_model}", f"--config.data_dir={data}", *FAST, *OVERRIDES]
  out = subprocess.run([sys.executable, "-c", _SIGTERM_AT.format(tests=str(REPO / "tests"), step=STOP_AT), *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stdout + out.stderr
  assert "Traceback" not in out.stderr, out.stderr
  said = [line for line in out.stdout.splitlines() if "stop requested" in line]
  assert said == [f"bert-jax finetune: stop requested (SIGTERM or Ctrl-C): seed 2's training state at step {STOP_AT} "
                  f"is saved in {workdir / 'seed_2' / 'state'}; the same command resumes it"], out.stdout
  assert not (workdir / "workdir.lock").exists()
  assert checkpoint_lib.Checkpointer(workdir / "seed_2", folder="state").steps() == [STOP_AT]
  assert (workdir / "seed_1" / "result.json").exists() and not (workdir / "seed_2" / "result.json").exists()
  assert checkpoint_lib.complete_steps(workdir / "seed_2") == [12]  # the selection so far

  resumed = _finetune(SPEC, tiny_model, data, workdir, *OVERRIDES)
  for ours, theirs in zip(resumed["seeds"], straight["seeds"], strict=True):
    assert ours["selected"] == theirs["selected"] and ours["history"] == theirs["history"]
    assert ours["steps"] == theirs["steps"] == 36
  assert resumed["summary"] == straight["summary"]
  for seed in (1, 2):
    ours, theirs = workdir / f"seed_{seed}", tmp_path / "straight" / f"seed_{seed}"
    assert not (ours / "state").exists()  # a finished seed keeps its result and selected parameters only
    assert _rows(ours, "train/") == _rows(theirs, "train/") and _rows(ours, "eval/") == _rows(theirs, "eval/")
    assert all(0.0 <= row["eval/accuracy"] <= 1.0 for row in _rows(ours, "eval/"))  # logged as a fraction
    ours_params, theirs_params = _selected_params(ours), _selected_params(theirs)
    assert ours_params.keys() == theirs_params.keys()
    for name, array in ours_params.items():
      assert array.tobytes() == theirs_params[name].tobytes(), name
