"""LayerNorm, GELU and bias add with hand-written gradients (same values as the textbook forms).

Autodiff of the textbook formulas leaves XLA with more memory traffic than
the math needs: LayerNorm's backward pass and the feed-forward's elementwise
work, whose exact-erf GELU saved three [tokens, 3072] arrays for the backward
pass, were a large share of a BERT step on a GPU (docs/performance.md). Here:

- `layer_norm` saves only its input (compute dtype) and two float32 numbers
  per row (mean, 1/std), and its backward is one row reduction (two sums)
  plus one column reduction (two sums), written so that XLA fuses each into
  one kernel; or (implementation="pallas", the default on GPU through "auto")
  one Pallas kernel for all of it (`layer_norm.py`).
- `add_layer_norm` is a post-LN residual, layer_norm(x + dropout(branch + its
  bias)): on GPU each pass is one Pallas kernel (forward: the bias, the hashed
  mask, the sum, the statistics and the output; backward: LayerNorm's, the
  mask hashed again, the branch's gradient and its bias's), and the XLA form's
  backward recomputes the mask too.
- `bias_add` sums its bias gradient in float32 (autodiff of a bfloat16 add
  sums it in bfloat16, PyTorch in float32).
- `gelu` saves only its input; the backward recomputes Phi(x) and phi(x)
  from it. The exact form is PyTorch's (and so Hugging Face BERT's):
  0.5 x (1 + erf(x / sqrt 2)); `jax.nn.gelu` evaluates Phi with erfc, which
  agrees to 1e-7 but costs XLA several times the arithmetic on a GPU.

LayerNorm and GELU compute in float32 and return the input's dtype (LayerNorm: `dtype`),
so their values match `flax.linen.LayerNorm(use_fast_variance=False)` and
`jax.nn.gelu` evaluated in float32 (GELU: to 1e-7 absolute).

The GELU's backward recomputes from an `optimization_barrier` of the input:
without it XLA shares the backward's Phi(x) with the forward pass, writing it
out as a float32 [tokens, 3072] array per layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.kernels import dropout
from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import layer_norm as layer_norm_kernel

Array = jax.Array


def use_kernel(implementation: str) -> bool:
  """Whether an "auto" / "xla" / "pallas" implementation choice runs the Pallas kernel here ("auto": on GPU)."""
  return implementation == "pallas" or (implementation == "auto" and jax.default_backend() == "gpu")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def layer_norm(x: Array, scale: Array, bias: Array, epsilon: float, dtype, implementation: str = "auto") -> Array:
  """(x - mean) / sqrt(var + epsilon) * scale + bias over the last axis, statistics in float32.

  Args:
    x: [..., E] input, any float dtype.
    scale: [E] (float32 parameters).
    bias: [E].
    epsilon: added to the variance.
    dtype: dtype of the result.
    implementation: of the backward pass: "xla", "pallas" (one kernel,
      `layer_norm.py`, where it supports the shape; "xla" otherwise),
      or "auto" ("pallas" on GPU, "xla" elsewhere).

  Returns:
    [..., E] in `dtype`.
  """
  return _layer_norm_fwd(x, scale, bias, epsilon, dtype, implementation)[0]


def _statistics(x: Array, epsilon: float) -> tuple[Array, Array]:
  """Mean and 1 / sqrt(var + epsilon) of each row in float32, from one pass over x.

  Both sums are over x minus the row's first element, so they need no mean first (XLA computes them in one
  reduction kernel; the two-pass form read the [tokens, hidden] input once more per LayerNorm) and keep float32
  precision when a row's mean is large against its spread, where E[x^2] - E[x]^2 would cancel.
  """
  x32 = x.astype(jnp.float32)
  shift = jax.lax.stop_gradient(x32[..., :1])
  d = x32 - shift
  mean_d = jnp.mean(d, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(jnp.square(d), axis=-1, keepdims=True) - jnp.square(mean_d), 0.0)
  return shift + mean_d, jax.lax.rsqrt(var + epsilon)


def _layer_norm_fwd(x, scale, bias, epsilon, dtype, implementation="auto"):
  del implementation
  mean, rstd = _statistics(x, epsilon)
  y = (x.astype(jnp.float32) - mean) * (rstd * scale.astype(jnp.float32)) + bias.astype(jnp.float32)
  return y.astype(dtype), (x, mean, rstd, scale, bias)


def _layer_norm_bwd(epsilon, dtype, implementation, residuals, dy):
  del epsilon, dtype
  x, mean, rstd, scale, bias = residuals
  kernel = layer_norm_kernel.layer_norm_backward(x, dy, mean, rstd, scale) if use_kernel(implementation) else None
  if kernel is not None:
    dx, dscale, dbias = kernel
    return dx, dscale.astype(scale.dtype), dbias.astype(bias.dtype)
  dy32 = dy.astype(jnp.float32)
  xhat = (x.astype(jnp.float32) - mean) * rstd
  g = dy32 * scale.astype(jnp.float32)
  # Row reductions (one fusion): mean of g and of g * xhat over the features.
  mean_g = jnp.mean(g, axis=-1, keepdims=True)
  mean_gx = jnp.mean(g * xhat, axis=-1, keepdims=True)
  dx = (rstd * (g - mean_g - xhat * mean_gx)).astype(x.dtype)
  # Column reductions (one fusion): over every row.
  rows = tuple(range(x.ndim - 1))
  dscale = jnp.sum(dy32 * xhat, axis=rows).astype(scale.dtype)
  dbias = jnp.sum(dy32, axis=rows).astype(bias.dtype)
  return dx, dscale, dbias


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def add_layer_norm(x: Array, branch: Array, scale: Array, bias: Array, seeds: Array, rate: float, epsilon: float,
                   dtype, implementation: str = "auto", branch_bias: Array | None = None) -> Array:
  """layer_norm(x + dropout(branch + branch_bias)): a post-LN residual, with `dropout.apply_mask(.., seeds, rate)`.

  The same values as the ops apart (`bias_add(branch, branch_bias)`, then the sum rounded to x's dtype, as
  `x + dropout(..)` is). The sublayer's output bias comes in here, rather than in the GEMM that makes the branch,
  so that its gradient (the branch gradient's column sums) comes from the backward pass's kernel. With the Pallas
  implementation (see `layer_norm`) each pass is one kernel (`layer_norm_kernel.add_layer_norm_forward`, which
  hashes the mask, and `add_layer_norm_backward`, which hashes it again and writes the branch's gradient beside
  x's); the XLA form recomputes the mask from `seeds` instead of saving it, too.

  Args:
    x: [..., E] residual stream.
    branch: [..., E] output of the sublayer, x's dtype.
    scale, bias: [E] LayerNorm parameters.
    seeds: int32[2] dropout seeds (`Dropout.seeds`); unused when rate is 0.
    rate: dropout rate in [0, 1).
    epsilon, dtype, implementation: as `layer_norm`.
    branch_bias: [E] the sublayer's output bias, or None.
  """
  return _add_layer_norm(x, branch, branch_bias, scale, bias, seeds, rate, epsilon, dtype, implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _add_layer_norm(x, branch, branch_bias, scale, bias, seeds, rate, epsilon, dtype, implementation):
  return _add_layer_norm_fwd(x, branch, branch_bias, scale, bias, seeds, rate, epsilon, dtype, implementation)[0]


def _add_layer_norm_fwd(x, branch, branch_bias, scale, bias, seeds, rate, epsilon, dtype, implementation="auto"):
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"add_layer_norm: dropout rate {rate} not in [0, 1)")
  fused = None
  if use_kernel(implementation):
    fused = layer_norm_kernel.add_layer_norm_forward(x, branch, scale, bias, seeds, rate, epsilon, dtype,
                                                     branch_bias)
  if fused is not None:
    y, total, mean, rstd = fused
  else:
    if branch_bias is not None:
      branch = bias_add(branch, branch_bias)
    total = x + (dropout.apply_mask(branch, seeds, rate) if rate > 0 else branch)
    y, (total, mean, rstd, _, _) = _layer_norm_fwd(total, scale, bias, epsilon, dtype)
  return y, (total, mean, rstd, scale, bias, seeds, branch_bias)


def _add_layer_norm_bwd(rate, epsilon, dtype, implementation, residuals, dy):
  total, mean, rstd, scale, bias, seeds, branch_bias = residuals
  kernel = None
  if use_kernel(implementation):
    kernel = layer_norm_kernel.add_layer_norm_backward(total, dy, mean, rstd, scale, seeds, rate,
                                                       branch_sums=branch_bias is not None)
  if kernel is not None:
    dtotal, dbranch, dscale, dbias, dbranch_bias = kernel
  else:
    dtotal, dscale, dbias = _layer_norm_bwd(epsilon, dtype, "xla", (total, mean, rstd, scale, bias), dy)
    dbranch = dtotal
    if rate > 0:
      dbranch = dropout.apply_mask_backward(dtotal, seeds, rate)  # the mask hashed again, not saved
    dbranch_bias = None if branch_bias is None else _bias_add_bwd(branch_bias, dbranch)[1]
  if branch_bias is not None:
    dbranch_bias = dbranch_bias.astype(branch_bias.dtype)
  return dtotal, dbranch, dbranch_bias, dscale.astype(scale.dtype), dbias.astype(bias.dtype), None


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)

_SQRT_HALF = float(np.sqrt(0.5))
_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))
_INV_SQRT_2PI = float(1.0 / np.sqrt(2.0 * np.pi))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gelu(x: Array, approximate: bool = False) -> Array:
  """x * Phi(x) (exact, erf) or its tanh approximation, computed in float32, returned in x's dtype."""
  return _gelu_value(x.astype(jnp.float32), approximate).astype(x.dtype)


def _gelu_value(x32: Array, approximate: bool) -> Array:
  if approximate:
    return 0.5 * x32 * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x32 + 0.044715 * x32 ** 3)))
  return 0.5 * x32 * (1.0 + jax.lax.erf(x32 * _SQRT_HALF))


def _gelu_derivative(x32: Array, approximate: bool) -> Array:
  if approximate:
    inner = _SQRT_2_OVER_PI * (x32 + 0.044715 * x32 ** 3)
    t = jnp.tanh(inner)
    return 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x32 * x32)
  return 0.5 * (1.0 + jax.lax.erf(x32 * _SQRT_HALF)) + x32 * _INV_SQRT_2PI * jnp.exp(-0.5 * x32 * x32)


def _gelu_fwd(x, approximate):
  return gelu(x, approximate), x


def _gelu_bwd(approximate, x, dy):
  # The barrier keeps XLA from computing Phi(x) once for both passes (a float32 residual per element).
  x32 = jax.lax.optimization_barrier(x).astype(jnp.float32)
  return ((dy.astype(jnp.float32) * _gelu_derivative(x32, approximate)).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


def gelu_feed_forward(x: Array, wi: Array, bi: Array, wo: Array) -> Array:
  """GELU(x @ wi + bi) @ wo with the exact (erf) GELU: a feed-forward block, both projections (the caller adds the
  output bias: `bias_add`, or the post-LN residual's `add_layer_norm`).

  x [..., E], wi [E, F] and wo [F, E] in the compute dtype, bias bi [F] (its gradient summed in float32, as
  `bias_add`). On a Hopper GPU the forward pass writes h = x @ wi + bi and GELU(h) from one Mosaic GPU kernel
  (`ffn_kernel.bias_gelu`, where `ffn_kernel.applies`: the FFN's caller checks it), and the backward pass takes
  dh = (dy @ wo^T) * GELU'(h) and its bias gradient from another (`ffn_kernel.dgelu`, where
  `ffn_kernel.applies_dgelu`), so GELU(h)'s gradient is never written and no GELU kernel passes over memory.
  Elsewhere the same rule runs XLA's forms, the values of `gelu(bias_add(x @ wi, bi)) @ wo` under autodiff. With
  `ffn_kernel.SAVE_GELU_DERIVATIVE` (where either kernel runs), the forward pass saves GELU'(h) instead of h, and
  the backward pass multiplies by it.
  """
  forward_kernel, backward_kernel = ffn_kernel.applies(x, wi), ffn_kernel.applies_dgelu(x, wi)
  save_derivative = ffn_kernel.SAVE_GELU_DERIVATIVE and (forward_kernel or backward_kernel)
  return _gelu_feed_forward(x, wi, bi, wo, forward_kernel, backward_kernel, save_derivative)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gelu_feed_forward(x, wi, bi, wo, forward_kernel: bool, backward_kernel: bool, save_derivative: bool):
  return _gelu_feed_forward_fwd(x, wi, bi, wo, forward_kernel, backward_kernel, save_derivative)[0]


def _gelu_feed_forward_fwd(x, wi, bi, wo, forward_kernel, backward_kernel, save_derivative):
  """The forward pass; its residual r is h, or GELU'(h) rounded to h's dtype with `save_derivative`."""
  del backward_kernel
  if forward_kernel:
    r, g = ffn_kernel.bias_gelu(x, wi, bi, derivative=save_derivative)
  else:  # the XLA form, for tests of the backward rule off GPU
    h = bias_add(jnp.dot(x, wi), bi)
    g = gelu(h)
    r = _gelu_derivative(h.astype(jnp.float32), False).astype(h.dtype) if save_derivative else h
  return jnp.dot(g, wo), (x, wi, bi, r, g, wo)


def _gelu_feed_forward_bwd(forward_kernel, backward_kernel, save_derivative, residuals, dy):
  """What autodiff of the XLA form computes, with dh from `ffn_kernel.dgelu` where `backward_kernel`."""
  del forward_kernel
  x, wi, bi, r, g, wo = residuals
  rows = tuple(range(dy.ndim - 1))
  last = dy.ndim - 1
  dwo = jax.lax.dot_general(g, dy, ((rows, rows), ((), ())))
  if backward_kernel:
    dh, dbi = ffn_kernel.dgelu(dy, wo, r, x, wi, saved=save_derivative)
  else:
    dg = jax.lax.dot_general(dy, wo, (((last,), (1,)), ((), ())))
    if save_derivative:
      dh = (dg.astype(jnp.float32) * r.astype(jnp.float32)).astype(r.dtype)
    else:
      (dh,) = _gelu_bwd(False, r, dg)
    dbi = jnp.sum(dh.astype(jnp.float32), axis=rows)
  dbi = dbi.astype(bi.dtype)
  dwi = jax.lax.dot_general(x, dh, ((rows, rows), ((), ())))
  dx = jax.lax.dot_general(dh, wi, (((last,), (1,)), ((), ())))
  return dx, dwi, dbi, dwo


_gelu_feed_forward.defvjp(_gelu_feed_forward_fwd, _gelu_feed_forward_bwd)


@jax.custom_vjp
def bias_add(y: Array, bias: Array) -> Array:
  """y + bias over the last axis, in y's dtype; the bias gradient is summed over the rows in float32.

  Autodiff of `y + bias.astype(y.dtype)` sums the gradient in y's dtype: in bfloat16, XLA added the 32,768 rows of
  a BERT-Base batch in bfloat16 partial sums. The forward pass is the plain add, which XLA fuses into the GEMM
  that produces y.
  """
  return y + bias.astype(y.dtype)


def _bias_add_fwd(y, bias):
  return bias_add(y, bias), bias


def _bias_add_bwd(bias, dy):
  rows = tuple(range(dy.ndim - 1))
  return dy, jnp.sum(dy.astype(jnp.float32), axis=rows).astype(bias.dtype)


bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)
