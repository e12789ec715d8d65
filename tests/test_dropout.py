"""The hashed dropout masks (`bert_jax.kernels.dropout`, `flash_attention.keep_mask`): closed-form statistics."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import dropout, flash_attention


def _z(count, mean, p):
  """Standard score of a Bernoulli(p) sample mean over `count` draws."""
  return (mean - p) / np.sqrt(p * (1 - p) / count)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_keep_rate_and_pairwise_independence(rate):
  seeds = dropout.dropout_seeds(jax.random.key(0))
  keep = np.asarray(dropout.keep_mask(seeds, (64, 128, 96), rate)).astype(np.float64)
  p = 1 - rate
  assert abs(_z(keep.size, keep.mean(), p)) < 5
  # Neighbours along each axis are independent: P(both kept) = p^2.
  for axis in range(3):
    a, b = np.moveaxis(keep, axis, 0)[:-1], np.moveaxis(keep, axis, 0)[1:]
    assert abs(_z(a.size, (a * b).mean(), p * p)) < 5, axis
  # Another key gives an independent mask.
  other = np.asarray(dropout.keep_mask(dropout.dropout_seeds(jax.random.key(1)), (64, 128, 96), rate))
  assert abs(_z(keep.size, (keep * other).mean(), p * p)) < 5


def test_attention_mask_statistics():
  seeds = dropout.dropout_seeds(jax.random.key(3))
  keep = np.asarray(flash_attention.keep_mask(seeds, 8, 4, 64, 64, 0.1)).astype(np.float64)
  assert abs(_z(keep.size, keep.mean(), 0.9)) < 5
  for axis in range(4):
    a, b = np.moveaxis(keep, axis, 0)[:-1], np.moveaxis(keep, axis, 0)[1:]
    assert abs(_z(a.size, (a * b).mean(), 0.81)) < 5, axis
  # Keys 2j and 2j + 1 share one hash (its two 16-bit halves): still independent.
  even, odd = keep[..., 0::2], keep[..., 1::2]
  assert abs(_z(even.size, (even * odd).mean(), 0.81)) < 5
  assert abs(_z(even.size, ((1 - even) * (1 - odd)).mean(), 0.01)) < 5


def test_attention_mask_rows_at_query_positions_are_the_full_masks_rows():
  """`keep_mask(..., query_positions)` (the sparse last block's queries) hashes the full self-attention's rows."""
  seeds = dropout.dropout_seeds(jax.random.key(3))
  full = np.asarray(flash_attention.keep_mask(seeds, 3, 2, 48, 48, 0.2))
  positions = np.asarray([[5, 0, 47], [9, 9, 1], [30, 2, 3]], np.int32)
  rows = np.asarray(flash_attention.keep_mask(seeds, 3, 2, 48, 48, 0.2, jnp.asarray(positions)))
  np.testing.assert_array_equal(rows, np.take_along_axis(full, positions[:, None, :, None], axis=2))


def test_dropout_module_scales_and_varies_per_call():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      layer = dropout.Dropout(0.25)
      return layer(x, deterministic=False), layer(x, deterministic=False), layer(x, deterministic=True)

  x = jnp.ones((32, 64), jnp.float32)
  a, b, c = Twice().apply({}, x, rngs={"dropout": jax.random.key(0)})
  np.testing.assert_allclose(np.unique(np.asarray(a)), [0.0, 1 / 0.75], rtol=1e-6)
  assert not np.array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(c), np.asarray(x))
  assert abs(_z(a.size, float(jnp.mean(a > 0)), 0.75)) < 5


def test_mask_is_the_same_under_sharding():
  """Each device hashes its own slice of the global index: the mask does not depend on the mesh."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None, "model"))
  x = jnp.ones((8, 16, 32), jnp.float32)
  f = lambda x, key: dropout.Dropout(0.1).apply({}, x, deterministic=False, rngs={"dropout": key})  # noqa: E731
  expected = np.asarray(jax.jit(f)(x, jax.random.key(7)))
  sharded = jax.jit(f, out_shardings=sharding)(jax.device_put(x, sharding), jax.random.key(7))
  np.testing.assert_array_equal(np.asarray(sharded), expected)


def test_apply_mask_gradient_is_the_same_product_with_the_mask_hashed_again():
  x = jax.random.normal(jax.random.key(0), (8, 16, 32), jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
  seeds = dropout.dropout_seeds(jax.random.key(2))
  _, vjp = jax.vjp(lambda x: dropout.apply_mask(x, seeds, 0.1), x)
  multiplier = dropout.keep_mask(seeds, x.shape, 0.1).astype(jnp.float32) * (1.0 / 0.9)
  np.testing.assert_array_equal(np.asarray(vjp(dy)[0], np.float32),
                                np.asarray((dy.astype(jnp.float32) * multiplier).astype(jnp.bfloat16), np.float32))
