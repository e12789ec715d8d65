"""The BERT-family encoder: embeddings, transformer blocks, optional sharing.

One implementation serves BERT, RoBERTa, ALBERT and ELECTRA; the differences
are `ModelConfig` fields. Every parameter carries logical axis names (vocab,
embed, heads, kv, mlp) and the main activations carry (batch, length, ...), so
sharding is decided by rules in the trainer, never here.

Shape suffixes: b batch, l length, h heads, d head size, e embedding/hidden
width, f feed-forward width, v vocabulary.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.models import ffn_kernel, flash_attention, ops
from bert_jax.models.attention import dot_product_attention, resolve_implementation, self_attention
from bert_jax.models.config import ModelConfig
from bert_jax.models.dropout import Dropout

Array = jax.Array


def activation(name: str):
  """The elementwise activation of a config's `hidden_act` (GELUs with a saved-input-only gradient)."""
  return {"gelu": lambda x: ops.gelu(x, False),
          "gelu_tanh": lambda x: ops.gelu(x, True),
          "relu": nn.relu}[name]


def dense_init(config: ModelConfig, axes: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), axes)


def bias_init(axes: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


class LayerNorm(nn.Module):
  """LayerNorm over the last axis with float32 statistics whatever the compute dtype.

  Parameters "scale" and "bias" as in `flax.linen.LayerNorm`; the arithmetic
  and its gradient are `ops.layer_norm`.
  """

  epsilon: float
  dtype: Any
  param_dtype: Any
  axis_name: str = "embed"
  implementation: str = "auto"

  @nn.compact
  def __call__(self, x: Array, branch: Array | None = None, dropout: Dropout | None = None,
               deterministic: bool = True, branch_bias: Array | None = None) -> Array:
    """LayerNorm(x), or of the post-LN residual x + dropout(branch + branch_bias) (`ops.add_layer_norm`: one
    kernel a pass on GPU, the mask that `dropout` would draw; `branch_bias` [E] or None)."""
    features = (x.shape[-1],)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), (self.axis_name,)),
                       features, self.param_dtype)
    bias = self.param("bias", bias_init((self.axis_name,)), features, self.param_dtype)
    if branch is None:
      return ops.layer_norm(x, scale, bias, self.epsilon, self.dtype, self.implementation)
    rate = 0.0 if deterministic or dropout is None else dropout.rate
    if rate >= 1.0:
      return ops.layer_norm(x, scale, bias, self.epsilon, self.dtype, self.implementation)
    seeds = dropout.seeds() if rate > 0 else jnp.zeros((2,), jnp.int32)
    return ops.add_layer_norm(x, branch.astype(x.dtype), scale, bias, seeds, rate, self.epsilon, self.dtype,
                              self.implementation, branch_bias)


def layer_norm(config: ModelConfig, name: str, axis_name: str = "embed") -> LayerNorm:
  return LayerNorm(config.layer_norm_eps, config.compute_dtype, config.weight_dtype, axis_name,
                   config.layer_norm_impl, name=name)


class Projection(nn.Module):
  """x [..., *in] -> [..., *features]: one [prod(in), prod(features)] matmul and a 1-D bias, in the compute dtype.

  The parameters are `nn.Dense`'s / `nn.DenseGeneral`'s (kernel [*in, *features], bias [*features]), so
  checkpoints and the Hugging Face mapping do not see the difference; the values are the same. The form is
  chosen for XLA on a GPU: it fuses a 1-D bias add on a 2-D product into the cuBLAS GEMM, where
  DenseGeneral's [heads, head_dim] bias add was a separate kernel reading and writing every query, key and
  value projection (1 ms of a 52 ms BERT-Base seq-128 step on an H200, bench/NOTES.md session 6). The bias
  gradient is summed in float32 (`ops.bias_add`).

  Attributes:
    config: compute and parameter dtypes, initialiser range.
    features: the output dims.
    axes: logical axis names of the kernel (the contracted input dims, then `features`).
    contract: how many trailing dims of x are contracted (2: [..., heads, head_dim] -> [..., E]).
  """

  config: ModelConfig
  features: tuple[int, ...]
  axes: tuple[str | None, ...]
  contract: int = 1

  @nn.compact
  def __call__(self, x: Array, weights_only: bool = False, add_bias: bool = True,
               train_bias: bool = True) -> Array | tuple[Array, Array]:
    """The projection of x; with `add_bias` False, (the projection without its bias, the bias [*features]) for a
    caller that adds it (`ops.add_layer_norm`); with `weights_only`, (kernel [*in, *features] in the compute
    dtype, bias [*features]) for a caller that fuses several projections of x into one GEMM (`SelfAttention`).
    With `train_bias` False the bias gets no gradient (a key bias the softmax ignores: `SelfAttention`)."""
    cfg = self.config
    lead, inputs = x.shape[:x.ndim - self.contract], x.shape[x.ndim - self.contract:]
    kernel = self.param("kernel", dense_init(cfg, self.axes), inputs + tuple(self.features), cfg.weight_dtype)
    bias = self.param("bias", bias_init(self.axes[self.contract:]), tuple(self.features), cfg.weight_dtype)
    if not train_bias:
      bias = jax.lax.stop_gradient(bias)
    dtype = cfg.compute_dtype
    if weights_only:
      return kernel.astype(dtype), bias
    width_in, width_out = math.prod(inputs), math.prod(self.features)
    y = jnp.dot(x.astype(dtype).reshape(*lead, width_in), kernel.astype(dtype).reshape(width_in, width_out))
    if not add_bias:
      return y.reshape(*lead, *self.features), bias
    return ops.bias_add(y, bias.reshape(width_out)).reshape(*lead, *self.features)


def dense(config: ModelConfig, features: int, axes: tuple[str | None, str | None], name: str) -> Projection:
  """A dense layer [..., in] -> [..., features] (parameters of `nn.Dense`)."""
  return Projection(config, (features,), axes, name=name)


def gather_positions(hidden_ble: Array, positions_bm: Array) -> Array:
  """[B, L, H] gathered at [B, M] positions -> [B, M, H]."""
  return jnp.take_along_axis(hidden_ble, positions_bm[..., None].astype(jnp.int32), axis=1)


def rotary_embedding(x_blhd: Array, position_ids_bl: Array, base: float) -> Array:
  """Rotates pairs of features (first half, second half) by position-dependent angles."""
  half = x_blhd.shape[-1] // 2
  inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles_bld = position_ids_bl[..., None].astype(jnp.float32) * inv_freq
  cos, sin = jnp.cos(angles_bld)[:, :, None, :], jnp.sin(angles_bld)[:, :, None, :]
  x1, x2 = jnp.split(x_blhd.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_blhd.dtype)


def embedding_lookup(table: Array, ids: Array, dtype) -> Array:
  """table[ids] in `dtype`, exact, with a gradient accumulated at least in `dtype` without scatter contention.

  The obvious `table.astype(dtype)[ids]` differentiates into a scatter-add in
  `dtype`; in bfloat16, with thousands of updates to the same rows ([CLS],
  [SEP], [MASK], the two token types), that took two thirds of a BERT-Base
  step on an H200. Small tables (positions, token types) are read with a
  one-hot matmul instead, whose gradient is a matmul; the vocabulary is
  gathered in float32, whose gradient is a float32 scatter-add (native
  atomics). Both give exactly table[ids] in the forward pass.
  """
  if table.shape[0] <= 1024:
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=dtype)
    return jnp.dot(one_hot, table.astype(dtype), precision=jax.lax.Precision.HIGHEST)
  return jnp.take(table, ids, axis=0).astype(dtype)


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
    self.dropout = Dropout(cfg.hidden_dropout)

  def __call__(self, input_ids_bl: Array, segment_ids_bl: Array, position_ids_bl: Array,
               deterministic: bool) -> Array:
    cfg = self.config
    dtype = cfg.compute_dtype
    x_ble = embedding_lookup(self.word_embeddings.embedding, input_ids_bl, dtype)
    if cfg.position_embedding == "learned":
      x_ble = x_ble + embedding_lookup(self.position_embeddings.embedding, position_ids_bl + cfg.position_offset,
                                       dtype)
    x_ble = x_ble + embedding_lookup(self.token_type_embeddings.embedding, segment_ids_bl, dtype)
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


def call_site_seed(path: tuple[str, ...], layer: int) -> int:
  """A static 31-bit seed per attention call site: module path and layer index (ALBERT's shared blocks run
  one module in several layers). Only cuDNN's dropout reads it (`attention.py`)."""
  return zlib.crc32(f"{'/'.join(path)}#{layer}".encode()) & 0x7FFFFFFF


class SelfAttention(nn.Module):
  """Multi-head self-attention and its output projection.

  Attributes:
    config: the architecture.
    defer_output_bias: return (output without the output projection's bias, that bias [E]) for the caller to add
      (the post-LN residual, `LayerNorm(x, branch, dropout, deterministic, branch_bias)`).
  """

  config: ModelConfig
  defer_output_bias: bool = False

  @nn.compact
  def __call__(self, x_ble: Array, pack_ids_bl: Array | None, position_ids_bl: Array, packed: bool,
               deterministic: bool, return_probs: bool, layer: int = 0,
               query_positions_bq: Array | None = None) -> tuple[Array, Array | None]:
    """The attention output [B, L, E] (post-LN: and the deferred bias), probabilities or None; with
    `query_positions_bq` [B, Q], only the rows at those positions ([B, Q, E]): queries there, keys and values
    at every position, through the XLA path (`dot_product_attention`)."""
    cfg = self.config
    heads, head_dim = cfg.num_heads, cfg.head_dim

    projections = {n: Projection(cfg, (heads, head_dim), ("embed", "heads", "kv"), name=n)
                   for n in ("query", "key", "value")}
    dropout_rng = None
    if not deterministic and cfg.attention_dropout > 0:
      dropout_rng = self.make_rng("dropout")
    impl = resolve_implementation(cfg.attention_impl, dtype=cfg.compute_dtype, head_dim=head_dim,
                                  dropout_active=dropout_rng is not None, return_probs=return_probs,
                                  length=x_ble.shape[1], training=not deterministic)
    options = dict(pack_ids=pack_ids_bl, packed=packed, causal=cfg.causal, implementation=impl,
                   dropout_rate=cfg.attention_dropout, dropout_rng=dropout_rng,
                   dropout_seed=call_site_seed(self.scope.path, layer), return_probs=return_probs)
    if impl == "flash" and cfg.position_embedding != "rotary" and query_positions_bq is None:
      # One [E, H * 3 * D] GEMM in the flash kernels' layout, which they read in place (`self_attention`);
      # its backward is one GEMM too. Three [E, E] GEMMs ran at ~35% of an H100's peak (bench/NOTES.md).
      weights = {n: projection(x_ble, weights_only=True) for n, projection in projections.items()}
      kernel = flash_attention.fuse_qkv(*(weights[n][0] for n in ("query", "key", "value")))
      bias = flash_attention.fuse_qkv(*(weights[n][1] for n in ("query", "key", "value")))
      width = x_ble.shape[-1]
      qkv = jnp.dot(x_ble.astype(cfg.compute_dtype).reshape(-1, width), kernel.reshape(width, -1))
      qkv_blh3d = qkv.reshape(*x_ble.shape[:2], heads, 3, head_dim)
      qkv_blh3d = nn.with_logical_constraint(qkv_blh3d, ("batch", "length", "heads", None, "kv"))
      # The bias is added by `self_attention`: the flash kernels sum its gradient as they write d(qkv).
      out_blhd, probs = self_attention(qkv_blh3d, bias_h3d=bias, **options)
    else:
      x_bqe = x_ble if query_positions_bq is None else gather_positions(x_ble, query_positions_bq)
      q_blhd, v_blhd = projections["query"](x_bqe), projections["value"](x_ble)
      # The key bias only matters where rotary positions rotate it (`flash_attention.add_qkv_bias`).
      k_blhd = projections["key"](x_ble, train_bias=cfg.position_embedding == "rotary")
      if cfg.position_embedding == "rotary":
        position_ids_bq = (position_ids_bl if query_positions_bq is None
                           else jnp.take_along_axis(position_ids_bl, query_positions_bq, axis=1))
        q_blhd = rotary_embedding(q_blhd, position_ids_bq, cfg.rotary_base)
        k_blhd = rotary_embedding(k_blhd, position_ids_bl, cfg.rotary_base)
      q_blhd = nn.with_logical_constraint(q_blhd, ("batch", "length", "heads", "kv"))
      k_blhd = nn.with_logical_constraint(k_blhd, ("batch", "length", "heads", "kv"))
      v_blhd = nn.with_logical_constraint(v_blhd, ("batch", "length", "heads", "kv"))
      out_blhd, probs = dot_product_attention(q_blhd, k_blhd, v_blhd, query_positions=query_positions_bq,
                                              **options)
    output = Projection(cfg, (cfg.hidden_size,), ("heads", "kv", "embed"), contract=2, name="output")
    return output(out_blhd, add_bias=not self.defer_output_bias), probs


class FeedForward(nn.Module):
  """The position-wise feed-forward block (`ModelConfig.ffn`, `hidden_act`), both projections.

  Attributes:
    config: the architecture.
    defer_output_bias: as `SelfAttention`'s: return (output without the "wo" bias, that bias).
  """

  config: ModelConfig
  defer_output_bias: bool = False

  @nn.compact
  def __call__(self, x_ble: Array) -> Array | tuple[Array, Array]:
    cfg = self.config
    add_bias = not self.defer_output_bias
    act = activation(cfg.hidden_act)
    if cfg.ffn == "geglu":
      h_blf = act(dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi_gate")(x_ble))
      h_blf = h_blf * dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble)
    elif cfg.hidden_act == "gelu":
      wi, bi = dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble, weights_only=True)
      x_ble = x_ble.astype(cfg.compute_dtype)
      if cfg.ffn_impl == "auto" and ffn_kernel.applies(x_ble, wi):  # both projections, GELU in Hopper kernels
        h_shape = jax.ShapeDtypeStruct((*x_ble.shape[:-1], cfg.intermediate_size), wi.dtype)
        wo, bo = dense(cfg, cfg.hidden_size, ("mlp", "embed"), "wo")(h_shape, weights_only=True)
        y_ble = ops.gelu_feed_forward(x_ble, wi, bi, wo)
        return ops.bias_add(y_ble, bo) if add_bias else (y_ble, bo)
      h_blf = ops.gelu(ops.bias_add(jnp.dot(x_ble, wi), bi))
    else:
      h_blf = act(dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble))
    h_blf = nn.with_logical_constraint(h_blf, ("batch", "length", "mlp"))
    return dense(cfg, cfg.hidden_size, ("mlp", "embed"), "wo")(h_blf, add_bias=add_bias)


class TransformerBlock(nn.Module):
  """Attention + feed-forward with residuals; post-LN (BERT) or pre-LN.

  Post-LN, the sublayers' output biases are added by the residual LayerNorms (`ops.add_layer_norm`), whose
  backward kernel sums their gradients beside the branch gradient it writes (one pass over memory fewer per
  residual than a separate dropout-backward and bias-sum kernel).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x_ble: Array, pack_ids_bl: Array | None, position_ids_bl: Array, packed: bool = False,
               deterministic: bool = True, return_probs: bool = False, layer: int = 0,
               output_positions_bk: Array | None = None) -> tuple[Array, Array | None]:
    """The block's output [B, L, E] and attention probabilities or None. With `output_positions_bk` [B, K], the
    output at those positions only ([B, K, E]): every row-wise part of the block runs on those K rows, the
    keys and values on all L (`SelfAttention`'s `query_positions_bq`)."""
    cfg = self.config
    dropout = Dropout(cfg.hidden_dropout)
    attention_norm, ffn_norm = layer_norm(cfg, "attention_norm"), layer_norm(cfg, "ffn_norm")
    post = cfg.norm != "pre"
    attention = SelfAttention(cfg, defer_output_bias=post, name="attention")
    ffn = FeedForward(cfg, defer_output_bias=post, name="ffn")
    rows = (lambda x: x) if output_positions_bk is None else (lambda x: gather_positions(x, output_positions_bk))
    if cfg.norm == "pre":
      attn_ble, probs = attention(attention_norm(x_ble), pack_ids_bl, position_ids_bl, packed, deterministic,
                                  return_probs, layer, output_positions_bk)
      x_ble = rows(x_ble) + dropout(attn_ble, deterministic=deterministic)
      x_ble = x_ble + dropout(ffn(ffn_norm(x_ble)), deterministic=deterministic)
    else:
      (attn_ble, attn_bias), probs = attention(x_ble, pack_ids_bl, position_ids_bl, packed, deterministic,
                                               return_probs, layer, output_positions_bk)
      # LayerNorm(x + dropout(attn + its output bias))
      x_ble = attention_norm(rows(x_ble), attn_ble, dropout, deterministic, attn_bias)
      ffn_ble, ffn_bias = ffn(x_ble)
      x_ble = ffn_norm(x_ble, ffn_ble, dropout, deterministic, ffn_bias)
    return nn.with_logical_constraint(x_ble, ("batch", "length", "embed")), probs


def _remat(block_cls, policy: str):
  if policy == "none":
    return block_cls
  checkpoint_policy = None if policy == "full" else jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
  # Arguments 4..7 (packed, deterministic, return_probs, layer) are Python values; 8 (output positions) an array.
  return nn.remat(block_cls, policy=checkpoint_policy, static_argnums=(4, 5, 6, 7))


class Encoder(nn.Module):
  """Embeddings -> (E->H projection) -> L transformer blocks.

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
    block = _remat(TransformerBlock, cfg.remat)
    num_blocks = cfg.num_shared_groups or cfg.num_layers
    self.blocks = [block(cfg, name=f"block_{i}") for i in range(num_blocks)]
    if cfg.norm == "pre":
      self.final_norm = layer_norm(cfg, "final_norm")

  def __call__(self, input_ids: Array, segment_ids: Array | None = None, position_ids: Array | None = None,
               pack_ids: Array | None = None, *, packed: bool = False, deterministic: bool = True,
               output_hidden_states: bool = False, output_attentions: bool = False,
               output_positions: Array | None = None) -> dict[str, Any]:
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
      x_ble, probs = block(x_ble, pack_ids, position_ids, packed, deterministic, output_attentions, layer,
                           output_positions if last else None)
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
