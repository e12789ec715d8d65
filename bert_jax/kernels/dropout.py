"""Dropout masks from a counter-based hash: the one dropout of the model zoo.

A keep bit is a pure function of (seeds, global element index): two rounds of
MurmurHash3's 32-bit finaliser (a bijection of int32, so distinct indices never
share bits) compared with (1 - rate) * 2^31. Compared with drawing the bits
from a PRNG:
  * no random-bit tensor is written to memory: XLA fuses the hash into the
    ops that use the mask, in the forward and backward passes;
  * under a sharded mesh the index is an iota of the global shape, so each
    device hashes only its own elements (XLA's RngBitGenerator would make
    every device draw the whole batch's bits) and the mask is independent of
    the sharding;
  * the attention kernels (`flash_attention.py`) hash the same way inside the
    kernel and recompute the mask in the backward pass.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

_MIX1 = int(np.array(0x85EBCA6B, np.uint32).view(np.int32))
_MIX2 = int(np.array(0xC2B2AE35, np.uint32).view(np.int32))


def fmix32(x: Array) -> Array:
  """MurmurHash3's 32-bit finaliser on int32 (wrapping multiply, logical shifts): a bijection."""
  x = x ^ lax.shift_right_logical(x, 16)
  x = x * _MIX1
  x = x ^ lax.shift_right_logical(x, 13)
  x = x * _MIX2
  return x ^ lax.shift_right_logical(x, 16)


def keep_threshold(rate: float) -> int:
  """Keep iff the top 31 bits of a hash are below this: probability 1 - rate (to 2^-31)."""
  return int(round((1.0 - rate) * 2 ** 31))


def keep_bits(bits: Array, rate: float) -> Array:
  return lax.shift_right_logical(bits, 1) < keep_threshold(rate)


def dropout_seeds(rng: Array) -> Array:
  """Two int32 seeds from a PRNG key."""
  return lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32), jnp.int32)


def element_index(shape: tuple[int, ...]) -> Array:
  """Row-major linear index of every element of `shape` (int32, wrapping past 2^31)."""
  index = jnp.zeros(shape, jnp.int32)
  for axis, size in enumerate(shape):
    index = index * size + lax.broadcasted_iota(jnp.int32, shape, axis)
  return index


def keep_index(index: Array, seed0: Array, seed1: Array, rate: float) -> Array:
  """Whether the elements of linear index `index` are kept: hash(seeds, index) under 1 - rate."""
  return keep_bits(fmix32(fmix32(index ^ seed0) ^ seed1), rate)


def keep_mask(seeds: Array, shape: tuple[int, ...], rate: float) -> Array:
  """Boolean keep mask of `shape`: element i (row-major) kept iff hash(seeds, i) is under 1 - rate."""
  return keep_index(element_index(shape), seeds[0], seeds[1], rate)


class Dropout(nn.Module):
  """Inverted dropout with the hashed mask; draws its key from the "dropout" RNG stream like `nn.Dropout`."""

  rate: float

  @nn.compact
  def __call__(self, x: Array, deterministic: bool) -> Array:
    if deterministic or self.rate == 0.0:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    return apply_mask(x, self.seeds(), self.rate)

  def seeds(self) -> Array:
    """The int32[2] seeds of this call's mask (what `__call__` draws), for callers that fuse the dropout into
    another op (`ops.add_layer_norm`)."""
    return dropout_seeds(self.make_rng("dropout"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def apply_mask(x: Array, seeds: Array, rate: float) -> Array:
  """Inverted dropout of x with `keep_mask(seeds, x.shape, rate)`, 0 < rate < 1.

  A product with a float32 multiplier (0 or 1 / (1 - rate)), rounded once to x's dtype, as PyTorch scales:
  dividing in bfloat16 would scale by 1 / bf16(0.9) = 1.113. No select against a zeros array either: XLA kept
  one such [batch, length, hidden] array of zeros in memory and read it in every dropout's backward. The
  gradient is the same product with the mask hashed again from `seeds`, not saved.
  """
  multiplier = keep_mask(seeds, x.shape, rate).astype(jnp.float32) * (1.0 / (1.0 - rate))
  return (x.astype(jnp.float32) * multiplier).astype(x.dtype)


def _apply_mask_fwd(x, seeds, rate):
  return apply_mask(x, seeds, rate), seeds


def apply_mask_backward(dy: Array, seeds: Array, rate: float) -> Array:
  """`apply_mask`'s gradient: dy times the same multiplier, the mask hashed again from `seeds`.

  The optimization barrier keeps XLA from sharing the mask with the forward pass, which would save it (a boolean
  array the size of x written and read back at every post-LN residual).
  """
  return apply_mask(dy, lax.optimization_barrier(seeds), rate)


def _apply_mask_bwd(rate, seeds, dy):
  return apply_mask_backward(dy, seeds, rate), None


apply_mask.defvjp(_apply_mask_fwd, _apply_mask_bwd)
