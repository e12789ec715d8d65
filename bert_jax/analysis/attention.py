"""Attention patterns (Clark et al. 2019; Kovaleva et al. 2019): where each head looks, on real text.

For every layer and head, averaged over every real query token of the given lines:

  cls, sep, punct   attention mass on [CLS], on [SEP] tokens, on punctuation tokens
  prev, next, self  attention on the token just before, just after, and on the token itself
  entropy           the entropy of the attention distribution, in nats

(`prev` averages over queries that have a previous token, `next` over those that have a next one.) Clark et al.
found that many heads in BERT's middle layers put most of their weight on [SEP] (a "no-op" when the head's
pattern does not apply), early heads on [CLS] and broadly, and some heads on the previous or next token.

`attention_patterns` returns the statistics; `write_figures` the heat maps and a sentence's attention maps.
"""

from __future__ import annotations

import pathlib
import string
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.analysis.features import padded_batches
from bert_jax.models import Encoder, ModelConfig

PATTERNS = ("cls", "sep", "punct", "prev", "next", "self", "entropy")
PATTERN_TITLES = {"cls": "attention to [CLS]", "sep": "attention to [SEP]", "punct": "attention to punctuation",
                  "prev": "attention to the previous token", "next": "attention to the next token",
                  "self": "attention to the token itself", "entropy": "attention entropy (nats)"}


def punctuation_ids(tokens: Sequence[str]) -> np.ndarray:
  """Boolean [vocab]: the vocabulary entries made only of punctuation (word-piece and byte-level marks removed)."""
  marks = set(string.punctuation) | {"“", "”", "‘", "’", "–", "—", "…"}

  def is_punct(token: str) -> bool:
    text = token.removeprefix("##").lstrip("Ġ▁")
    return bool(text) and all(char in marks for char in text) and not (token.startswith("[") and token.endswith("]"))

  return np.array([is_punct(token) for token in tokens], bool)


def pattern_sums(probs_bhql: jax.Array, lengths_b: jax.Array, is_cls_bl: jax.Array, is_sep_bl: jax.Array,
                 is_punct_bl: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One layer's attention summed over real query tokens: ([heads, len(PATTERNS)] sums, [len(PATTERNS)] counts).

  probs_bhql: float32 attention probabilities; padding keys carry no weight. The mean of a pattern is its sum
  over its count.
  """
  length = probs_bhql.shape[-1]
  position = jnp.arange(length)
  real_bq = position[None, :] < lengths_b[:, None]
  to_tokens = lambda mask_bl: jnp.einsum("bhql,bl->bhq", probs_bhql, mask_bl.astype(probs_bhql.dtype))  # noqa: E731
  diagonal = lambda offset: jnp.diagonal(probs_bhql, offset=offset, axis1=2, axis2=3)  # noqa: E731
  zero_h1 = jnp.zeros(probs_bhql.shape[:2] + (1,), probs_bhql.dtype)
  prev_bhq = jnp.concatenate([zero_h1, diagonal(-1)], axis=-1)  # query q's weight on key q - 1
  next_bhq = jnp.concatenate([diagonal(1), zero_h1], axis=-1)
  entropy_bhq = -jnp.sum(jnp.where(probs_bhql > 0, probs_bhql * jnp.log(jnp.maximum(probs_bhql, 1e-30)), 0.0), -1)
  has_prev_bq = real_bq & (position[None, :] > 0)
  has_next_bq = real_bq & (position[None, :] < lengths_b[:, None] - 1)
  values = (to_tokens(is_cls_bl), to_tokens(is_sep_bl), to_tokens(is_punct_bl), prev_bhq, next_bhq,
            diagonal(0), entropy_bhq)
  masks = (real_bq, real_bq, real_bq, has_prev_bq, has_next_bq, real_bq, real_bq)
  sums_h = [jnp.einsum("bhq,bq->h", value, mask.astype(value.dtype)) for value, mask in zip(values, masks)]
  return jnp.stack(sums_h, axis=-1), jnp.stack([jnp.sum(mask) for mask in masks]).astype(jnp.float32)


def attention_fn(config: ModelConfig):
  """A jitted (params, ids [B, L], segments [B, L], lengths [B]) -> float32 [layers, B, heads, L, L]; the heads a
  pruned layer lacks (`ModelConfig.heads_per_layer`) are zeros."""
  encoder = Encoder(config)

  @jax.jit
  def attentions(params, ids_bl, segments_bl, lengths_b):
    pack_ids_bl = (jnp.arange(ids_bl.shape[1])[None, :] < lengths_b[:, None]).astype(jnp.int32)
    outputs = encoder.apply({"params": params}, ids_bl, segments_bl, pack_ids=pack_ids_bl, output_attentions=True)
    pad = lambda probs: ((0, 0), (0, config.num_heads - probs.shape[1]), (0, 0), (0, 0))  # noqa: E731
    return jnp.stack([jnp.pad(probs.astype(jnp.float32), pad(probs)) for probs in outputs["attentions"]])

  return attentions


def attention_patterns(config: ModelConfig, params: Any, encoded: Sequence[tuple[list[int], list[int]]],
                       cls_id: int, sep_id: int, punct_v: np.ndarray, max_len: int,
                       batch_size: int = 16) -> dict[str, np.ndarray]:
  """{pattern: float [layers, heads]} means over every real query token of `encoded` ((ids, segments) lines with
  special tokens, as `features.encode_line` makes them; NaN for heads a pruned layer lacks), and "tokens": the
  query tokens counted."""
  attentions = attention_fn(config)

  @jax.jit
  def batch_sums(params, ids_bl, segments_bl, lengths_b):
    probs_kbhql = attentions(params, ids_bl, segments_bl, lengths_b)
    ids_bl = jnp.asarray(ids_bl)
    categories = (ids_bl == cls_id, ids_bl == sep_id, jnp.asarray(punct_v)[ids_bl])
    return jax.vmap(lambda probs: pattern_sums(probs, lengths_b, *categories))(probs_kbhql)

  sums = np.zeros((config.num_layers, config.num_heads, len(PATTERNS)))
  counts = np.zeros((len(PATTERNS),))
  for _, ids_bt, segments_bt, lengths_b in padded_batches(encoded, batch_size, max_len):
    batch_sums_khp, batch_counts_kp = batch_sums(params, ids_bt, segments_bt, lengths_b)
    sums += np.asarray(batch_sums_khp, np.float64)
    counts += np.asarray(batch_counts_kp[0], np.float64)
  means = sums / np.maximum(counts, 1)
  for layer in range(config.num_layers):
    means[layer, config.layer_heads(layer):] = np.nan  # heads pruned away
  result = {name: means[..., index] for index, name in enumerate(PATTERNS)}
  result["tokens"] = np.array(int(counts[0]))
  return result


def sentence_attention(config: ModelConfig, params: Any, ids: list[int], segments: list[int]) -> np.ndarray:
  """float32 [layers, heads, T, T]: the attention maps of one encoded line."""
  attentions = attention_fn(config)
  probs = attentions(params, np.array([ids], np.int32), np.array([segments], np.int32), np.array([len(ids)]))
  return np.asarray(probs[:, 0])


def patterns_markdown(patterns: dict[str, np.ndarray], lines: int) -> str:
  """The report's section: per-layer means of every pattern, each pattern's strongest heads, and per-head tables."""
  layers, heads = patterns["cls"].shape
  out = [f"{lines} lines, {int(patterns['tokens'])} query tokens; means over query tokens "
         "(entropy in nats; the others are attention weights in [0, 1]).", "",
         "Per layer (mean over heads):", "",
         "| layer | " + " | ".join(PATTERNS) + " |", "|---" * (len(PATTERNS) + 1) + "|"]
  for layer in range(layers):
    out.append(f"| {layer + 1} | " + " | ".join(f"{np.nanmean(patterns[p][layer]):.3f}" for p in PATTERNS) + " |")
  out += ["", "Strongest head per pattern (layer-head, 1-based):", ""]
  for pattern in PATTERNS:
    values = patterns[pattern]
    layer, head = np.unravel_index(np.nanargmax(values), values.shape)
    above = int(np.sum(values > 0.5)) if pattern != "entropy" else None
    extra = f"; heads above 0.5: {above} of {int(np.sum(~np.isnan(values)))}" if above is not None else ""
    out.append(f"- {PATTERN_TITLES[pattern]}: {layer + 1}-{head + 1} ({values[layer, head]:.3f}){extra}")
  for pattern in PATTERNS:
    out += ["", f"### {PATTERN_TITLES[pattern]}", "",
            "| layer | " + " | ".join(f"h{h + 1}" for h in range(heads)) + " |", "|---" * (heads + 1) + "|"]
    for layer in range(layers):
      out.append(f"| {layer + 1} | " + " | ".join(f"{v:.2f}" for v in patterns[pattern][layer]) + " |")
  return "\n".join(out)


def patterns_summary(patterns: dict[str, np.ndarray]) -> str:
  """A few printed lines: each pattern's per-layer means."""
  layers = patterns["cls"].shape[0]
  lines = ["attention, mean over heads; layer" + "".join(f"{layer + 1:>7}" for layer in range(layers))]
  for pattern in PATTERNS:
    lines.append(f"  {pattern:<31}" + "".join(f"{v:7.3f}" for v in np.nanmean(patterns[pattern], axis=1)))
  return "\n".join(lines)


def write_figures(patterns: dict[str, np.ndarray], sentence_maps: np.ndarray | None, sentence_tokens: list[str],
                  out_dir: pathlib.Path) -> list[pathlib.Path]:
  """attention_patterns.png (one heat map per pattern, layers x heads) and, with `sentence_maps`,
  sentence_attention.png (every head's map of the chosen line). Returns the files written."""
  import matplotlib  # noqa: PLC0415 - only for the figures
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  written = []
  layers, heads = patterns["cls"].shape
  columns = 4
  rows = -(-len(PATTERNS) // columns)
  fig, axes = plt.subplots(rows, columns, figsize=(columns * (1.2 + 0.3 * heads), rows * (1.0 + 0.35 * layers)),
                           squeeze=False)
  for axis in axes.ravel()[len(PATTERNS):]:
    axis.axis("off")
  for axis, pattern in zip(axes.ravel(), PATTERNS):
    values = patterns[pattern]
    image = axis.imshow(values, cmap="viridis", vmin=0, vmax=None if pattern == "entropy" else 1, aspect="auto")
    axis.set_title(pattern)
    axis.set_xlabel("head", fontsize=7)
    axis.set_ylabel("layer", fontsize=7)
    axis.set_xticks(range(heads), [str(h + 1) for h in range(heads)], fontsize=6)
    axis.set_yticks(range(layers), [str(layer + 1) for layer in range(layers)], fontsize=6)
    fig.colorbar(image, ax=axis, fraction=0.05)
  fig.tight_layout()
  path = out_dir / "attention_patterns.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  written.append(path)
  if sentence_maps is not None:
    fig, axes = plt.subplots(layers, heads, figsize=(1.3 * heads, 1.3 * layers), squeeze=False)
    for layer in range(layers):
      for head in range(heads):
        axis = axes[layer][head]
        axis.imshow(sentence_maps[layer, head], cmap="Blues", vmin=0, vmax=1)
        axis.set_xticks([])
        axis.set_yticks([])
        if layer == 0:
          axis.set_title(f"head {head + 1}", fontsize=7)
        if head == 0:
          axis.set_ylabel(f"layer {layer + 1}", fontsize=7)
    fig.suptitle(" ".join(sentence_tokens)[:160], fontsize=8)
    fig.tight_layout()
    path = out_dir / "sentence_attention.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written
