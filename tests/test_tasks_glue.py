"""GLUE readers (real files and bad input), featurisation, metrics, submissions, TFDS path."""

import collections
import importlib.util
import json
import sys
import types

import numpy as np
import pytest

from bert_jax.tasks import get_task
from bert_jax.tasks.base import HFTokenizerAdapter, TextPairExample
from bert_jax.tasks import glue
from bert_jax.tasks.glue import SPECS, GlueTask

# Rows of the real files, from shared/data/SOURCES.md.
REAL_ROW_COUNTS = {
    ("cola", "train"): 8551, ("cola", "dev"): 1043, ("cola", "test"): 1063,
    ("sst2", "train"): 67349, ("sst2", "test"): 1821,
    ("mrpc", "train"): 3668, ("mrpc", "dev"): 408, ("mrpc", "test"): 1725,
    ("stsb", "train"): 5749, ("stsb", "dev"): 1500, ("stsb", "test"): 1379,
    ("rte", "train"): 2490, ("rte", "dev"): 277, ("rte", "test"): 3000,
    ("wnli", "train"): 635, ("wnli", "dev"): 71, ("wnli", "test"): 146,
}
TRAIN_LABEL_COUNTS = {
    "cola": {"1": 6023, "0": 2528},
    "sst2": {"1": 37569, "0": 29780},
    "mrpc": {"1": 2474, "0": 1194},
    "rte": {"entailment": 1249, "not_entailment": 1241},
    "wnli": {"0": 323, "1": 312},
}


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return HFTokenizerAdapter.from_vocab_file(minilm_dir / "vocab.txt")


@pytest.mark.shared_data
@pytest.mark.parametrize("task_name,split", sorted(REAL_ROW_COUNTS))
def test_real_files_row_counts(shared_data, task_name, split):
  examples = get_task(f"glue/{task_name}").load(shared_data / "glue", split)
  assert len(examples) == REAL_ROW_COUNTS[task_name, split]
  if split == "test":
    assert all(e.label is None for e in examples)
    assert [e.guid for e in examples[:3]] == ["0", "1", "2"]
  if split == "train" and task_name in TRAIN_LABEL_COUNTS:
    labels = [e.label for e in examples]
    assert {label: labels.count(label) for label in set(labels)} == TRAIN_LABEL_COUNTS[task_name]
  if task_name == "stsb" and split != "test":
    assert all(0.0 <= e.label <= 5.0 for e in examples)


@pytest.mark.shared_data
def test_real_files_fields(shared_data):
  mrpc = get_task("glue/mrpc").load(shared_data / "glue", "train")
  assert mrpc[0].text_a.startswith("Amrozi accused his brother")  # BOM header skipped
  rte = get_task("glue/rte").load(shared_data / "glue", "train")
  assert rte[2164].text_a.startswith('"')  # a field opening with a quote stays as is
  cola = get_task("glue/cola").load(shared_data / "glue", "dev")
  assert cola[0].text_a == "The sailors rode the breeze clear of the rocks." and cola[0].label == "1"


def _write(path, text):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text, encoding="utf-8")
  return path


@pytest.mark.parametrize("content,message", [
    ("", r"RTE[/\\]train\.tsv: file is empty"),
    ("index\tsentence1\tsentence2\tlabel\n", r"train\.tsv: file has a header but no rows"),
    ("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\n",
     r"train\.tsv:3: expected 4 tab-separated columns, found 3"),
    ("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tb\tcontradiction\n",
     r"train\.tsv:3: label 'contradiction' is not one of"),
])
def test_bad_rte_files_name_file_and_line(tmp_path, content, message):
  _write(tmp_path / "RTE" / "train.tsv", content)
  with pytest.raises(ValueError, match=message):
    get_task("glue/rte").load(tmp_path, "train")


def test_a_byte_that_is_not_utf8_names_file_line_and_column(tmp_path):
  path = tmp_path / "SST-2" / "dev.tsv"
  path.parent.mkdir(parents=True)
  path.write_bytes("sentence\tlabel\nfine\t1\ncaf\u00e9 ok\t0\n".encode("utf-8") + "na\u00efve\t1\n".encode("latin-1"))
  with pytest.raises(ValueError, match=r"SST-2[/\\]dev\.tsv:4: byte 0xef at column 3 is not UTF-8; convert"):
    get_task("glue/sst2").load(tmp_path, "dev")


def test_bad_cola_and_stsb_rows(tmp_path):
  _write(tmp_path / "CoLA" / "dev.tsv", "gj04\t1\t\tGood.\ngj04\t2\t*\tBad.\n")
  with pytest.raises(ValueError, match=r"dev\.tsv:2: label '2'"):
    get_task("glue/cola").load(tmp_path, "dev")
  header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
  _write(tmp_path / "STS-B" / "dev.tsv", header + "0\tg\tf\ty\t0\tn\tn\ta\tb\t5.5\n")
  with pytest.raises(ValueError, match=r"dev\.tsv:2: score 5\.5 is outside"):
    get_task("glue/stsb").load(tmp_path, "dev")


def test_mnli_layout_and_splits(tmp_path):
  train_header = ["index", "promptID", "pairID", "genre", "s1b", "s2b", "s1p", "s2p",
                  "sentence1", "sentence2", "label1", "gold_label"]
  dev_header = train_header[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
  _write(tmp_path / "MNLI" / "train.tsv", "\t".join(train_header) + "\n"
         + "\t".join(["7", "", "", "", "", "", "", "", "P", "H", "neutral", "neutral"]) + "\n")
  _write(tmp_path / "MNLI" / "dev_mismatched.tsv", "\t".join(dev_header) + "\n"
         + "\t".join(["3"] + [""] * 7 + ["P2", "H2"] + ["x"] * 5 + ["contradiction"]) + "\n")
  task = get_task("glue/mnli")
  train = task.load(tmp_path, "train")[0]
  assert (train.guid, train.text_a, train.text_b, train.label) == ("7", "P", "H", "neutral")
  dev = task.load(tmp_path, "dev_mismatched")[0]
  assert (dev.guid, dev.text_a, dev.text_b, dev.label) == ("3", "P2", "H2", "contradiction")
  assert task.eval_splits == ("dev_matched", "dev_mismatched")
  with pytest.raises(ValueError, match="no split 'dev'"):
    task.load(tmp_path, "dev")


def test_featurize_pairs_and_single_sentences(tokenizer):
  task = get_task("glue/rte")
  examples = [TextPairExample("0", "The cat sat.", "A cat is sitting on the mat.", "entailment"),
              TextPairExample("1", "word " * 40, "short", None)]
  features = task.featurize(examples, tokenizer, max_len=16)
  assert features["input_ids"].shape == (2, 16) and features["input_ids"].dtype == np.int32
  (ids_a, ids_b), _ = tokenizer.tokenize_with_offsets([examples[0].text_a, examples[0].text_b])
  expected = [tokenizer.cls_id, *ids_a, tokenizer.sep_id, *ids_b, tokenizer.sep_id]
  assert features["lengths"][0] == len(expected)
  assert features["input_ids"][0].tolist() == expected + [tokenizer.pad_id] * (16 - len(expected))
  assert features["segment_ids"][0].tolist() == [0] * (len(ids_a) + 2) + [1] * (len(ids_b) + 1) + [0] * (
      16 - len(expected))
  # The long first segment is trimmed; the short second one is kept whole.
  (short_ids,), _ = tokenizer.tokenize_with_offsets(["short"])
  assert features["lengths"][1] == 16
  assert features["input_ids"][1, -1 - len(short_ids):-1].tolist() == short_ids
  assert features["labels"].tolist() == [0, -1]
  assert features["example_index"].tolist() == [0, 1]

  single = get_task("glue/sst2").featurize([TextPairExample("0", "fine", None, "1")], tokenizer, 8)
  assert single["segment_ids"].sum() == 0 and single["lengths"][0] == 3
  regression = get_task("glue/stsb").featurize(
      [TextPairExample("0", "a", "b", 3.2), TextPairExample("1", "a", "b", None)], tokenizer, 8)
  assert regression["labels"].dtype == np.float32 and regression["labels"][0] == pytest.approx(3.2)
  assert np.isnan(regression["labels"][1])


def _features(labels):
  return {"input_ids": np.zeros((len(labels), 4), np.int32), "labels": np.asarray(labels)}


def test_evaluate_and_predict_use_official_metrics():
  examples = [TextPairExample(str(i), "a", "b", label) for i, label in enumerate("1100")]
  features = _features([1, 1, 0, 0])
  logits = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
  mrpc = get_task("glue/mrpc")
  assert mrpc.predict(logits, features, examples) == ["1", "0", "0", "1"]
  assert mrpc.evaluate(logits, features, examples) == pytest.approx({"f1": 50.0, "accuracy": 50.0})
  # All one class: Matthews correlation is 0, not NaN.
  assert get_task("glue/cola").evaluate(np.tile([[0.0, 1.0]], (4, 1)), features, examples) == {"mcc": 0.0}
  stsb_examples = [TextPairExample(str(i), "a", "b", s) for i, s in enumerate([0.0, 2.0, 2.0, 5.0])]
  scores = np.array([[0.5], [1.0], [1.0], [4.0]])
  result = get_task("glue/stsb").evaluate(scores, _features([0.0, 2.0, 2.0, 5.0]), stsb_examples)
  assert result["spearman"] == pytest.approx(100.0)
  with pytest.raises(ValueError, match="expected"):
    mrpc.evaluate(logits[:3], features, examples)  # a padded/short batch is caught
  with pytest.raises(ValueError, match="unlabelled"):
    mrpc.evaluate(logits, features, [TextPairExample(str(i), "a", "b", None) for i in range(4)])


def test_write_submission_formats(tmp_path):
  mnli = get_task("glue/mnli")
  examples = [TextPairExample("0", "a", "b", None), TextPairExample("1", "c", "d", None)]
  path = mnli.write_submission(tmp_path, "test_mismatched", examples, ["neutral", "entailment"])
  assert path.name == "MNLI-mm.tsv"
  assert path.read_text() == "index\tprediction\n0\tneutral\n1\tentailment\n"
  path = get_task("glue/stsb").write_submission(tmp_path, "test", examples, [1.23456, 4.0])
  assert path.name == "STS-B.tsv" and path.read_text().splitlines()[1:] == ["0\t1.235", "1\t4.000"]
  expected_names = {"cola": ["CoLA.tsv"], "sst2": ["SST-2.tsv"], "mrpc": ["MRPC.tsv"], "stsb": ["STS-B.tsv"],
                    "qqp": ["QQP.tsv"], "mnli": ["MNLI-m.tsv", "MNLI-mm.tsv"], "qnli": ["QNLI.tsv"],
                    "rte": ["RTE.tsv"], "wnli": ["WNLI.tsv"]}
  assert {name: list(spec.submissions.values()) for name, spec in SPECS.items()} == expected_names
  with pytest.raises(ValueError, match="no submission file"):
    mnli.write_submission(tmp_path, "dev_matched", examples, ["neutral", "neutral"])


@pytest.mark.skipif(importlib.util.find_spec("tensorflow_datasets") is not None,
                    reason="tensorflow-datasets is installed")
def test_tfds_missing_names_the_extra():
  with pytest.raises(ImportError, match=r"bert_jax\[tfds\]"):
    get_task("glue/rte").load_tfds("dev")


def test_tfds_records_are_mapped_by_label_name(monkeypatch):
  """A stand-in tensorflow_datasets checks the record -> example conversion without TensorFlow."""
  requested = {}

  class FakeBuilder:
    info = types.SimpleNamespace(features={"label": types.SimpleNamespace(
        names=["entailment", "neutral", "contradiction"])})

    def __init__(self, name, data_dir):
      requested.update(name=name, data_dir=data_dir)

    def download_and_prepare(self):
      pass

    def as_dataset(self, split):
      requested["split"] = split
      return [{"idx": np.int32(5), "premise": b"P", "hypothesis": b"H", "label": np.int64(2)},
              {"idx": np.int32(6), "premise": b"Q", "hypothesis": b"I", "label": np.int64(-1)}]

  fake = types.ModuleType("tensorflow_datasets")
  fake.builder = FakeBuilder
  fake.as_numpy = lambda dataset: iter(dataset)
  monkeypatch.setitem(sys.modules, "tensorflow_datasets", fake)
  examples = get_task("glue/mnli").load_tfds("dev_mismatched", data_dir="/tfds")
  assert requested == {"name": "glue/mnli", "data_dir": "/tfds", "split": "validation_mismatched"}
  assert examples == [TextPairExample("5", "P", "H", "contradiction"), TextPairExample("6", "Q", "I", None)]


def test_tfds_mock_data_if_installed(tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")
  task = get_task("glue/mnli")
  with tfds.testing.mock_data(num_examples=3, policy=tfds.testing.MockPolicy.USE_CODE):
    examples = task.load_tfds("dev_matched", data_dir=str(tmp_path))
  assert len(examples) == 3 and all(e.label in task.labels for e in examples)


def test_registry_names_and_errors():
  assert get_task("glue/SST-2").name == "glue/sst2" and get_task("GLUE/STS-B").kind == "regression"
  assert isinstance(get_task("glue/wnli"), GlueTask)
  with pytest.raises(ValueError, match=r"unknown task 'glue/mnli-mm'; valid names: glue/cola, .*conll2003"):
    get_task("glue/mnli-mm")


@pytest.mark.shared_data
def test_real_rte_dev_features(shared_data, tokenizer):
  task = get_task("glue/rte")
  examples = task.load(shared_data / "glue", "dev")
  features = task.featurize(examples, tokenizer, max_len=128)
  assert features["input_ids"].shape == (277, 128)
  assert (features["input_ids"][:, 0] == tokenizer.cls_id).all()
  assert ((features["input_ids"] == tokenizer.sep_id).sum(axis=1) == 2).all()
  rows = np.arange(277)
  assert (features["input_ids"][rows, features["lengths"] - 1] == tokenizer.sep_id).all()
  assert (features["lengths"] == 128).any()  # some premises are long enough to be trimmed
  assert np.bincount(features["labels"]).tolist() == [146, 131]
  # Gold logits score 100 through predict/evaluate.
  logits = np.eye(2)[features["labels"]]
  assert task.evaluate(logits, features, examples) == {"accuracy": 100.0}


# Two sentences (rows 0 and 7) and their phrases: row 6 is row 0 again with other spacing, row 8 repeats row 1;
# "good" lies in both sentences and "film" only in the first (the second says "films").
CARVE_ROWS = [
    "a good film . \t1", "good film \t1", "good \t1", "the good cast \t1", "is not enough \t0", "film \t1",
    "a  good film .\t1", "the good cast of films is not enough \t0", "good film \t1", "a good \t1", "not enough \t0",
]
# The dev row -> the train rows left, by hand: every row inside the dev sentence goes, duplicates of it included.
CARVE_TRAIN = {0: [3, 4, 7, 10], 7: [0, 1, 5, 6, 8, 9]}


def test_carve_sentence_dev_by_hand():
  texts = [glue.phrase_text(row) for row in CARVE_ROWS]
  assert glue.maximal_phrases(texts) == ["a good film .", "the good cast of films is not enough"]
  drawn = set()
  for seed in range(8):
    train, dev = glue.carve_sentence_dev(CARVE_ROWS, 1, seed)
    (dev_index,) = [CARVE_ROWS.index(row) for row in dev]
    drawn.add(dev_index)
    assert train == [CARVE_ROWS[i] for i in CARVE_TRAIN[dev_index]]
  assert drawn == {0, 7}
  # Both sentences in dev: one row each, every other row inside one of them.
  assert glue.carve_sentence_dev(CARVE_ROWS, 2, 0) == ([], [CARVE_ROWS[0], CARVE_ROWS[7]])
  with pytest.raises(ValueError, match="cannot carve 3 dev sentences: the rows hold 2 maximal phrases"):
    glue.carve_sentence_dev(CARVE_ROWS, 3, 0)


def test_write_sentence_carve_marker(tmp_path):
  source = tmp_path / "source.tsv"
  source.write_text("sentence\tlabel\n" + "\n".join(CARVE_ROWS) + "\n", encoding="utf-8")
  marker = glue.write_sentence_carve(source, tmp_path / "SST-2", size=1, seed=0)
  assert json.loads((tmp_path / "SST-2" / "carve.json").read_text()) == marker
  assert marker["method"] == glue.SENTENCE_CARVE_METHOD
  assert marker["sha256_dev"] == glue.dev_set_fingerprint(tmp_path / "SST-2" / "dev.tsv")
  assert marker["sha256_train"] == glue.dev_set_fingerprint(tmp_path / "SST-2" / "train.tsv")
  task = get_task("glue/sst2")
  dev, train = task.load(tmp_path, "dev"), task.load(tmp_path, "train")
  assert (len(dev), len(train)) == (marker["dev_rows"], marker["train_rows"]) and len(dev) == 1
  assert len(glue.dev_set_fingerprint(source)) == 16


def test_carve_report_overlap_by_hand():
  from bert_jax.tasks import carve_report  # pylint: disable=import-outside-toplevel

  train = ["a good film . \t0", "film \t1", "bad \t0"]
  report = carve_report.overlap(["good film \t1", "a good film , not bad \t0", "dull \t1"], train)
  # "good film" is inside row 0 (label 0, wrong); the second holds "film" and "bad", the longest first (1, wrong);
  # "dull" shares nothing: the majority label, 0 (wrong too).
  assert report["dev_in_train"] == 1 / 3 and report["dev_contains_train"] == 2 / 3
  assert report["copy_label_accuracy"] == 0.0 and report["majority_label"] == "0"
  assert {k: v["examples"] for k, v in report["copy_label_sources"].items()} == {
      "from_containing": 1, "from_contained": 1, "from_majority": 1}


@pytest.mark.shared_data
@pytest.mark.slow
def test_real_sst2_sentence_carve_shares_no_text(shared_data):
  path = shared_data / "glue" / "SST-2" / "train.tsv"
  if not path.is_file():
    pytest.skip(f"{path} is not present")
  rows = path.read_text(encoding="utf-8").splitlines()[1:]
  train, dev = glue.carve_sentence_dev(rows, 872, 0)
  dev_texts = [glue.phrase_text(row) for row in dev]
  train_texts = [glue.phrase_text(row) for row in train]
  assert len(dev) == len(set(dev_texts)) == 872
  assert {row.rsplit("\t", 1)[1] for row in dev} == {"0", "1"}
  # Brute force, apart from the carve's n-grams: each text framed by spaces, one a line, so that a framed text
  # found in the joined file lies inside one row at word boundaries.
  joined_train = "".join(f" {text} \n" for text in train_texts)
  joined_dev = "".join(f" {text} \n" for text in dev_texts)
  assert not [text for text in dev_texts if f" {text} " in joined_train]
  assert not [text for text in train_texts if f" {text} " in joined_dev]
  # Whole sentences: no row of the file holds a dev sentence unless it has its text.
  joined_all = "".join(f" {glue.phrase_text(row)} \n" for row in rows)
  counts = collections.Counter(glue.phrase_text(row) for row in rows)
  assert all(joined_all.count(f" {text} ") == counts[text] for text in dev_texts)
  # Train and dev are rows of the file, none on both sides.
  assert set(train).isdisjoint(dev) and set(train) | set(dev) <= set(rows)
