"""`bert-jax sample-rte`: RTE's files and layout, a learnable label, the same bytes every run, a safe --out."""

from __future__ import annotations

import re

import numpy as np
import pytest

from bert_jax import cli
from bert_jax.tasks import get_task
from bert_jax.tasks import sample


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  out = tmp_path_factory.mktemp("sample")
  counts = sample.write_sample_rte(str(out))
  return out, counts


def test_files_are_rtes_layout_read_by_the_glue_reader(written):
  out, counts = written
  assert sorted(path.name for path in (out / "RTE").iterdir()) == ["dev.tsv", "test.tsv", "train.tsv"]
  assert (out / "RTE" / "train.tsv").read_text().split("\n", 1)[0] == "index\tsentence1\tsentence2\tlabel"
  assert (out / "RTE" / "test.tsv").read_text().split("\n", 1)[0] == "index\tsentence1\tsentence2"
  task = get_task("glue/rte")
  splits = {split: task.load(out, split) for split in ("train", "dev", "test")}
  assert {split: len(rows) for split, rows in splits.items()} == counts == sample.SPLIT_SIZES
  for split in ("train", "dev"):
    labels = [example.label for example in splits[split]]
    assert labels.count("entailment") == labels.count("not_entailment")
  assert all(example.label is None for example in splits["test"])
  assert "not GLUE" in (out / "README.txt").read_text()
  # Documents are split, not pairs: no sentence is in two splits.
  sentences = {split: {text for example in rows for text in (example.text_a, example.text_b)}
               for split, rows in splits.items()}
  assert not sentences["train"] & sentences["dev"] and not sentences["train"] & sentences["test"]
  assert not sentences["dev"] & sentences["test"]


def _overlap(example) -> float:
  """The fraction of sentence2's words that sentence1 has too."""
  first, second = (set(re.findall(r"\w+", text.lower())) for text in (example.text_a, example.text_b))
  return len(first & second) / max(len(second), 1)


def test_the_label_is_learnable_by_word_overlap_alone(written):
  """A threshold on word overlap, chosen on train, beats chance on dev: the label is real, and easy."""
  task = get_task("glue/rte")
  train, dev = task.load(written[0], "train"), task.load(written[0], "dev")
  overlaps, follows = (np.array([_overlap(e) for e in train]), np.array([e.label == "entailment" for e in train]))
  threshold = max(np.unique(overlaps), key=lambda t: ((overlaps >= t) == follows).mean())
  dev_accuracy = np.mean([(_overlap(e) >= threshold) == (e.label == "entailment") for e in dev])
  assert dev_accuracy > 0.6


def test_same_bytes_every_run_and_a_rerun_rewrites_the_sample(written, tmp_path):
  out, _ = written
  for rerun in (tmp_path, out):  # a fresh folder, and the earlier sample rewritten without --force
    sample.write_sample_rte(str(rerun))
    for name in ("train.tsv", "dev.tsv", "test.tsv"):
      assert (rerun / "RTE" / name).read_bytes() == (out / "RTE" / name).read_bytes()


def test_a_non_empty_folder_or_a_file_is_refused_in_one_line(tmp_path, capsys):
  (tmp_path / "notes.txt").write_text("mine")
  assert cli.main(["sample-rte", "--out", str(tmp_path)]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"--out {tmp_path} is not empty (notes.txt)" in err and "--force" in err
  assert not (tmp_path / "RTE").exists()
  assert cli.main(["sample-rte", "--out", str(tmp_path), "--force"]) == 0
  assert (tmp_path / "RTE" / "dev.tsv").exists() and (tmp_path / "notes.txt").read_text() == "mine"
  assert cli.main(["sample-rte", "--out", str(tmp_path / "notes.txt")]) == 1
  assert "is a file" in capsys.readouterr().err
