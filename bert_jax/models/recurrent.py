"""A bidirectional LSTM with both directions in one scan, for the heads that put a BiLSTM on the encoder.

flax's `nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(n)), ...)` runs two scans one after the other, each step
multiplying its input by the input kernel inside the loop; on an accelerator such a loop is bound by its steps.
`BiLSTM` computes the same function (flax's cell equations, gates i, f, g, o, padded rows read backwards from their
last real token) but projects every input before the loop (one GEMM for both directions), steps both directions
together (one batched matmul a step) and unrolls the loop. `bench/bilstm.py` times the two;
`tests/test_models.py` checks them equal through `params_from_flax`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.recurrent import flip_sequences

Array = jax.Array


def _per_direction(init):
  """An initializer of [2, ...] that draws each direction as `init` draws one cell's kernel (flax's defaults)."""
  def draw(key, shape, dtype=jnp.float32):
    return jnp.stack([init(k, shape[1:], dtype) for k in jax.random.split(key, shape[0])])
  return draw


class BiLSTM(nn.Module):
  """[B, L, E] -> [B, L, 2 * features]: the forward direction's outputs, then the backward one's.

  Attributes:
    features: LSTM units per direction.
    unroll: scan steps per loop iteration (more: fewer, longer loop iterations; the same result).
  """

  features: int
  unroll: int = 8

  @nn.compact
  def __call__(self, x_ble: Array, lengths_b: Array | None = None) -> Array:
    """lengths_b [B]: real tokens per row (None: every position); outputs past a row's length are not used."""
    batch, length, width = x_ble.shape
    gates = 4 * self.features
    input_kernel = self.param("input_kernel", _per_direction(nn.initializers.lecun_normal()), (2, width, gates))
    recurrent_kernel = self.param("recurrent_kernel", _per_direction(nn.initializers.orthogonal()),
                                  (2, self.features, gates))
    bias = self.param("bias", nn.initializers.zeros_init(), (2, gates))
    backward_ble = flip_sequences(x_ble, lengths_b, num_batch_dims=1, time_major=False)
    projected_ldbg = jnp.einsum("dble,deg->ldbg", jnp.stack([x_ble, backward_ble]), input_kernel) + bias[:, None]

    def step(carry, projected_dbg):
      h_dbh, c_dbh = carry
      i, f, g, o = jnp.split(projected_dbg + jnp.einsum("dbh,dhg->dbg", h_dbh, recurrent_kernel), 4, axis=-1)
      c_dbh = nn.sigmoid(f) * c_dbh + nn.sigmoid(i) * jnp.tanh(g)
      h_dbh = nn.sigmoid(o) * jnp.tanh(c_dbh)
      return (h_dbh, c_dbh), h_dbh

    zeros = jnp.zeros((2, batch, self.features), projected_ldbg.dtype)
    _, h_ldbh = jax.lax.scan(step, (zeros, zeros), projected_ldbg, unroll=max(1, min(self.unroll, length)))
    forward_blh = jnp.moveaxis(h_ldbh[:, 0], 0, 1)
    backward_blh = flip_sequences(jnp.moveaxis(h_ldbh[:, 1], 0, 1), lengths_b, num_batch_dims=1, time_major=False)
    return jnp.concatenate([forward_blh, backward_blh], axis=-1)


def flax_bilstm(features: int) -> nn.Module:
  """flax's own BiLSTM of the same function (the reference `BiLSTM` is checked and timed against)."""
  return nn.Bidirectional(nn.RNN(nn.OptimizedLSTMCell(features)), nn.RNN(nn.OptimizedLSTMCell(features)))


def params_from_flax(params: dict[str, Any]) -> dict[str, Array]:
  """`flax_bilstm`'s parameters in `BiLSTM`'s layout (gates i, f, g, o; flax keeps the biases on the h side)."""
  cells = [params[direction]["cell"] for direction in ("forward_rnn", "backward_rnn")]

  def stack(prefix, leaf):
    return jnp.stack([jnp.concatenate([cell[prefix + gate][leaf] for gate in "ifgo"], -1) for cell in cells])

  return {"input_kernel": stack("i", "kernel"), "recurrent_kernel": stack("h", "kernel"), "bias": stack("h", "bias")}
