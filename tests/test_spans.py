"""Linguistic spans: marking a prepared corpus with taggers, carrying the marks through the pipeline, and
SpanBERT's named-entity / noun-phrase masking (closed-form statistics)."""

import json
import math
import shutil

import jax
import numpy as np
import pytest

from bert_jax.data import batch as batch_lib
from bert_jax.data import masking
from bert_jax.data import pipeline
from bert_jax.data import prepare
from bert_jax.data import tokenizers
from bert_jax.tasks import spans as spans_lib
from bert_jax.train import trainer

from test_pipeline import assert_same_batches, random_corpus, take
from test_trainer import tiny_config

NE_START, NE_INSIDE = batch_lib.span_bits("named_entity")
NP_START, NP_INSIDE = batch_lib.span_bits("noun_phrase")


# Masking ---------------------------------------------------------------------------------------------------------

def _rows(rows: int, length: int, marks: np.ndarray) -> dict[str, np.ndarray]:
  """`rows` rows of `length` maskable one-token words with the span bits `marks` [length]; no specials."""
  ones = np.ones((rows, length), np.int32)
  return {"input_ids": np.tile(np.arange(10, 10 + length, dtype=np.int32), (rows, 1)),
          "word_starts": ones | marks[None].astype(np.int32), "special_mask": 0 * ones, "pack_ids": ones,
          "example_ids": np.arange(rows, dtype=np.int32), "epoch": np.zeros(rows, np.int32)}


def _chosen(batch, config) -> np.ndarray:
  out = jax.jit(lambda b: masking.mask_batch(jax.random.key(3), b, config, mask_id=4, vocab_size=100))(batch)
  chosen = np.zeros(batch["input_ids"].shape, bool)
  rows, slots = np.nonzero(np.asarray(out["mlm_weights"]) > 0)
  chosen[rows, np.asarray(out["mlm_positions"])[rows, slots]] = True
  return chosen


def test_half_the_units_are_whole_marked_spans_within_the_budget():
  """20 one-token words, two entities of 3 words, budget round(0.15 * 20) = 3: the first unit is an entity with
  probability 1/2 (which spends the budget); otherwise no entity fits after it and the 3 words are a uniform
  3-subset. So P(the masked set is one entity) = 1/2 + 1/2 * 2 / C(20, 3), and the expected share of masked
  tokens inside entities is 1/2 + 1/2 * 6/20."""
  marks = np.zeros(20, np.int32)
  for start in (2, 9):
    marks[start] |= NE_START
    marks[start:start + 3] |= NE_INSIDE
  marks[14:17] |= NP_INSIDE  # Noun-phrase bits are not named_entity's.
  marks[14] |= NP_START
  rows = 4000
  chosen = _chosen(_rows(rows, 20, marks), masking.MaskingConfig(granularity="named_entity", max_predictions=10))
  assert (chosen.sum(1) == 3).all()
  entities = [np.arange(2, 5), np.arange(9, 12)]
  one_entity = np.mean([any(set(np.flatnonzero(row)) == set(e) for e in entities) for row in chosen])
  standard_error = math.sqrt(0.25 / rows)
  assert abs(one_entity - (0.5 + 0.5 * 2 / math.comb(20, 3))) < 4 * standard_error
  share = chosen[:, (marks & NE_INSIDE) > 0].sum() / chosen.sum()
  assert abs(share - (0.5 + 0.5 * 6 / 20)) < 4 * standard_error
  # noun_phrase reads its own bits: its one 3-word phrase is the masked set about half of the time.
  chosen = _chosen(_rows(rows, 20, marks), masking.MaskingConfig(granularity="noun_phrase", max_predictions=10))
  phrase = np.mean([set(np.flatnonzero(row)) == {14, 15, 16} for row in chosen])
  assert abs(phrase - (0.5 + 0.5 / math.comb(20, 3))) < 4 * standard_error


def test_spans_are_masked_whole_and_never_split_words():
  """With linguistic_prob=1 every unit is a span while one fits: the three spans (9 tokens, multi-piece words,
  one cut by a [SEP]) are masked whole before any word, and words stay whole."""
  length = 40
  word_starts = np.ones(length, np.int32)
  word_starts[[6, 7, 21, 30]] = 0  # Continuation pieces.
  special = np.zeros(length, np.int32)
  special[[0, 25, 39]] = 1
  marks = np.zeros(length, np.int32)
  for first, last in ((5, 7), (20, 22), (26, 28)):
    marks[first] |= NE_START
    marks[first:last + 1] |= NE_INSIDE
  marks[24] |= NE_INSIDE  # The tail of a span cut before a [SEP]: its own 1-token span.
  batch = _rows(256, length, marks)
  batch["word_starts"] = (word_starts | marks)[None].repeat(256, 0)
  batch["special_mask"] = special[None].repeat(256, 0)
  config = masking.MaskingConfig(granularity="named_entity", linguistic_prob=1.0, rate=0.5, max_predictions=20)
  chosen = _chosen(batch, config)
  assert chosen[:, (marks & NE_INSIDE) > 0].all()
  assert (chosen.sum(1) == 18).all()  # round(0.5 * 37) = 18 (a tie rounds to even)
  assert (chosen[:, 5] == chosen[:, 6]).all() and (chosen[:, 29] == chosen[:, 30]).all()
  assert not chosen[:, special > 0].any()


# The pipeline carries the marks -----------------------------------------------------------------------------------

def _marks_of(tokenizer) -> np.ndarray:
  """Span marks (prepare's layout: kind k in bits 2k, 2k+1) as a function of the token id, for the tests' corpus:
  colours are one-word entities; 'the' starts a noun phrase, 'cat' and 'dog' are inside one."""
  table = np.zeros(tokenizer.vocab_size, np.uint8)
  for word in ("red", "blue", "green"):
    table[tokenizer.encode(word)] = 1 | 2
  table[tokenizer.encode("the")] = 4 | 8
  for word in ("cat", "dog"):
    table[tokenizer.encode(word)] = 8
  return table


@pytest.fixture(scope="module")
def marked_dir(tmp_path_factory, minilm_dir):
  """test_pipeline's kind of corpus with span marks that are a function of the token."""
  directory = tmp_path_factory.mktemp("marked")
  (directory / "corpus.txt").write_text(random_corpus(np.random.default_rng(12), 40, 12, 30))
  tokenizer = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  prepare.prepare_corpus([str(directory / "corpus.txt")], tokenizer, directory / "prepared", num_workers=0,
                         eval_documents=4, shard_tokens=1500, chunk_documents=8, log=lambda *_: None)
  corpus = prepare.open_prepared(directory / "prepared")
  table = _marks_of(tokenizer)
  starts = corpus.shard_token_starts
  marks = [table[corpus.tokens(a, b)] for a, b in zip(starts[:-1], starts[1:])]
  prepare.write_spans(directory / "prepared", marks, batch_lib.SPAN_KINDS, {"by": "test"})
  return directory / "prepared", table


@pytest.mark.parametrize("example_format,packing", [("segment_pair", False), ("sop", True),
                                                    ("full_sentences", False), ("doc_sentences", True),
                                                    ("sentence_pair", False), ("single", True)])
def test_marks_stay_with_their_tokens_through_cuts_and_packs(marked_dir, example_format, packing):
  directory, table = marked_dir
  assert len(prepare.open_prepared(directory).manifest["shards"]) > 1
  # seq_len 24 truncates many segment pairs.
  with pipeline.pretraining_iterator(directory, example_format=example_format, seq_len=24, batch_size=8, seed=2,
                                     packing=packing, max_packs=3, block_documents=8) as iterator:
    batches = take(iterator, 12)
  for batch in batches:
    real = batch["special_mask"] == 0
    expected = 1 | (table[batch["input_ids"]].astype(np.int32) << 1)
    np.testing.assert_array_equal(batch["word_starts"][real], expected[real])
    assert (batch["word_starts"][~real] <= 1).all()


def test_marked_corpus_resumes_and_builds_the_same_batches_with_workers(marked_dir):
  directory, _ = marked_dir
  settings = dict(example_format="segment_pair", seq_len=24, batch_size=8, seed=2, block_documents=8)
  with pipeline.pretraining_iterator(directory, workers=0, **settings) as in_thread:
    reference = take(in_thread, 16)
  with pipeline.pretraining_iterator(directory, workers=2, **settings) as in_workers:
    assert_same_batches(take(in_workers, 6), reference[:6])
    state = json.loads(json.dumps(in_workers.get_state()))
  assert state["pipeline"]["spans"] == prepare.open_prepared(directory).manifest["spans"]["fingerprint"]
  with pipeline.pretraining_iterator(directory, workers=0, **settings) as resumed:
    resumed.set_state(state)
    assert_same_batches(take(resumed, 10), reference[6:])


# Marking with a fine-tuned tagger, then pre-training -------------------------------------------------------------

def test_spans_from_tags_follow_conlleval_within_sentences():
  labels = ("O", "B-NP", "I-NP", "I-VP")
  # word pieces: [the big] [ca ##t] [sat] | [I-NP at a new sentence] [B-NP] -- one sentence boundary at 5.
  tags = np.array([2, 2, 2, 0, 3, 2, 1, 2])
  word_starts = np.array([1, 1, 1, 0, 1, 1, 1, 1])
  starts, inside = spans_lib.spans_from_tags(tags, word_starts, np.array([0, 5]), labels, only="NP")
  np.testing.assert_array_equal(inside, [1, 1, 1, 1, 0, 1, 1, 1])  # The "##t" piece follows its word.
  np.testing.assert_array_equal(starts, [1, 0, 0, 0, 0, 1, 1, 0])


@pytest.mark.slow
def test_tagger_marks_a_corpus_and_named_entity_masking_pretrains(tagging_run, tmp_path, capsys):
  workdir, _ = tagging_run
  rng = np.random.default_rng(7)
  names = ["pera", "perb", "loca", "locb"]
  documents = []
  for _ in range(30):
    sentences = []
    for _ in range(rng.integers(2, 6)):
      words = [f"w{i}" for i in rng.integers(0, 30, 8)]
      for position in rng.choice(8, 2, replace=False):
        words[position] = str(rng.choice(names))
      sentences.append(" ".join(words))
    documents.append("\n".join(sentences))
  (tmp_path / "corpus.txt").write_text("\n\n".join(documents) + "\n")
  prepared = tmp_path / "prepared"
  prepare.prepare_corpus([str(tmp_path / "corpus.txt")], workdir / "tokenizer", prepared, num_workers=0,
                         eval_documents=4, log=lambda *_: None)

  config = tiny_config(prepared, "mlm+nsp", steps=3)
  config.masking.granularity = "named_entity"
  with pytest.raises(ValueError, match=r"config.masking.granularity='named_entity' needs named_entity spans .*"
                                       r"bert-jax mark-spans --prepared"):
    trainer.train_and_evaluate(config, tmp_path / "refused")

  with pytest.raises(ValueError, match="fine-tuned on conll2003, not conll2003_chunk"):
    spans_lib.mark_spans(prepared, {"noun_phrase": str(workdir)})
  manifest = spans_lib.mark_spans(prepared, {"named_entity": str(workdir)})
  assert manifest["spans"]["kinds"] == ["named_entity"]
  assert "marked" in capsys.readouterr().out
  corpus = prepare.open_prepared(prepared)
  tokens, marks = corpus.gather([0], [corpus.manifest["totals"]["tokens"]])
  vocabulary = corpus.load_tokenizer()
  is_name = np.isin(tokens, [vocabulary.encode(name) for name in names])
  inside = (marks & NE_INSIDE) > 0
  # The tiny tagger learned the names: its spans are (nearly) the name tokens, each its own entity or a run.
  assert np.mean(inside == is_name) > 0.95
  assert ((marks & NE_START) > 0)[is_name].mean() > 0.5

  # The spans travel as one file to another copy of the corpus.
  copy = tmp_path / "copy"
  prepare.prepare_corpus([str(tmp_path / "corpus.txt")], workdir / "tokenizer", copy, num_workers=0,
                         eval_documents=4, log=lambda *_: None)
  spans_lib.export_spans(prepared, tmp_path / "spans.npz")
  assert spans_lib.import_spans(tmp_path / "spans.npz", copy) and not spans_lib.import_spans(tmp_path / "spans.npz",
                                                                                            copy)
  assert prepare.open_prepared(copy).manifest["spans"] == manifest["spans"]
  np.testing.assert_array_equal(prepare.open_prepared(copy).gather([0], [len(tokens)])[1], marks)
  # Preparing again with other options drops the spans with the shards they marked.
  prepare.prepare_corpus([str(tmp_path / "corpus.txt")], workdir / "tokenizer", copy, num_workers=0,
                         eval_documents=3, log=lambda *_: None)
  assert not prepare.open_prepared(copy).span_kinds and not list(copy.glob("*.spans.npy"))

  result = trainer.train_and_evaluate(config, tmp_path / "pretrain")
  assert result["step"] == 3 and np.isfinite(result["train"]["loss"])
  shutil.rmtree(tmp_path / "pretrain")
