"""Corpus preparation: shards, manifest, bad input reporting, eval split, re-runs, reading back."""

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from bert_jax import cli
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


@pytest.mark.slow
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
      b"\n\x7f\x7f\x7f\x7f\n"                                       # 9 junk
      b"\nFine text.\nMore fine text.\nStill fine.\n")                  # 11-13: most lines are readable
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
  assert reader.num_documents == 3
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


@pytest.mark.slow
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
  assert f"prepare: {len(DOCUMENTS)} doc, " in printed and "doc/s" in printed  # progress lines, not a bar
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


def _prepare(inputs, tokenizer, out, **kwargs):
  return prepare.prepare_corpus([str(i) for i in inputs], tokenizer, out, num_workers=0, log=lambda *_: None,
                                **kwargs)


def test_out_with_user_files_is_refused_and_never_deleted(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  out = tmp_path / "out"
  (out / "tokenizer").mkdir(parents=True)
  (out / "tokenizer" / "vocab.txt").write_text("[PAD]\nmy\nvocabulary\n")
  with pytest.raises(ValueError, match=r"is not empty \(tokenizer\).*--force"):
    _prepare([corpus], tokenizer, out)
  with pytest.raises(ValueError, match=r"holds tokenizer, which prepare would overwrite"):
    _prepare([corpus], tokenizer, out, force=True)
  assert (out / "tokenizer" / "vocab.txt").read_text() == "[PAD]\nmy\nvocabulary\n"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]  # no staging folder left behind

  notes = tmp_path / "notes"
  notes.mkdir()
  (notes / "README").write_text("mine")
  _prepare([corpus], tokenizer, notes, force=True)
  assert (notes / "README").read_text() == "mine" and prepare.open_prepared(notes).num_documents == len(DOCUMENTS)
  # Preparing again over that corpus (other options) replaces the corpus and still keeps the user's file.
  _prepare([corpus], tokenizer, notes, eval_documents=2)
  assert (notes / "README").read_text() == "mine" and len(prepare.open_prepared(notes).split_documents("eval")) == 2


def test_out_that_is_a_file_is_one_clear_error(tmp_path, tokenizer, minilm_dir, capsys):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  (tmp_path / "out").write_text("a file")
  argv = ["--input", str(corpus), "--out", str(tmp_path / "out"), "--tokenizer", str(minilm_dir / "vocab.txt"),
          "--num-workers", "0"]
  assert prepare.main(argv) == 1
  error = capsys.readouterr().err.strip()
  assert error == f"bert-jax prepare: error: --out {tmp_path / 'out'} is a file; give a directory (new, empty, or " \
                  f"an earlier prepared corpus)"
  assert (tmp_path / "out").read_text() == "a file"


def test_argument_abbreviations_are_refused(tmp_path, capsys):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  with pytest.raises(SystemExit):
    prepare.main(["--input", str(corpus), "--out", str(tmp_path / "out"), "--train-tokenizer", "wordpiece",
                  "--vocab", "vocab.txt"])
  assert "unrecognized arguments: --vocab" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def _corpus_files(directory):
  return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_failure_midway_leaves_the_earlier_corpus_intact(tmp_path, tokenizer, monkeypatch):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  out = tmp_path / "out"
  first = _prepare([corpus], tokenizer, out, shard_tokens=60)
  before = _corpus_files(out)
  # A truncated .gz as the second input fails while the first is already tokenised into shards.
  truncated = tmp_path / "more.txt.gz"
  truncated.write_bytes(gzip.compress(("\n".join(s for d in DOCUMENTS for s in d) + "\n").encode() * 20)[:300])
  with pytest.raises(ValueError, match=rf"{truncated}: truncated or corrupt gzip data after line \d+"):
    _prepare([corpus, truncated], tokenizer, out, shard_tokens=60)
  assert _corpus_files(out) == before
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "more.txt.gz", "out"]

  # A kill while tokenising leaves only its staging folder, which the next run clears.
  def killed(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(prepare, "_install", killed)
  with pytest.raises(KeyboardInterrupt):
    _prepare([corpus], tokenizer, out, eval_documents=3)
  monkeypatch.undo()
  assert _corpus_files(out) == before
  assert prepare.open_prepared(out).manifest == first

  # A crash while the new corpus moves in: the folder reads as unprepared (never as a mix), and a rerun finishes.
  moves = []
  real_move = prepare._move
  def crash_on_third_move(source, target):
    moves.append(target)
    if len(moves) == 3:
      raise OSError("disk gone")
    real_move(source, target)
  monkeypatch.setattr(prepare, "_move", crash_on_third_move)
  with pytest.raises(OSError):
    _prepare([corpus], tokenizer, out, eval_documents=3)
  monkeypatch.undo()
  with pytest.raises(FileNotFoundError, match="has no manifest.json"):
    prepare.open_prepared(out)
  again = _prepare([corpus], tokenizer, out, eval_documents=3)
  assert again["splits"]["eval"]["documents"] == 3 and prepare.open_prepared(out).num_documents == len(DOCUMENTS)
  assert not (out / "manifest.json.installing").exists()


def test_a_killed_run_leaves_a_staging_folder_the_next_run_clears(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  stale = tmp_path / ".out.preparing"
  stale.mkdir()
  (stale / ".bert_jax_preparing").touch()
  (stale / "shard-00000.tokens.npy").write_bytes(b"partial")
  _prepare([corpus], tokenizer, tmp_path / "out")
  assert not stale.exists() and prepare.open_prepared(tmp_path / "out").num_documents == len(DOCUMENTS)


def test_binary_or_latin1_input_is_refused_with_counts(tmp_path, tokenizer):
  latin1 = tmp_path / "latin1.txt"
  latin1.write_bytes("\n".join(["Café au lait.", "Déjà vu à Genève.", "Fine line.", "Ça va très bien."] * 50)
                     .encode("latin-1"))
  with pytest.raises(ValueError, match=rf"{latin1}: 150 of its first 200 non-blank lines are not UTF-8 text.*iconv"):
    _prepare([latin1], tokenizer, tmp_path / "out")
  binary = tmp_path / "model.bin"
  binary.write_bytes(np.random.default_rng(0).integers(0, 256, 20_000, dtype=np.uint8).tobytes())
  with pytest.raises(ValueError, match=rf"{binary}: \d+ of its first \d+ non-blank lines are not UTF-8"):
    _prepare([binary], tokenizer, tmp_path / "out")
  assert not (tmp_path / "out").exists()


def test_a_damaged_prepared_folder_names_the_file(tmp_path, tokenizer):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  out = tmp_path / "out"
  _prepare([corpus], tokenizer, out)
  shard = out / "shard-00000.word_starts.npy"
  np.save(shard, np.array([{"not": "tokens"}], dtype=object), allow_pickle=True)
  with pytest.raises(ValueError, match=rf"{shard} is not a readable numeric array .*prepare` again"):
    prepare.open_prepared(out)
  np.save(shard, np.zeros(3, np.float32))
  with pytest.raises(ValueError, match=rf"{shard} holds float32 \[3\], not the uint8 vector"):
    prepare.open_prepared(out)
  shard.write_bytes(shard.read_bytes()[:20])
  with pytest.raises(ValueError, match=rf"{shard} is not a readable numeric array"):
    prepare.open_prepared(out)
  (out / "manifest.json").write_text('{"shards": [')
  with pytest.raises(ValueError, match=rf"{out / 'manifest.json'} is not a readable manifest"):
    prepare.open_prepared(out)


def test_corrupt_gzip_input_is_one_line_from_the_cli(tmp_path, minilm_dir, capsys):
  fake = tmp_path / "corpus.txt.gz"
  fake.write_text("plain text, not gzip\n")
  argv = ["prepare", "--input", str(fake), "--out", str(tmp_path / "out"), "--tokenizer",
          str(minilm_dir / "vocab.txt"), "--num-workers", "0"]
  assert cli.main(argv) == 1
  error = capsys.readouterr().err.strip()
  assert "\n" not in error and "Traceback" not in error
  assert error.startswith(f"bert-jax prepare: error: {fake}: truncated or corrupt gzip data after line 0")
  assert not (tmp_path / "out").exists()


_KILLED_PREPARE = """
import os, signal, sys
from bert_jax.data import prepare
moves = []
def kill_on(name):
  def killed(*args, **kwargs):
    moves.append(args)
    if name == "install" or len(moves) == 3:
      os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
  return killed
real = getattr(prepare, "_" + sys.argv[1])
setattr(prepare, "_" + sys.argv[1], kill_on(sys.argv[1]))
sys.exit(prepare.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("moment", ["install", "move"])
@pytest.mark.slow
def test_kill_9_keeps_the_earlier_corpus_or_leaves_a_rerunnable_folder(tmp_path, minilm_dir, moment):
  corpus = write_bert_format(tmp_path / "corpus.txt", DOCUMENTS)
  out = tmp_path / "out"
  argv = ["--input", str(corpus), "--out", str(out), "--tokenizer", str(minilm_dir / "vocab.txt"),
          "--num-workers", "0"]
  assert prepare.main(argv) == 0
  before = _corpus_files(out)
  killed = subprocess.run([sys.executable, "-c", _KILLED_PREPARE, moment, *argv, "--eval-documents", "4"],
                          capture_output=True, text=True, timeout=120)
  assert killed.returncode == -9, killed.stderr
  if moment == "install":  # killed with the new corpus complete in its staging folder, before it moved in
    assert _corpus_files(out) == before and (tmp_path / ".out.preparing").is_dir()
  else:  # killed while moving in: no manifest, so nothing reads a mix of two corpora
    assert not (out / "manifest.json").exists()
  assert prepare.main(argv + ["--eval-documents", "4"]) == 0
  assert len(prepare.open_prepared(out).split_documents("eval")) == 4
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]
