"""The scaffold both drivers share (`bert_jax.train.run`): the workdir's lock, the Ctrl-C line, the mesh, the run
files, the banner and the saved config; no training."""

from __future__ import annotations

import dataclasses
import json

from etils import epath
import jax
import ml_collections
import numpy as np
import pytest

from bert_jax.models import model_config
from bert_jax.tasks import finetune as finetune_lib
from bert_jax.tasks import finetune_config
from bert_jax.train import config_lib, run as run_lib, trainer
from bert_jax.train import workdir as workdir_lib


class _Tokenizer:
  """Stands in for a tokenizer: `save` writes one file into the folder it is given."""

  def save(self, directory) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("[PAD]\n[UNK]\n")


def test_the_lock_is_held_inside_and_let_go_after(tmp_path):
  with run_lib.locked(tmp_path / "run", lambda workdir: "unused") as (workdir, primary):
    assert isinstance(workdir, epath.Path) and workdir == epath.Path(tmp_path / "run")
    assert primary
    assert (workdir / workdir_lib.LOCK_FILE).exists()
    with pytest.raises(workdir_lib.WorkdirBusyError):  # A second run in the same workdir refuses.
      workdir_lib.WorkdirLock.acquire(workdir)
  assert not (tmp_path / "run" / workdir_lib.LOCK_FILE).exists()


def test_an_error_passes_unchanged_and_the_lock_is_let_go(tmp_path):
  with pytest.raises(ValueError, match="^boom$"):
    with run_lib.locked(tmp_path, lambda workdir: "unused"):
      raise ValueError("boom")
  assert not (tmp_path / workdir_lib.LOCK_FILE).exists()


def test_ctrl_c_becomes_one_line_naming_what_is_kept(tmp_path):
  with pytest.raises(InterruptedError) as caught:
    with run_lib.locked(tmp_path, lambda workdir: f"what is kept in {workdir}"):
      raise KeyboardInterrupt
  assert str(caught.value) == f"stopped by Ctrl-C; what is kept in {tmp_path}"
  assert caught.value.__suppress_context__  # printed alone, without the KeyboardInterrupt's traceback
  assert not (tmp_path / workdir_lib.LOCK_FILE).exists()


def test_each_driver_says_what_a_ctrl_c_at_start_up_keeps(tmp_path, monkeypatch):
  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(trainer, "_train_and_evaluate", interrupted)
  monkeypatch.setattr(finetune_lib, "_finetune", interrupted)
  with pytest.raises(InterruptedError) as pretrain:
    trainer.train_and_evaluate(config_lib.pretrain_defaults(), tmp_path / "pretrain")
  assert str(pretrain.value) == (f"stopped by Ctrl-C; no complete checkpoint exists in "
                                 f"{tmp_path / 'pretrain' / 'checkpoints'}, where the same command resumes")
  with pytest.raises(InterruptedError) as finetune:
    finetune_lib.finetune(finetune_config.finetune_defaults(), tmp_path / "finetune")
  assert str(finetune.value) == (f"stopped by Ctrl-C; the seeds finished in {tmp_path / 'finetune'} "
                                 "(seed_<s>/result.json) are kept, and the same command trains the others")
  assert not any(tmp_path.glob(f"*/{workdir_lib.LOCK_FILE}"))


def test_mesh_and_partitioning_validate_against_the_data_parallel_size():
  config = config_lib.pretrain_defaults()
  seen = []
  mesh, partitioning = run_lib.mesh_and_partitioning(config, lambda config, data_parallel: seen.append(data_parallel))
  assert mesh.size == jax.device_count() and partitioning.mesh is mesh
  assert seen == [mesh.shape["data"] * mesh.shape["fsdp"]]

  def refuse(config, data_parallel):
    raise ValueError(f"batch does not divide {data_parallel}")

  with pytest.raises(ValueError, match="batch does not divide"):
    run_lib.mesh_and_partitioning(config, refuse)


def test_run_files_are_indented_json_and_the_tokenizer(tmp_path):
  config = ml_collections.ConfigDict({"seed": 3, "train": {"steps": 10}, "data": {"prepared": epath.Path("/data")}})
  model_cfg = model_config("bert", "tiny", vocab_size=120)
  workdir = epath.Path(tmp_path / "run")
  run_lib.write_run_files(workdir, config, model_cfg, _Tokenizer(), {"environment.json": {"jax": jax.__version__}})
  assert (workdir / "config.json").read_text() == json.dumps(config.to_dict(), indent=2, default=str) + "\n"
  assert json.loads((workdir / "config.json").read_text())["data"]["prepared"] == "/data"
  # The dataclass's fields, as the model loaders read them back.
  assert (workdir / "model_config.json").read_text() == json.dumps(model_cfg.__dict__, indent=2) + "\n"
  assert json.loads((workdir / "environment.json").read_text()) == {"jax": jax.__version__}
  assert (workdir / "tokenizer" / "vocab.txt").exists()

  run_lib.write_run_files(workdir, config, model_cfg, _Tokenizer(), end="")
  assert (workdir / "config.json").read_text() == json.dumps(config.to_dict(), indent=2, default=str)


def test_banner_lines(capsys):
  run_lib.banner("pretrain", "objective=mlm model=bert/tiny", 1_234_567, f"{run_lib.batch_sizes(16)} seq_len=128",
                 epath.Path("/runs/demo"))
  per_host = 16 // jax.process_count()
  assert capsys.readouterr().out == (f"bert_jax pretrain: objective=mlm model=bert/tiny params=1.23M\n"
                                     f"  global batch=16 per-host batch={per_host} seq_len=128\n"
                                     f"  workdir=/runs/demo\n")
  run_lib.banner("finetune", "task=rte", 2_000_000, "seeds=(1,)", "runs/rte", ("runs/teacher", {"soft": 1.0}))
  assert capsys.readouterr().out == ("bert_jax finetune: task=rte params=2.00M\n  seeds=(1,)\n  workdir=runs/rte\n"
                                     "  distilling from runs/teacher: loss weights {'soft': 1.0}\n")


def test_saved_config_takes_the_defaults_of_keys_newer_than_the_run(tmp_path):
  defaults = ml_collections.ConfigDict({"seed": 0, "train": {"steps": 100, "new_key": "default"}, "added": [1]})
  (tmp_path / "config.json").write_text(json.dumps({"seed": 7, "train": {"steps": 5}, "old_only": True}))
  config = run_lib.saved_config(tmp_path, defaults)
  assert config.to_dict() == {"seed": 7, "train": {"steps": 5, "new_key": "default"}, "added": [1], "old_only": True}
  with pytest.raises(FileNotFoundError, match="bert_jax run directory"):
    run_lib.saved_config(tmp_path / "missing", defaults)


class _Throughput:
  """Stands in for `metrics.Throughput`: a fixed rate."""

  def update(self, step: int) -> dict[str, float]:
    return {"tokens_per_second": 10.0 * step}


def test_the_train_log_drops_an_interrupted_runs_later_rows_then_writes_and_keeps_its_own(tmp_path):
  rows = [{"step": step, "train/loss": 1.0} for step in (2, 4, 6)]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
  train_log = run_lib.TrainLog(epath.Path(tmp_path), 4, True, _Throughput(), None)
  train_log(6, {"loss": 0.5})
  train_log.writer.close()
  written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [row["step"] for row in written] == [2, 4, 6]  # the old step 6 went; the resumed run logged it again
  assert written[-1]["train/loss"] == 0.5 and written[-1]["train/tokens_per_second"] == 60.0
  assert train_log.last == {"loss": 0.5, "tokens_per_second": 60.0}
  assert train_log.history == [{"step": 6, "loss": 0.5, "tokens_per_second": 60.0}]


def test_a_teachers_forward_pass_counts_a_third_of_its_training_flops():
  plain = run_lib.throughput(100, 30.0, 1)
  distilling = run_lib.throughput(100, 30.0, 1, teacher_flops_per_token=90.0)
  assert (plain.flops_per_token, distilling.flops_per_token) == (30.0, 60.0)


def test_a_seeds_batches_from_any_step_are_the_rest_of_its_batches_from_step_0():
  from bert_jax.tasks.batching import BatchMaker, epoch_batches
  from bert_jax.parallel import sharding

  features = {"input_ids": np.arange(20 * 4).reshape(20, 4), "labels": np.arange(20)}
  make_batch = BatchMaker(("input_ids", "labels"), 8, sharding.create_mesh({"data": -1}))
  labels = lambda batches: [np.asarray(batch["labels"]).tolist() for batch in batches]  # noqa: E731
  whole = labels(epoch_batches(make_batch, features, 3, 2, 0))
  assert len(whole) == 6  # three batches an epoch, the last padded
  for epoch in (whole[:3], whole[3:]):  # every row once an epoch, in an order of its own
    assert sorted(sum(epoch, [])[:20]) == list(range(20))
  assert whole[:3] != whole[3:]
  assert all(labels(epoch_batches(make_batch, features, 3, 2, start)) == whole[start:] for start in range(7))
  assert labels(epoch_batches(make_batch, features, 4, 2, 0)) != whole  # another seed, another order


def test_the_selection_keeps_the_best_or_the_last_and_counts_for_early_stopping():
  from bert_jax.tasks.evaluate import Selection

  class _Task:
    eval_splits, selection_metric = ("dev",), "accuracy"

  records = [{"step": step, "metrics": {"dev": {"accuracy": value}}} for step, value in ((1, 50.0), (2, 60.0),
                                                                                          (3, 60.0), (4, 55.0))]
  best, last = Selection(), Selection()
  assert [best.add(record, _Task, keep_last=False) for record in records] == [True, True, False, False]
  assert best.selected["step"] == 2 and best.evaluations_since_best == 2  # a tie keeps the earlier evaluation
  assert [last.add(record, _Task, keep_last=True) for record in records] == [True] * 4
  assert last.selected["step"] == 4 and last.history == records
  assert Selection(**dataclasses.asdict(best)) == best  # what a stopped seed saves restores it
