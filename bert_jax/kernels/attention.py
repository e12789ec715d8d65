"""The attention of the fast path (`layers.self_attention`): four implementations behind one signature.

  * "cudnn": cuDNN's fused flash-attention kernel
    (`jax.nn.dot_product_attention(implementation="cudnn")`). Chosen by "auto"
    on GPU for float16/bfloat16 in a forward-only pass without attention
    dropout (evaluation, inference) when the head size allows and
    probabilities are not requested.
  * "flash": our Pallas (Triton) flash-attention kernels with in-kernel
    attention dropout (`flash_attention.py`). Chosen by "auto" on GPU for
    float16/bfloat16 in training (with or without attention dropout) when the
    head size is a power of two up to 128 and lengths are multiples of 16.
  * "splash": JAX's Pallas TPU kernel
    (`jax.experimental.pallas.ops.tpu.splash_attention`). Chosen by "auto" on
    TPU where attention dropout is off (evaluation, inference, ALBERT's
    training), lengths are multiples of 128 and the head size a multiple of 64
    up to 256: it has no dropout of the probabilities, so where dropout is on
    the plain path keeps its mask.
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
attends only inside its own example). Splash takes `pack_ids` as segment ids
and zeroes the padding rows' outputs, as the plain path's masked softmax does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from bert_jax.kernels import flash_attention
from bert_jax.models.functional import attention_mask  # The plain model's mask: one definition for both paths.
from bert_jax.parallel import sharding as sharding_lib

IMPLEMENTATIONS = ("auto", "cudnn", "flash", "splash", "xla")
# Splash's blocks are whole multiples of a TPU vreg's 128 lanes.
SPLASH_BLOCK = 128


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
  splash_ok = not return_probs and not dropout_active and splash_supported(head_dim=head_dim, length=length)
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
  if requested == "splash":
    if not splash_ok:
      raise ValueError(f"splash attention needs lengths that are multiples of {SPLASH_BLOCK}, a head size that is a "
                       f"multiple of 64 up to 256, no attention dropout and no returned probabilities "
                       f"(head_dim={head_dim}, length={length}, dropout={dropout_active}, return_probs={return_probs})")
    return "splash"
  if requested == "auto" and _backend() == "tpu" and splash_ok:
    return "splash"
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
    implementation: "auto", "cudnn", "flash", "splash" or "xla" ("flash" off GPU
      and "splash" off TPU run the kernels in Pallas' interpreter: slow, for tests).
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
  if impl == "splash":
    return splash_attention(query_blhd, key_blhd, value_blhd, pack_ids=pack_ids, causal=causal), None

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


def splash_supported(*, head_dim: int, length: int | None) -> bool:
  """Whether "splash" takes these shapes; an unknown length (None) counts as not."""
  return length is not None and length % SPLASH_BLOCK == 0 and head_dim % 64 == 0 and head_dim <= 256


def splash_attention(query_blhd: jax.Array, key_blhd: jax.Array, value_blhd: jax.Array, *,
                     pack_ids: jax.Array | None, causal: bool) -> jax.Array:
  """Self-attention without dropout through JAX's splash attention kernel: [batch, length, heads, head_dim] in,
  the same out, in the query dtype. Under a mesh it runs per shard (`jax.shard_map`), batch and heads split as the
  logical axis rules say; the kernel sees one shard's heads."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # Only where this path is taken.

  batch, length, heads, head_dim = query_blhd.shape
  scale = jnp.asarray(head_dim ** -0.5, query_blhd.dtype)  # As the plain path scales: the query, in its dtype.
  block = min(length, 512)
  block_sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)

  def per_shard(q_blhd, k_blhd, v_blhd, segments_bl):
    shard_heads = q_blhd.shape[2]
    mask = splash.MultiHeadMask([(splash.CausalMask if causal else splash.FullMask)((length, length))
                                 for _ in range(shard_heads)])
    kernel = splash.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1,
                                    interpret=_backend() != "tpu")
    to_bhld = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    if segments_bl is None:
      out_bhld = jax.vmap(kernel)(to_bhld(q_blhd * scale), to_bhld(k_blhd), to_bhld(v_blhd))
    else:
      segments = splash.SegmentIds(segments_bl, segments_bl)
      out_bhld = jax.vmap(kernel)(to_bhld(q_blhd * scale), to_bhld(k_blhd), to_bhld(v_blhd), segments)
    out_blhd = to_bhld(out_bhld).astype(q_blhd.dtype)
    if segments_bl is None:
      return out_blhd
    # Padding (segment 0) attends to padding in the kernel; the plain path gives those rows zeros.
    return jnp.where((segments_bl > 0)[:, :, None, None], out_blhd, jnp.zeros((), out_blhd.dtype))

  segments_bl = None if pack_ids is None else pack_ids.astype(jnp.int32)
  mesh = sharding_lib.current_mesh()
  if mesh is None or mesh.size == 1:
    return per_shard(query_blhd, key_blhd, value_blhd, segments_bl)
  batch_axes, _, head_axes, _ = sharding_lib.split_axes(("batch", "length", "heads", "kv"),
                                                        (batch, length, heads, head_dim), mesh)
  spec = P(batch_axes or None, None, head_axes or None, None)
  rows = P(batch_axes or None, None)
  if segments_bl is None:
    return jax.shard_map(lambda q, k, v: per_shard(q, k, v, None), mesh=mesh, in_specs=(spec, spec, spec),
                         out_specs=spec, check_vma=False)(query_blhd, key_blhd, value_blhd)
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec, spec, rows), out_specs=spec,
                       check_vma=False)(query_blhd, key_blhd, value_blhd, segments_bl)
