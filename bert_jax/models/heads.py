"""Output heads on top of the encoder's hidden states.

Pre-training: MLM (sparse: only gathered positions are projected to the
vocabulary), sentence-level NSP/SOP, ELECTRA replaced-token detection,
SpanBERT span-boundary objective. Fine-tuning: classification/regression,
span extraction, multiple choice, token tagging.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.models.config import ModelConfig
from bert_jax.models.encoder import Dropout, activation, add_bias, dense, layer_norm
from bert_jax.models.functional import bias_init, gather_positions

Array = jax.Array

# The logit of the vocabulary's padding columns (`ModelConfig.vocab_pad_multiple`): exp(-1e9 - max) is 0 in float32.
PAD_LOGIT = -1e9


class VocabTransform(nn.Module):
  """dense(H -> E) + activation + LayerNorm, then the tied vocabulary projection + bias: [..., padded_vocab_size]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_bmh: Array, attend) -> Array:
    cfg = self.config
    x_bme = activation(cfg)(dense(cfg, cfg.embed_dim, (None, "embed"), "transform")(x_bmh))
    x_bme = layer_norm(cfg, "transform_norm")(x_bme)
    bias_v = self.param("output_bias", bias_init(("vocab",)), (cfg.vocab_size,), cfg.weight_dtype)
    extra = cfg.padded_vocab_size - cfg.vocab_size
    if extra:  # `ModelConfig.vocab_pad_multiple`: logits past the vocabulary that no softmax weighs
      bias_v = jnp.concatenate([bias_v, jnp.full((extra,), PAD_LOGIT, bias_v.dtype)])
    return add_bias(cfg, attend(x_bme), bias_v)


class MLMHead(nn.Module):
  """Masked-LM head computed only at the masked positions (sparse prediction)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, hidden_ble: Array, positions_bm: Array, attend) -> Array:
    """Returns [B, M, padded_vocab_size] logits at `positions_bm` (`ModelConfig.vocab_pad_multiple`); `attend` is
    the tied embedding projection."""
    return VocabTransform(self.config, name="predictions")(gather_positions(hidden_ble, positions_bm), attend)


class Pooler(nn.Module):
  """tanh(dense(h_[CLS])) at the given positions (BERT's pooler)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, hidden_ble: Array, cls_positions_bp: Array | None = None) -> Array:
    if cls_positions_bp is None:
      first_bph = hidden_ble[:, :1]
    else:
      first_bph = gather_positions(hidden_ble, cls_positions_bp)
    return jnp.tanh(dense(self.config, self.config.hidden_size, ("embed", None), "dense")(first_bph))


class SentenceHead(nn.Module):
  """NSP / SOP (2 classes), StructBERT's SSO (3): pooler + classifier, one prediction per packed example."""

  config: ModelConfig
  num_classes: int = 2

  @nn.compact
  def __call__(self, hidden_ble: Array, cls_positions_bp: Array | None = None, deterministic: bool = True) -> Array:
    pooled = Pooler(self.config, name="pooler")(hidden_ble, cls_positions_bp)
    pooled = Dropout(self.config.hidden_dropout, self.config.kernels)(pooled, deterministic=deterministic)
    return dense(self.config, self.num_classes, ("embed", None), "classifier")(pooled)


class ReplacedTokenHead(nn.Module):
  """ELECTRA discriminator: dense + activation + dense(1) per token -> [B, L] logits."""

  config: ModelConfig

  @nn.compact
  def __call__(self, hidden_ble: Array) -> Array:
    cfg = self.config
    x = activation(cfg)(dense(cfg, cfg.hidden_size, ("embed", None), "dense")(hidden_ble))
    return dense(cfg, 1, ("embed", None), "prediction")(x)[..., 0]


class SpanBoundaryHead(nn.Module):
  """SpanBERT SBO: predict each span token from the states just outside the span.

  y_i = f(x_{s-1}, x_{e+1}, p_{i-s+1}) with f a 2-layer GELU + LayerNorm MLP,
  followed by the tied vocabulary projection.
  """

  config: ModelConfig
  max_span_positions: int = 64

  @nn.compact
  def __call__(self, hidden_ble: Array, left_bm: Array, right_bm: Array, offsets_bm: Array, attend) -> Array:
    cfg = self.config
    position_table = self.param("position_embeddings",
                                nn.with_logical_partitioning(nn.initializers.normal(cfg.initializer_range),
                                                             (None, "embed")),
                                (self.max_span_positions, cfg.hidden_size), cfg.weight_dtype)
    offsets_bm = jnp.clip(offsets_bm, 0, self.max_span_positions - 1)
    x = jnp.concatenate([gather_positions(hidden_ble, left_bm), gather_positions(hidden_ble, right_bm),
                         jnp.take(position_table, offsets_bm, axis=0).astype(hidden_ble.dtype)], axis=-1)
    act = activation(cfg)
    for i in range(2):
      x = layer_norm(cfg, f"norm_{i}")(act(dense(cfg, cfg.hidden_size, (None, "embed"), f"dense_{i}")(x)))
    return VocabTransform(cfg, name="predictions")(x, attend)


class ClassificationHead(nn.Module):
  """Pooled [CLS] -> dropout -> dense(num_labels). num_labels=1 is regression."""

  config: ModelConfig
  num_labels: int

  @nn.compact
  def __call__(self, hidden_ble: Array, deterministic: bool = True) -> Array:
    pooled = Pooler(self.config, name="pooler")(hidden_ble)[:, 0]
    pooled = Dropout(self.config.hidden_dropout, self.config.kernels)(pooled, deterministic=deterministic)
    return dense(self.config, self.num_labels, ("embed", None), "classifier")(pooled)


class SpanExtractionHead(nn.Module):
  """SQuAD: dense(2) per token -> (start [B, L], end [B, L]) logits."""

  config: ModelConfig

  @nn.compact
  def __call__(self, hidden_ble: Array, deterministic: bool = True) -> tuple[Array, Array]:
    logits = dense(self.config, 2, ("embed", None), "qa_outputs")(hidden_ble)
    return logits[..., 0], logits[..., 1]


class MultipleChoiceHead(nn.Module):
  """Pooled [CLS] of each (context, choice) row -> one score; caller reshapes to [N, C]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, hidden_ble: Array, deterministic: bool = True) -> Array:
    pooled = Pooler(self.config, name="pooler")(hidden_ble)[:, 0]
    pooled = Dropout(self.config.hidden_dropout, self.config.kernels)(pooled, deterministic=deterministic)
    return dense(self.config, 1, ("embed", None), "classifier")(pooled)[..., 0]


class TokenClassificationHead(nn.Module):
  """Per-token tagging (NER): dropout -> dense(num_labels)."""

  config: ModelConfig
  num_labels: int

  @nn.compact
  def __call__(self, hidden_ble: Array, deterministic: bool = True) -> Array:
    x = Dropout(self.config.hidden_dropout, self.config.kernels)(hidden_ble, deterministic=deterministic)
    return dense(self.config, self.num_labels, ("embed", None), "classifier")(x)
