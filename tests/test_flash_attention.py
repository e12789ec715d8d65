"""The Pallas flash-attention kernels, run in Pallas' interpreter on CPU, against a float32 reference.

The reference is plain softmax attention with the same hashed dropout mask
(`flash_attention.keep_mask`), so outputs and gradients must agree to float32
rounding; on a GPU, tests/test_attention_gpu.py checks the compiled kernels in
bfloat16. Also checked: the sharded call (shard_map over batch and heads with
global mask indices) equals the unsharded one.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import attention
from bert_jax.kernels import flash_attention as fa
from bert_jax.kernels.attention import dot_product_attention, self_attention
from bert_jax.parallel.sharding import DEFAULT_RULES


def reference(q, k, v, pack, seeds, rate, causal):
  batch, length, heads, head_dim = q.shape
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(head_dim)
  allowed = (pack[:, :, None] == pack[:, None, :]) & (pack[:, None, :] > 0)
  if causal:
    allowed &= jnp.tril(jnp.ones((length, length), bool))
  allowed = allowed[:, None]
  p = jax.nn.softmax(jnp.where(allowed, s, -1e30), -1)
  p = jnp.where(allowed.any(-1, keepdims=True), p, 0.0)
  if rate > 0:
    p = jnp.where(fa.keep_mask(seeds, batch, heads, length, length, rate), p / (1 - rate), 0.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")


def inputs(batch=2, length=64, heads=2, head_dim=16, packed=True):
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, cotangent = (jax.random.normal(key, (batch, length, heads, head_dim), jnp.float32) for key in keys)
  # Row 0: one example then padding; row 1: two packed examples (one if not packed) then padding.
  pack = np.zeros((batch, length), np.int32)
  pack[0, :40] = 1
  pack[1, :20], pack[1, 20:50] = 1, 2 if packed else 1
  pack[2:] = pack[:2][np.arange(batch - 2) % 2]
  return q, k, v, cotangent, jnp.asarray(pack)


@pytest.mark.parametrize("rate,causal,packed", [(0.0, False, True), (0.1, False, True), (0.3, True, True),
                                                (0.0, False, False), (0.1, False, False), (0.3, True, False)])
@pytest.mark.slow
def test_kernels_match_reference(rate, causal, packed):
  # packed=False: pack ids 0 / 1, masked by the per-key bias alone (no per-pair compare in the kernels).
  q, k, v, cotangent, pack = inputs(packed=packed)
  rng = jax.random.key(5)
  seeds = fa.dropout_seeds(rng)
  flash = lambda q, k, v: fa.flash_attention(fa.fuse_qkv(q, k, v), pack_ids=pack, packed=packed,  # noqa: E731
                                             causal=causal, dropout_rate=rate, dropout_rng=rng, interpret=True)
  plain = lambda q, k, v: reference(q, k, v, pack, seeds, rate, causal)  # noqa: E731
  np.testing.assert_allclose(flash(q, k, v), plain(q, k, v), atol=2e-6)
  grads = [jax.grad(lambda *a, f=f: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2))(q, k, v) for f in (flash, plain)]
  for ours, expected in zip(*grads):
    np.testing.assert_allclose(ours, expected, atol=5e-6)
  # Padding query rows give zeros.
  np.testing.assert_array_equal(np.asarray(flash(q, k, v))[0, 40:], 0.0)


def test_xla_path_drops_the_same_probabilities():
  q, k, v, _, pack = inputs()
  rng = jax.random.key(9)
  outs = [dot_product_attention(q, k, v, pack_ids=pack, packed=True, implementation=impl, dropout_rate=0.2,
                                dropout_rng=rng)[0] for impl in ("flash", "xla")]
  np.testing.assert_allclose(outs[0], outs[1], atol=2e-6)


def test_sharded_call_equals_unsharded():
  q, k, v, cotangent, pack = inputs(batch=4, heads=4)
  rng = jax.random.key(2)

  def loss(q, k, v):
    out = fa.flash_attention(fa.fuse_qkv(q, k, v), pack_ids=pack, packed=True, dropout_rate=0.1, dropout_rng=rng,
                             interpret=True)
    return jnp.sum(out * cotangent), out

  (_, expected), expected_grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
  with mesh, nn.logical_axis_rules(DEFAULT_RULES):
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  np.testing.assert_allclose(out, expected, atol=2e-6)
  for ours, want in zip(grads, expected_grads):
    np.testing.assert_allclose(ours, want, atol=5e-6)


def test_self_attention_splits_the_fused_projections_for_the_other_implementations():
  q, k, v, _, pack = inputs()
  rng = jax.random.key(4)
  qkv = fa.fuse_qkv(q, k, v)
  np.testing.assert_array_equal(np.stack(fa.split_qkv(qkv)), np.stack([q, k, v]))
  fused, _ = self_attention(qkv, pack_ids=pack, packed=True, implementation="xla", dropout_rate=0.1, dropout_rng=rng)
  apart, _ = dot_product_attention(q, k, v, pack_ids=pack, packed=True, implementation="xla", dropout_rate=0.1,
                                   dropout_rng=rng)
  np.testing.assert_array_equal(np.asarray(fused), np.asarray(apart))


def test_auto_picks_flash_for_training_and_cudnn_for_forward_only_passes(monkeypatch):
  monkeypatch.setattr(attention, "_backend", lambda: "gpu")
  pick = functools.partial(attention.resolve_implementation, "auto", head_dim=64, return_probs=False, length=128)
  assert pick(dtype=jnp.bfloat16, dropout_active=True, training=True) == "flash"
  assert pick(dtype=jnp.bfloat16, dropout_active=False, training=True) == "flash"  # ALBERT: no attention dropout
  assert pick(dtype=jnp.bfloat16, dropout_active=False, training=False) == "cudnn"  # evaluation, inference
  assert pick(dtype=jnp.float32, dropout_active=False, training=True) == "xla"
  assert attention.resolve_implementation("auto", dtype=jnp.bfloat16, head_dim=48, dropout_active=False,
                                          return_probs=False, length=128, training=True) == "cudnn"
  assert pick(dtype=jnp.bfloat16, dropout_active=False, training=True, return_probs=True) == "xla"
  monkeypatch.setattr(attention, "_backend", lambda: "cpu")
  assert pick(dtype=jnp.bfloat16, dropout_active=True, training=True) == "xla"


def test_add_qkv_bias_trains_the_query_and_value_slots_only():
  """The fused bias's value is ops.bias_add's; its gradient is the float32 row sum of the query and value slots
  and exactly 0 in the key slot (a per-query shift of the scores: no effect on the output)."""
  from bert_jax.kernels import ops
  heads, head_dim = 3, 8
  qkv = jax.random.normal(jax.random.key(0), (2, 5, heads * 3 * head_dim), jnp.bfloat16)
  bias = jax.random.normal(jax.random.key(1), (heads, 3, head_dim), jnp.float32)
  cotangent = jax.random.normal(jax.random.key(2), qkv.shape, jnp.bfloat16)
  out, vjp = jax.vjp(fa.add_qkv_bias, qkv, bias)
  want, want_vjp = jax.vjp(ops.bias_add, qkv, bias.reshape(-1))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  (d_qkv, d_bias), (want_qkv, want_bias) = vjp(cotangent), want_vjp(cotangent)
  np.testing.assert_array_equal(np.asarray(d_qkv, np.float32), np.asarray(want_qkv, np.float32))
  want_bias = np.asarray(want_bias).reshape(heads, 3, head_dim)
  for slot in (fa.QUERY, fa.VALUE):
    np.testing.assert_array_equal(np.asarray(d_bias)[:, slot], want_bias[:, slot])
  assert not np.any(np.asarray(d_bias)[:, fa.KEY]) and np.all(want_bias[:, fa.KEY] != 0)


@pytest.mark.parametrize("mesh_shape", [None, (2, 2, 2)])
def test_bias_gradient_is_summed_by_the_kernels(mesh_shape):
  """flash_attention(bias_h3d=) equals add_qkv_bias followed by the reference, in value and in both gradients:
  the query and value slots' sums come from the backward kernels' tiles (and, on a mesh, from every shard's),
  the key slot's is exactly 0."""
  q, k, v, cotangent, pack = inputs(batch=4, heads=4)
  bias = jax.random.normal(jax.random.key(7), (4, 3, 16), jnp.float32)
  rng = jax.random.key(3)
  seeds = fa.dropout_seeds(rng)

  def flash(qkv, bias):
    out = fa.flash_attention(qkv, pack_ids=pack, packed=True, dropout_rate=0.1, dropout_rng=rng, bias_h3d=bias,
                             interpret=True)
    return jnp.sum(out * cotangent), out

  def plain(qkv, bias):
    out = reference(*fa.split_qkv(fa.add_qkv_bias(qkv, bias)), pack, seeds, 0.1, False)
    return jnp.sum(out * cotangent), out

  qkv = fa.fuse_qkv(q, k, v)
  (_, expected), (want_qkv, want_bias) = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(qkv, bias)
  run = jax.value_and_grad(flash, argnums=(0, 1), has_aux=True)
  if mesh_shape is None:
    (_, out), (d_qkv, d_bias) = run(qkv, bias)
  else:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(mesh_shape), ("data", "fsdp", "tensor"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
      (_, out), (d_qkv, d_bias) = jax.jit(run)(qkv, bias)
  np.testing.assert_allclose(out, expected, atol=2e-6)
  np.testing.assert_allclose(d_qkv, want_qkv, atol=5e-6)
  assert np.abs(np.asarray(want_bias)[:, fa.QUERY]).max() > 1.0  # a gradient worth comparing
  np.testing.assert_allclose(d_bias, want_bias, rtol=1e-6, atol=2e-5)
  assert not np.any(np.asarray(d_bias)[:, fa.KEY])


@pytest.mark.parametrize("impl,position", [("flash", "learned"), ("xla", "learned"), ("xla", "rotary")])
@pytest.mark.slow
def test_key_bias_is_trained_only_where_it_changes_the_scores(monkeypatch, impl, position):
  """The encoder's key-bias gradient with kernels: exactly 0 with learned positions (fused flash projections, forced
  here in Pallas' interpreter, or separate ones), a real gradient with rotary positions (which rotate the bias by
  key position)."""
  from bert_jax.kernels import layers
  from bert_jax.models import Encoder, ModelConfig
  resolve = layers.resolve_implementation
  monkeypatch.setattr(layers, "resolve_implementation", lambda _, **kw: resolve(impl, **kw))
  config = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                       max_position_embeddings=32, position_embedding=position,
                       hidden_dropout=0.0, attention_dropout=0.0)
  model = Encoder(config)
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  target = jax.random.normal(jax.random.key(2), (2, 16, 32))
  params = model.init(jax.random.key(0), ids)
  grads = jax.grad(lambda p: jnp.mean(model.apply(p, ids)["hidden"] * target))(params)
  leaves = {jax.tree_util.keystr(path): np.asarray(g) for path, g in jax.tree_util.tree_leaves_with_path(grads)}
  key_bias = [g for name, g in leaves.items() if "['key']['bias']" in name]
  query_bias = [g for name, g in leaves.items() if "['query']['bias']" in name]
  assert key_bias and all(np.any(g) for g in query_bias)
  assert all(np.any(g) for g in key_bias) == (position == "rotary")
