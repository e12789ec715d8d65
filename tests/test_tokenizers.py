"""Tokenizers: parity with transformers' BERT tokenizer, train/reload round trips, special ids."""

import numpy as np
import pytest

from bert_jax.data import tokenizers

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo, Wörld! Tokenization isn't always straightforward — e.g. naïve café résumé.",
    "東京 is the capital of Japan; 北京 is China's.",
    "Numbers like 3.14159, $1,000,000 and 50% are tricky (sometimes).",
    "URLs such as https://example.com/a?b=c&d=e and emails like a.b@c.org",
    "   leading and trailing spaces   ",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "",
]

TRAINING_TEXT = [
    "the cat sat on the mat and looked at the dog.",
    "a dog barked loudly at the passing mail carrier.",
    "language models learn statistics of words in context.",
    "the quick brown fox jumps over the lazy dog again and again.",
    "tokenizers split text into pieces that a model can embed.",
] * 40


def test_wordpiece_matches_transformers_bert_tokenizer(tmp_path, minilm_dir):
  transformers = pytest.importorskip("transformers")
  # A directory with only vocab.txt makes transformers build its tokenizer from the vocab file.
  (tmp_path / "vocab.txt").write_bytes((minilm_dir / "vocab.txt").read_bytes())
  reference = transformers.BertTokenizerFast.from_pretrained(str(tmp_path), do_lower_case=True)
  ours = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  ids, word_starts = ours.encode_batch(SENTENCES)
  for sentence, our_ids, our_starts in zip(SENTENCES, ids, word_starts):
    expected = reference(sentence, add_special_tokens=False)["input_ids"]
    assert our_ids == expected, sentence
    pieces = ours.convert_ids_to_tokens(our_ids)
    # BERT's own word-piece convention: a word continues exactly at '##' pieces.
    assert our_starts == [0 if p.startswith("##") else 1 for p in pieces], sentence


def test_wordpiece_special_ids_come_from_vocab(minilm_dir):
  tokenizer = tokenizers.load_tokenizer(minilm_dir)
  assert tokenizer.kind == "wordpiece"
  assert tokenizer.vocab_size == 30522
  assert tokenizer.special_ids == {"pad": 0, "cls": 101, "sep": 102, "mask": 103, "unk": 100}
  assert tokenizer.convert_ids_to_tokens([tokenizer.cls_id, tokenizer.mask_id]) == ["[CLS]", "[MASK]"]


def test_tokenizer_json_and_vocab_txt_agree(minilm_dir):
  from_json = tokenizers.load_tokenizer(minilm_dir / "tokenizer.json")
  from_vocab = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  assert from_json.encode_batch(SENTENCES) == from_vocab.encode_batch(SENTENCES)


def test_uncased_flag_is_read_from_tokenizer_config(tmp_path, minilm_dir):
  (tmp_path / "vocab.txt").write_bytes((minilm_dir / "vocab.txt").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": false}')
  cased = tokenizers.load_tokenizer(tmp_path)
  uncased = tokenizers.load_tokenizer(minilm_dir / "vocab.txt")
  assert cased.encode("Hello") != uncased.encode("Hello")
  assert cased.fingerprint() != uncased.fingerprint()


@pytest.mark.parametrize("kind", tokenizers.TOKENIZER_KINDS)
def test_train_save_reload_round_trip(tmp_path, kind):
  trained = tokenizers.train_tokenizer(kind, iter(TRAINING_TEXT), vocab_size=400, out_dir=tmp_path / "trained")
  reloaded = tokenizers.load_tokenizer(tmp_path / "trained")
  assert reloaded.kind == trained.kind == kind
  assert reloaded.fingerprint() == trained.fingerprint()
  assert reloaded.special_ids == trained.special_ids
  assert len(set(trained.special_ids.values())) == 5
  assert trained.vocab_size <= 400
  text = "the dog sat on the lazy cat"
  ids = reloaded.encode(text)
  assert ids == trained.encode(text)
  assert not set(ids) & set(trained.special_ids.values())
  assert reloaded.decode(ids).strip() == text
  _, (word_starts,) = reloaded.encode_batch([text])
  assert sum(word_starts) == len(text.split())
  saved_again = reloaded.save(tmp_path / "again")
  assert tokenizers.load_tokenizer(saved_again).fingerprint() == trained.fingerprint()


def test_trained_tokenizers_use_family_special_tokens(tmp_path):
  expected = {
      "wordpiece": tokenizers.BERT_SPECIALS,
      "sentencepiece-unigram": tokenizers.ALBERT_SPECIALS,
      "byte-bpe": tokenizers.ROBERTA_SPECIALS,
  }
  for kind, specials in expected.items():
    tokenizer = tokenizers.train_tokenizer(kind, TRAINING_TEXT, vocab_size=300, out_dir=tmp_path / kind)
    ids = tokenizer.special_ids
    assert tokenizer.convert_ids_to_tokens([ids[role] for role in specials]) == list(specials.values())


@pytest.mark.parametrize("kind", tokenizers.TOKENIZER_KINDS)
def test_training_from_files_equals_training_from_an_iterator(tmp_path, kind):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(TRAINING_TEXT) + "\n")
  from_file = tokenizers.train_tokenizer(kind, [corpus], vocab_size=120, out_dir=tmp_path / "f")
  from_iter = tokenizers.train_tokenizer(kind, TRAINING_TEXT, vocab_size=120, out_dir=tmp_path / "i")
  assert from_file.fingerprint() == from_iter.fingerprint()
  assert from_file.decode(from_file.encode("the lazy dog")).strip() == "the lazy dog"


def test_wordpiece_training_is_reproducible(tmp_path):
  """The Hugging Face trainer alone gives a different vocabulary almost every time on this text (ties broken in
  hash-map order, tokenizers issue #1794); `train_tokenizer` must give one."""
  rng = np.random.default_rng(0)
  words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 8))) for _ in range(300)]
  text = [" ".join(rng.choice(words, size=12)) for _ in range(300)]
  trained = [tokenizers.train_tokenizer("wordpiece", text, 200, tmp_path / str(i)) for i in range(3)]
  assert len({t.fingerprint() for t in trained}) == 1
  # The continuing single characters ("##a") the training fixes up front are ordinary tokens afterwards.
  added = {token.content for token in trained[0].tokenizer.get_added_tokens_decoder().values()}
  assert added == set(tokenizers.BERT_SPECIALS.values())
  assert "##a" in trained[0].tokenizer.get_vocab()
  reloaded = tokenizers.load_tokenizer(tmp_path / "0")
  assert reloaded.fingerprint() == trained[0].fingerprint()


def test_byte_bpe_loads_from_vocab_json_and_merges(tmp_path):
  trained = tokenizers.train_tokenizer("byte-bpe", TRAINING_TEXT, vocab_size=300, out_dir=tmp_path / "t",
                                       lowercase=False)
  (tmp_path / "roberta").mkdir()
  trained.tokenizer.model.save(str(tmp_path / "roberta"))
  reloaded = tokenizers.load_tokenizer(tmp_path / "roberta")
  assert reloaded.kind == "byte-bpe"
  assert reloaded.special_ids == trained.special_ids
  text = "the lazy dog barked at the cat"
  assert reloaded.encode(text) == trained.encode(text)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="none of"):
    tokenizers.load_tokenizer(tmp_path)
