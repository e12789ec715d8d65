"""The frozen model config shared by every BERT-family encoder, and its presets.

One `ModelConfig` describes BERT, RoBERTa, ALBERT and ELECTRA encoders alike:
the families differ only in field values (embedding factorisation, layer
sharing, position offset, activation...). Presets come from a string table, as
in big_vision's `decode_variant`:

  model_config("bert", "base")                  # BERT-Base, 110M
  model_config("bert", "L4-H256")               # any miniature
  model_config("albert", "large", dtype="bfloat16")
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp

from bert_jax.models import fast_path

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
FAMILIES = ("bert", "roberta", "albert", "electra")
SHARED_SUBLAYERS = ("all", "attention", "ffn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture and numerics of one encoder.

  Attributes:
    vocab_size: number of word pieces.
    hidden_size: H, width of the residual stream.
    num_layers: L, number of transformer blocks applied.
    num_heads: A, attention heads; head size is H / A.
    intermediate_size: width of the feed-forward layer.
    embedding_size: E; ALBERT/ELECTRA factorise embeddings with E != H and a
      projection E -> H. None means E = H (BERT, RoBERTa).
    max_position_embeddings: rows of the learned position table.
    type_vocab_size: token types (2 for BERT; RoBERTa keeps 1).
    position_offset: added to position ids before lookup (RoBERTa: pad id + 1).
    pad_token_id: id of the padding token.
    hidden_act: "gelu" (exact erf), "gelu_tanh" (ALBERT's gelu_new) or "relu".
    layer_norm_eps: LayerNorm epsilon.
    hidden_dropout: dropout on embeddings and residual branches.
    attention_dropout: dropout on attention probabilities.
    initializer_range: std of the truncated-free normal initialiser.
    norm: "post" (BERT) or "pre" (LayerNorm before each sublayer, plus a
      final LayerNorm).
    ffn: "dense" (BERT) or "geglu" (gated GELU, Shazeer 2020).
    position_embedding: "learned" or "rotary".
    rotary_base: base of the rotary frequencies.
    causal: left-to-right attention (BERT's "LTR & No NSP" ablation).
    num_shared_groups: 0 = every layer has its own parameters; k >= 1 = ALBERT
      cross-layer sharing, the L layers use k parameter groups in order.
    shared_sublayers: what the k groups share (ALBERT's Table 4): "all" (the
      whole block), "attention" (the attention projections; each layer keeps
      its feed-forward) or "ffn" (the feed-forward; each layer keeps its
      attention). With "attention" or "ffn" the LayerNorms stay per layer.
      Only "all" without sharing (num_shared_groups=0).
    dtype: compute dtype ("float32" or "bfloat16"); softmax, LayerNorm
      statistics and losses stay float32.
    param_dtype: parameter dtype (float32).
    kernels: "auto" (default): the hand-written GPU kernels and custom-gradient
      ops of `bert_jax.kernels` wherever they apply (GPU, dtype, shapes; their
      own XLA forms elsewhere), the same values to rounding; "off": the plain
      Flax / `jax.nn` model, the reference the fast paths are tested against.
      Other names come from `fast_path.register`.
    remat: "none", "full" (recompute each block in the backward pass) or
      "dots" (save only matmul outputs).
    vocab_pad_multiple: the MLM and SBO heads' tied vocabulary projection
      computes `padded_vocab_size` (vocab_size rounded up to a multiple of
      this) logits, the extra ones at -1e9: never predicted, no loss, no
      gradient; the parameters keep vocab_size rows. For the GPU's GEMMs:
      cuBLAS wants bf16 dimensions in multiples of 8, and XLA pads BERT's
      30522 by copying the [predictions, vocab] logits' gradient every step.
      1 (default): exactly vocab_size logits. The pre-training configs
      (`config_lib.model_section`) set 128 (docs/performance.md).
    sparse_last_layer: the last transformer block computes only the rows
      the heads read (pre-training: the MLM, [CLS] and span-boundary
      positions; fine-tuning's sentence-level heads: the pooled position):
      its queries, output projection, LayerNorms and feed-forward run on
      those rows, its keys and values on every position. The same loss and
      gradients to rounding (the rows' own hidden dropout masks are drawn
      for the smaller array, so differ from a full block's; attention
      dropout's are the same); the model's "hidden" output is then absent.
      Applies when the rows are at most half the sequence (not LTR's every
      position). The pre-training configs (`config_lib.model_section`) and
      the fine-tuning configs (`config_lib.finetune_config`) set it.
    fp8: the dense layers of every transformer block (attention's query, key, value and output projections, the
      feed-forward's) multiply in float8: inputs and kernels in e4m3, the incoming gradients in e5m2, each tensor
      with one scale from its absolute maximum at run time; accumulation, the rest of the model and the float32
      parameters are unchanged, so a run switches it on or off between steps (`bert_jax.models.quantization`,
      through Qwix: the `quant` extra). For Hopper's float8 tensor cores; off by default.
    heads_per_layer: a model with pruned attention heads (`bert_jax.analysis.heads.prune_heads`): how many heads
      each layer keeps, at most num_heads, at least 1; the head size stays hidden_size / num_heads. None: every
      layer has num_heads.
  """

  vocab_size: int = 30522
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  intermediate_size: int = 3072
  embedding_size: int | None = None
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  position_offset: int = 0
  pad_token_id: int = 0
  hidden_act: str = "gelu"
  layer_norm_eps: float = 1e-12
  hidden_dropout: float = 0.1
  attention_dropout: float = 0.1
  initializer_range: float = 0.02
  norm: str = "post"
  ffn: str = "dense"
  position_embedding: str = "learned"
  rotary_base: float = 10000.0
  causal: bool = False
  num_shared_groups: int = 0
  shared_sublayers: str = "all"
  dtype: str = "float32"
  param_dtype: str = "float32"
  kernels: str = "auto"
  # Older model_config.json files name the implementation of each operation; "kernels" replaces all four.
  attention_impl: dataclasses.InitVar[str | None] = None
  layer_norm_impl: dataclasses.InitVar[str | None] = None
  ffn_impl: dataclasses.InitVar[str | None] = None
  cross_entropy_impl: dataclasses.InitVar[str | None] = None
  remat: str = "none"
  vocab_pad_multiple: int = 1
  sparse_last_layer: bool = False
  fp8: bool = False
  heads_per_layer: tuple[int, ...] | None = None

  def __post_init__(self, attention_impl=None, layer_norm_impl=None, ffn_impl=None, cross_entropy_impl=None):
    del attention_impl, layer_norm_impl, ffn_impl, cross_entropy_impl
    def fail(field, why):
      raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                  "max_position_embeddings", "vocab_pad_multiple"):
      if getattr(self, field) <= 0:
        fail(field, "must be positive")
    if self.hidden_size % self.num_heads:
      fail("num_heads", f"must divide hidden_size={self.hidden_size}")
    if self.embedding_size is not None and self.embedding_size <= 0:
      fail("embedding_size", "must be positive or None")
    if self.hidden_act not in ACTIVATIONS:
      fail("hidden_act", f"expected one of {ACTIVATIONS}")
    choices = {"norm": ("post", "pre"), "ffn": ("dense", "geglu"),
               "position_embedding": ("learned", "rotary"), "kernels": ("off", *fast_path.PROVIDERS),
               "remat": ("none", "full", "dots"), "dtype": ("float32", "bfloat16", "float16"),
               "param_dtype": ("float32", "bfloat16"), "shared_sublayers": SHARED_SUBLAYERS}
    for field, allowed in choices.items():
      if getattr(self, field) not in allowed:
        fail(field, f"expected one of {allowed}")
    if self.num_shared_groups < 0 or (self.num_shared_groups and self.num_layers % self.num_shared_groups):
      fail("num_shared_groups", f"must be 0 or divide num_layers={self.num_layers}")
    if self.shared_sublayers != "all" and not self.num_shared_groups:
      fail("shared_sublayers", "shares sub-layers across the layers of a group: set num_shared_groups >= 1 too")
    if self.position_embedding == "rotary" and self.head_dim % 2:
      fail("num_heads", "rotary positions need an even head size")
    if self.type_vocab_size < 1:
      fail("type_vocab_size", "must be at least 1")
    if self.heads_per_layer is not None:
      object.__setattr__(self, "heads_per_layer", tuple(int(h) for h in self.heads_per_layer))  # JSON gives a list
      if len(self.heads_per_layer) != self.num_layers or not all(1 <= h <= self.num_heads
                                                                 for h in self.heads_per_layer):
        fail("heads_per_layer", f"needs one count in [1, num_heads={self.num_heads}] per layer ({self.num_layers})")
      if self.num_shared_groups:
        fail("heads_per_layer", "layers that share parameters (num_shared_groups) cannot keep different heads")

  @property
  def padded_vocab_size(self) -> int:
    """The width of the vocabulary logits: vocab_size rounded up to a multiple of vocab_pad_multiple."""
    return -(-self.vocab_size // self.vocab_pad_multiple) * self.vocab_pad_multiple

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  def layer_heads(self, layer: int) -> int:
    """The attention heads of `layer` (fewer than num_heads where `heads_per_layer` pruned some)."""
    return self.num_heads if self.heads_per_layer is None else self.heads_per_layer[layer]

  @property
  def embed_dim(self) -> int:
    """E: the width of the embedding tables (= H unless factorised)."""
    return self.embedding_size or self.hidden_size

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  @property
  def num_blocks(self) -> int:
    """The encoder's `block_{i}` modules: one per group when whole blocks are shared, else one per layer."""
    whole_blocks = self.num_shared_groups and self.shared_sublayers == "all"
    return self.num_shared_groups if whole_blocks else self.num_layers

  def num_params(self, include_embeddings: bool = True) -> int:
    """Encoder parameters (no pre-training heads), counted from the config."""
    H, E, F = self.hidden_size, self.embed_dim, self.intermediate_size
    ffn = (2 * H * F + 2 * F if self.ffn == "geglu" else H * F + F) + F * H + H
    norms = 2 * 2 * H
    attention = lambda heads: 3 * (H * heads * self.head_dim + heads * self.head_dim) + heads * self.head_dim * H + H
    ffn_copies = self.num_shared_groups if self.shared_sublayers == "ffn" else self.num_blocks
    attention_copies = self.num_shared_groups if self.shared_sublayers == "attention" else self.num_blocks
    blocks = norms * self.num_blocks + ffn * ffn_copies
    blocks += sum(attention(self.layer_heads(layer)) for layer in range(attention_copies))
    embeddings = self.vocab_size * E + self.type_vocab_size * E + 2 * E
    if self.position_embedding == "learned":
      embeddings += self.max_position_embeddings * E
    projection = E * H + H if E != H else 0
    final_norm = 2 * H if self.norm == "pre" else 0
    return blocks + projection + final_norm + (embeddings if include_embeddings else 0)

  def flops_per_token(self, seq_len: int, predictions_per_token: float = 1.0,
                      dense_embedding_lookup: bool = False) -> float:
    """Training FLOPs per token: 6 x (matmul params) + attention + output head.

    Non-embedding parameters are counted per *application*: a shared ALBERT
    block costs its FLOPs at every layer. The MLM head's vocabulary projection
    is charged only for the fraction of tokens that are predicted. With
    `dense_embedding_lookup`, the token embedding is charged as a one-hot
    matmul (E x vocab), as ELECTRA's paper counts training FLOPs when it
    compares models at equal compute; a gather costs next to nothing.
    """
    H, E, F, L = self.hidden_size, self.embed_dim, self.intermediate_size, self.num_layers
    ffn_matmul = (3 if self.ffn == "geglu" else 2) * H * F
    attention_width = sum(self.layer_heads(layer) * self.head_dim for layer in range(L))  # H per unpruned layer
    matmul = 4 * H * attention_width + L * ffn_matmul + (E * H if E != H else 0)
    if dense_embedding_lookup:
      matmul += E * self.vocab_size
    attention = 2 * seq_len * attention_width  # QK^T and PV, forward, per token
    head = predictions_per_token * (H * E + E * self.vocab_size)
    return 6 * (matmul + head) + 6 * attention


# BERT miniatures (Turc et al. 2019): L in {2..12} x H in {128..768}; heads = H/64, FFN = 4H.
BERT_NAMED_SIZES = {
    "tiny": (2, 128), "mini": (4, 256), "small": (4, 512), "medium": (8, 512),
    "base": (12, 768), "large": (24, 1024),
}

_ALBERT_SIZES = {  # (layers, hidden, heads, ffn); E = 128 for all.
    "base": (12, 768, 12, 3072), "large": (24, 1024, 16, 4096),
    "xlarge": (24, 2048, 16, 8192), "xxlarge": (12, 4096, 64, 16384),
}
_ELECTRA_SIZES = {  # (layers, hidden, heads, ffn, embedding size)
    "small": (12, 256, 4, 1024, 128), "base": (12, 768, 12, 3072, 768),
    "large": (24, 1024, 16, 4096, 1024),
}


def _parse_miniature(size: str) -> tuple[int, int] | None:
  """'L4-H256' / 'L=4,H=256' / '4/256' -> (4, 256)."""
  match = re.fullmatch(r"L=?(\d+)[-_,]H=?(\d+)", size) or re.fullmatch(r"(\d+)/(\d+)", size)
  return (int(match.group(1)), int(match.group(2))) if match else None


def _bert_layout(size: str) -> dict[str, int]:
  if size in BERT_NAMED_SIZES:
    layers, hidden = BERT_NAMED_SIZES[size]
  elif (parsed := _parse_miniature(size)) is not None:
    layers, hidden = parsed
  else:
    raise ValueError(f"unknown BERT size {size!r}: use one of {sorted(BERT_NAMED_SIZES)} or 'L<layers>-H<hidden>'")
  heads = 16 if hidden == 1024 else max(1, hidden // 64)
  return dict(num_layers=layers, hidden_size=hidden, num_heads=heads, intermediate_size=4 * hidden)


def model_config(family: str = "bert", size: str = "base", **overrides: Any) -> ModelConfig:
  """Returns the preset `ModelConfig` for a family and size, with overrides.

  Args:
    family: "bert", "roberta", "albert" or "electra" (for ELECTRA this is the
      discriminator; see `electra_generator_config`).
    size: a named size of the family, or for BERT/RoBERTa any miniature as
      "L<layers>-H<hidden>".
    **overrides: any `ModelConfig` field (e.g. num_layers=4, dtype="bfloat16").
  """
  if family in ("bert", "roberta"):
    fields = _bert_layout(size)
    if family == "roberta":
      fields.update(vocab_size=50265, type_vocab_size=1, pad_token_id=1, position_offset=2,
                    max_position_embeddings=514, layer_norm_eps=1e-5)
  elif family == "albert":
    if size not in _ALBERT_SIZES:
      raise ValueError(f"unknown ALBERT size {size!r}: use one of {sorted(_ALBERT_SIZES)}")
    layers, hidden, heads, ffn = _ALBERT_SIZES[size]
    fields = dict(num_layers=layers, hidden_size=hidden, num_heads=heads, intermediate_size=ffn,
                  embedding_size=128, vocab_size=30000, num_shared_groups=1, hidden_act="gelu_tanh",
                  hidden_dropout=0.0, attention_dropout=0.0)
  elif family == "electra":
    if size not in _ELECTRA_SIZES:
      raise ValueError(f"unknown ELECTRA size {size!r}: use one of {sorted(_ELECTRA_SIZES)}")
    layers, hidden, heads, ffn, embed = _ELECTRA_SIZES[size]
    fields = dict(num_layers=layers, hidden_size=hidden, num_heads=heads, intermediate_size=ffn,
                  embedding_size=embed)
  else:
    raise ValueError(f"unknown model family {family!r}: use one of {FAMILIES}")
  unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
  if unknown:
    raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
  fields.update(overrides)
  return ModelConfig(**fields)


def electra_generator_config(discriminator: ModelConfig, size_fraction: float = 0.25) -> ModelConfig:
  """The ELECTRA generator: same depth and embeddings, hidden size scaled by `size_fraction`.

  Heads keep a head size of 64 (at least one head); the feed-forward keeps the
  discriminator's ratio to the hidden size.
  """
  if not 0 < size_fraction <= 1:
    raise ValueError(f"generator size_fraction={size_fraction} must be in (0, 1]")
  hidden = max(16, int(round(discriminator.hidden_size * size_fraction)))
  heads = max(1, hidden // 64) if hidden % 64 == 0 else max(1, discriminator.num_heads * hidden // discriminator.hidden_size)
  while hidden % heads:
    heads -= 1
  ratio = discriminator.intermediate_size / discriminator.hidden_size
  return discriminator.replace(hidden_size=hidden, num_heads=heads, intermediate_size=int(hidden * ratio),
                               embedding_size=discriminator.embed_dim)
