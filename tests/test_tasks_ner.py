"""CoNLL-2003: reader on the real files, conlleval chunk rules by hand, first-piece labels, document context."""

import collections

import numpy as np
import pytest

from bert_jax.tasks import get_task
from bert_jax.tasks.base import HFTokenizerAdapter
from bert_jax.tasks.ner import TAGS, TaggedSentence, conll_f1, iob1_chunks, read_conll


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return HFTokenizerAdapter.from_vocab_file(minilm_dir / "vocab.txt")


@pytest.mark.parametrize("tags,chunks", [
    ("I-PER I-PER O", {(0, 1, "PER")}),
    ("O I-PER", {(1, 1, "PER")}),  # I- after O starts a chunk (IOB1)
    ("I-PER B-PER I-PER", {(0, 0, "PER"), (1, 2, "PER")}),  # B- separates adjacent same-type chunks
    ("I-PER I-LOC", {(0, 0, "PER"), (1, 1, "LOC")}),  # a type change starts a chunk
    ("B-ORG I-ORG", {(0, 1, "ORG")}),  # IOB2 reads the same
    ("B-ORG B-ORG", {(0, 0, "ORG"), (1, 1, "ORG")}),
    ("B-ORG I-MISC", {(0, 0, "ORG"), (1, 1, "MISC")}),
    ("I-LOC O I-LOC", {(0, 0, "LOC"), (2, 2, "LOC")}),
    ("O O", set()),
])
def test_iob1_chunks_follow_conlleval(tags, chunks):
  assert iob1_chunks(tags.split()) == chunks


def test_conll_f1_by_hand():
  gold = [["I-PER", "I-PER", "O", "I-LOC"], ["I-ORG", "B-ORG", "O"]]
  predicted = [["I-PER", "O", "O", "I-LOC"], ["I-ORG", "I-ORG", "O"]]
  # Gold: PER(0-1), LOC(3), ORG(0), ORG(1) = 4. Predicted: PER(0), LOC(3), ORG(0-1) = 3. Correct: LOC only.
  results = conll_f1(predicted, gold)
  assert results["precision"] == pytest.approx(100 / 3)
  assert results["recall"] == pytest.approx(25.0)
  assert results["f1"] == pytest.approx(2 * (100 / 3) * 25 / (100 / 3 + 25))
  assert results["f1_LOC"] == pytest.approx(100.0) and results["f1_PER"] == 0.0 and results["f1_ORG"] == 0.0
  assert conll_f1(gold, gold)["f1"] == pytest.approx(100.0)
  # A chunk never spans two sentences.
  assert conll_f1([["I-PER"], ["I-PER"]], [["I-PER"], ["I-PER"]])["precision"] == pytest.approx(100.0)
  assert conll_f1([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}


@pytest.mark.shared_data
@pytest.mark.parametrize("split,documents,sentences,tokens,entities", [
    ("train", 946, 14041, 203621, {"LOC": 7140, "MISC": 3438, "ORG": 6321, "PER": 6600}),
    ("dev", 216, 3250, 51362, {"LOC": 1837, "MISC": 922, "ORG": 1341, "PER": 1842}),
])
def test_real_files_counts(shared_data, split, documents, sentences, tokens, entities):
  examples = get_task("conll2003").load(shared_data / "conll2003", split)
  assert len(examples) == sentences
  assert len({s.document_index for s in examples}) == documents == examples[-1].document_index + 1
  assert sum(len(s.words) for s in examples) == tokens
  counts = collections.Counter(kind for s in examples for _, _, kind in iob1_chunks(s.tags))
  assert counts == entities
  if split == "train":
    assert examples[0].words[:3] == ("EU", "rejects", "German") and examples[1].words == ("Peter", "Blackburn")


def test_bad_files_name_file_and_line(tmp_path):
  path = tmp_path / "eng.train"
  path.write_text("-DOCSTART- -X- O O\n\nEU NNP I-NP I-ORG\nrejects VBZ I-VP\n")
  with pytest.raises(ValueError, match=r"eng\.train:4: expected 4 space-separated columns, found 3"):
    read_conll(path)
  path.write_text("EU NNP I-NP I-ORG\nrejects VBZ I-VP I-FOO\n")
  with pytest.raises(ValueError, match=r"eng\.train:2: tag 'I-FOO' is not one of"):
    read_conll(path)
  path.write_text("")
  with pytest.raises(ValueError, match=r"eng\.train: file has no sentences"):
    read_conll(path)


def _sentences():
  return [TaggedSentence(("Zwolinski", "Face", "rejects", "Przemyslowy", "."), ("I-ORG", "I-ORG", "O", "I-LOC", "O"), 0),
          TaggedSentence(("Peter", "Blackburn"), ("I-PER", "I-PER"), 0),
          TaggedSentence(("Another", "document", "here"), ("O", "O", "O"), 1)]


def test_labels_only_on_first_pieces(tokenizer):
  sentences = _sentences()
  features = get_task("conll2003").featurize(sentences, tokenizer, max_len=16)
  for row, sentence in enumerate(sentences):
    labelled = np.flatnonzero(features["labels"][row] >= 0)
    assert features["word_ids"][row, labelled].tolist() == list(range(len(sentence.words)))
    assert [TAGS[i] for i in features["labels"][row, labelled]] == list(sentence.tags)
    # A piece is labelled exactly when it starts at a word's first character.
    text = " ".join(sentence.words)
    (ids,), (offsets,) = tokenizer.tokenize_with_offsets([text])
    word_start_chars = {0} | {i + 1 for i, ch in enumerate(text) if ch == " "}
    assert len(ids) > len(sentence.words) or row > 0  # "Zwolinski", "Przemyslowy" have several pieces
    assert features["input_ids"][row, 1:1 + len(ids)].tolist() == ids
    is_first = [start in word_start_chars for start, _ in offsets]
    assert (features["labels"][row, 1:1 + len(ids)] >= 0).tolist() == is_first
    assert features["labels"][row, 0] == -1 and (features["labels"][row, 1 + len(ids):] == -1).all()
  assert (features["segment_ids"] == 0).all()


def test_long_sentences_span_several_rows(tokenizer):
  sentence = TaggedSentence(tuple(f"Johannesburg{i}" for i in range(10)), ("I-LOC",) * 10, 0)
  task = get_task("conll2003")
  features = task.featurize([sentence], tokenizer, max_len=8)
  rows = len(features["input_ids"])
  assert rows > 1 and (features["example_index"] == 0).all() and (features["lengths"] <= 8).all()
  # Every word is labelled exactly once, in order, and rows break only at word starts.
  word_ids = features["word_ids"][features["word_ids"] >= 0]
  assert word_ids.tolist() == list(range(10))
  assert (features["word_ids"][:, 1] >= 0).all()
  logits = np.zeros((rows, 8, len(TAGS)), np.float32)
  logits[..., TAGS.index("I-LOC")] = 1.0
  assert task.predict(logits, features, [sentence]) == [["I-LOC"] * 10]
  # A single word longer than a row is cut; its label sits on its first piece.
  long_word = TaggedSentence(("Johannesburg" * 6, "x"), ("I-LOC", "O"), 0)
  features = task.featurize([long_word], tokenizer, max_len=5)
  assert features["word_ids"][features["word_ids"] >= 0].tolist() == [0, 1]


def test_document_context_keeps_labels_on_centre_sentence(tokenizer):
  sentences = _sentences()
  plain = get_task("conll2003").featurize(sentences, tokenizer, max_len=32)
  with_context = get_task("conll2003", document_context=True).featurize(sentences, tokenizer, max_len=32)
  ids = tokenizer.tokenize_with_offsets([" ".join(s.words) for s in sentences])[0]
  # Sentence 0 gets sentence 1 after it; sentence 1 gets sentence 0 before it; document 1 stays alone.
  assert with_context["input_ids"][0, 1:with_context["lengths"][0] - 1].tolist() == ids[0] + ids[1]
  assert with_context["input_ids"][1, 1:with_context["lengths"][1] - 1].tolist() == ids[0] + ids[1]
  assert (with_context["input_ids"][2] == plain["input_ids"][2]).all()
  for row in range(3):
    # Same labels in the same order, shifted by the left context.
    assert with_context["labels"][row][with_context["labels"][row] >= 0].tolist() == (
        plain["labels"][row][plain["labels"][row] >= 0].tolist())
  shift = len(ids[0])
  np.testing.assert_array_equal(with_context["labels"][1, 1 + shift:1 + shift + len(ids[1])],
                                plain["labels"][1, 1:1 + len(ids[1])])
  # Evaluation reads each word from its first piece in the centre sentence.
  task = get_task("conll2003", document_context=True)
  logits = np.zeros((3, 32, len(TAGS)), np.float32)
  rows, positions = np.nonzero(with_context["labels"] >= 0)
  logits[rows, positions, with_context["labels"][rows, positions]] = 1.0
  assert task.predict(logits, with_context, sentences) == [list(s.tags) for s in sentences]
  assert task.evaluate(logits, with_context, sentences)["f1"] == pytest.approx(100.0)


def test_document_context_is_balanced_and_fills_the_row(tokenizer):
  words = tuple(f"w{i}" for i in range(6))
  sentences = [TaggedSentence(words, ("O",) * 6, 0) for _ in range(9)]
  features = get_task("conll2003", document_context=True).featurize(sentences, tokenizer, max_len=40)
  centre = len(tokenizer.tokenize_with_offsets([" ".join(words)])[0][0])
  assert (features["lengths"] == 40).all()
  middle = np.flatnonzero(features["labels"][4] >= 0)
  left = middle[0] - 1
  right = 40 - 2 - left - centre
  assert abs(left - right) <= 1
  assert np.flatnonzero(features["labels"][0] >= 0)[0] == 1  # first sentence: all context on the right


@pytest.mark.shared_data
def test_real_dev_round_trip_with_context(shared_data, tokenizer):
  task = get_task("conll2003", document_context=True)
  examples = task.load(shared_data / "conll2003", "dev")
  features = task.featurize(examples, tokenizer, max_len=128)
  assert (features["lengths"] <= 128).all()
  logits = np.zeros(features["input_ids"].shape + (len(TAGS),), np.float32)
  rows, positions = np.nonzero(features["labels"] >= 0)
  logits[rows, positions, features["labels"][rows, positions]] = 1.0
  # Gold through the features scores 100: long sentences use several rows, no word is lost.
  assert task.evaluate(logits, features, examples)["f1"] == pytest.approx(100.0)


def test_chunk_task_reads_noun_phrases_and_scores_them_by_conlleval(tmp_path):
  # The chunk column in IOB1: "I-NP B-NP" are two adjacent NPs; VP/PP chunks read as O.
  path = tmp_path / "eng.testa"
  path.write_text("-DOCSTART- -X- O O\n\n"
                  "The DT I-NP O\nEuropean NNP I-NP I-ORG\nCommission NNP I-NP I-ORG\nsaid VBD I-VP O\n"
                  "on IN I-PP O\nThursday NNP I-NP O\nit PRP B-NP O\ndisagreed VBD I-VP O\n. . O O\n")
  task = get_task("conll2003_chunk")
  assert task.name == "conll2003_chunk" and task.labels == ("O", "B-NP", "I-NP") and task.num_labels == 3
  (sentence,) = task.load(tmp_path, "dev")
  assert sentence.tags == ("I-NP", "I-NP", "I-NP", "O", "O", "I-NP", "B-NP", "O", "O")
  assert sentence.chunks[3:5] == ("I-VP", "I-PP")  # The raw column is kept.
  assert iob1_chunks(sentence.tags) == {(0, 2, "NP"), (5, 5, "NP"), (6, 6, "NP")}
  assert get_task("conll2003").load(tmp_path, "dev")[0].tags[1:3] == ("I-ORG", "I-ORG")
  # conlleval on NP chunks: "Thursday it" predicted as one NP is wrong at both; "The European Commission" right.
  predicted = ["I-NP", "I-NP", "I-NP", "O", "O", "I-NP", "I-NP", "O", "O"]
  results = conll_f1([predicted], [sentence.tags])
  assert results["precision"] == pytest.approx(50.0) and results["recall"] == pytest.approx(100 / 3)
  path.write_text("EU NNP X-NP I-ORG\n")
  with pytest.raises(ValueError, match=r"eng\.testa:1: chunk tag 'X-NP' is not O, B-TYPE or I-TYPE"):
    task.load(tmp_path, "dev")


@pytest.mark.shared_data
def test_chunk_task_real_counts(shared_data):
  examples = get_task("conll2003_chunk").load(shared_data / "conll2003", "train")
  assert len(examples) == 14041
  tags = collections.Counter(tag for s in examples for tag in s.tags)
  assert tags == {"I-NP": 120255, "B-NP": 3777, "O": 203621 - 120255 - 3777}
