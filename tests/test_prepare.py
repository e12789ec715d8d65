"""Corpus preparation: shards, manifest, bad input reporting, eval split, re-runs, reading back."""

import gzip
import json

import numpy as np
import pytest

from bert_jax.data import prepare
from bert_jax.data import text as text_lib
from bert_jax.data import tokenizers

DOCUMENTS = [
    ["The cat sat on the mat.", "It was a sunny day.", "Birds sang in the trees."],
    ["Paris is the capital of France.", "It has many museums."],
    ["Water boils at one hundred degrees.", "Ice melts at zero.", "Steam is hot.", "Clouds are water."],
    ["A single sentence document."],
] * 5


def write_bert_format(path, documents):
  path.write_text("\n\n".join("\n".join(d) for d in documents) + "\n")
  return path


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return tokenizers.load_tokenizer(minilm_dir / "vocab.txt")


def test_shards_hold_every_document_in_order(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  manifest = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "out", num_workers=0, shard_tokens=60,
                                    chunk_documents=3,
                                    log=lambda *_: None)
  assert len(manifest["shards"]) > 1
  assert manifest["totals"]["documents"] == len(DOCUMENTS)
  assert manifest["totals"]["sentences"] == sum(len(d) for d in DOCUMENTS)
  assert manifest["tokenizer"]["fingerprint"] == tokenizer.fingerprint()
  corpus_reader = prepare.open_prepared(tmp_path / "out")
  for index, document in enumerate(DOCUMENTS):
    expected_ids, expected_starts = tokenizer.encode_batch(document)
    sentences = corpus_reader.document_sentences(index)
    assert [s.tolist() for s in sentences] == expected_ids
    first, last = corpus_reader.document_starts[index], corpus_reader.document_starts[index + 1]
    starts = [corpus_reader.word_starts(a, b).tolist()
              for a, b in zip(corpus_reader.sentence_starts[first:last], corpus_reader.sentence_starts[first + 1:last + 1])]
    assert starts == expected_starts
  assert sum(s["tokens"] for s in manifest["shards"]) == corpus_reader.sentence_starts[-1]
  assert corpus_reader.load_tokenizer().fingerprint() == tokenizer.fingerprint()


def test_parallel_workers_give_the_same_bytes(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS * 4)
  serial = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "serial", num_workers=0, chunk_documents=7,
                                  log=lambda *_: None)
  parallel = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "parallel", num_workers=2,
                                    chunk_documents=7, log=lambda *_: None)
  assert serial["shards"] == parallel["shards"]
  for key in prepare.SHARD_ARRAYS:
    a = np.load(tmp_path / "serial" / f"shard-00000.{key}.npy")
    b = np.load(tmp_path / "parallel" / f"shard-00000.{key}.npy")
    np.testing.assert_array_equal(a, b)


def test_rerun_is_a_noop_and_another_tokenizer_is_refused(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  messages = []
  first = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "out", num_workers=0, log=messages.append)
  mtime = (tmp_path / "out" / "shard-00000.tokens.npy").stat().st_mtime_ns
  again = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "out", num_workers=0, log=messages.append)
  assert again == first
  assert "nothing to do" in messages[-1]
  assert (tmp_path / "out" / "shard-00000.tokens.npy").stat().st_mtime_ns == mtime

  other = tokenizers.train_tokenizer("wordpiece", [s for d in DOCUMENTS for s in d], 100, tmp_path / "other")
  with pytest.raises(ValueError) as error:
    prepare.prepare_corpus([str(corpus)], other, tmp_path / "out", num_workers=0, log=messages.append)
  assert tokenizer.fingerprint() in str(error.value) and other.fingerprint() in str(error.value)


def test_bad_input_is_counted_with_file_and_line(tmp_path, tokenizer):
  corpus = tmp_path / "bad.txt"
  long_sentence = " ".join(["word"] * 40)
  corpus.write_bytes(
      b"A fine first sentence.\n"                                   # 1
      b"This line has one bad byte \xff in a long enough line.\n"   # 2 invalid UTF-8, kept
      b"\x00\x01\x02binary\x03\x04\n"                              # 3 junk, dropped
      b"\n"
      b"\x00\x00\x00\n"                                            # 5 junk: leaves an empty document
      b"\n" + long_sentence.encode() + b"\n"                      # 7 over-long sentence
      b"\n\x7f\x7f\x7f\x7f\n")                                      # 9 junk
  messages = []
  manifest = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "out", num_workers=0,
                                    max_sentence_tokens=16, log=messages.append)
  report = manifest["report"]
  assert report["counts"] == {"binary_junk": 3, "invalid_utf8": 1, "long_sentences": 1}
  assert report["examples"]["invalid_utf8"][0].startswith(f"{corpus}:2")
  assert [e.split(":")[1] for e in report["examples"]["binary_junk"]] == ["3", "5", "9"]
  assert report["examples"]["long_sentences"][0].startswith(f"{corpus}:7: 40 tokens, split")
  assert "binary_junk" in messages[-1]
  reader = prepare.open_prepared(tmp_path / "out")
  assert reader.num_documents == 2
  # 40 tokens split into pieces of at most 16: 16 + 16 + 8.
  assert [len(s) for s in reader.document_sentences(1)] == [16, 16, 8]
  kept = tokenizer.decode(reader.document_sentences(0)[1].tolist())
  assert kept.startswith("this line has one bad byte")


def test_truncation_policy_cuts_long_sentences(tmp_path, tokenizer):
  corpus = tmp_path / "long.txt"
  corpus.write_text("short one.\n" + " ".join(["word"] * 40) + "\n")
  manifest = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "out", num_workers=0,
                                    max_sentence_tokens=16, long_sentences="truncate", log=lambda *_: None)
  assert "cut of 16" in manifest["report"]["examples"]["long_sentences"][0]
  reader = prepare.open_prepared(tmp_path / "out")
  assert [len(s) for s in reader.document_sentences(0)] == [3, 16]


def test_json_lines_and_gzip_inputs(tmp_path, tokenizer):
  jsonl = tmp_path / "docs.jsonl.gz"
  with gzip.open(jsonl, "wt") as f:
    f.write(json.dumps({"text": "First sentence here. Second one follows! Third? Yes."}) + "\n")
    f.write("not json\n")
    f.write(json.dumps({"title": "no text"}) + "\n")
    f.write(json.dumps({"text": "Another document.\nWith two lines."}) + "\n")
  manifest = prepare.prepare_corpus([str(jsonl)], tokenizer, tmp_path / "out", num_workers=0, log=lambda *_: None)
  assert manifest["report"]["counts"] == {"bad_json": 2}
  assert manifest["totals"] == {"documents": 2, "sentences": 6, "tokens": manifest["totals"]["tokens"]}
  reader = prepare.open_prepared(tmp_path / "out")
  assert [tokenizer.decode(s.tolist()) for s in reader.document_sentences(0)] == [
      "first sentence here.", "second one follows!", "third?", "yes."]


def test_sentence_splitting_rule():
  assert text_lib.split_sentences('He said "Stop." Then e.g. he left. 3 dogs ran!\nNew line') == [
      'He said "Stop."', "Then e.g. he left.", "3 dogs ran!", "New line"]


def test_eval_split_is_seeded_and_disjoint(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS * 5)
  splits = {}
  for seed in (0, 0, 1):
    out = tmp_path / f"out{len(splits)}"
    prepare.prepare_corpus([str(corpus)], tokenizer, out, num_workers=0, eval_fraction=0.1, seed=seed,
                           log=lambda *_: None)
    reader = prepare.open_prepared(out)
    train, held_out = reader.split_documents("train"), reader.split_documents("eval")
    assert len(held_out) == 10 and len(train) == 90
    assert not set(train) & set(held_out)
    splits[len(splits)] = held_out.tolist()
  assert splits[0] == splits[1] != splits[2]
  counted = prepare.prepare_corpus([str(corpus)], tokenizer, tmp_path / "count", num_workers=0, eval_documents=3,
                                   log=lambda *_: None)
  assert counted["splits"]["eval"]["documents"] == 3


def test_tfds_input_without_tensorflow_names_the_extra(tmp_path, tokenizer):
  try:
    import tensorflow_datasets  # noqa: F401
    pytest.skip("tensorflow_datasets is installed; this checks the message when it is not")
  except ImportError:
    pass
  with pytest.raises(ImportError, match=r"\[tfds\]"):
    prepare.prepare_corpus(["tfds:wikipedia/20230601.en"], tokenizer, tmp_path / "out", num_workers=0,
                           log=lambda *_: None)


def test_tfds_text_dataset_is_prepared_with_mock_data(tmp_path, tokenizer):
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=6):
    manifest = prepare.prepare_corpus(["tfds:wikipedia/20230601.en"], tokenizer, tmp_path / "out", num_workers=0,
                                      log=lambda *_: None)
  assert manifest["totals"]["documents"] >= 1 and manifest["inputs"][0]["input"] == "tfds:wikipedia/20230601.en"
  corpus = prepare.open_prepared(tmp_path / "out")
  assert corpus.num_documents == manifest["totals"]["documents"] and corpus.num_sentences > 0


def test_cli_trains_a_tokenizer_and_prepares(tmp_path, capsys):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  argv = ["--input", str(corpus), "--out", str(tmp_path / "out"), "--train-tokenizer", "wordpiece",
          "--vocab-size", "150", "--num-workers", "0", "--eval-documents", "2"]
  assert prepare.main(argv) == 0
  assert prepare.main(argv) == 0
  printed = capsys.readouterr().out
  assert "using the tokenizer already trained" in printed and "nothing to do" in printed
  manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
  assert manifest["tokenizer"]["vocab_size"] <= 150
  assert manifest["splits"]["eval"]["documents"] == 2


def test_builtin_corpus_is_deterministic_prose_in_bert_format(tmp_path):
  from bert_jax.data import builtin_corpus
  first = builtin_corpus.build_builtin_corpus(tmp_path / "a.txt").read_bytes()
  assert builtin_corpus.build_builtin_corpus(tmp_path / "b.txt").read_bytes() == first
  assert 200_000 < len(first) < 5_000_000
  text = first.decode("utf-8")
  documents = text.strip("\n").split("\n\n")
  assert len(documents) > 300 and all(document.strip() for document in documents)
  lines = text.splitlines()
  assert not [line for line in lines if line.startswith((">>>", "    ")) or ":func:`" in line or "``" in line]
  # The demo path: train a small WordPiece vocab on it and prepare it.
  tokenizer = tokenizers.train_tokenizer("wordpiece", [tmp_path / "a.txt"], 2000, tmp_path / "vocab")
  manifest = prepare.prepare_corpus([str(tmp_path / "a.txt")], tokenizer, tmp_path / "out", num_workers=0,
                                    eval_fraction=0.05, log=lambda *_: None)
  assert manifest["totals"]["documents"] == len(documents)
  assert set(manifest["report"]["counts"]) <= {"long_sentences"}  # a few run-on table lines are split
