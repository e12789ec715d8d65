"""Example builders: BERT NSP, ALBERT SOP, RoBERTa FULL-/DOC-SENTENCES, single segments, packing."""

import numpy as np
import pytest

from bert_jax.data import batch as batch_lib
from bert_jax.data import formats
from bert_jax.data import prepare
from bert_jax.data import tokenizers

WORDS = "the cat dog sat ran on a mat big red blue green house tree car road sun moon star sky".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm_dir):
  """80 documents of 1-25 sentences of 2-24 one-token words, prepared with the MiniLM vocab."""
  rng = np.random.default_rng(7)
  documents = []
  for _ in range(80):
    sentences = [" ".join(rng.choice(WORDS, size=rng.integers(2, 25))) + " ." for _ in range(rng.integers(1, 26))]
    documents.append("\n".join(sentences))
  directory = tmp_path_factory.mktemp("formats")
  (directory / "corpus.txt").write_text("\n\n".join(documents) + "\n")
  tokenizer = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  prepare.prepare_corpus([str(directory / "corpus.txt")], tokenizer, directory / "prepared", num_workers=0,
                         max_sentence_tokens=40, log=lambda *_: None)
  return prepare.open_prepared(directory / "prepared")


def document_of(corpus, token_range):
  """Global document of a token range, checking that the range stays inside it."""
  start, end = token_range
  sentence = np.searchsorted(corpus.sentence_starts, start, side="right") - 1
  document = np.searchsorted(corpus.document_starts, sentence, side="right") - 1
  document_end = corpus.sentence_starts[corpus.document_starts[document + 1]]
  assert end <= document_end, f"range {token_range} leaves document {document}"
  return int(document)


def plan(corpus, config, seed=0, documents=None):
  all_documents = corpus.split_documents("train")
  documents = all_documents if documents is None else documents
  return formats.plan_examples(corpus, documents, all_documents, config, np.random.default_rng(seed))


def test_bert_truncation_closed_form_matches_the_reference_loop():
  rng = np.random.default_rng(0)
  planner = formats._Planner.__new__(formats._Planner)
  for length_a, length_b, max_tokens in rng.integers(1, 60, size=(300, 3)):
    a, b = list(range(length_a)), list(range(length_b))
    while len(a) + len(b) > max(max_tokens, 2):  # create_pretraining_data.truncate_seq_pair
      longer = a if len(a) > len(b) else b
      longer.pop()
    planner.rng = rng
    cut_a, cut_b = planner.truncate_pair((0, length_a), (100, 100 + length_b), max(max_tokens, 2))
    assert (cut_a[1] - cut_a[0], cut_b[1] - cut_b[0]) == (len(a), len(b))
  # The front/back choice is a fair coin per removed token.
  fronts = [planner.truncate_pair((0, 100), (100, 110), 30)[0][0] for _ in range(2000)]
  assert abs(np.mean(fronts) - 40) < 1.0  # 80 tokens cut from A, half from its front


def test_segment_pairs_follow_bert(corpus):
  config = formats.FormatConfig("segment_pair", seq_len=64, short_seq_prob=0.0)
  examples = plan(corpus, config)
  labels = np.array([e.label for e in examples])
  for example in examples:
    assert example.length <= 64
    (a,), (b,) = example.segment_a, example.segment_b
    assert a[1] > a[0] and b[1] > b[0]
    document_a, document_b = document_of(corpus, a), document_of(corpus, b)
    if example.label == 0:
      # B is what follows A; only truncation (rows that end up exactly full) leaves a gap.
      assert document_a == document_b and (a[1] == b[0] if example.length < 64 else a[1] <= b[0])
    else:
      assert document_a != document_b
  # Random B with probability 1/2, plus one-sentence chunks that must take a random B.
  rate = labels.mean()
  bound = 4 * np.sqrt(0.25 / len(labels))
  assert 0.5 - bound < rate < 0.5 + bound + 0.15, rate
  full = np.array([e.length for e in examples])
  assert np.mean(full >= 60) > 0.5  # most fill the target of L-3 tokens + 3 specials


def sentence_of(corpus, token_range):
  """Global sentence of a token range, checking that the range stays inside it."""
  start, end = token_range
  sentence = int(np.searchsorted(corpus.sentence_starts, start, side="right") - 1)
  assert end <= corpus.sentence_starts[sentence + 1], f"range {token_range} leaves sentence {sentence}"
  return sentence


def test_sentence_pairs_hold_one_natural_sentence_a_segment(corpus):
  """RoBERTa SENTENCE-PAIR: A is a sentence, B the next one (label 0) or another document's sentence (label 1)."""
  examples = plan(corpus, formats.FormatConfig("sentence_pair", seq_len=64, random_next_prob=0.5))
  labels = np.array([e.label for e in examples])
  whole = 0
  for example in examples:
    assert example.length <= 64
    (a,), (b,) = example.segment_a, example.segment_b
    sentence_a, sentence_b = sentence_of(corpus, a), sentence_of(corpus, b)
    whole += a == (corpus.sentence_starts[sentence_a], corpus.sentence_starts[sentence_a + 1])
    if example.label == 0:
      assert sentence_b == sentence_a + 1 and document_of(corpus, a) == document_of(corpus, b)
    else:
      assert document_of(corpus, a) != document_of(corpus, b)
  assert whole > 0.9 * len(examples)  # only a pair longer than L-3 tokens is cut
  # Random B with probability 1/2, plus a document's last sentence, which must take one.
  bound = 4 * np.sqrt(0.25 / len(labels))
  assert 0.5 - bound < labels.mean() < 0.5 + bound + 0.15, labels.mean()
  segment_pairs = plan(corpus, formats.FormatConfig("segment_pair", seq_len=64, short_seq_prob=0.0))
  assert np.mean([e.length for e in examples]) < 0.6 * np.mean([e.length for e in segment_pairs])


def test_short_seq_prob_draws_short_targets(corpus):
  long_examples = plan(corpus, formats.FormatConfig("segment_pair", seq_len=64, short_seq_prob=0.0))
  short_examples = plan(corpus, formats.FormatConfig("segment_pair", seq_len=64, short_seq_prob=1.0))
  assert np.mean([e.length for e in short_examples]) < 0.8 * np.mean([e.length for e in long_examples])
  assert len(short_examples) > len(long_examples)


def test_sop_swaps_consecutive_segments_of_one_document(corpus):
  examples = plan(corpus, formats.FormatConfig("sop", seq_len=64))
  labels = np.array([e.label for e in examples])
  for example in examples:
    (a,), (b,) = example.segment_a, example.segment_b
    assert document_of(corpus, a) == document_of(corpus, b)
    first, second = (a, b) if example.label == 0 else (b, a)
    assert first[1] == second[0] if example.length < 64 else first[1] <= second[0]
    assert example.length <= 64
  assert abs(labels.mean() - 0.5) < 4 * np.sqrt(0.25 / len(labels))


def test_full_sentences_cross_documents_doc_sentences_never(corpus):
  documents = corpus.split_documents("train")
  for example_format in ("full_sentences", "doc_sentences"):
    config = formats.FormatConfig(example_format, seq_len=48)
    examples = plan(corpus, config)
    covered = 0
    crossing = 0
    for example in examples:
      assert example.segment_b == () and example.label == 0
      assert example.length <= 48
      owners = [document_of(corpus, r) for r in example.segment_a]
      crossing += len(set(owners)) > 1
      # Ranges are consecutive documents in order, one range per document.
      assert owners == sorted(set(owners), key=owners.index)
      covered += sum(end - start for start, end in example.segment_a)
    if example_format == "full_sentences":
      assert crossing > 0
      full = [e.length for e in examples[:-1]]
      assert np.mean(np.array(full) >= 48 - 24) > 0.9  # rows are filled up to the longest sentence
    else:
      assert crossing == 0
    # Every token of the split is used exactly once (no sentence is over-long here).
    total = sum(corpus.sentence_starts[corpus.document_starts[d + 1]] - corpus.sentence_starts[corpus.document_starts[d]]
                for d in documents)
    assert covered == total


def test_rows_hold_the_planned_tokens(corpus):
  tokenizer = corpus.load_tokenizer()
  config = formats.FormatConfig("segment_pair", seq_len=64)
  examples = plan(corpus, config)[:20]
  rows = formats.pack_examples(examples, config)
  batch = formats.build_rows(corpus, rows, config, tokenizer.special_ids, np.arange(20), np.zeros(20))
  batch_lib.validate_batch(batch)
  specials = tokenizer.special_ids
  for index, example in enumerate(examples):
    (a_start, a_end), (b_start, b_end) = example.segment_a[0], example.segment_b[0]
    tokens_a = corpus.tokens(a_start, a_end).tolist()
    tokens_b = corpus.tokens(b_start, b_end).tolist()
    expected = [specials["cls"], *tokens_a, specials["sep"], *tokens_b, specials["sep"]]
    used = len(expected)
    assert batch["input_ids"][index, :used].tolist() == expected
    assert (batch["input_ids"][index, used:] == specials["pad"]).all()
    assert batch["segment_ids"][index].tolist() == [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1) + [0] * (
        64 - used)
    assert batch["special_mask"][index].tolist() == (
        [1] + [0] * len(tokens_a) + [1] + [0] * len(tokens_b) + [1] + [1] * (64 - used))
    assert batch["position_ids"][index, :used].tolist() == list(range(used))
    assert batch["pack_ids"][index].tolist() == [1] * used + [0] * (64 - used)
    assert batch["sentence_labels"][index, 0] == example.label
  assert batch["cls_positions"].shape == (20, 1) and (batch["cls_positions"] == 0).all()


def test_packing_keeps_examples_apart(corpus):
  tokenizer = corpus.load_tokenizer()
  config = formats.FormatConfig("sop", seq_len=128, short_seq_prob=1.0, packing=True, max_packs=4)
  examples = plan(corpus, config)
  rows = formats.pack_examples(examples, config)
  assert len(rows) < len(examples) / 2
  assert [e for row in rows for e in row] == examples
  batch = formats.build_rows(corpus, rows, config, tokenizer.special_ids, np.arange(len(rows)),
                             np.full(len(rows), 3))
  batch_lib.validate_batch(batch)
  assert batch["cls_positions"].shape == (len(rows), 4)
  for index, row in enumerate(rows):
    assert 1 <= len(row) <= 4
    pack_ids = batch["pack_ids"][index]
    used = int((pack_ids > 0).sum())
    assert used <= 128 and (pack_ids[used:] == 0).all()
    # Attention groups: pack k is one contiguous run; positions restart at each [CLS].
    assert (np.diff(pack_ids[:used]) >= 0).all() and pack_ids[:used].max() == len(row)
    starts = batch["cls_positions"][index, :len(row)]
    assert (batch["input_ids"][index, starts] == tokenizer.cls_id).all()
    assert (batch["position_ids"][index, starts] == 0).all()
    assert np.array_equal(np.flatnonzero(batch["position_ids"][index, :used] == 0), starts)
    for pack, example in enumerate(row):
      members = np.flatnonzero(pack_ids == pack + 1)
      assert len(members) == example.length and members[0] == starts[pack]
      assert batch["sentence_labels"][index, pack] == example.label
    assert batch["sentence_weights"][index].tolist() == [1.0] * len(row) + [0.0] * (4 - len(row))
  assert (batch["epoch"] == 3).all()


def test_single_segments_and_empty_padding_rows(corpus):
  tokenizer = corpus.load_tokenizer()
  config = formats.FormatConfig("single", seq_len=32)
  examples = plan(corpus, config)
  for example in examples:
    assert len(example.segment_a) == 1 and example.length <= 32
    document_of(corpus, example.segment_a[0])
  batch = formats.build_rows(corpus, [[examples[0]], []], config, tokenizer.special_ids, np.array([5, 6]),
                             np.zeros(2))
  batch_lib.validate_batch(batch)
  assert (batch["input_ids"][1] == tokenizer.pad_id).all() and (batch["special_mask"][1] == 1).all()
  assert batch["sentence_weights"].tolist() == [[1.0], [0.0]]
  assert (batch["segment_ids"] == 0).all()


@pytest.mark.parametrize("example_format", formats.EXAMPLE_FORMATS)
def test_plans_are_deterministic_in_the_seed(corpus, example_format):
  config = formats.FormatConfig(example_format, seq_len=64)
  assert plan(corpus, config, seed=3) == plan(corpus, config, seed=3)
  if example_format not in ("full_sentences", "doc_sentences"):  # these two draw nothing
    assert plan(corpus, config, seed=3) != plan(corpus, config, seed=4)


def test_bad_configs_fail_loudly():
  with pytest.raises(ValueError, match="unknown example_format"):
    formats.FormatConfig("nsp", seq_len=128)
  with pytest.raises(ValueError, match="too short"):
    formats.FormatConfig("segment_pair", seq_len=4)


def _reference_rows(corpus, rows, config, specials):
  """`build_rows`' sequence fields row by row from the Example definition: [CLS] A [SEP] (B [SEP]) per example,
  the ranges of a segment joined by [SEP]."""
  length = config.seq_len
  fields = {k: np.full((len(rows), length), v, np.int32) for k, v in
            (("input_ids", specials["pad"]), ("segment_ids", 0), ("position_ids", 0), ("pack_ids", 0),
             ("word_starts", 0), ("special_mask", 1))}
  for r, row in enumerate(rows):
    column = 0
    for pack, example in enumerate(row):
      tokens = [(specials["cls"], 1, 0, 1)]
      for segment, ranges in ((0, example.segment_a), (1, example.segment_b)):
        for start, end in ranges:
          tokens += [(int(t), int(w), segment, 0) for t, w in zip(corpus.tokens(start, end),
                                                                   corpus.word_starts(start, end))]
          tokens.append((specials["sep"], 1, segment, 1))
      for position, (token, word_start, segment, special) in enumerate(tokens):
        for key, value in (("input_ids", token), ("segment_ids", segment), ("position_ids", position),
                           ("pack_ids", pack + 1), ("word_starts", word_start), ("special_mask", special)):
          fields[key][r, column + position] = value
      column += len(tokens)
  return fields


@pytest.mark.parametrize("example_format,packing", [("segment_pair", False), ("sop", True), ("full_sentences", True),
                                                    ("doc_sentences", False), ("single", True)])
def test_build_rows_equals_the_row_by_row_reference_across_shards(tmp_path, minilm_dir, example_format, packing):
  """`build_rows` writes a batch at once (one gather a shard): every field equals the row-by-row reference, on a
  corpus cut into many shards (ranges in several shards in one batch)."""
  rng = np.random.default_rng(3)
  text = "\n\n".join("\n".join(" ".join(rng.choice(WORDS, size=rng.integers(2, 15))) + " ."
                               for _ in range(rng.integers(1, 12))) for _ in range(60))
  (tmp_path / "corpus.txt").write_text(text + "\n")
  tokenizer = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  prepare.prepare_corpus([str(tmp_path / "corpus.txt")], tokenizer, tmp_path / "prepared", num_workers=0,
                         shard_tokens=500, chunk_documents=4, log=lambda *_: None)
  sharded = prepare.open_prepared(tmp_path / "prepared")
  assert len(sharded.manifest["shards"]) > 3
  config = formats.FormatConfig(example_format, seq_len=64, short_seq_prob=0.5, packing=packing, max_packs=3)
  rows = formats.pack_examples(plan(sharded, config), config)[:40] + [[]]
  batch = formats.build_rows(sharded, rows, config, tokenizer.special_ids, np.arange(len(rows)),
                             np.zeros(len(rows)))
  batch_lib.validate_batch(batch)
  for key, expected in _reference_rows(sharded, rows, config, tokenizer.special_ids).items():
    np.testing.assert_array_equal(batch[key], expected, err_msg=key)
  for r, row in enumerate(rows):
    starts = np.cumsum([0] + [e.length for e in row])[:-1]
    assert batch["cls_positions"][r, :len(row)].tolist() == starts.tolist()
    assert batch["sentence_labels"][r, :len(row)].tolist() == [e.label for e in row]
    assert batch["sentence_weights"][r].tolist() == [1.0] * len(row) + [0.0] * (config.packs_per_row - len(row))
