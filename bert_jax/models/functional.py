"""The plain model's pure functions that the fast paths share: parameter initialisers, position gathering,
rotary positions, the attention mask and head gating. `model.py` and `bert_jax.kernels` both import them here,
so the kernels never import the encoder.

Shape suffixes as in `model.py`: b batch, l length, q queries, m gathered positions, h heads, d head size.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.models.config import ModelConfig

Array = jax.Array


def dense_init(config: ModelConfig, axes: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(config.initializer_range), axes)


def bias_init(axes: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


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


def position_and_constrain(cfg: ModelConfig, q_bqhd: Array, k_blhd: Array, v_blhd: Array, position_ids_bl: Array,
                           query_positions_bq: Array | None) -> tuple[Array, Array, Array]:
  """Rotary positions on queries and keys (where the config has them), then the heads' logical constraints."""
  if cfg.position_embedding == "rotary":
    position_ids_bq = (position_ids_bl if query_positions_bq is None
                       else jnp.take_along_axis(position_ids_bl, query_positions_bq, axis=1))
    q_bqhd = rotary_embedding(q_bqhd, position_ids_bq, cfg.rotary_base)
    k_blhd = rotary_embedding(k_blhd, position_ids_bl, cfg.rotary_base)
  axes = ("batch", "length", "heads", "kv")
  return (nn.with_logical_constraint(q_bqhd, axes), nn.with_logical_constraint(k_blhd, axes),
          nn.with_logical_constraint(v_blhd, axes))


def attention_mask(pack_ids_bl: Array, causal: bool, query_positions_bq: Array | None = None) -> Array:
  """Boolean [B, 1, Q, L] mask: same packed example, key not padding, (causal); the rows of every position, or
  of `query_positions_bq` [B, Q]."""
  length = pack_ids_bl.shape[1]
  if query_positions_bq is None:
    query_pack_ids, query_positions_bq = pack_ids_bl, jnp.arange(length, dtype=jnp.int32)[None]
  else:
    query_pack_ids = jnp.take_along_axis(pack_ids_bl, query_positions_bq, axis=1)
  allowed = (query_pack_ids[:, :, None] == pack_ids_bl[:, None, :]) & (pack_ids_bl[:, None, :] > 0)
  if causal:
    allowed &= jnp.arange(length)[None, None, :] <= query_positions_bq[:, :, None]
  return allowed[:, None]


def gate_heads(out_bqhd: Array, head_mask_h: Array | None) -> Array:
  """Each head's attention output times its gate (Michel et al. 2019's xi_h, before the output projection)."""
  if head_mask_h is None:
    return out_bqhd
  return out_bqhd * head_mask_h.astype(out_bqhd.dtype)[:, None]
