"""SWAG: swagaf CSV reading (generated files), [N, 4, L] features, accuracy, bad input."""

import csv

import numpy as np
import pytest

from bert_jax.tasks import get_task
from bert_jax.tasks.base import HFTokenizerAdapter
from bert_jax.tasks.swag import MultipleChoiceExample, read_swag_csv

HEADER = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source",
          "ending0", "ending1", "ending2", "ending3", "label"]


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return HFTokenizerAdapter.from_vocab_file(minilm_dir / "vocab.txt")


def _write_csv(path, rows, header=HEADER):
  with open(path, "w", encoding="utf-8", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    writer.writerows(rows)
  return path


def _row(index, label="2"):
  return [str(index), f"anetv_{index}", str(1000 + index), "Students lower their eyes. She",
          "Students lower their eyes.", "She", "gold", "pats her shoulder, then \"smiles\".",
          "turns with two students.", "walks slowly towards someone.", "wheels around.", label]


def test_reads_generated_csv_with_quotes(tmp_path):
  path = _write_csv(tmp_path / "val.csv", [_row(0), _row(1, "0")])
  examples = get_task("swag").load(tmp_path, "dev")
  assert examples[0] == MultipleChoiceExample(
      "1000", "Students lower their eyes.", "She",
      ("pats her shoulder, then \"smiles\".", "turns with two students.", "walks slowly towards someone.",
       "wheels around."), 2)
  assert [e.label for e in read_swag_csv(path)] == [2, 0]
  test_path = _write_csv(tmp_path / "test.csv", [_row(5)[:-1]], header=HEADER[:-1])
  assert read_swag_csv(test_path)[0].label is None


@pytest.mark.parametrize("rows,header,message", [
    ([_row(0), _row(1, "4")], HEADER, r"val\.csv:3: label '4' is not one of 0\.\.3"),
    ([_row(0), _row(1)[:-2]], HEADER, r"val\.csv:3: expected 12 columns, found 10"),
    ([_row(0)], [h if h != "sent2" else "second" for h in HEADER], r"val\.csv:1: header lacks columns \['sent2'\]"),
    ([], HEADER, r"val\.csv: file has a header but no rows"),
])
def test_bad_files_name_file_and_line(tmp_path, rows, header, message):
  _write_csv(tmp_path / "val.csv", rows, header)
  with pytest.raises(ValueError, match=message):
    read_swag_csv(tmp_path / "val.csv")
  (tmp_path / "empty.csv").write_text("")
  with pytest.raises(ValueError, match=r"empty\.csv: file is empty"):
    read_swag_csv(tmp_path / "empty.csv")


def test_features_have_a_choice_axis(tokenizer):
  example = MultipleChoiceExample("7", "The man opens the door.", "He", ("walks in.", "sings loudly today.",
                                                                       "sits.", "leaves quickly."), 1)
  task = get_task("swag")
  features = task.featurize([example, example], tokenizer, max_len=20)
  assert features["input_ids"].shape == (2, 4, 20) and features["segment_ids"].shape == (2, 4, 20)
  assert features["lengths"].shape == (2, 4) and features["labels"].tolist() == [1, 1]
  (context_ids, ending_ids), _ = tokenizer.tokenize_with_offsets(["The man opens the door.", "He sings loudly today."])
  expected = [tokenizer.cls_id, *context_ids, tokenizer.sep_id, *ending_ids, tokenizer.sep_id]
  assert features["input_ids"][0, 1, :len(expected)].tolist() == expected
  assert features["segment_ids"][0, 1, :len(expected)].tolist() == [0] * (len(context_ids) + 2) + [1] * (
      len(ending_ids) + 1)
  assert features["lengths"][0, 1] == len(expected)


def test_accuracy_and_shape_checks():
  task = get_task("swag")
  examples = [MultipleChoiceExample(str(i), "c", "s", ("a", "b", "c", "d"), label) for i, label in enumerate([0, 3, 2])]
  features = {"input_ids": np.zeros((3, 4, 8), np.int32)}
  scores = np.array([[5.0, 0, 0, 0], [0, 0, 0, 1.0], [0, 9.0, 0, 0]])
  assert task.predict(scores, features, examples) == [0, 3, 1]
  assert task.evaluate(scores, features, examples) == {"accuracy": pytest.approx(200 / 3)}
  with pytest.raises(ValueError, match="expected"):
    task.evaluate(scores[:, :3], features, examples)
