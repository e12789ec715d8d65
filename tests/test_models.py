"""Model zoo behaviour: sizes, masking semantics, options, heads."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.models import ElectraModel, Encoder, PretrainingModel, electra_generator_config, model_config
from bert_jax.models.model import Pooler
from bert_jax.models.recurrent import BiLSTM, flax_bilstm, params_from_flax
from bert_jax.tasks.finetune_model import FinetuneModel


def tiny(**overrides):
  base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
              max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
  base.update(overrides)
  return model_config("bert", "tiny", **base)


def count(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree))))


def assert_trees_close(actual, expected, rtol: float, atol: float) -> None:
  """Every leaf of `actual` close to the leaf at the same path of `expected` (boxed or not), the path named."""
  expected_leaves = dict(jax.tree_util.tree_leaves_with_path(nn.unbox(expected)))
  for path, leaf in jax.tree_util.tree_leaves_with_path(nn.unbox(actual)):
    np.testing.assert_allclose(leaf, expected_leaves[path], rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def encoder_params(cfg):
  ids = jnp.zeros((1, 8), jnp.int32)

  def init():
    params = Encoder(cfg).init(jax.random.key(0), ids)
    hidden = jnp.zeros((1, 8, cfg.hidden_size), cfg.compute_dtype)
    pooler = Pooler(cfg).init(jax.random.key(0), hidden)
    return params, pooler

  return jax.eval_shape(init)


@pytest.mark.parametrize("family,size,published_millions,precision", [
    ("bert", "base", 110, 1), ("bert", "large", 340, 1), ("albert", "base", 12, 1), ("albert", "large", 18, 1),
    ("electra", "small", 14, 1)])
def test_preset_parameter_counts_match_published(family, size, published_millions, precision):
  # Encoder + pooler, as the papers count. Published figures are rounded to
  # `precision` million; we accept 2% or that rounding, whichever is wider.
  encoder, pooler = encoder_params(model_config(family, size))
  total = (count(encoder) + count(pooler)) / 1e6
  tolerance = max(0.02 * published_millions, precision / 2 + 0.05)
  assert abs(total - published_millions) <= tolerance, total
  assert count(encoder) == model_config(family, size).num_params()


def test_bert_miniature_table():
  for layers in (2, 4, 6, 8, 10, 12):
    for hidden in (128, 256, 512, 768):
      cfg = model_config("bert", f"L{layers}-H{hidden}")
      assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size) == (
          layers, hidden, hidden // 64, 4 * hidden)
  assert model_config("bert", "mini").num_layers == 4 and model_config("bert", "mini").hidden_size == 256
  with pytest.raises(ValueError, match="unknown BERT size"):
    model_config("bert", "huge")
  with pytest.raises(ValueError, match="num_heads"):
    model_config("bert", "tiny", num_heads=3)
  with pytest.raises(ValueError, match="unknown ModelConfig fields"):
    model_config("bert", "tiny", hiden_size=3)


def run_encoder(cfg, ids, pack_ids=None, position_ids=None, packed=False, segment_ids=None, seed=0, **kwargs):
  model = Encoder(cfg)
  params = model.init(jax.random.key(seed), ids)
  return model.apply(params, ids, segment_ids, position_ids, pack_ids, packed=packed, **kwargs)


@pytest.mark.slow
def test_packed_rows_equal_each_segment_alone():
  cfg = tiny()
  rng = np.random.default_rng(0)
  a, b = rng.integers(5, 97, 7), rng.integers(5, 97, 5)
  packed_ids = np.zeros((1, 16), np.int32)
  packed_ids[0, :7], packed_ids[0, 7:12] = a, b
  pack_ids = np.zeros((1, 16), np.int32)
  pack_ids[0, :7], pack_ids[0, 7:12] = 1, 2
  positions = np.zeros((1, 16), np.int32)
  positions[0, :7], positions[0, 7:12] = np.arange(7), np.arange(5)
  out = run_encoder(cfg, jnp.asarray(packed_ids), jnp.asarray(pack_ids), jnp.asarray(positions), packed=True)["hidden"]
  alone_a = run_encoder(cfg, jnp.asarray(a[None]))["hidden"]
  alone_b = run_encoder(cfg, jnp.asarray(b[None]))["hidden"]
  np.testing.assert_allclose(out[0, :7], alone_a[0], atol=1e-5)
  np.testing.assert_allclose(out[0, 7:12], alone_b[0], atol=1e-5)


def test_padding_does_not_change_real_tokens():
  cfg = tiny()
  ids = np.random.default_rng(1).integers(5, 97, (1, 10)).astype(np.int32)
  padded = np.concatenate([ids, np.zeros((1, 6), np.int32)], axis=1)
  pack = (np.arange(16) < 10).astype(np.int32)[None]
  out_padded = run_encoder(cfg, jnp.asarray(padded), jnp.asarray(pack))["hidden"]
  out_alone = run_encoder(cfg, jnp.asarray(ids))["hidden"]
  np.testing.assert_allclose(out_padded[0, :10], out_alone[0], atol=1e-5)


def test_causal_mode_never_looks_right():
  cfg = tiny(causal=True)
  ids = np.random.default_rng(2).integers(5, 97, (2, 12)).astype(np.int32)
  changed = ids.copy()
  changed[:, 6:] = np.random.default_rng(3).integers(5, 97, (2, 6))
  out = run_encoder(cfg, jnp.asarray(ids))["hidden"]
  out_changed = run_encoder(cfg, jnp.asarray(changed))["hidden"]
  np.testing.assert_allclose(out[:, :6], out_changed[:, :6], atol=1e-6)
  assert not np.allclose(out[:, 6:], out_changed[:, 6:], atol=1e-3)
  # The bidirectional model does look right.
  bi, bi_changed = (run_encoder(tiny(), jnp.asarray(x))["hidden"] for x in (ids, changed))
  assert not np.allclose(bi[:, :6], bi_changed[:, :6], atol=1e-3)


@pytest.mark.slow
def test_causal_classifier_pools_the_last_real_token():
  """A left-to-right encoder's [CLS] sees only itself: its classifier must read the last real token instead."""
  cfg = tiny(causal=True)
  model = FinetuneModel(cfg, "classification", num_labels=3)
  ids = np.random.default_rng(4).integers(5, 97, (2, 10)).astype(np.int32)
  lengths = np.array([10, 7])
  pack_ids = (np.arange(10)[None] < lengths[:, None]).astype(np.int32)
  params = model.init(jax.random.key(0), jnp.asarray(ids), pack_ids=jnp.asarray(pack_ids))["params"]
  logits = model.apply({"params": params}, jnp.asarray(ids), pack_ids=jnp.asarray(pack_ids))
  # Independently: the encoder's hidden state at each row's last real token through the pooler and classifier.
  hidden = Encoder(cfg).apply({"params": params["encoder"]}, jnp.asarray(ids), pack_ids=jnp.asarray(pack_ids))["hidden"]
  last = hidden[np.arange(2), lengths - 1].astype(jnp.float32)
  head = nn.unbox(params["head"])
  pooled = np.tanh(last @ head["pooler"]["dense"]["kernel"] + head["pooler"]["dense"]["bias"])
  expected = pooled @ head["classifier"]["kernel"] + head["classifier"]["bias"]
  np.testing.assert_allclose(logits, expected, atol=1e-5)
  # A middle token changes the prediction (a [CLS]-pooled causal classifier would ignore it); padding does not.
  changed, padded = ids.copy(), ids.copy()
  changed[:, 3] = (changed[:, 3] + 1 - 5) % 92 + 5
  padded[1, 7:] = 0
  run = lambda x: model.apply({"params": params}, jnp.asarray(x), pack_ids=jnp.asarray(pack_ids))  # noqa: E731
  assert np.abs(run(changed) - logits).max() > 1e-6  # exactly 0 under [CLS] pooling
  np.testing.assert_allclose(run(padded)[1], logits[1], atol=1e-6)


def test_albert_sharing_and_factorised_embeddings():
  cfg = tiny(num_layers=4, num_shared_groups=1, embedding_size=16)
  params = Encoder(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  blocks = [k for k in params if k.startswith("block_")]
  assert blocks == ["block_0"]
  assert nn.unbox(params["embeddings"]["word_embeddings"]["embedding"]).shape == (97, 16)
  assert nn.unbox(params["embedding_projection"]["kernel"]).shape == (16, 32)
  two_groups = Encoder(tiny(num_layers=4, num_shared_groups=2)).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  assert sorted(k for k in two_groups["params"] if k.startswith("block_")) == ["block_0", "block_1"]


@pytest.mark.parametrize("embedding", [768, 128])
@pytest.mark.parametrize("groups,sublayers,published", [(0, "all", {768: 108, 128: 89}), (1, "all", {768: 31, 128: 12}),
                                                         (1, "attention", {768: 83, 128: 64}),
                                                         (1, "ffn", {768: 57, 128: 38})])
def test_albert_sharing_strategies_match_the_papers_parameter_counts(embedding, groups, sublayers, published):
  """ALBERT Table 4's ALBERT-base counts: not-shared, all-shared, shared-attention, shared-FFN."""
  cfg = model_config("albert", "base", embedding_size=embedding, num_shared_groups=groups, shared_sublayers=sublayers)
  encoder, pooler = encoder_params(cfg)
  total = (count(encoder) + count(pooler)) / 1e6
  assert abs(total - published[embedding]) <= max(0.02 * published[embedding], 0.55), total
  assert count(encoder) == cfg.num_params()


@pytest.mark.parametrize("sublayers", ["attention", "ffn"])
def test_a_shared_sublayer_is_one_set_of_weights_used_by_every_layer_of_its_group(sublayers):
  shared = tiny(num_layers=4, num_shared_groups=2, shared_sublayers=sublayers)
  ids = jnp.asarray(np.random.default_rng(5).integers(5, 97, (2, 8)).astype(np.int32))
  params = Encoder(shared).init(jax.random.key(0), ids)["params"]
  assert sorted(k for k in params if k.startswith("shared_")) == [f"shared_{sublayers}_0", f"shared_{sublayers}_1"]
  own = {"attention": "ffn", "ffn": "attention"}[sublayers]
  for layer in range(4):
    assert sorted(params[f"block_{layer}"]) == sorted([own, "attention_norm", "ffn_norm"])
  # The same model written out as four unshared blocks, each with a copy of its group's sub-layer.
  unshared = {k: v for k, v in params.items() if not k.startswith("shared_")}
  for layer in range(4):
    unshared[f"block_{layer}"] = {**params[f"block_{layer}"], sublayers: params[f"shared_{sublayers}_{layer // 2}"]}
  np.testing.assert_allclose(Encoder(shared).apply({"params": params}, ids)["hidden"],
                             Encoder(tiny(num_layers=4)).apply({"params": unshared}, ids)["hidden"], atol=1e-6)
  with pytest.raises(ValueError, match="num_shared_groups"):
    tiny(shared_sublayers=sublayers)
  with pytest.raises(ValueError, match="shared_sublayers"):
    tiny(num_shared_groups=1, shared_sublayers="embeddings")


def test_rotary_attention_is_translation_invariant():
  cfg = tiny(position_embedding="rotary", type_vocab_size=1)
  ids = jnp.asarray(np.random.default_rng(4).integers(5, 97, (1, 8)).astype(np.int32))
  base = run_encoder(cfg, ids, position_ids=jnp.arange(8)[None])["hidden"]
  shifted = run_encoder(cfg, ids, position_ids=jnp.arange(8)[None] + 13)["hidden"]
  np.testing.assert_allclose(base, shifted, atol=2e-5)
  params = Encoder(cfg).init(jax.random.key(0), ids)["params"]
  assert "position_embeddings" not in params["embeddings"]


@pytest.mark.parametrize("options", [dict(norm="pre"), dict(ffn="geglu"), dict(dtype="bfloat16"),
                                     dict(remat="full"), dict(hidden_act="gelu_tanh")])
@pytest.mark.slow
def test_options_run_with_float32_params(options):
  cfg = tiny(**options)
  ids = jnp.ones((2, 8), jnp.int32)
  model = Encoder(cfg)
  params = model.init(jax.random.key(0), ids)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(params)))
  out = model.apply(params, ids)["hidden"]
  assert out.dtype == cfg.compute_dtype and out.shape == (2, 8, 32)
  grads = jax.grad(lambda p: jnp.sum(model.apply(p, ids)["hidden"].astype(jnp.float32)))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(nn.unbox(grads)))


def test_attention_probabilities_returned_and_normalised():
  cfg = tiny()
  pack = jnp.asarray((np.arange(8) < 5).astype(np.int32)[None])
  out = run_encoder(cfg, jnp.ones((1, 8), jnp.int32), pack, output_attentions=True, output_hidden_states=True)
  assert len(out["attentions"]) == 2 and len(out["hidden_states"]) == 3
  probs = np.asarray(out["attentions"][0])
  assert probs.shape == (1, 4, 8, 8)
  np.testing.assert_allclose(probs[0, :, :5].sum(-1), 1.0, atol=1e-5)
  assert np.all(probs[0, :, :5, 5:] == 0)


def test_pretraining_heads_shapes():
  cfg = tiny()
  model = PretrainingModel(cfg, sentence_head=True, span_boundary_head=True)
  ids = jnp.ones((2, 12), jnp.int32)
  positions = jnp.array([[1, 2, 3], [4, 5, 0]])
  kwargs = dict(cls_positions=jnp.zeros((2, 1), jnp.int32), sbo_left=positions - 1, sbo_right=positions + 1,
                sbo_offsets=jnp.zeros_like(positions))
  params = model.init(jax.random.key(0), ids, positions, **kwargs)
  out = model.apply(params, ids, positions, **kwargs)
  assert out["mlm_logits"].shape == (2, 3, 97)
  assert out["sentence_logits"].shape == (2, 1, 2)
  assert out["sbo_logits"].shape == (2, 3, 97)


@pytest.mark.slow
def test_electra_shares_embeddings_and_labels_replacements():
  disc = tiny(embedding_size=16)
  gen = electra_generator_config(disc, 0.5)
  assert gen.hidden_size == 16 and gen.embed_dim == 16
  model = ElectraModel(disc, gen)
  ids = jnp.asarray(np.random.default_rng(5).integers(5, 97, (2, 10)).astype(np.int32))
  positions = jnp.array([[1, 3], [2, 0]])
  masked = ids.at[jnp.arange(2)[:, None], positions].set(4)
  rngs = {"params": jax.random.key(0), "sample": jax.random.key(1)}
  params = model.init(rngs, masked, positions, ids)
  assert "embeddings" in params["params"]
  assert "embeddings" not in params["params"]["generator"]
  assert "embeddings" not in params["params"]["discriminator"]
  out = model.apply(params, masked, positions, ids, rngs={"sample": jax.random.key(2)})
  assert out["rtd_logits"].shape == (2, 10)
  replaced = np.asarray(out["replaced"])
  assert not replaced[1, 0]  # unused slot at position 0 leaves [CLS] alone
  untouched = np.ones((2, 10), bool)
  untouched[0, [1, 3]] = untouched[1, 2] = False
  assert not replaced[untouched].any()


@pytest.mark.parametrize("kind,shape", [("classification", (2, 3)), ("regression", (2,)), ("tagging", (2, 8, 3)),
                                        ("multiple_choice", (2, 4))])
def test_finetune_heads(kind, shape):
  model = FinetuneModel(tiny(), kind, num_labels=3)
  ids = jnp.ones((2, 4, 8) if kind == "multiple_choice" else (2, 8), jnp.int32)
  params = model.init(jax.random.key(0), ids)
  assert model.apply(params, ids).shape == shape
  span = FinetuneModel(tiny(), "span")
  start, end = span.apply(span.init(jax.random.key(0), ids[:, :8] if ids.ndim == 2 else ids[:, 0]), ids.reshape(-1, 8))
  assert start.shape == end.shape == (ids.reshape(-1, 8).shape[0], 8)


@pytest.mark.parametrize("unroll", [1, 4])
@pytest.mark.slow
def test_bilstm_equals_flax_bidirectional_lstm(unroll):
  """Both directions in one scan = flax's two RNNs of OptimizedLSTMCell: outputs and gradients at real tokens of
  rows of lengths 9, 4 and 1 (the backward direction starts at each row's last real token), random biases."""
  x = jnp.asarray(np.random.default_rng(5).normal(size=(3, 9, 7)), jnp.float32)
  lengths = jnp.array([9, 4, 1])
  reference, ours = flax_bilstm(5), BiLSTM(5, unroll)
  params = reference.init(jax.random.key(1), x, seq_lengths=lengths)["params"]
  params = jax.tree_util.tree_map_with_path(
      lambda path, leaf: jax.random.normal(jax.random.key(len(str(path))), leaf.shape) * 0.3
      if "bias" in str(path) else leaf, params)
  valid = (jnp.arange(9)[None, :] < lengths[:, None])[..., None]
  outputs = {"flax": lambda p: reference.apply({"params": p}, x, seq_lengths=lengths),
             "ours": lambda p: ours.apply({"params": params_from_flax(p)}, x, lengths)}
  with jax.default_matmul_precision("highest"):
    results = {name: jnp.where(valid, f(params), 0.0) for name, f in outputs.items()}
    grads = {name: jax.grad(lambda p, f=f: jnp.sum(jnp.where(valid, f(p), 0.0) ** 2))(params)
             for name, f in outputs.items()}
    whole_rows = ours.apply({"params": params_from_flax(params)}, x)
  np.testing.assert_allclose(results["ours"], results["flax"], atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads["ours"], grads["flax"])
  np.testing.assert_allclose(whole_rows[0], results["flax"][0], atol=1e-5)  # no lengths: every row is whole
  assert ours.init(jax.random.key(0), x)["params"]["input_kernel"].shape == (2, 7, 20)


@pytest.mark.parametrize("features, axes, contract, reference", [
    ((24,), (None, "embed"), 1, lambda: nn.Dense(24)),
    ((4, 6), ("embed", "heads", "kv"), 1, lambda: nn.DenseGeneral((4, 6))),
    ((16,), ("heads", "kv", "embed"), 2, lambda: nn.DenseGeneral(16, axis=(-2, -1))),
])
def test_projection_equals_flax_dense_with_the_same_parameters(features, axes, contract, reference):
  from bert_jax.kernels.layers import Projection
  config = model_config("bert", "tiny", dtype="float32")
  shape = (2, 5, 16) if contract == 1 else (2, 5, 4, 4)
  x = jax.random.normal(jax.random.key(0), shape)
  ours = Projection(config, features, axes, contract=contract)
  params = nn.unbox(ours.init(jax.random.key(1), x))
  params = jax.tree.map(lambda p: p + 0.1, params)  # a nonzero bias
  np.testing.assert_allclose(ours.apply(params, x), reference().apply(params, x), rtol=1e-6, atol=1e-6)
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(ours.apply(p, x))))(params)
  expected = jax.grad(lambda p: jnp.sum(jnp.sin(reference().apply(p, x))))(params)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fused_qkv_flash_path_equals_the_xla_path(monkeypatch):
  """Where the flash kernels apply (forced here: Pallas' interpreter on CPU), Q/K/V are one fused GEMM read in place
  by the kernels; the XLA form projects them separately. Same parameters, same dropout masks: same outputs and
  gradients."""
  from bert_jax.kernels import flash_attention, layers
  fused_shapes = []
  fuse = flash_attention.fuse_qkv
  monkeypatch.setattr(flash_attention, "fuse_qkv", lambda *a: fused_shapes.append(a[0].shape) or fuse(*a))
  resolve = layers.resolve_implementation
  ids = jnp.asarray(np.random.default_rng(3).integers(5, 97, (2, 16)), jnp.int32)
  pack = jnp.asarray([[1] * 16, [1] * 9 + [2] * 4 + [0] * 3], jnp.int32)
  results = []
  for impl in ("flash", "xla"):
    monkeypatch.setattr(layers, "resolve_implementation", lambda _, impl=impl, **kw: resolve(impl, **kw))
    cfg = tiny(hidden_size=64, num_heads=4, intermediate_size=128, attention_dropout=0.2, dtype="float32")
    model = Encoder(cfg)
    params = model.init(jax.random.key(0), ids)

    def loss(params, model=model):
      hidden = model.apply(params, ids, pack_ids=pack, packed=True, deterministic=False,
                           rngs={"dropout": jax.random.key(1)})["hidden"]
      return jnp.sum(jnp.sin(hidden)), hidden

    results.append(jax.value_and_grad(loss, has_aux=True)(params))
  # The flash run fused the weights [E, H, D] and biases [H, D] of every layer, never activations.
  assert fused_shapes and set(fused_shapes) == {(64, 4, 16), (4, 16)}
  ((_, flash_hidden), flash_grads), ((_, xla_hidden), xla_grads) = results
  np.testing.assert_allclose(flash_hidden, xla_hidden, atol=2e-5)
  assert jax.tree.structure(flash_grads) == jax.tree.structure(xla_grads)
  assert_trees_close(flash_grads, xla_grads, rtol=1e-5, atol=5e-5)  # float32 rounding


@pytest.mark.parametrize("layer_norm_kernel", [False, True])
@pytest.mark.slow
def test_post_ln_block_adding_the_output_biases_in_its_layer_norms_equals_adding_them_in_the_projections(
    monkeypatch, layer_norm_kernel):
  """With kernels, the post-LN block hands its sublayers' output biases to the residual LayerNorms (so that the
  backward kernel sums their gradients); the values and every gradient are those of the block that adds them to the
  branches first (float32, dropout on: the same masks; the LayerNorm kernels in Pallas' interpreter or XLA)."""
  from bert_jax.kernels import ops
  from bert_jax.kernels.dropout import Dropout
  from bert_jax.models.model import FeedForward, SelfAttention, TransformerBlock, layer_norm
  if layer_norm_kernel:
    monkeypatch.setattr(ops, "use_kernel", lambda implementation: True)

  class BiasInProjections(nn.Module):
    config: object

    @nn.compact
    def __call__(self, x, position_ids, deterministic):
      cfg = self.config
      dropout = Dropout(cfg.hidden_dropout)
      attention_norm, ffn_norm = layer_norm(cfg, "attention_norm"), layer_norm(cfg, "ffn_norm")
      attention, ffn = SelfAttention(cfg, name="attention"), FeedForward(cfg, name="ffn")
      (attn, attn_bias), _ = attention(x, None, position_ids, False, deterministic, False)
      x = attention_norm(x, attn + attn_bias, dropout, deterministic)
      ffn_out, ffn_bias = ffn(x)
      return ffn_norm(x, ffn_out + ffn_bias, dropout, deterministic)

  cfg = tiny(hidden_size=128, intermediate_size=256, hidden_dropout=0.2, attention_dropout=0.1, dtype="float32")
  x = jax.random.normal(jax.random.key(0), (2, 16, 128))
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  block = TransformerBlock(cfg)
  params = block.init(jax.random.key(1), x, None, positions)
  for name in ("output", "wo"):  # nonzero output biases, so that adding them in the wrong place would show
    scope = params["params"]["attention" if name == "output" else "ffn"][name]
    scope["bias"] = nn.Partitioned(0.5 * jax.random.normal(jax.random.key(2), scope["bias"].value.shape),
                                   scope["bias"].names)
  rngs = {"dropout": jax.random.key(3)}

  def loss(params, module, call):
    out = call(module, params)
    return jnp.sum(jnp.sin(out) * jnp.arange(128.0)), out

  ours = jax.value_and_grad(loss, has_aux=True)(
      params, block, lambda m, p: m.apply(p, x, None, positions, deterministic=False, rngs=rngs)[0])
  expected = jax.value_and_grad(loss, has_aux=True)(
      params, BiasInProjections(cfg), lambda m, p: m.apply(p, x, positions, False, rngs=rngs))
  np.testing.assert_allclose(ours[0][1], expected[0][1], rtol=1e-5, atol=1e-5)
  assert_trees_close(ours[1], expected[1], rtol=1e-4, atol=1e-5)
  assert float(jnp.max(jnp.abs(nn.unbox(ours[1])["params"]["ffn"]["wo"]["bias"]))) > 0


def _sparse_vs_full(cfg, model_kwargs, ids, positions, rngs=None, **call_kwargs):
  """(outputs, gradients) of the pre-training model with and without `sparse_last_layer`, same parameters."""
  results = []
  for sparse in (True, False):
    model = PretrainingModel(cfg.replace(sparse_last_layer=sparse), **model_kwargs)
    params = model.init(jax.random.key(0), ids, positions, **call_kwargs)

    def loss(params, model=model):
      out = model.apply(params, ids, positions, rngs=rngs, deterministic=rngs is None, **call_kwargs)
      logits = {k: v for k, v in out.items() if k.endswith("_logits")}
      return sum(jnp.sum(jnp.sin(v.astype(jnp.float32))) for v in logits.values()), out

    results.append(jax.value_and_grad(loss, has_aux=True)(params))
  return results


@pytest.mark.parametrize("overrides,packed", [
    ({}, False), ({"norm": "pre", "position_embedding": "rotary"}, True), ({"num_shared_groups": 1}, False),
    ({"remat": "full", "causal": True}, True), ({"attention_dropout": 0.3}, True)])
@pytest.mark.slow
def test_sparse_last_layer_equals_the_full_model(overrides, packed):
  """`sparse_last_layer`: the last block computes only the heads' rows (MLM, [CLS], span boundaries); every head's
  logits and every gradient are the full model's (float32; attention dropout on draws the same masks)."""
  cfg = tiny(hidden_size=64, intermediate_size=128, dtype="float32", **overrides)
  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(5, 97, (2, 32)), jnp.int32)
  positions = jnp.asarray([[3, 7, 30, 0], [1, 12, 13, 0]], jnp.int32)
  pack = jnp.asarray([[1] * 20 + [2] * 12, [1] * 24 + [0] * 8], jnp.int32)
  kwargs = dict(pack_ids=pack, packed=packed, cls_positions=jnp.asarray([[0, 20], [0, 0]], jnp.int32),
                sbo_left=positions - 1, sbo_right=positions + 1, sbo_offsets=jnp.ones_like(positions))
  rngs = {"dropout": jax.random.key(7)} if overrides.get("attention_dropout") else None
  (sparse, sparse_grads), (full, full_grads) = _sparse_vs_full(
      cfg, dict(sentence_head=True, span_boundary_head=True), ids, positions, rngs, **kwargs)
  assert "hidden" not in sparse[1] and "hidden" in full[1]
  for name in ("mlm_logits", "sentence_logits", "sbo_logits"):
    np.testing.assert_allclose(sparse[1][name], full[1][name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert_trees_close(sparse_grads, full_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,overrides", [("classification", {}), ("regression", {"causal": True}),
                                             ("multiple_choice", {"norm": "pre"}), ("tagging", {})])
@pytest.mark.slow
def test_sparse_last_layer_of_a_finetuning_model_equals_the_full_model(kind, overrides):
  """The sentence-level heads read one row (the [CLS], or a left-to-right model's last real token): with
  `sparse_last_layer` the last block computes that row alone; logits and every gradient are the full model's
  (float32, padded rows). Tagging reads every row, so it is the full model."""
  cfg = tiny(hidden_size=64, intermediate_size=128, dtype="float32", **overrides)
  rng = np.random.default_rng(6)
  shape = (2, 3, 16) if kind == "multiple_choice" else (2, 16)
  ids = jnp.asarray(rng.integers(5, 97, shape), jnp.int32)
  pack = jnp.asarray(np.arange(16) < rng.integers(4, 17, shape[:-1])[..., None], jnp.int32)
  results = []
  for sparse in (True, False):
    model = FinetuneModel(cfg.replace(sparse_last_layer=sparse), kind, num_labels=3)
    params = model.init(jax.random.key(0), ids, pack_ids=pack)

    def loss(params, model=model):
      out = model.apply(params, ids, pack_ids=pack)
      return jnp.sum(jnp.sin(out)), out

    results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
  (sparse_out, sparse_grads), (full_out, full_grads) = results
  np.testing.assert_allclose(sparse_out[1], full_out[1], rtol=1e-5, atol=1e-5)
  assert_trees_close(sparse_grads, full_grads, rtol=1e-4, atol=1e-5)
  model = FinetuneModel(cfg.replace(sparse_last_layer=True), kind, num_labels=3)
  _, captured = model.apply(params, ids, pack_ids=pack, capture_intermediates=True)
  hidden = captured["intermediates"]["encoder"]["__call__"][0]["hidden"]
  assert hidden.shape[1] == (16 if kind == "tagging" else 1)  # the encoder's last block: one row, or every row


def test_sparse_last_layer_only_where_the_rows_are_at_most_half_the_sequence():
  from bert_jax.models.model import head_rows
  cfg = tiny(sparse_last_layer=True)
  mlm, cls = jnp.asarray([[5, 2, 9]]), jnp.asarray([[0]])
  rows, in_rows = head_rows(cfg, 8, {"mlm": mlm, "cls": cls})
  np.testing.assert_array_equal(rows, [[5, 2, 9, 0]])
  np.testing.assert_array_equal(in_rows["mlm"], [[0, 1, 2]])
  np.testing.assert_array_equal(in_rows["cls"], [[3]])
  assert head_rows(cfg, 7, {"mlm": mlm, "cls": cls})[0] is None       # 4 rows of 7: every position
  assert head_rows(cfg.replace(sparse_last_layer=False), 8, {"mlm": mlm})[0] is None


@pytest.mark.slow
def test_sparse_last_layer_electra_generator():
  """ELECTRA's generator reads only the masked positions; its sparse last block gives the same logits and
  replacements (argmax sampling)."""
  disc = tiny(embedding_size=16, dtype="float32")
  ids = jnp.asarray(np.random.default_rng(5).integers(5, 97, (2, 16)).astype(np.int32))
  positions = jnp.array([[1, 3], [2, 0]])
  outs = []
  for sparse in (True, False):
    d = disc.replace(sparse_last_layer=sparse)
    model = ElectraModel(d, electra_generator_config(d, 0.5))
    params = model.init({"params": jax.random.key(0), "sample": jax.random.key(1)}, ids, positions, ids)
    outs.append(model.apply(params, ids, positions, ids, sample=False))
  np.testing.assert_allclose(outs[0]["mlm_logits"], outs[1]["mlm_logits"], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(outs[0]["corrupted_ids"], outs[1]["corrupted_ids"])


@pytest.mark.parametrize("overrides, packed", [
    ({}, False), ({}, True), ({"norm": "pre"}, False), ({"causal": True}, True),
    ({"position_embedding": "rotary", "ffn": "geglu"}, True), ({"sparse_last_layer": True}, False),
    ({"embedding_size": 32, "num_shared_groups": 1, "num_layers": 3, "hidden_act": "gelu_tanh"}, False)])
@pytest.mark.slow
def test_kernels_auto_equals_the_plain_model(overrides, packed):
  """`kernels="auto"` (here the kernels' XLA forms and custom gradients) against the plain Flax model ("off"): the
  same parameter tree (names, shapes, logical axes), and with those parameters the same logits and gradients
  (float32, dropout off)."""
  cfg = tiny(hidden_size=64, num_heads=4, intermediate_size=128, hidden_dropout=0.0, attention_dropout=0.0,
             dtype="float32", **overrides)
  rng = np.random.default_rng(6)
  ids = jnp.asarray(rng.integers(5, 97, (2, 16)), jnp.int32)
  positions = jnp.asarray([[3, 7, 12], [1, 5, 9]], jnp.int32)
  pack = jnp.asarray([[1] * 9 + [2] * 5 + [0] * 2, [1] * 16] if packed else [[1] * 13 + [0] * 3, [1] * 16], jnp.int32)
  kwargs = dict(pack_ids=pack, packed=packed, cls_positions=jnp.asarray([[0, 9], [0, 0]], jnp.int32),
                sbo_left=positions - 1, sbo_right=positions + 1, sbo_offsets=jnp.ones_like(positions))
  models = {k: PretrainingModel(cfg.replace(kernels=k), span_boundary_head=True) for k in ("auto", "off")}
  boxed = {k: m.init(jax.random.key(0), ids, positions, **kwargs) for k, m in models.items()}
  axes = {k: jax.tree.map(lambda p: (p.value.shape, p.names), v, is_leaf=lambda p: isinstance(p, nn.Partitioned))
          for k, v in boxed.items()}
  assert axes["auto"] == axes["off"]
  params = nn.unbox(boxed["off"])

  def loss(params, model):
    out = model.apply(params, ids, positions, **kwargs)
    logits = [out[name].astype(jnp.float32) for name in ("mlm_logits", "sentence_logits", "sbo_logits")]
    return sum(jnp.sum(jnp.sin(v[..., :97])) for v in logits), logits

  (_, fast), fast_grads = jax.value_and_grad(loss, has_aux=True)(params, models["auto"])
  (_, plain), plain_grads = jax.value_and_grad(loss, has_aux=True)(params, models["off"])
  for a, b in zip(fast, plain):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain_grads))
  # The key bias's exact gradient is 0 (softmax ignores a per-query constant); the plain model's is rounding.
  assert_trees_close(fast_grads, plain_grads, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.slow
def test_plain_model_imports_no_kernels():
  """`kernels="off"` builds and runs the model without importing `bert_jax.kernels`."""
  import os
  import subprocess
  import sys
  code = ("import sys, jax, jax.numpy as jnp\n"
          "from bert_jax.models import PretrainingModel, model_config\n"
          "cfg = model_config('bert', 'L2-H64', vocab_size=50, kernels='off', max_position_embeddings=16)\n"
          "ids = jnp.ones((2, 8), jnp.int32)\n"
          "model = PretrainingModel(cfg)\n"
          "rngs = {'params': jax.random.key(0), 'dropout': jax.random.key(1)}\n"
          "v = model.init(rngs, ids, ids[:, :2], deterministic=False)\n"
          "model.apply(v, ids, ids[:, :2], deterministic=False, rngs={'dropout': jax.random.key(2)})\n"
          "assert not [m for m in sys.modules if m.startswith('bert_jax.kernels')], sorted(sys.modules)\n")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "JAX_PLATFORMS": "cpu"})
