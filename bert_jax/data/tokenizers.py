"""Tokenizers behind one interface: WordPiece, SentencePiece and byte-level BPE.

Every tokenizer the project uses is a `Tokenizer`: it encodes text into ids
*without* special tokens (the example builders place [CLS]/[SEP]), reports which
tokens start a word (whole-word, n-gram and span masking need this), and knows
its own special-token ids, which are always looked up in the vocabulary, never
assumed.

The work is done by the Hugging Face `tokenizers` library (WordPiece with BERT's
basic tokenisation, `tokenizer.json` files, byte-level BPE) and by
`sentencepiece` (ALBERT-style unigram/BPE models). `load_tokenizer` detects the
kind from the files it is given; `train_tokenizer` trains any of the four kinds,
reproducibly: the same text and settings give the same vocabulary.

Word starts: for Hugging Face tokenizers a token starts a word when its word id
(the index of the pre-tokenized word it came from) differs from the previous
token's. For SentencePiece a token starts a word when its piece begins with the
word-boundary marker U+2581, which is how SentencePiece itself marks words. The
first token of every encoded text always starts a word.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import os
import pathlib
import tempfile
from typing import Iterable, Sequence

import numpy as np
import sentencepiece
import tokenizers as hf

from bert_jax import paths

# Special tokens of each family, in the order the trainers put them in the vocab.
BERT_SPECIALS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ALBERT_SPECIALS = {"pad": "<pad>", "unk": "<unk>", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
ROBERTA_SPECIALS = {"cls": "<s>", "pad": "<pad>", "sep": "</s>", "unk": "<unk>", "mask": "<mask>"}
TOKENIZER_KINDS = ("wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-bpe")
_SENTENCEPIECE_WORD_MARK = "\u2581"


def _flatten_encodings(ids_per_text: Sequence[Sequence[int]],
                       word_starts_per_text: Iterable[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  lengths = np.fromiter((len(ids) for ids in ids_per_text), dtype=np.int64, count=len(ids_per_text))
  ids = np.fromiter(itertools.chain.from_iterable(ids_per_text), dtype=np.int32, count=int(lengths.sum()))
  starts = np.concatenate([np.zeros(0, np.uint8), *word_starts_per_text]).astype(np.uint8)
  return ids, starts, lengths


class Tokenizer(abc.ABC):
  """The interface every tokenizer implements (see the module docstring).

  Attributes:
    kind: 'wordpiece', 'sentencepiece-unigram', 'sentencepiece-bpe', 'byte-bpe'
      or 'hf-json' (a tokenizer.json of another model type).
    vocab_size: number of ids.
    pad_id, cls_id, sep_id, mask_id, unk_id: special-token ids from the vocab.
  """

  kind: str
  vocab_size: int
  pad_id: int
  cls_id: int
  sep_id: int
  mask_id: int
  unk_id: int

  @abc.abstractmethod
  def encode_arrays(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encodes many texts into flat arrays (the fast path used by corpus preparation).

    Returns:
      ids int32 [T], word_starts uint8 [T] and lengths int64 [N] where T is the
      total token count and `lengths[i]` the token count of `texts[i]`.
    """

  def encode_batch(self, texts: Sequence[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Returns (ids per text, word-start flags per text); no special tokens added."""
    ids, starts, lengths = self.encode_arrays(texts)
    bounds = np.cumsum(lengths)[:-1]
    return ([part.tolist() for part in np.split(ids, bounds)],
            [part.tolist() for part in np.split(starts.astype(np.int32), bounds)])

  def encode(self, text: str) -> list[int]:
    """Ids of one text, no special tokens."""
    return self.encode_batch([text])[0][0]

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, special tokens dropped."""

  @abc.abstractmethod
  def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
    """Vocabulary strings of `ids`."""

  @abc.abstractmethod
  def fingerprint(self) -> str:
    """A stable hex hash of the vocabulary and normalisation settings."""

  def save(self, directory: str | os.PathLike) -> str | os.PathLike:
    """Writes files that `load_tokenizer(directory)` reads back (a local folder or `gs://`); returns it.

    Each file appears whole or not at all, the one `load_tokenizer` looks for first written last.

    Raises:
      paths.StorageError: a file could not be written (disk full, quota, permission).
    """
    if not paths.is_remote(directory):
      return self._write(pathlib.Path(directory))
    with tempfile.TemporaryDirectory(prefix="bert_jax-tokenizer-") as local:
      paths.upload(self._write(pathlib.Path(local)), paths.as_path(directory))
    return directory

  @abc.abstractmethod
  def _write(self, directory: pathlib.Path) -> pathlib.Path:
    """Writes the tokenizer's files into the local `directory` (created if missing); returns it."""

  @property
  def special_ids(self) -> dict[str, int]:
    return {"pad": self.pad_id, "cls": self.cls_id, "sep": self.sep_id, "mask": self.mask_id, "unk": self.unk_id}

  def __repr__(self) -> str:
    return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, specials={self.special_ids})"


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizers.Tokenizer` (WordPiece, byte-level BPE or any tokenizer.json)."""

  def __init__(self, tokenizer: hf.Tokenizer, kind: str):
    # Files saved for inference (sentence-transformers among them) often pad or
    # truncate; lengths are the example builders' business, so both go.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    self.tokenizer = tokenizer
    self.kind = kind
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    for specials in (BERT_SPECIALS, ROBERTA_SPECIALS, ALBERT_SPECIALS):
      if all(token in vocab for token in specials.values()):
        for role, token in specials.items():
          setattr(self, f"{role}_id", vocab[token])
        break
    else:
      raise ValueError(f"{kind} tokenizer has none of the special-token sets BERT {list(BERT_SPECIALS.values())}, "
                       f"RoBERTa {list(ROBERTA_SPECIALS.values())} or ALBERT {list(ALBERT_SPECIALS.values())}")

  def encode_arrays(self, texts):
    encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
    ids_per_text = [encoding.ids for encoding in encodings]
    starts_per_text = []
    for encoding in encodings:
      word_ids = np.asarray(encoding.word_ids, dtype=np.int64)
      starts = np.ones(len(word_ids), np.uint8)
      starts[1:] = word_ids[1:] != word_ids[:-1]
      starts_per_text.append(starts)
    return _flatten_encodings(ids_per_text, starts_per_text)

  def decode(self, ids):
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)

  def convert_ids_to_tokens(self, ids):
    return [self.tokenizer.id_to_token(int(i)) for i in ids]

  def fingerprint(self):
    # to_str() holds the vocab, normaliser, pre-tokenizer and model settings;
    # re-serialising with sorted keys makes the hash independent of key order.
    canonical = json.dumps(json.loads(self.tokenizer.to_str()), sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(f"{self.kind}\n{canonical}".encode()).hexdigest()[:16]

  def _write(self, directory):
    # tokenizer.json last: its presence is what callers take for a saved tokenizer.
    paths.write_text(directory / "bert_jax_tokenizer.json", json.dumps({"kind": self.kind}))
    paths.write_text(directory / "tokenizer.json", self.tokenizer.to_str(pretty=True))
    return directory


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model (unigram or BPE) with ALBERT's special tokens."""

  def __init__(self, model_proto: bytes):
    self.model_proto = model_proto
    self.processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    self.vocab_size = self.processor.get_piece_size()
    trainer_spec = _sentencepiece_trainer_spec(model_proto)
    self.kind = f"sentencepiece-{trainer_spec.get('model_type', 'unigram').lower()}"
    for role, piece in ALBERT_SPECIALS.items():
      piece_id = self.processor.piece_to_id(piece)
      if self.processor.id_to_piece(piece_id) != piece:
        raise ValueError(f"SentencePiece model lacks the special piece {piece!r}; ALBERT-style models need "
                         f"{list(ALBERT_SPECIALS.values())}")
      setattr(self, f"{role}_id", piece_id)
    pieces = [self.processor.id_to_piece(i) for i in range(self.vocab_size)]
    self._piece_starts_word = np.array([p.startswith(_SENTENCEPIECE_WORD_MARK) for p in pieces], np.uint8)

  def encode_arrays(self, texts):
    ids_per_text = self.processor.encode(list(texts), out_type=int)
    starts_per_text = []
    for ids in ids_per_text:
      starts = self._piece_starts_word[np.asarray(ids, dtype=np.int64)]
      starts[:1] = 1
      starts_per_text.append(starts)
    return _flatten_encodings(ids_per_text, starts_per_text)

  def decode(self, ids):
    return self.processor.decode([int(i) for i in ids])

  def convert_ids_to_tokens(self, ids):
    return [self.processor.id_to_piece(int(i)) for i in ids]

  def fingerprint(self):
    # The serialised model holds the pieces, scores, normaliser rules and training options, less the two
    # fields that name the training run's files (its input and a temporary output prefix), so a model
    # trained again on the same text has the same fingerprint.
    model = _sentencepiece_model(self.model_proto)
    model.trainer_spec.ClearField("input")
    model.trainer_spec.ClearField("model_prefix")
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]

  def _write(self, directory):
    paths.write_bytes_with(directory / "spiece.model", lambda handle: handle.write(self.model_proto))
    return directory


def _sentencepiece_model(model_proto: bytes):
  """The parsed `ModelProto` of a serialised SentencePiece model."""
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
  model = sentencepiece_model_pb2.ModelProto()
  model.ParseFromString(model_proto)
  return model


def _sentencepiece_trainer_spec(model_proto: bytes) -> dict[str, str]:
  """Reads `trainer_spec.model_type` from a serialised model."""
  model = _sentencepiece_model(model_proto)
  return {"model_type": type(model.trainer_spec).ModelType.Name(model.trainer_spec.model_type)}


def _bert_tokenizer(model: hf.models.WordPiece, lowercase: bool) -> hf.Tokenizer:
  """BERT's tokenizer: basic tokenisation (clean, CJK and punctuation split, optional lowercase+accents) + `model`."""
  tokenizer = hf.Tokenizer(model)
  tokenizer.normalizer = hf.normalizers.BertNormalizer(
      clean_text=True, handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase)
  tokenizer.pre_tokenizer = hf.pre_tokenizers.BertPreTokenizer()
  tokenizer.decoder = hf.decoders.WordPiece(prefix="##")
  return tokenizer


def _wordpiece_from_vocab(vocab_file: pathlib.Path, lowercase: bool) -> hf.Tokenizer:
  return _bert_tokenizer(hf.models.WordPiece.from_file(str(vocab_file), unk_token=BERT_SPECIALS["unk"]), lowercase)


def _byte_bpe_from_files(vocab_file: pathlib.Path, merges_file: pathlib.Path) -> hf.Tokenizer:
  """RoBERTa/GPT-2 byte-level BPE from vocab.json + merges.txt (cased, no prefix space)."""
  tokenizer = hf.Tokenizer(hf.models.BPE.from_file(str(vocab_file), str(merges_file)))
  tokenizer.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = hf.decoders.ByteLevel()
  vocab = tokenizer.get_vocab()
  tokenizer.add_special_tokens([t for t in ROBERTA_SPECIALS.values() if t in vocab])
  return tokenizer


def _read_do_lower_case(directory: pathlib.Path) -> bool:
  config_file = directory / "tokenizer_config.json"
  if config_file.exists():
    return bool(json.loads(config_file.read_text()).get("do_lower_case", True))
  return True


def _hf_json_kind(tokenizer: hf.Tokenizer, directory: pathlib.Path) -> str:
  marker = directory / "bert_jax_tokenizer.json"
  if marker.exists():
    return json.loads(marker.read_text())["kind"]
  model_type = json.loads(tokenizer.to_str())["model"]["type"]
  return {"WordPiece": "wordpiece"}.get(model_type, "hf-json")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """Loads a tokenizer from a directory or a file (local or `gs://`), detecting its kind.

  Looked for, in this order: `tokenizer.json` (Hugging Face), `vocab.txt`
  (BERT WordPiece; `do_lower_case` from tokenizer_config.json, default True),
  `*.model` (SentencePiece), `vocab.json` + `merges.txt` (byte-level BPE).
  A file path selects that file directly.

  Raises:
    FileNotFoundError: when nothing loadable is there.
  """
  if paths.is_remote(path):  # Read from a local copy of its folder (the libraries open files by name).
    remote = paths.as_path(path)
    is_file = remote.is_file()
    with paths.local_copy(remote.parent if is_file else remote) as local:
      return load_tokenizer(local / remote.name if is_file else local)
  path = pathlib.Path(path)
  if path.is_file():
    directory, files = path.parent, [path]
  elif path.is_dir():
    directory, files = path, sorted(path.iterdir())
  else:
    raise FileNotFoundError(f"no tokenizer at {path}")
  names = {f.name: f for f in files}
  if "tokenizer.json" in names:
    tokenizer = hf.Tokenizer.from_file(str(names["tokenizer.json"]))
    return HFTokenizer(tokenizer, _hf_json_kind(tokenizer, directory))
  if "vocab.txt" in names:
    return HFTokenizer(_wordpiece_from_vocab(names["vocab.txt"], _read_do_lower_case(directory)), "wordpiece")
  models = [f for f in files if f.suffix == ".model"]
  if models:
    return SentencePieceTokenizer(models[0].read_bytes())
  if path.is_dir() and (directory / "vocab.json").exists() and (directory / "merges.txt").exists():
    return HFTokenizer(_byte_bpe_from_files(directory / "vocab.json", directory / "merges.txt"), "byte-bpe")
  raise FileNotFoundError(f"{path} holds none of tokenizer.json, vocab.txt, *.model, vocab.json+merges.txt")


def train_tokenizer(kind: str, files_or_iterator: Sequence[str | pathlib.Path] | Iterable[str], vocab_size: int,
                    out_dir: str | pathlib.Path, lowercase: bool = True) -> Tokenizer:
  """Trains a tokenizer of `kind` (one of TOKENIZER_KINDS), saves it to `out_dir` and returns it.

  Args:
    kind: 'wordpiece' (BERT), 'sentencepiece-unigram' / 'sentencepiece-bpe'
      (ALBERT), or 'byte-bpe' (RoBERTa).
    files_or_iterator: plain-text files (one sentence per line) or an iterator
      of texts.
    vocab_size: target vocabulary size including special tokens.
    out_dir: where the tokenizer files are written.
    lowercase: lowercase (and for WordPiece strip accents) before tokenising.
  """
  if kind not in TOKENIZER_KINDS:
    raise ValueError(f"unknown tokenizer kind {kind!r}; choose one of {TOKENIZER_KINDS}")
  out_dir = pathlib.Path(out_dir)
  is_files = isinstance(files_or_iterator, (list, tuple)) and all(
      isinstance(f, (str, pathlib.Path)) and pathlib.Path(f).is_file() for f in files_or_iterator)
  if kind.startswith("sentencepiece"):
    tokenizer = _train_sentencepiece(kind.split("-")[1], files_or_iterator, is_files, vocab_size, lowercase)
    tokenizer.save(out_dir)
    return tokenizer
  if kind == "wordpiece":
    model = _train_wordpiece(files_or_iterator, is_files, vocab_size, lowercase)
  else:
    model = hf.Tokenizer(hf.models.BPE())
    if lowercase:
      model.normalizer = hf.normalizers.Lowercase()
    model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(ROBERTA_SPECIALS.values()), show_progress=False,
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    _run_trainer(model, trainer, files_or_iterator, is_files)
  tokenizer = HFTokenizer(model, kind)
  tokenizer.save(out_dir)
  return tokenizer


def _run_trainer(tokenizer: hf.Tokenizer, trainer, files_or_iterator, is_files: bool) -> None:
  if is_files:
    tokenizer.train([str(f) for f in files_or_iterator], trainer)
  else:
    tokenizer.train_from_iterator(files_or_iterator, trainer)


def _train_wordpiece(files_or_iterator, is_files: bool, vocab_size: int, lowercase: bool) -> hf.Tokenizer:
  """BERT's WordPiece from `tokenizers`' WordPieceTrainer, made reproducible: the same text gives the same vocabulary.

  The trainer numbers the continuing-subword tokens of single characters ("##a") in the iteration order of a
  hash map, which changes from one training to the next (huggingface/tokenizers issue #1794), and breaks ties between
  equally frequent merges by those numbers: two trainings of the demo's 4k vocabulary on the same corpus gave
  different vocabularies every time. So the trainer runs twice. The first run stops before any merge (it only
  counts words) and finds those tokens; the second lists them, sorted, after the special tokens, which gives
  them fixed numbers before the trainer reaches them. They then go back to being ordinary vocabulary entries
  (the trainer would have made them added tokens). An iterator's texts are written to a temporary file during
  the first run, one per line, and the second run reads that.
  """
  specials = list(BERT_SPECIALS.values())

  def fit(data, size, fixed_tokens, from_files):
    tokenizer = _bert_tokenizer(hf.models.WordPiece(unk_token=BERT_SPECIALS["unk"]), lowercase)
    trainer = hf.trainers.WordPieceTrainer(vocab_size=size, special_tokens=specials + fixed_tokens,
                                           show_progress=False)
    _run_trainer(tokenizer, trainer, data, from_files)
    return tokenizer

  with tempfile.TemporaryDirectory() as tmp:
    files = files_or_iterator
    if is_files:
      first = fit(files, len(specials), [], True)
    else:
      files = [pathlib.Path(tmp) / "texts.txt"]
      with open(files[0], "w", encoding="utf-8") as copy:
        def copied(texts):
          for text in texts:
            try:
              copy.write(text.replace("\n", " ") + "\n")
            except OSError as error:  # A full temporary disk: named, or the message says neither file nor disk.
              raise paths.storage_error(error, files[0]) from error
            yield text
        first = fit(copied(files_or_iterator), len(specials), [], False)
    continuing = sorted(t for t in first.get_vocab() if t.startswith("##") and len(t) == 3)
    trained = fit(files, vocab_size, continuing, True)
  tokenizer = _bert_tokenizer(hf.models.WordPiece(vocab=trained.get_vocab(), unk_token=BERT_SPECIALS["unk"]),
                              lowercase)
  tokenizer.add_special_tokens(specials)
  return tokenizer


def _train_sentencepiece(model_type: str, files_or_iterator, is_files: bool, vocab_size: int,
                         lowercase: bool) -> SentencePieceTokenizer:
  """ALBERT's recipe: <pad>=0, <unk>=1, [CLS]=2, [SEP]=3, [MASK]=4, no BOS/EOS."""
  options = dict(
      model_type=model_type, vocab_size=vocab_size, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
      pad_piece=ALBERT_SPECIALS["pad"], unk_piece=ALBERT_SPECIALS["unk"],
      control_symbols=[ALBERT_SPECIALS["cls"], ALBERT_SPECIALS["sep"], ALBERT_SPECIALS["mask"]],
      normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
      character_coverage=0.9995, hard_vocab_limit=False, input_sentence_size=2_000_000,
      shuffle_input_sentence=True, num_threads=1, minloglevel=2)
  # Sentence sampling (corpora over input_sentence_size) draws from this seed.
  sentencepiece.set_random_generator_seed(0)
  with tempfile.TemporaryDirectory() as tmp:
    prefix = pathlib.Path(tmp) / "spiece"
    if is_files:
      sentencepiece.SentencePieceTrainer.train(
          input=[str(f) for f in files_or_iterator], model_prefix=str(prefix), **options)
    else:
      sentencepiece.SentencePieceTrainer.train(
          sentence_iterator=iter(files_or_iterator), model_prefix=str(prefix), **options)
    return SentencePieceTokenizer(prefix.with_suffix(".model").read_bytes())
