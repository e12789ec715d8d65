"""The fast forms of the encoder's operations: what `bert_jax.models.model` calls where `ModelConfig.kernels` is
"auto".

Each function or module here computes what its plain counterpart in `model.py` computes (to rounding) and
creates the same parameters (names, shapes, logical axes), so checkpoints do not see which path made them. The
functions that create parameters run inside the calling module's `nn.compact` method, so their children are the
caller's. Here:

- `Projection`: a dense layer as one 2-D GEMM whose 1-D bias XLA fuses into the GEMM, the bias gradient summed in
  float32 (`ops.bias_add`).
- `LayerNorm`: `ops.layer_norm` (a saved-input-only gradient; the Pallas backward kernel on GPU), and for the
  post-LN residual `ops.add_layer_norm` (bias, hashed dropout, sum and LayerNorm, one kernel a pass on GPU).
- `self_attention`: the query/key/value projections as one fused GEMM read in place by the flash kernels
  (`attention.py`), or the explicit XLA form with the hashed attention dropout.
- `feed_forward`: the exact-GELU block through the Hopper GEMM kernels (`ffn.py`) where they apply.
- `embedding_lookup`: one-hot matmuls for the small tables (their gradient is a matmul, not a contended scatter).

Post-LN, the sublayers return their output without its bias, as (output, bias), for `residual_layer_norm` to add
inside the LayerNorm kernel, whose backward pass sums the bias gradient beside the branch gradient it writes.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bert_jax.kernels import ffn as ffn_kernel
from bert_jax.kernels import flash_attention, ops
from bert_jax.kernels.attention import dot_product_attention, resolve_implementation
from bert_jax.kernels.attention import self_attention as fused_self_attention
from bert_jax.kernels.dropout import Dropout
from bert_jax.models.config import ModelConfig
from bert_jax.models.functional import bias_init, dense_init, gate_heads, gather_positions, position_and_constrain

Array = jax.Array
bias_add = ops.bias_add  # `encoder.add_bias`'s fast form.


def activation(name: str):
  """The elementwise activation of a config's `hidden_act` (GELUs with a saved-input-only gradient)."""
  return {"gelu": lambda x: ops.gelu(x, False),
          "gelu_tanh": lambda x: ops.gelu(x, True),
          "relu": nn.relu}[name]


class LayerNorm(nn.Module):
  """LayerNorm over the last axis with float32 statistics whatever the compute dtype.

  Parameters "scale" and "bias" as in `flax.linen.LayerNorm`; the arithmetic and its gradient are `ops.layer_norm`.
  """

  epsilon: float
  dtype: Any
  param_dtype: Any
  axis_name: str = "embed"

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
      return ops.layer_norm(x, scale, bias, self.epsilon, self.dtype)
    rate = 0.0 if deterministic or dropout is None else dropout.rate
    if rate >= 1.0:
      return ops.layer_norm(x, scale, bias, self.epsilon, self.dtype)
    seeds = dropout.seeds() if rate > 0 else jnp.zeros((2,), jnp.int32)
    return ops.add_layer_norm(x, branch.astype(x.dtype), scale, bias, seeds, rate, self.epsilon, self.dtype,
                              "auto", branch_bias)


def layer_norm(config: ModelConfig, name: str, axis_name: str = "embed") -> LayerNorm:
  return LayerNorm(config.layer_norm_eps, config.compute_dtype, config.weight_dtype, axis_name, name=name)


def residual_layer_norm(norm: LayerNorm, x_ble: Array, branch: tuple[Array, Array], dropout: Dropout,
                        deterministic: bool) -> Array:
  """The post-LN residual LayerNorm(x + dropout(output + bias)) of a sublayer's (output, bias) pair."""
  branch_ble, branch_bias = branch
  return norm(x_ble, branch_ble, dropout, deterministic, branch_bias)


class Projection(nn.Module):
  """x [..., *in] -> [..., *features]: one [prod(in), prod(features)] matmul and a 1-D bias, in the compute dtype.

  The parameters are `nn.Dense`'s / `nn.DenseGeneral`'s (kernel [*in, *features], bias [*features]). The form is
  chosen for XLA on a GPU: it fuses a 1-D bias add on a 2-D product into the cuBLAS GEMM, where DenseGeneral's
  [heads, head_dim] bias add is a separate kernel (docs/performance.md). The bias gradient is summed in float32
  (`ops.bias_add`).

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
    dtype, bias [*features]) for a caller that fuses several projections of x into one GEMM (`self_attention`).
    With `train_bias` False the bias gets no gradient (a key bias the softmax ignores)."""
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
    # lax.dot_general itself, not jnp.dot: jnp.dot's traces are cached by shape, so a matmul that Qwix intercepts
    # (`ModelConfig.fp8`) would be served to a float model of the same shapes, and the other way round.
    y = jax.lax.dot_general(x.astype(dtype).reshape(*lead, width_in), kernel.astype(dtype).reshape(width_in, width_out),
                            (((len(lead),), (0,)), ((), ())))
    if not add_bias:
      return y.reshape(*lead, *self.features), bias
    return ops.bias_add(y, bias.reshape(width_out)).reshape(*lead, *self.features)


def dense(config: ModelConfig, features: int, axes: tuple[str | None, str | None], name: str) -> Projection:
  """A dense layer [..., in] -> [..., features] (parameters of `nn.Dense`)."""
  return Projection(config, (features,), axes, name=name)


def embedding_lookup(table: Array, ids: Array, dtype) -> Array:
  """table[ids] in `dtype`, exact, with a gradient accumulated at least in `dtype` without scatter contention.

  `table.astype(dtype)[ids]` differentiates into a scatter-add in `dtype`, which in bfloat16, with thousands of
  updates to the same rows ([CLS], [SEP], [MASK], the two token types), is slow on a GPU. Small tables (positions,
  token types) are read with a one-hot matmul instead, whose gradient is a matmul; the vocabulary is gathered in
  float32, whose gradient is a float32 scatter-add (native atomics).
  """
  if table.shape[0] <= 1024:
    one_hot = jax.nn.one_hot(ids, table.shape[0], dtype=dtype)
    return jnp.dot(one_hot, table.astype(dtype), precision=jax.lax.Precision.HIGHEST)
  return jnp.take(table, ids, axis=0).astype(dtype)


def self_attention(module: nn.Module, x_ble: Array, pack_ids_bl: Array | None, position_ids_bl: Array,
                   packed: bool, deterministic: bool, return_probs: bool,
                   query_positions_bq: Array | None,
                   head_mask_h: Array | None = None) -> tuple[Array | tuple[Array, Array], Array | None]:
  """`encoder.SelfAttention`'s computation, called from its compact `__call__` (`module`): the projections are
  its children "query", "key", "value" and "output"; `head_mask_h` gates the heads (`encoder.gate_heads`).
  Post-LN the output is (output without its bias, that bias) for `residual_layer_norm`."""
  cfg = module.config
  heads, head_dim = module.heads, cfg.head_dim
  projections = {n: Projection(cfg, (heads, head_dim), ("embed", "heads", "kv"), name=n)
                 for n in ("query", "key", "value")}
  dropout_rng = None
  if not deterministic and cfg.attention_dropout > 0:
    dropout_rng = module.make_rng("dropout")
  impl = resolve_implementation("auto", dtype=cfg.compute_dtype, head_dim=head_dim,
                                dropout_active=dropout_rng is not None, return_probs=return_probs,
                                length=x_ble.shape[1], training=not deterministic)
  options = dict(pack_ids=pack_ids_bl, packed=packed, causal=cfg.causal, implementation=impl,
                 dropout_rate=cfg.attention_dropout, dropout_rng=dropout_rng, return_probs=return_probs)
  # (fp8: each projection multiplies in its own module, where Qwix's float8 rule finds it.)
  if impl == "flash" and cfg.position_embedding != "rotary" and query_positions_bq is None and not cfg.fp8:
    # One [E, H * 3 * D] GEMM in the flash kernels' layout, which they read in place; its backward is one GEMM too.
    weights = {n: projection(x_ble, weights_only=True) for n, projection in projections.items()}
    kernel = flash_attention.fuse_qkv(*(weights[n][0] for n in ("query", "key", "value")))
    bias = flash_attention.fuse_qkv(*(weights[n][1] for n in ("query", "key", "value")))
    width = x_ble.shape[-1]
    qkv = jnp.dot(x_ble.astype(cfg.compute_dtype).reshape(-1, width), kernel.reshape(width, -1))
    qkv_blh3d = qkv.reshape(*x_ble.shape[:2], heads, 3, head_dim)
    qkv_blh3d = nn.with_logical_constraint(qkv_blh3d, ("batch", "length", "heads", None, "kv"))
    # The bias is added by `fused_self_attention`: the flash kernels sum its gradient as they write d(qkv).
    out_blhd, probs = fused_self_attention(qkv_blh3d, bias_h3d=bias, **options)
  else:
    x_bqe = x_ble if query_positions_bq is None else gather_positions(x_ble, query_positions_bq)
    q_blhd, v_blhd = projections["query"](x_bqe), projections["value"](x_ble)
    # The key bias only matters where rotary positions rotate it (`flash_attention.add_qkv_bias`).
    k_blhd = projections["key"](x_ble, train_bias=cfg.position_embedding == "rotary")
    q_blhd, k_blhd, v_blhd = position_and_constrain(cfg, q_blhd, k_blhd, v_blhd, position_ids_bl, query_positions_bq)
    out_blhd, probs = dot_product_attention(q_blhd, k_blhd, v_blhd, query_positions=query_positions_bq, **options)
  output = Projection(cfg, (cfg.hidden_size,), ("heads", "kv", "embed"), contract=2, name="output")
  return output(gate_heads(out_blhd, head_mask_h), add_bias=cfg.norm == "pre"), probs


def feed_forward(module: nn.Module, x_ble: Array) -> Array | tuple[Array, Array]:
  """`encoder.FeedForward`'s computation, called from its compact `__call__`: children "wi" ("wi_gate"), "wo".
  Post-LN the output is (output without the "wo" bias, that bias) for `residual_layer_norm`."""
  cfg = module.config
  add_bias = cfg.norm == "pre"
  act = activation(cfg.hidden_act)
  if cfg.ffn == "geglu":
    h_blf = act(dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi_gate")(x_ble))
    h_blf = h_blf * dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble)
  elif cfg.hidden_act == "gelu" and not cfg.fp8:  # (fp8: as the projections in `self_attention`)
    wi, bi = dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble, weights_only=True)
    x_ble = x_ble.astype(cfg.compute_dtype)
    if ffn_kernel.applies(x_ble, wi):  # both projections, the GELU in the GEMM kernels
      h_shape = jax.ShapeDtypeStruct((*x_ble.shape[:-1], cfg.intermediate_size), wi.dtype)
      wo, bo = dense(cfg, cfg.hidden_size, ("mlp", "embed"), "wo")(h_shape, weights_only=True)
      y_ble = ops.gelu_feed_forward(x_ble, wi, bi, wo)
      return ops.bias_add(y_ble, bo) if add_bias else (y_ble, bo)
    h_blf = ops.gelu(ops.bias_add(jnp.dot(x_ble, wi), bi))
  else:
    h_blf = act(dense(cfg, cfg.intermediate_size, ("embed", "mlp"), "wi")(x_ble))
  h_blf = nn.with_logical_constraint(h_blf, ("batch", "length", "mlp"))
  return dense(cfg, cfg.hidden_size, ("mlp", "embed"), "wo")(h_blf, add_bias=add_bias)
