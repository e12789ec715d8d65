"""The attention of the fast path (`layers.self_attention`): three implementations behind one signature.

  * "cudnn": cuDNN's fused flash-attention kernel
    (`jax.nn.dot_product_attention(implementation="cudnn")`). Chosen by "auto"
    on GPU for float16/bfloat16 in a forward-only pass without attention
    dropout (evaluation, inference) when the head size allows and
    probabilities are not requested.
  * "flash": our Pallas (Triton) flash-attention kernels with in-kernel
    attention dropout (`flash_attention.py`). Chosen by "auto" on GPU for
    float16/bfloat16 in training (with or without attention dropout) when the
    head size is a power of two up to 128 and lengths are multiples of 16.
  * "xla": an explicit einsum/softmax path (float32 softmax) that also applies
    attention dropout and can return the probabilities for analysis.

Two entries: `dot_product_attention` (separate query, key and value) and
`self_attention` (one fused [B, L, H, 3, D] projection, which the encoder
computes as one GEMM and the flash kernels read in place; the other
implementations split it).

"flash" and "xla" drop the same probabilities: the mask is a hash of (seed,
batch row, head, query, key), `flash_attention.keep_mask`, with the seed drawn
from the step's dropout key (reproducible, resumable, independent of how the
batch is split over devices).

Masking: `pack_ids` [B, L] says which packed example each token belongs to
(0 = padding). Unpacked rows are 1 on real tokens, and their padding is passed
to cuDNN as sequence lengths; packed rows get a block-diagonal mask (a token
attends only inside its own example).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bert_jax.kernels import flash_attention
from bert_jax.models.encoder import attention_mask  # The plain model's mask: one definition for both paths.

IMPLEMENTATIONS = ("auto", "cudnn", "flash", "xla")


@functools.cache
def _backend() -> str:
  return jax.default_backend()


def resolve_implementation(requested: str, *, dtype, head_dim: int, dropout_active: bool,
                           return_probs: bool, length: int | None = None, training: bool = False) -> str:
  """Chooses "cudnn", "flash" or "xla" for `requested` in IMPLEMENTATIONS.

  `length` (the sequence length) gates "flash" under "auto"; None skips that
  check (for reporting which path a config takes). `training` (a backward pass
  follows) makes "auto" pick "flash" also without attention dropout: its
  forward and backward together beat cuDNN's, while cuDNN's forward alone is
  faster at long lengths (docs/performance.md).
  """
  if requested not in IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {requested!r} not in {IMPLEMENTATIONS}")
  half = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
  cudnn_ok = half and head_dim % 8 == 0 and head_dim <= 128 and not return_probs
  flash_ok = (not return_probs and flash_attention.supported(head_dim=head_dim, q_len=length or 16,
                                                             k_len=length or 16))
  if requested == "cudnn":
    if not cudnn_ok or dropout_active:
      raise ValueError(f"cuDNN attention needs float16/bfloat16, head size a multiple of 8 up to 128, no attention "
                       f"dropout and no returned probabilities (dtype={jnp.dtype(dtype)}, head_dim={head_dim}, "
                       f"dropout={dropout_active}, return_probs={return_probs})")
    return "cudnn"
  if requested == "flash":
    if not flash_ok:
      raise ValueError(f"flash attention needs a power-of-two head size in [16, 128], lengths that are multiples "
                       f"of 16 and no returned probabilities (head_dim={head_dim}, length={length}, "
                       f"return_probs={return_probs})")
    return "flash"
  if requested == "auto" and _backend() == "gpu":
    if half and (dropout_active or training) and flash_ok:
      return "flash"
    if cudnn_ok and not dropout_active:
      return "cudnn"
  return "xla"


def dot_product_attention(
    query_blhd: jax.Array,
    key_blhd: jax.Array,
    value_blhd: jax.Array,
    *,
    pack_ids: jax.Array | None,
    packed: bool = False,
    causal: bool = False,
    implementation: str = "auto",
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    return_probs: bool = False,
    query_positions: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Multi-head scaled dot-product attention.

  Args:
    query_blhd, key_blhd, value_blhd: [batch, length, heads, head_dim] ([batch, Q, heads, head_dim] queries
      with `query_positions`).
    pack_ids: [batch, length] int, 0 for padding, else the packed example id.
      None means no padding.
    packed: whether rows may hold several examples (needs the block mask).
    causal: attend only to earlier positions.
    implementation: "auto", "cudnn", "flash" or "xla" ("flash" off GPU runs the
      kernels in Pallas' interpreter: slow, for tests).
    dropout_rate: attention-probability dropout; applied when `dropout_rng` is
      given.
    return_probs: also return the [batch, heads, length, length] float32
      probabilities (XLA path only).
    query_positions: [batch, Q] int: the queries are the self-attention's rows at these positions of the
      key sequence (masks and dropout are those rows' of the full self-attention). Always the XLA path: it
      serves a few rows a sequence (`ModelConfig.sparse_last_layer`).

  Returns:
    ([batch, length, heads, head_dim] output in the query dtype, probs or None).
  """
  head_dim = query_blhd.shape[-1]
  dropout_active = dropout_rng is not None and dropout_rate > 0.0
  impl = resolve_implementation(implementation, dtype=query_blhd.dtype, head_dim=head_dim,
                                dropout_active=dropout_active, return_probs=return_probs, length=key_blhd.shape[1])
  if query_positions is not None:
    impl = "xla"
  if impl == "flash":
    if query_blhd.shape != key_blhd.shape:
      raise ValueError(f"flash attention is self-attention: query {query_blhd.shape} and key {key_blhd.shape} "
                       f"must have one shape")
    return self_attention(flash_attention.fuse_qkv(query_blhd, key_blhd, value_blhd), pack_ids=pack_ids,
                          packed=packed, causal=causal, implementation="flash", dropout_rate=dropout_rate,
                          dropout_rng=dropout_rng)
  if impl == "cudnn":
    mask, lengths = None, None
    if pack_ids is not None:
      if packed:
        mask = attention_mask(pack_ids, causal=False)
      else:
        lengths = jnp.sum(pack_ids > 0, axis=-1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(query_blhd, key_blhd, value_blhd, mask=mask, is_causal=causal,
                                       query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return out, None

  scale = head_dim ** -0.5
  logits_bhqk = jnp.einsum("bqhd,bkhd->bhqk", query_blhd * jnp.asarray(scale, query_blhd.dtype), key_blhd,
                           preferred_element_type=jnp.float32)
  if pack_ids is not None:
    mask = attention_mask(pack_ids, causal, query_positions)
  elif causal:  # no padding: every key is real
    mask = attention_mask(jnp.ones(key_blhd.shape[:2], jnp.int32), causal, query_positions)
  else:
    mask = None
  if mask is not None:
    logits_bhqk = jnp.where(mask, logits_bhqk, jnp.finfo(jnp.float32).min)
  probs_bhqk = jax.nn.softmax(logits_bhqk, axis=-1)
  if mask is not None:
    # Fully masked query rows (padding) get zeros instead of a uniform average.
    probs_bhqk = jnp.where(mask.any(axis=-1, keepdims=True), probs_bhqk, 0.0)
  weights = probs_bhqk
  if dropout_active:
    batch, heads, q_len, k_len = weights.shape
    keep = flash_attention.keep_mask(flash_attention.dropout_seeds(dropout_rng), batch, heads, q_len, k_len,
                                     dropout_rate, query_positions)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(value_blhd.dtype), value_blhd)
  return out, (probs_bhqk if return_probs else None)


def self_attention(qkv_blh3d: jax.Array, *, pack_ids: jax.Array | None, packed: bool = False, causal: bool = False,
                   implementation: str = "auto", dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
                   return_probs: bool = False,
                   bias_h3d: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
  """`dot_product_attention` of one fused [batch, length, heads, 3, head_dim] projection
  (`flash_attention.fuse_qkv`'s layout): the flash kernels read it in place, the other implementations split it.

  bias_h3d: the projections' fused bias [heads, 3, head_dim], added first (`flash_attention.add_qkv_bias`: no
  gradient for the key slot); the flash kernels also sum its gradient.
  """
  head_dim = qkv_blh3d.shape[-1]
  impl = resolve_implementation(implementation, dtype=qkv_blh3d.dtype, head_dim=head_dim,
                                dropout_active=dropout_rng is not None and dropout_rate > 0.0,
                                return_probs=return_probs, length=qkv_blh3d.shape[1])
  if impl == "flash":
    out = flash_attention.flash_attention(qkv_blh3d, pack_ids=pack_ids, packed=packed, causal=causal,
                                          dropout_rate=dropout_rate, dropout_rng=dropout_rng, bias_h3d=bias_h3d,
                                          interpret=_backend() != "gpu")
    return out, None
  if bias_h3d is not None:
    qkv_blh3d = flash_attention.add_qkv_bias(qkv_blh3d, bias_h3d)
  return dot_product_attention(*flash_attention.split_qkv(qkv_blh3d), pack_ids=pack_ids, packed=packed,
                               causal=causal, implementation=impl, dropout_rate=dropout_rate,
                               dropout_rng=dropout_rng, return_probs=return_probs)
