"""`bert-jax features`: BERT's feature-based use, per-token vectors from chosen layers.

  bert-jax features --model DIR --input FILE --layers -1,-2,-3,-4 [--concat] \\
      [--max-len 128] [--batch-size 32] --out FILE.npz

DIR is a model directory (ours or a Hugging Face checkpoint; --tokenizer where it has no tokenizer files) or a
pre-training or fine-tuning workdir (its newest checkpoint's encoder, its own tokenizer).

Each input line is one sentence, or a sentence pair separated by a tab. Lines
are encoded as the model's family expects ([CLS] A [SEP] B [SEP] with token
types 0/1; RoBERTa: <s> A </s></s> B </s>), truncated longest-first to
--max-len, and run through the frozen encoder in batches padded to a few
length buckets (one compilation per bucket). Layer -1 is the last block's
output, 0 the embedding output, as in Hugging Face's `hidden_states`.

The .npz holds:
  features  float32 [lines, tokens, layers, dim], or [lines, tokens, layers * dim]
            with --concat (layers in the order given); zero past each line's end
  lengths   int32 [lines], tokens per line
  tokens    str [lines, tokens], the word pieces ("" past each line's end)
  layers    int32 [layers], the layer indices used
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.convert.params import Params
from bert_jax.data.tokenizers import Tokenizer, load_tokenizer
from bert_jax.models import Encoder, ModelConfig
from bert_jax.tasks.finetune_model import load_initial_model

_MIN_BUCKET = 8


def encode_line(tokenizer: Tokenizer, family: str, line: str, max_len: int) -> tuple[list[int], list[int]]:
  """One line (sentence, or pair split at a tab) -> (ids, segment ids) with special tokens, at most max_len."""
  texts = line.split("\t", 1)
  pieces = [tokenizer.encode(text) for text in texts]
  cls, sep = [tokenizer.cls_id], [tokenizer.sep_id]
  # RoBERTa separates a pair with two </s> and has a single token type.
  middle = sep + sep if family == "roberta" else sep
  budget = max_len - (2 if len(pieces) == 1 else 1 + len(middle) + 1)
  if budget < len(pieces):
    raise ValueError(f"--max-len {max_len} leaves no room for text after the special tokens")
  while sum(map(len, pieces)) > budget:
    longest = max(range(len(pieces)), key=lambda i: (len(pieces[i]), -i))
    pieces[longest].pop()
  if len(pieces) == 1:
    ids = cls + pieces[0] + sep
    segments = [0] * len(ids)
  else:
    first, second = cls + pieces[0] + middle, pieces[1] + sep
    ids = first + second
    segments = [0] * len(first) + [0 if family == "roberta" else 1] * len(second)
  return ids, segments


def bucket_length(length: int, max_len: int) -> int:
  """Padded length for a sequence: the next power of two (at least 8), at most max_len."""
  bucket = _MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max_len)


def padded_batches(encoded: Sequence[tuple[list[int], list[int]]], batch_size: int, max_len: int):
  """Yields (row indices, ids [B, T], segments [B, T], lengths [B]) over the lines grouped by length bucket
  (`bucket_length`); rows past the lines are empty (length 0)."""
  by_bucket: dict[int, list[int]] = {}
  for index, (ids, _) in enumerate(encoded):
    by_bucket.setdefault(bucket_length(len(ids), max_len), []).append(index)
  for bucket, indices in sorted(by_bucket.items()):
    for start in range(0, len(indices), batch_size):
      rows = indices[start:start + batch_size]
      ids_bt = np.zeros((batch_size, bucket), np.int32)
      segments_bt = np.zeros((batch_size, bucket), np.int32)
      lengths_b = np.zeros((batch_size,), np.int32)
      for row, index in enumerate(rows):
        ids, segments = encoded[index]
        ids_bt[row, :len(ids)], segments_bt[row, :len(ids)], lengths_b[row] = ids, segments, len(ids)
      yield rows, ids_bt, segments_bt, lengths_b


@functools.lru_cache(maxsize=8)
def layer_features_fn(config: ModelConfig, layers: tuple[int, ...]):
  """A jitted (params, ids [B,T], segments [B,T], pack_ids [B,T]) -> float32 [B, T, len(layers), H]; one per
  (config, layers), so callers that pass lines in chunks compile each length bucket once."""
  encoder = Encoder(config)

  @jax.jit
  def features(params, ids_bt, segments_bt, pack_ids_bt):
    outputs = encoder.apply({"params": params}, ids_bt, segments_bt, pack_ids=pack_ids_bt,
                            output_hidden_states=True)
    hidden_states = outputs["hidden_states"]
    return jnp.stack([hidden_states[layer] for layer in layers], axis=2).astype(jnp.float32)

  return features


def extract_features(config: ModelConfig, params: Params, encoded: list[tuple[list[int], list[int]]],
                     layers: Sequence[int], max_len: int, batch_size: int) -> np.ndarray:
  """Runs the encoder over encoded lines; returns float32 [lines, max tokens, len(layers), H], zero-padded.

  Lines are grouped by length bucket; each batch is padded to `batch_size`
  rows and the bucket length, so each bucket compiles once.
  """
  longest = max((len(ids) for ids, _ in encoded), default=0)
  out = np.zeros((len(encoded), longest, len(layers), config.hidden_size), np.float32)
  features = layer_features_fn(config, tuple(layers))
  for rows, ids_bt, segments_bt, lengths_b in padded_batches(encoded, batch_size, max_len):
    pack_ids_bt = (np.arange(ids_bt.shape[1])[None, :] < lengths_b[:, None]).astype(np.int32)
    batch_features = np.asarray(features(params, ids_bt, segments_bt, pack_ids_bt))
    for row, index in enumerate(rows):
      length = len(encoded[index][0])
      out[index, :length] = batch_features[row, :length]
  return out


def _parse_layers(text: str, num_layers: int) -> list[int]:
  layers = [int(part) for part in text.split(",") if part.strip()]
  bad = [layer for layer in layers if not -(num_layers + 1) <= layer <= num_layers]
  if not layers or bad:
    raise ValueError(f"--layers {text!r}: each must lie in [{-(num_layers + 1)}, {num_layers}] "
                     f"(0 = embeddings, -1 = last of {num_layers} layers)")
  return layers


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="bert-jax features", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  parser.add_argument("--model", required=True, help="model directory (ours or a Hugging Face checkpoint), or a "
                      "pre-training or fine-tuning workdir")
  parser.add_argument("--input", required=True, help="text file: a sentence, or two separated by a tab, per line")
  parser.add_argument("--layers", default="-1,-2,-3,-4", help="comma-separated layer indices (-1 = last)")
  parser.add_argument("--concat", action="store_true", help="concatenate the layers instead of stacking them")
  parser.add_argument("--max-len", type=int, default=128, help="tokens per line, special tokens included")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--tokenizer", help="tokenizer file or directory (default: the model directory's)")
  parser.add_argument("--out", required=True, help="output .npz file")
  return parser


def _attach_layers_value(argv: list[str]) -> list[str]:
  """["--layers", "-1,-2"] -> ["--layers=-1,-2"]: argparse takes "-1,-2" for an option otherwise."""
  argv = list(argv)
  for index, arg in enumerate(argv[:-1]):
    if arg == "--layers":
      argv[index:index + 2] = [f"--layers={argv[index + 1]}"]
      break
  return argv


def main(argv: list[str]) -> int:
  """Runs the command on `argv` (the arguments after `features`); returns the exit status."""
  args = _parser().parse_args(_attach_layers_value(argv))
  initial = load_initial_model(args.model, require_tokenizer=False)
  family, config, params = initial.family, initial.config, initial.params["encoder"]
  if args.max_len > config.max_position_embeddings - config.position_offset:
    print(f"bert-jax features: error: --max-len {args.max_len} exceeds the model's "
          f"{config.max_position_embeddings - config.position_offset} positions", file=sys.stderr)
    return 1
  if args.tokenizer is None and initial.tokenizer is None:
    print(f"bert-jax features: error: {args.model} has no tokenizer files; pass --tokenizer", file=sys.stderr)
    return 1
  tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else initial.tokenizer
  layers = _parse_layers(args.layers, config.num_layers)
  lines = pathlib.Path(args.input).read_text(encoding="utf-8").splitlines()
  encoded = [encode_line(tokenizer, family, line, args.max_len) for line in lines]
  features = extract_features(config, params, encoded, layers, args.max_len, args.batch_size)
  if args.concat:
    features = features.reshape(features.shape[0], features.shape[1], -1)
  lengths = np.array([len(ids) for ids, _ in encoded], np.int32)
  tokens = np.full(features.shape[:2], "", dtype=object)
  for index, (ids, _) in enumerate(encoded):
    tokens[index, :len(ids)] = tokenizer.convert_ids_to_tokens(ids)
  np.savez(args.out, features=features, lengths=lengths, tokens=tokens.astype(str), layers=np.array(layers, np.int32))
  print(f"{len(lines)} lines, features {features.shape} from layers {layers} -> {args.out}")
  return 0
