"""The BERT-family model in one file: embeddings, transformer blocks (optionally shared), the pre-training and
fine-tuning heads, and the complete pre-training models.

  Encoder           one implementation for BERT, RoBERTa, ALBERT and ELECTRA; the differences are `ModelConfig`
                    fields.
  heads             MLM (sparse: only gathered positions reach the vocabulary), sentence-level NSP / SOP / SSO,
                    ELECTRA's replaced-token detection, SpanBERT's span-boundary objective; classification,
                    regression, span extraction, multiple choice and token tagging for fine-tuning (the
                    fine-tuning model itself is `bert_jax.tasks.finetune_model`'s).
  PretrainingModel  BERT / RoBERTa / ALBERT / SpanBERT / LTR: MLM at gathered positions, optional NSP/SOP head,
                    optional SBO head.
  ElectraModel      generator + discriminator sharing one embedding table; the discriminator detects replaced
                    tokens, or (ELECTRA's Table 5) predicts the originals: Replace / All-Tokens MLM.

The models take the batch fields of `bert_jax.data.batch` by name. Every parameter carries logical axis names
(vocab, embed, heads, kv, mlp) and the main activations carry (batch, length, ...), so sharding is decided by rules
in the trainer, never here.

The model is plain Flax and `jax.nn`. Where `ModelConfig.kernels` names a fast
path ("auto": `bert_jax.kernels.layers`, found through `fast_path`'s registry
and imported only then), each operation goes through one seam into it: dense
layers, LayerNorm and the post-LN residual, attention, the feed-forward block,
the embedding lookup, bias adds and dropout. The seams are the functions and
`if _fast(cfg)` branches below; the fast forms create the same parameters and
compute the same values to rounding.

Shape suffixes: b batch, l length, q queries, m gathered positions, h heads, d head size, e embedding/hidden
width, f feed-forward width, v vocabulary.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.models import fast_path
from bert_jax.models.config import ModelConfig
from bert_jax.models.functional import (attention_mask, bias_init, dense_init, gate_heads, gather_positions,
                                        position_and_constrain)

Array = jax.Array
# The mutable collection in which each `SelfAttention` sows its pre-softmax scores [B, heads, Q, L] (float32)
# when a caller asks for them (`attention_scores`); the model computes as without it.
SCORES = "attention_scores"


def _fast(config: ModelConfig):
  """The fast layers registered for `config.kernels` (`fast_path`), or None: the plain forms here."""
  return fast_path.layers(config.kernels)


def activation(config: ModelConfig):
  """The elementwise activation of `config.hidden_act`: exact (erf) GELU, its tanh form, or ReLU."""
  if fast := _fast(config):
    return fast.activation(config.hidden_act)
  return {"gelu": lambda x: jax.nn.gelu(x, approximate=False),
          "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
          "relu": nn.relu}[config.hidden_act]


def dense(config: ModelConfig, features: int, axes: tuple[str | None, str | None], name: str) -> nn.Module:
  """A dense layer [..., in] -> [..., features] in the compute dtype; `axes` name the kernel's two dims."""
  if fast := _fast(config):
    return fast.dense(config, features, axes, name)
  return nn.Dense(features, dtype=config.compute_dtype, param_dtype=config.weight_dtype,
                  kernel_init=dense_init(config, axes), bias_init=bias_init(axes[1:]), name=name)


def add_bias(config: ModelConfig, y: Array, bias: Array) -> Array:
  """y + bias over the last axis, in y's dtype."""
  if fast := _fast(config):
    return fast.bias_add(y, bias)
  return y + bias.astype(y.dtype)


def layer_norm(config: ModelConfig, name: str, axis_name: str = "embed") -> nn.Module:
  """LayerNorm over the last axis, statistics in float32, parameters "scale" and "bias" on `axis_name`."""
  if fast := _fast(config):
    return fast.layer_norm(config, name, axis_name)
  return nn.LayerNorm(config.layer_norm_eps, dtype=config.compute_dtype, param_dtype=config.weight_dtype,
                      use_fast_variance=False, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (axis_name,)),
                      bias_init=bias_init((axis_name,)))


def Dropout(rate: float, kernels: str = "auto") -> nn.Module:  # noqa: N802 (used as the module class it returns)
  """Inverted dropout drawing from the "dropout" RNG stream: `nn.Dropout`, or the fast layers' for `kernels`
  ("auto": a hashed mask, no random bits in memory, the mask independent of the sharding)."""
  if fast := fast_path.layers(kernels):
    return fast.Dropout(rate)
  return nn.Dropout(rate)


def residual_layer_norm(config: ModelConfig, norm: nn.Module, x_ble: Array, branch_ble: Any, dropout: nn.Module,
                        deterministic: bool) -> Array:
  """The post-LN residual LayerNorm(x + dropout(branch)). With kernels, `branch_ble` is the sublayer's
  (output without its bias, that bias), which the LayerNorm kernel adds."""
  if fast := _fast(config):
    return fast.residual_layer_norm(norm, x_ble, branch_ble, dropout, deterministic)
  return norm(x_ble + dropout(branch_ble, deterministic=deterministic))


class Embeddings(nn.Module):
  """Word + position + token-type embeddings, LayerNorm and dropout, at width E."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    embed_init = lambda axes: dense_init(cfg, axes)  # noqa: E731
    self.word_embeddings = nn.Embed(cfg.vocab_size, cfg.embed_dim, dtype=cfg.compute_dtype,
                                    param_dtype=cfg.weight_dtype, embedding_init=embed_init(("vocab", "embed")))
    if cfg.position_embedding == "learned":
      self.position_embeddings = nn.Embed(cfg.max_position_embeddings, cfg.embed_dim, dtype=cfg.compute_dtype,
                                          param_dtype=cfg.weight_dtype, embedding_init=embed_init((None, "embed")))
    self.token_type_embeddings = nn.Embed(cfg.type_vocab_size, cfg.embed_dim, dtype=cfg.compute_dtype,
                                          param_dtype=cfg.weight_dtype, embedding_init=embed_init((None, "embed")))
    self.norm = layer_norm(cfg, "norm")
    self.dropout = Dropout(cfg.hidden_dropout, cfg.kernels)

  def __call__(self, input_ids_bl: Array, segment_ids_bl: Array, position_ids_bl: Array,
               deterministic: bool) -> Array:
    cfg = self.config
    if fast := _fast(cfg):
      lookup = lambda table, ids: fast.embedding_lookup(table.embedding, ids, cfg.compute_dtype)  # noqa: E731
    else:
      lookup = lambda table, ids: table(ids)  # noqa: E731
    x_ble = lookup(self.word_embeddings, input_ids_bl)
    if cfg.position_embedding == "learned":
      x_ble = x_ble + lookup(self.position_embeddings, position_ids_bl + cfg.position_offset)
    x_ble = x_ble + lookup(self.token_type_embeddings, segment_ids_bl)
    x_ble = self.dropout(self.norm(x_ble), deterministic=deterministic)
    return nn.with_logical_constraint(x_ble, ("batch", "length", "embed"))

  def attend(self, x_bme: Array) -> Array:
    """Tied output projection: [..., E] -> [..., padded_vocab_size] logits (`ModelConfig.vocab_pad_multiple`:
    the table's extra rows are zeros, so those logits are 0 before the head's bias)."""
    cfg = self.config
    extra = cfg.padded_vocab_size - cfg.vocab_size
    if not extra:
      return self.word_embeddings.attend(x_bme)
    table = jnp.pad(self.word_embeddings.embedding.astype(cfg.compute_dtype), ((0, extra), (0, 0)))
    return jnp.dot(x_bme.astype(cfg.compute_dtype), table.T)

  def word_table(self) -> Array:
    return self.word_embeddings.embedding


class SelfAttention(nn.Module):
  """Multi-head self-attention and its output projection.

  Attributes:
    config: the architecture.
    num_heads: this layer's heads (`ModelConfig.layer_heads`: fewer in a pruned model); None: config.num_heads.
  """

  config: ModelConfig
  num_heads: int | None = None

  @property
  def heads(self) -> int:
    return self.num_heads or self.config.num_heads

  @nn.compact
  def __call__(self, x_ble: Array, pack_ids_bl: Array | None, position_ids_bl: Array, packed: bool,
               deterministic: bool, return_probs: bool, query_positions_bq: Array | None = None,
               head_mask_h: Array | None = None) -> tuple[Array, Array | None]:
    """The attention output [B, L, E] and the probabilities [B, heads, L, L] (float32) or None.

    With `query_positions_bq` [B, Q], only the rows at those positions ([B, Q, E]): queries there, keys and
    values at every position. `pack_ids_bl` [B, L]: 0 for padding, else the packed example id (None: no padding);
    `packed` rows attend only inside their own example. `head_mask_h` [heads]: each head's output is scaled by
    its gate before the output projection (`gate_heads`; None: no gates).
    """
    cfg = self.config
    # TinyBERT's attention loss reads the pre-softmax scores, which only the plain path materialises.
    # (Not at init, where every collection is mutable: the variables it returns hold parameters only.)
    scores_wanted = self.is_mutable_collection(SCORES) and not self.is_initializing()
    if scores_wanted and cfg.kernels != "off":
      raise ValueError(f"the {SCORES!r} collection needs the plain attention path: build the model with "
                       "kernels='off' (the fused kernels never hold the score matrix)")
    if fast := _fast(cfg):
      return fast.self_attention(self, x_ble, pack_ids_bl, position_ids_bl, packed, deterministic, return_probs,
                                 query_positions_bq, head_mask_h)
    heads, head_dim = self.heads, cfg.head_dim
    projection = lambda name: nn.DenseGeneral(  # noqa: E731
        (heads, head_dim), dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, name=name,
        kernel_init=dense_init(cfg, ("embed", "heads", "kv")), bias_init=bias_init(("heads", "kv")))
    x_bqe = x_ble if query_positions_bq is None else gather_positions(x_ble, query_positions_bq)
    q_bqhd, k_blhd, v_blhd = projection("query")(x_bqe), projection("key")(x_ble), projection("value")(x_ble)
    q_bqhd, k_blhd, v_blhd = position_and_constrain(cfg, q_bqhd, k_blhd, v_blhd, position_ids_bl, query_positions_bq)

    lengths_b, mask_b1ql, causal = None, None, cfg.causal
    if pack_ids_bl is not None and not packed and query_positions_bq is None:
      lengths_b = jnp.sum(pack_ids_bl > 0, axis=-1).astype(jnp.int32)  # padding by lengths
    elif pack_ids_bl is not None or query_positions_bq is not None:
      ids_bl = pack_ids_bl if pack_ids_bl is not None else jnp.ones(x_ble.shape[:2], jnp.int32)
      mask_b1ql, causal = attention_mask(ids_bl, cfg.causal, query_positions_bq), False
    dropout = not deterministic and cfg.attention_dropout > 0
    if scores_wanted:
      self.sow(SCORES, "scores", jnp.einsum("bqhd,blhd->bhql", q_bqhd, k_blhd, preferred_element_type=jnp.float32)
               / jnp.sqrt(jnp.float32(head_dim)))
    if not (dropout or return_probs):
      out_bqhd = jax.nn.dot_product_attention(q_bqhd, k_blhd, v_blhd, mask=mask_b1ql, is_causal=causal,
                                              query_seq_lengths=lengths_b, key_value_seq_lengths=lengths_b)
      probs_bhql = None
    else:  # attention dropout or the probabilities: jax.nn's attention offers neither
      if lengths_b is not None:
        mask_b1ql = attention_mask(pack_ids_bl, cfg.causal)
      elif causal:
        mask_b1ql = nn.make_causal_mask(jnp.ones(x_ble.shape[:2], jnp.int32))
      probs_bhql = nn.dot_product_attention_weights(q_bqhd, k_blhd, mask=mask_b1ql, dtype=jnp.float32)
      weights_bhql = probs_bhql
      if dropout:
        keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - cfg.attention_dropout, probs_bhql.shape)
        weights_bhql = jnp.where(keep, probs_bhql / (1.0 - cfg.attention_dropout), 0.0)
      out_bqhd = jnp.einsum("bhql,blhd->bqhd", weights_bhql.astype(v_blhd.dtype), v_blhd)
      probs_bhql = probs_bhql if return_probs else None
    output = nn.DenseGeneral(cfg.hidden_size, axis=(-2, -1), dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                             kernel_init=dense_init(cfg, ("heads", "kv", "embed")), bias_init=bias_init(("embed",)),
                             name="output")
    return output(gate_heads(out_bqhd, head_mask_h)), probs_bhql


def attention_scores(collection: Any, config: ModelConfig) -> tuple[Array, ...]:
  """The scores an `Encoder` sowed into `SCORES` (its subtree of that collection), one [B, heads, Q, L] array per
  layer in layer order; q . k / sqrt(head size), before masking and softmax.

  A shared attention (ALBERT) sows once per layer that calls it, in call order; each group's layers are
  consecutive, so groups in order give layers in order.
  """
  if config.num_shared_groups and config.shared_sublayers == "attention":
    sources = [collection[f"shared_attention_{g}"] for g in range(config.num_shared_groups)]
  else:
    sources = [collection[f"block_{b}"]["attention"] for b in range(config.num_blocks)]
  scores = tuple(s for source in sources for s in source["scores"])
  if len(scores) != config.num_layers:
    raise ValueError(f"{len(scores)} layers of attention scores for a model of {config.num_layers} layers")
  return scores


def apply_with_scores(apply: Any, config: ModelConfig, wanted: bool) -> Any:
  """`apply` (a model's apply, its encoder named "encoder") returning (its outputs, {"attention_scores": the
  encoder's per layer (`attention_scores`)}) when `wanted`, else (its outputs, {})."""
  def run(*args, **kwargs):
    if not wanted:
      return apply(*args, **kwargs), {}
    outputs, collections = apply(*args, mutable=[SCORES], **kwargs)
    return outputs, {"attention_scores": attention_scores(collections[SCORES]["encoder"], config)}
  return run


class FeedForward(nn.Module):
  """The position-wise feed-forward block (`ModelConfig.ffn`, `hidden_act`), both projections."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x_ble: Array) -> Array:
    cfg = self.config
    if fast := _fast(cfg):
      return fast.feed_forward(self, x_ble)
    act = activation(cfg)
    if cfg.ffn == "geglu":
      h_blf = act(dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi_gate")(x_ble))
      h_blf = h_blf * dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble)
    else:
      h_blf = act(dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble))
    h_blf = nn.with_logical_constraint(h_blf, ("batch", "length", "mlp"))
    return dense(cfg, cfg.hidden_size, ("mlp", "embed"), "wo")(h_blf)


class TransformerBlock(nn.Module):
  """Attention + feed-forward with residuals; post-LN (BERT) or pre-LN. `num_heads`: as `SelfAttention`'s.

  `shared_attention` / `shared_ffn`: a sub-layer owned by the encoder and used by every layer of a group
  (`ModelConfig.shared_sublayers`) in place of the block's own; None: the block owns it.
  """

  config: ModelConfig
  num_heads: int | None = None
  shared_attention: SelfAttention | None = None
  shared_ffn: FeedForward | None = None

  @nn.compact
  def __call__(self, x_ble: Array, pack_ids_bl: Array | None, position_ids_bl: Array, packed: bool = False,
               deterministic: bool = True, return_probs: bool = False, output_positions_bk: Array | None = None,
               head_mask_h: Array | None = None) -> tuple[Array, Array | None]:
    """The block's output [B, L, E] and attention probabilities or None. With `output_positions_bk` [B, K], the
    output at those positions only ([B, K, E]): every row-wise part of the block runs on those K rows, the
    keys and values on all L (`SelfAttention`'s `query_positions_bq`). `head_mask_h` [heads]: the heads' gates."""
    cfg = self.config
    dropout = Dropout(cfg.hidden_dropout, cfg.kernels)
    attention_norm, ffn_norm = layer_norm(cfg, "attention_norm"), layer_norm(cfg, "ffn_norm")
    attention = self.shared_attention
    if attention is None:
      attention = SelfAttention(cfg, self.num_heads, name="attention")
    ffn = self.shared_ffn if self.shared_ffn is not None else FeedForward(cfg, name="ffn")
    rows = (lambda x: x) if output_positions_bk is None else (lambda x: gather_positions(x, output_positions_bk))
    if cfg.norm == "pre":
      attn_ble, probs = attention(attention_norm(x_ble), pack_ids_bl, position_ids_bl, packed, deterministic,
                                  return_probs, output_positions_bk, head_mask_h)
      x_ble = rows(x_ble) + dropout(attn_ble, deterministic=deterministic)
      x_ble = x_ble + dropout(ffn(ffn_norm(x_ble)), deterministic=deterministic)
    else:
      attn_ble, probs = attention(x_ble, pack_ids_bl, position_ids_bl, packed, deterministic, return_probs,
                                  output_positions_bk, head_mask_h)
      x_ble = residual_layer_norm(cfg, attention_norm, rows(x_ble), attn_ble, dropout, deterministic)
      x_ble = residual_layer_norm(cfg, ffn_norm, x_ble, ffn(x_ble), dropout, deterministic)
    return nn.with_logical_constraint(x_ble, ("batch", "length", "embed")), probs


def _block_class(config: ModelConfig) -> type[TransformerBlock]:
  """`TransformerBlock`, or with `config.fp8` its subclass whose dense layers multiply in float8."""
  if not config.fp8:
    return TransformerBlock
  try:
    from bert_jax.models import quantization  # noqa: PLC0415 - Qwix (the `quant` extra) only where asked for
  except ModuleNotFoundError as error:
    if error.name != "qwix":
      raise
    raise ModuleNotFoundError("ModelConfig.fp8=True multiplies through Qwix, which is not installed: pip install -e "
                              "'.[quant]' (or leave fp8 off)", name="qwix") from None
  return quantization.fp8_module(TransformerBlock, config)


def _remat(block_cls, policy: str):
  if policy == "none":
    return block_cls
  checkpoint_policy = None if policy == "full" else jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
  # Arguments 4..6 (packed, deterministic, return_probs) are Python values; 7, 8 (output positions, head gates)
  # arrays.
  return nn.remat(block_cls, policy=checkpoint_policy, static_argnums=(4, 5, 6))


class Encoder(nn.Module):
  """Embeddings -> (E->H projection) -> L transformer blocks, whole or in part shared across layers (ALBERT).

  Attributes:
    config: the architecture.
    shared_embeddings: an `Embeddings` module owned by a parent, for models
      whose encoders share one embedding table (ELECTRA's generator and
      discriminator). None: this encoder owns its embeddings.
  """

  config: ModelConfig
  shared_embeddings: Embeddings | None = None

  def setup(self):
    cfg = self.config
    self.embeddings = self.shared_embeddings or Embeddings(cfg)
    if cfg.embed_dim != cfg.hidden_size:
      self.embedding_projection = dense(cfg, cfg.hidden_size, (None, "embed"), "embedding_projection")
    block = _remat(_block_class(cfg), cfg.remat)
    groups = range(cfg.num_shared_groups)
    # Sharing one kind of sub-layer: the encoder owns each group's copy, every layer its own block for the rest.
    attention = ([SelfAttention(cfg, name=f"shared_attention_{g}") for g in groups]
                 if cfg.shared_sublayers == "attention" else None)
    ffn = [FeedForward(cfg, name=f"shared_ffn_{g}") for g in groups] if cfg.shared_sublayers == "ffn" else None
    group = lambda i: i * cfg.num_shared_groups // cfg.num_layers  # noqa: E731
    self.blocks = [block(cfg, cfg.layer_heads(i) if cfg.heads_per_layer else None,
                         attention and attention[group(i)], ffn and ffn[group(i)], name=f"block_{i}")
                   for i in range(cfg.num_blocks)]
    if cfg.norm == "pre":
      self.final_norm = layer_norm(cfg, "final_norm")

  def __call__(self, input_ids: Array, segment_ids: Array | None = None, position_ids: Array | None = None,
               pack_ids: Array | None = None, *, packed: bool = False, deterministic: bool = True,
               output_hidden_states: bool = False, output_attentions: bool = False,
               output_positions: Array | None = None, head_mask: Array | None = None) -> dict[str, Any]:
    """Encodes a batch.

    Args:
      input_ids: [B, L] int token ids.
      segment_ids: [B, L] token types; zeros when None.
      position_ids: [B, L] positions inside each (packed) example; 0..L-1 when
        None. The family's `position_offset` is added by the embeddings.
      pack_ids: [B, L] 0 for padding, else the packed example id (1 for every
        real token of an unpacked row). None: no padding.
      packed: rows may hold several examples (block-diagonal attention).
      deterministic: disables dropout.
      output_hidden_states: also return the embeddings output and every
        block's output (L + 1 arrays, as Hugging Face does).
      output_attentions: also return each block's attention probabilities
        (forces the XLA attention path).
      output_positions: [B, K] int: the last block computes only the rows at
        these positions (its keys and values at every position), and "hidden"
        is [B, K, H] (`ModelConfig.sparse_last_layer`). None: every position.
      head_mask: [num_layers, num_heads] float gates, one per head (Michel et al. 2019's xi): each head's output
        is scaled by its gate; ones give the model's outputs, a 0 disables the head. A pruned layer
        (`ModelConfig.heads_per_layer`) reads its first heads. None: no gates.

    Returns:
      dict with "hidden" [B, L, H], and optionally "hidden_states" (tuple) and
      "attentions" (tuple of [B, heads, L, L]); the last block's are [B, K, H]
      and [B, heads, K, L] with `output_positions`.
    """
    cfg = self.config
    batch, length = input_ids.shape
    if segment_ids is None:
      segment_ids = jnp.zeros_like(input_ids)
    if position_ids is None:
      position_ids = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    x_ble = self.embeddings(input_ids, segment_ids, position_ids, deterministic)
    if cfg.embed_dim != cfg.hidden_size:
      x_ble = self.embedding_projection(x_ble)
    hidden_states, attentions = [x_ble], []
    for layer in range(cfg.num_layers):
      block = self.blocks[layer * len(self.blocks) // cfg.num_layers]
      last = layer == cfg.num_layers - 1
      gates = None if head_mask is None else head_mask[layer, :cfg.layer_heads(layer)]
      x_ble, probs = block(x_ble, pack_ids, position_ids, packed, deterministic, output_attentions,
                           output_positions if last else None, gates)
      hidden_states.append(x_ble)
      attentions.append(probs)
    if cfg.norm == "pre":
      x_ble = self.final_norm(x_ble)
      hidden_states[-1] = x_ble
    outputs = {"hidden": x_ble}
    if output_hidden_states:
      outputs["hidden_states"] = tuple(hidden_states)
    if output_attentions:
      outputs["attentions"] = tuple(attentions)
    return outputs

  def attend(self, x_bme: Array) -> Array:
    return self.embeddings.attend(x_bme)


# Heads on the encoder's hidden states: pre-training (MLM, NSP/SOP/SSO, RTD, SBO), then fine-tuning.

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


# The pre-training models: encoder + heads.


def head_rows(config: ModelConfig, length: int, positions: dict[str, Array]) -> tuple[Array | None, dict[str, Array]]:
  """The rows the last block computes under `config.sparse_last_layer`, and each head's positions in them.

  positions: per head, [B, M_i] positions in the sequence. Returns (the encoder's `output_positions` [B, sum M_i],
  the heads' positions in its output: consecutive slices), or (None, `positions`) where every position is
  computed: the option is off, or the rows would be more than half the sequence.
  """
  widths = [p.shape[1] for p in positions.values()]
  if not config.sparse_last_layer or 2 * sum(widths) > length:
    return None, positions
  rows = jnp.concatenate([p.astype(jnp.int32) for p in positions.values()], axis=1)
  rows = jnp.where(rows < 0, rows + length, rows)  # as the heads' gathers read a negative position
  starts = [sum(widths[:i]) for i in range(len(widths))]
  in_rows = {name: jnp.broadcast_to(jnp.arange(start, start + width, dtype=jnp.int32), p.shape)
             for (name, p), start, width in zip(positions.items(), starts, widths)}
  return rows, in_rows


class PretrainingModel(nn.Module):
  """Encoder with the MLM head and, by flag, a sentence (NSP/SOP) head and an SBO head.

  The left-to-right LM ablation is this model with `config.causal=True` and
  the MLM head read at every position (the objective shifts the targets).
  """

  config: ModelConfig
  sentence_head: bool = True
  span_boundary_head: bool = False
  sentence_classes: int = 2  # 2 for NSP / SOP, 3 for StructBERT's sentence structural objective

  def setup(self):
    self.encoder = Encoder(self.config)
    self.mlm = MLMHead(self.config)
    if self.sentence_head:
      self.sentence = SentenceHead(self.config, self.sentence_classes)
    if self.span_boundary_head:
      self.sbo = SpanBoundaryHead(self.config)

  def __call__(self, input_ids: Array, mlm_positions: Array, *, segment_ids: Array | None = None,
               position_ids: Array | None = None, pack_ids: Array | None = None,
               cls_positions: Array | None = None, sbo_left: Array | None = None, sbo_right: Array | None = None,
               sbo_offsets: Array | None = None, packed: bool = False, deterministic: bool = True,
               output_hidden_states: bool = False) -> dict[str, Array]:
    """Returns {"hidden" [B,L,H], "mlm_logits" [B,M,V], "sentence_logits" [B,P,C]?, "sbo_logits" [B,M,V]?}, V the
    config's `padded_vocab_size` (vocab_size unless `vocab_pad_multiple` pads it), C `sentence_classes`; no "hidden"
    where the last block computes only the heads' rows (`ModelConfig.sparse_last_layer`, `head_rows`). With
    `output_hidden_states`, also the encoder's "hidden_states" (`Encoder`'s)."""
    positions = {"mlm": mlm_positions}
    if self.sentence_head:
      positions["cls"] = cls_positions if cls_positions is not None else jnp.zeros_like(mlm_positions[:, :1])
    if self.span_boundary_head:
      positions.update(sbo_left=sbo_left, sbo_right=sbo_right)
    output_positions, positions = head_rows(self.config, input_ids.shape[1], positions)
    encoded = self.encoder(input_ids, segment_ids, position_ids, pack_ids, packed=packed,
                           deterministic=deterministic, output_positions=output_positions,
                           output_hidden_states=output_hidden_states)
    hidden = encoded["hidden"]
    outputs = {"mlm_logits": self.mlm(hidden, positions["mlm"], self.encoder.attend)}
    if output_hidden_states:
      outputs["hidden_states"] = encoded["hidden_states"]
    if output_positions is None:
      outputs["hidden"] = hidden
    if self.sentence_head:
      outputs["sentence_logits"] = self.sentence(hidden, positions["cls"], deterministic)
    if self.span_boundary_head:
      outputs["sbo_logits"] = self.sbo(hidden, positions["sbo_left"], positions["sbo_right"], sbo_offsets,
                                       self.encoder.attend)
    return outputs


ELECTRA_HEADS = ("rtd", "mlm", "all_tokens")


class ElectraModel(nn.Module):
  """ELECTRA: a small MLM generator and a discriminator sharing embeddings.

  The generator fills the masked positions with samples from its own
  distribution (no gradient flows through the sampling); the discriminator
  reads the corrupted tokens. What it predicts is `head` (ELECTRA's Table 5):
  "rtd", for every token whether it was replaced (ELECTRA); "mlm", the
  original token at the masked positions (Replace MLM); "all_tokens", the
  original token at every position, as a copy gate D (a sigmoid per token)
  mixed with the MLM softmax (All-Tokens MLM).
  """

  config: ModelConfig            # discriminator
  generator_config: ModelConfig
  head: str = "rtd"

  def setup(self):
    if self.generator_config.embed_dim != self.config.embed_dim:
      raise ValueError("ELECTRA generator and discriminator must share the embedding size "
                       f"({self.generator_config.embed_dim} != {self.config.embed_dim})")
    if self.head not in ELECTRA_HEADS:
      raise ValueError(f"ElectraModel head={self.head!r}: expected one of {ELECTRA_HEADS}")
    self.embeddings = Embeddings(self.config)
    self.generator = Encoder(self.generator_config, shared_embeddings=self.embeddings)
    self.generator_mlm = MLMHead(self.generator_config)
    self.discriminator = Encoder(self.config, shared_embeddings=self.embeddings)
    if self.head == "rtd":
      self.rtd = ReplacedTokenHead(self.config)
    else:
      self.mlm = MLMHead(self.config)
    if self.head == "all_tokens":
      self.copy = ReplacedTokenHead(self.config)  # the copy gate's logit: one per token, as RTD's

  def __call__(self, input_ids: Array, mlm_positions: Array, original_ids: Array, *,
               segment_ids: Array | None = None, position_ids: Array | None = None, pack_ids: Array | None = None,
               packed: bool = False, deterministic: bool = True, sample: bool = True) -> dict[str, Array]:
    """Runs generator, samples replacements, runs the discriminator.

    Args:
      input_ids: [B, L] masked inputs.
      mlm_positions: [B, M] masked positions.
      original_ids: [B, L] inputs before masking.
      sample: draw replacements from the generator (rng stream "sample");
        False takes the argmax (for deterministic evaluation).

    Returns:
      {"mlm_logits" [B,M,V] generator logits (V: `padded_vocab_size`), "corrupted_ids" [B,L], "replaced" [B,L]
       bool} and the head's: "rtd_logits" [B,L]; "token_logits" [B,M,V] at the masked positions ("mlm") or
       [B,L,V] at every position ("all_tokens", with "copy_logits" [B,L]).
    """
    kwargs = dict(segment_ids=segment_ids, position_ids=position_ids, pack_ids=pack_ids, packed=packed,
                  deterministic=deterministic)
    output_positions, positions = head_rows(self.generator_config, input_ids.shape[1], {"mlm": mlm_positions})
    gen_hidden = self.generator(input_ids, output_positions=output_positions, **kwargs)["hidden"]
    mlm_logits = self.generator_mlm(gen_hidden, positions["mlm"], self.embeddings.attend)
    # The vocabulary's own logits (`vocab_pad_multiple` pads them): the samples do not depend on the padding.
    logits = jax.lax.stop_gradient(mlm_logits[..., :self.generator_config.vocab_size].astype(jnp.float32))
    if sample:
      sampled_bm = jax.random.categorical(self.make_rng("sample"), logits, axis=-1)
    else:
      sampled_bm = jnp.argmax(logits, axis=-1)
    rows = jnp.arange(input_ids.shape[0])[:, None]
    corrupted = input_ids.at[rows, mlm_positions].set(sampled_bm.astype(input_ids.dtype))
    # Unused prediction slots point at position 0 ([CLS]); restore it.
    corrupted = corrupted.at[:, 0].set(original_ids[:, 0])
    outputs = {"mlm_logits": mlm_logits, "corrupted_ids": corrupted, "replaced": corrupted != original_ids}
    if self.head == "rtd":
      outputs["rtd_logits"] = self.rtd(self.discriminator(corrupted, **kwargs)["hidden"])
    elif self.head == "mlm":
      output_positions, positions = head_rows(self.config, input_ids.shape[1], {"mlm": mlm_positions})
      disc_hidden = self.discriminator(corrupted, output_positions=output_positions, **kwargs)["hidden"]
      outputs["token_logits"] = self.mlm(disc_hidden, positions["mlm"], self.embeddings.attend)
    else:
      disc_hidden = self.discriminator(corrupted, **kwargs)["hidden"]
      every_position = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
      outputs["token_logits"] = self.mlm(disc_hidden, every_position, self.embeddings.attend)
      outputs["copy_logits"] = self.copy(disc_hidden)
    return outputs
