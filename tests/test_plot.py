"""`bert-jax plot`: resumed runs' rows de-duplicated, one PNG per quantity, several runs on one axis."""

from __future__ import annotations

import json

import pytest

from bert_jax.train import plot


def _write(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _train(step, loss):
  return {"step": step, "train/loss": loss, "train/mlm_accuracy": 1 - loss / 10, "train/learning_rate": 1e-4,
          "train/tokens_per_second": 1000.0}


def test_resumed_rows_are_drawn_once(tmp_path):
  # Killed after logging step 30 with its last checkpoint at 20; the resumed run logs 30 and 40 again.
  rows = [_train(10, 5.0), _train(20, 4.0), _train(30, 3.5), {"step": 20, "eval/loss": 4.2},
          _train(30, 3.0), _train(40, 2.0), {"step": 40, "eval/loss": 2.5}]
  _write(tmp_path / "metrics.jsonl", rows)
  read = plot.read_rows(tmp_path / "metrics.jsonl")
  train = [(row["step"], row["train/loss"]) for row in read if "train/loss" in row]
  assert train == [(10, 5.0), (20, 4.0), (30, 3.0), (40, 2.0)]
  assert [row["step"] for row in read if "eval/loss" in row] == [20, 40]


def test_plots_of_a_pretraining_and_a_finetuning_workdir(tmp_path):
  pretrain, finetune = tmp_path / "demo", tmp_path / "rte"
  _write(pretrain / "metrics.jsonl", [_train(s, 6 - s / 100) for s in range(100, 500, 100)])
  (pretrain / "config.json").write_text(json.dumps({"train": {"batch_size": 8}, "data": {"seq_len": 64}}))
  for seed in (1, 2):
    _write(finetune / f"seed_{seed}" / "metrics.jsonl",
           [_train(s, 0.7 - s / 1000) for s in (10, 20)] + [{"step": 20, "eval/accuracy": 0.6}])
  written = plot.plot([str(pretrain), str(finetune)], tmp_path / "plots")
  assert sorted(path.name for path in written) == ["accuracy.png", "learning_rate.png", "loss.png",
                                                   "loss_vs_tokens.png", "throughput.png"]
  for path in written:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert [label for label, _, _ in plot.find_runs([str(pretrain), str(finetune)])] == [
      str(pretrain), f"{finetune}/seed_1", f"{finetune}/seed_2"]


def test_a_folder_without_metrics_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
    plot.main([str(tmp_path), "--out", str(tmp_path / "plots")])


def test_scores_share_one_axis_in_fractions_whatever_unit_a_run_logged(tmp_path):
  """Every command logs scores as fractions; a fine-tuning run logged before that rule (dev accuracy in percent) is
  drawn in fractions too, and the axis says the unit."""
  _write(tmp_path / "metrics.jsonl", [{"step": 10, "train/task_accuracy": 0.5}, {"step": 10, "eval/accuracy": 62.5},
                                      {"step": 20, "eval/accuracy": 75.0}, {"step": 20, "train/task_accuracy": 1.0}])
  rows = plot.read_rows(tmp_path / "metrics.jsonl")
  assert plot._points(rows, "eval/accuracy", "accuracy") == [(10, 0.625), (20, 0.75)]
  assert plot._points(rows, "train/task_accuracy", "accuracy") == [(10, 0.5), (20, 1.0)]
  assert plot.Y_LABELS["accuracy"] == "accuracy / score (fraction, 0-1)"
