"""Train step: gradient accumulation, data/FSDP/tensor sharding equivalence, non-finite guard, optimizers."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bert_jax.models import model_config
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import config_lib, objectives, optim
from bert_jax.train.step import Partitioning, create_state, make_train_step

VOCAB, SEQ, ROWS = 101, 32, 16


def synthetic_batch(rows=ROWS, seq=SEQ, packs=1, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, VOCAB, (rows, seq)).astype(np.int32)
  lengths = rng.integers(seq // 2, seq + 1, rows)
  pack_ids = (np.arange(seq)[None] < lengths[:, None]).astype(np.int32)
  ids[:, 0] = 2
  ids[np.arange(rows), lengths - 1] = 3
  ids[pack_ids == 0] = 0
  special = ((ids == 2) | (ids == 3) | (pack_ids == 0)).astype(np.int32)
  segment = (np.arange(seq)[None] >= (lengths // 2)[:, None]).astype(np.int32) * pack_ids
  return {"input_ids": ids, "segment_ids": segment,
          "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
          "pack_ids": pack_ids, "word_starts": (rng.random((rows, seq)) < 0.7).astype(np.int32) | special,
          "special_mask": special, "cls_positions": np.zeros((rows, packs), np.int32),
          "sentence_labels": rng.integers(0, 2, (rows, packs)).astype(np.int32),
          "sentence_weights": np.ones((rows, packs), np.float32),
          "example_ids": np.arange(rows, dtype=np.int32) + 1000 * seed, "epoch": np.zeros(rows, np.int32)}


def make_config(objective="mlm+nsp", **train):
  config = config_lib.pretrain_defaults()
  config.objective = objective
  config.optim.warmup_steps = 2
  config.optim.lr = 5e-3
  config.masking.max_predictions = 6
  config.train.batch_size = ROWS
  for key, value in train.items():
    config.train[key] = value
  return config


def tiny_model(**overrides):
  fields = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                max_position_embeddings=64)
  fields.update(overrides)
  return model_config("bert", "tiny", **fields)


def build(objective_name="mlm+nsp", mesh_sizes=None, accum_steps=1, dropout=0.0, model_overrides=None,
          param_norms=False, steps_per_call=1):
  config = make_config(objective_name, accum_steps=accum_steps)
  model_cfg = tiny_model(hidden_dropout=dropout, attention_dropout=dropout, **(model_overrides or {}))
  objective = objectives.make_objective(config, model_cfg, mask_id=4)
  tx, schedule = optim.make_optimizer(config.optim, total_steps=100)
  mesh = sharding_lib.create_mesh(mesh_sizes or {"data": 1}, devices=jax.devices()[: _product(mesh_sizes)])
  partitioning = Partitioning(mesh, sharding_lib.DEFAULT_RULES)
  dummy = {k: jnp.asarray(v) for k, v in synthetic_batch().items()}
  state, shardings = create_state(lambda key: objective.init_variables(key, dummy), tx, jax.random.key(0),
                                  partitioning)
  step = make_train_step(objective, tx, schedule, accum_steps=accum_steps, rng=jax.random.key(1),
                         partitioning=partitioning, state_shardings=shardings, param_norms=param_norms,
                         steps_per_call=steps_per_call)
  return state, step, mesh, objective, partitioning, shardings


def _product(sizes):
  return int(np.prod(list((sizes or {"data": 1}).values())))


def run_steps(state, step, mesh, batches):
  losses = []
  for batch in batches:
    state, metrics = step(state, sharding_lib.global_batch(batch, mesh))
    losses.append(float(metrics["loss"]))
  return state, losses


@pytest.mark.slow
def test_gradient_accumulation_equals_direct_step():
  batches = [synthetic_batch(seed=s) for s in range(3)]
  direct_state, direct_step, mesh, *_ = build(accum_steps=1)
  accum_state, accum_step, _, *_ = build(accum_steps=4)
  direct_state, direct_losses = run_steps(direct_state, direct_step, mesh, batches)
  accum_state, accum_losses = run_steps(accum_state, accum_step, mesh, batches)
  np.testing.assert_allclose(direct_losses, accum_losses, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(direct_state.params), jax.tree.leaves(accum_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


# The scan is objective-agnostic: ELECTRA's generator samples and SBO's span targets take the same keys through a
# call as through single steps. SBO's case also shards over 8 devices and accumulates; the plain MLM + NSP step's
# calls are the trainer's (tests/test_trainer.py).
@pytest.mark.parametrize("objective_name,mesh_sizes,accum_steps", [("rtd", None, 1), ("mlm+sbo", {"data": 8}, 2)])
@pytest.mark.slow
def test_several_steps_per_call_equal_single_steps(objective_name, mesh_sizes, accum_steps):
  """A call of 3 steps over 3 batches (with dropout; sharded and with accumulation in one case) gives the 3 single
  steps' state and metrics, one entry a step, and takes the step's random keys from the state's step as they do."""
  batches = [synthetic_batch(seed=s) for s in range(3)]
  settings = dict(mesh_sizes=mesh_sizes, dropout=0.1, accum_steps=accum_steps)
  single_state, single_step, mesh, *_ = build(objective_name, **settings)
  multi_state, multi_step, *_ = build(objective_name, steps_per_call=3, **settings)
  singles = []
  for batch in batches:
    single_state, metrics = single_step(single_state, sharding_lib.global_batch(batch, mesh))
    singles.append(jax.device_get(metrics))
  multi_state, multi_metrics = multi_step(multi_state, [sharding_lib.global_batch(b, mesh) for b in batches])
  multi_metrics = jax.device_get(multi_metrics)
  assert int(multi_state.step) == 3 and multi_metrics.keys() == singles[0].keys()
  for key, values in multi_metrics.items():
    np.testing.assert_allclose(values, [m[key] for m in singles], rtol=2e-5, atol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(single_state), jax.tree.leaves(multi_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)
  with pytest.raises(ValueError, match="takes 3 batches a call"):
    multi_step(multi_state, [sharding_lib.global_batch(batches[0], mesh)])


@pytest.mark.slow
def test_padded_vocabulary_losses_and_gradients_equal_the_exact_ones():
  """`vocab_pad_multiple`: the MLM and SBO heads compute 128 logits for the 101 words; the losses, accuracies and
  gradients (parameters of the same shapes) are the unpadded model's."""
  import flax.linen as nn
  config = make_config("mlm+sbo")
  exact = objectives.make_objective(config, tiny_model(), mask_id=4)
  padded = objectives.make_objective(config, tiny_model(vocab_pad_multiple=128), mask_id=4)
  inputs = exact.prepare({k: jnp.asarray(v) for k, v in synthetic_batch().items()})
  params = nn.unbox(exact.init_variables(jax.random.key(0), synthetic_batch()))["params"]
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(
      jnp.shape, nn.unbox(padded.init_variables(jax.random.key(0), synthetic_batch()))["params"])

  def loss(objective, params):
    out = objective.forward(params, inputs, None, train=False)
    return out["mlm_loss"] + out["sbo_loss"], out

  grad = lambda objective: jax.jit(jax.value_and_grad(functools.partial(loss, objective), has_aux=True))  # noqa: E731
  (exact_loss, exact_out), exact_grads = grad(exact)(params)
  (padded_loss, padded_out), padded_grads = grad(padded)(params)
  for key in exact_out:
    np.testing.assert_allclose(padded_out[key], exact_out[key], rtol=1e-6, err_msg=key)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(exact_grads), jax.tree.leaves(padded_grads)):
    name = jax.tree_util.keystr(path)
    if "['key']['bias']" in name:  # softmax ignores a per-query shift of the scores: not trained
      assert not np.any(a) and not np.any(b), name
      continue
    scale = float(np.max(np.abs(a)))  # float32 sums in another order: rounding relative to the leaf
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * scale, err_msg=name)


def test_cross_entropy_kernel_losses_and_gradients_equal_xla(monkeypatch):
  """The cross-entropy kernel (forced, in Pallas' interpreter here): the MLM and SBO losses' statistics from the
  kernel, over a vocabulary padded to 4096 logits (the kernel's narrowest rows), equal the XLA form's with
  gradients."""
  import flax.linen as nn

  from bert_jax.kernels import cross_entropy as cross_entropy_kernel
  config = make_config("mlm+sbo")
  objective = objectives.make_objective(config, tiny_model(vocab_pad_multiple=4096), mask_id=4)
  inputs = objective.prepare({k: jnp.asarray(v) for k, v in synthetic_batch().items()})
  params = nn.unbox(objective.init_variables(jax.random.key(0), synthetic_batch()))["params"]

  def loss(params):
    out = objective.forward(params, inputs, None, train=False)
    return out["mlm_loss"] + out["sbo_loss"], out

  grad = lambda: jax.value_and_grad(lambda p: loss(p), has_aux=True)  # noqa: E731 (a new function: traced again)
  assert "pallas_call" not in str(jax.make_jaxpr(grad())(params))
  (_, xla_out), xla_grads = jax.jit(grad())(params)
  monkeypatch.setattr(cross_entropy_kernel, "use_kernel", lambda: True)
  assert "pallas_call" in str(jax.make_jaxpr(grad())(params))
  (_, kernel_out), kernel_grads = jax.jit(grad())(params)
  for key in xla_out:
    np.testing.assert_allclose(kernel_out[key], xla_out[key], rtol=1e-6, err_msg=key)
  for a, b in zip(jax.tree.leaves(xla_grads), jax.tree.leaves(kernel_grads)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(a))))


def test_cross_entropy_sums_plain_and_auto_equal_the_formula():
  """`losses.cross_entropy_sums`: "off" (optax) and "auto" (the kernels' seam) give the weighted sums of
  logsumexp - target logit and of correct argmaxes, with the same gradients; a typo names the key."""
  from bert_jax.train import losses
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(6, 130)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 130, size=6), jnp.int32)
  weights = jnp.asarray([1.0, 1.0, 0.0, 1.0, 0.5, 1.0], jnp.float32)
  token_loss = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[:, None], -1)[:, 0]
  want = (jnp.sum(token_loss * weights), jnp.sum((jnp.argmax(logits, -1) == targets) * weights))
  grads = {}
  for kernels in ("off", "auto"):
    got = losses.cross_entropy_sums(logits, targets, weights, kernels)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, err_msg=kernels)
    grads[kernels] = jax.grad(lambda l: losses.cross_entropy_sums(l, targets, weights, kernels)[0])(logits)
  np.testing.assert_allclose(grads["auto"], grads["off"], rtol=1e-5, atol=1e-7)
  with pytest.raises(ValueError, match="kernels='of'"):
    losses.cross_entropy_sums(logits, targets, weights, "of")


@pytest.mark.slow
def test_padded_vocabulary_logits_and_electra_samples():
  from bert_jax.models import ElectraModel, PretrainingModel, electra_generator_config
  cfg = tiny_model(vocab_pad_multiple=64)
  assert cfg.padded_vocab_size == 128 and tiny_model(vocab_pad_multiple=101).padded_vocab_size == 101
  ids, positions = jnp.full((2, 12), 7, jnp.int32), jnp.array([[1, 2, 3], [4, 5, 0]])
  padded = PretrainingModel(cfg, sentence_head=False)
  exact = PretrainingModel(cfg.replace(vocab_pad_multiple=1), sentence_head=False)
  params = exact.init(jax.random.key(0), ids, positions)
  logits = padded.apply(params, ids, positions)["mlm_logits"]
  assert logits.shape == (2, 3, 128) and np.all(np.asarray(logits[..., 101:]) < -1e8)
  np.testing.assert_allclose(logits[..., :101], exact.apply(params, ids, positions)["mlm_logits"], rtol=1e-6)
  with pytest.raises(ValueError, match="vocab_pad_multiple"):
    tiny_model(vocab_pad_multiple=0)
  # ELECTRA's generator samples from the vocabulary's logits only: the same replacements with the padding.
  outs = []
  for multiple in (1, 64):
    disc = cfg.replace(vocab_pad_multiple=multiple)
    electra = ElectraModel(disc, electra_generator_config(disc, 0.5))
    rngs = {"params": jax.random.key(0), "sample": jax.random.key(1)}
    variables = electra.init(rngs, ids, positions, ids)
    outs.append(electra.apply(variables, ids, positions, ids, rngs={"sample": jax.random.key(1)}))
  assert outs[1]["mlm_logits"].shape[-1] == 128
  np.testing.assert_array_equal(outs[0]["corrupted_ids"], outs[1]["corrupted_ids"])
  assert np.any(np.asarray(outs[0]["replaced"]))


@pytest.mark.slow
def test_param_norms_are_those_of_the_parameters_before_and_the_update():
  state, step, mesh, *_ = build(param_norms=True)
  before = jax.tree.map(np.asarray, state.params)
  after, metrics = step(state, sharding_lib.global_batch(synthetic_batch(), mesh))
  norm = lambda tree: np.sqrt(sum(np.sum(np.square(x.astype(np.float64))) for x in jax.tree.leaves(tree)))  # noqa: E731
  np.testing.assert_allclose(float(metrics["param_norm"]), norm(before), rtol=1e-5)
  update = jax.tree.map(lambda new, old: np.asarray(new, np.float64) - old, after.params, before)
  np.testing.assert_allclose(float(metrics["update_norm"]), norm(update), rtol=1e-3)
  # Off by default: not computed.
  plain_state, plain_step, *_ = build()
  assert "param_norm" not in plain_step(plain_state, sharding_lib.global_batch(synthetic_batch(), mesh))[1]


@functools.cache  # the reference of several tests: computed once a process
def single_device_losses():
  state, step, mesh, *_ = build()
  return tuple(run_steps(state, step, mesh, [synthetic_batch(seed=s) for s in range(2)])[1])


@pytest.mark.parametrize("mesh_sizes", [{"data": 8}, {"fsdp": 8}, {"data": 2, "fsdp": 2, "tensor": 2}])
@pytest.mark.slow
def test_sharded_steps_equal_single_device(mesh_sizes):
  batches = [synthetic_batch(seed=s) for s in range(2)]
  single_losses = single_device_losses()
  sharded_state, sharded_step, mesh, *_ = build(mesh_sizes=mesh_sizes)
  sharded_state, sharded_losses = run_steps(sharded_state, sharded_step, mesh, batches)
  np.testing.assert_allclose(single_losses, sharded_losses, rtol=2e-5)
  if "fsdp" in mesh_sizes or "tensor" in mesh_sizes:
    shardings = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(sharded_state.params)}
    assert any(axis in spec for spec in shardings for axis in mesh_sizes), shardings


@pytest.mark.parametrize("mesh_sizes", [{"data": 4}, {"data": 2, "tensor": 2}])
@pytest.mark.slow
def test_pallas_layer_norm_backward_steps_equal_xla(monkeypatch, mesh_sizes):
  """A 128-wide model (the kernel's chunk): the Pallas LayerNorm backward per batch shard (replicated over
  the tensor axis, as the activations are) equals the XLA form on one device."""
  from bert_jax.kernels import layer_norm as layer_norm_kernel
  from bert_jax.kernels import ops
  traced = []
  kernel = layer_norm_kernel._backward_2d
  monkeypatch.setattr(layer_norm_kernel, "_backward_2d", lambda meta, x, *args, **kw: traced.append(x.shape) or
                      kernel(meta, x, *args, **kw))
  wide = dict(hidden_size=128, intermediate_size=256)
  batches = [synthetic_batch(seed=s) for s in range(2)]
  states, losses = [], []
  for sizes, impl in ((None, "xla"), (mesh_sizes, "pallas")):
    monkeypatch.setattr(ops, "use_kernel", lambda implementation, impl=impl: impl == "pallas")
    state, step, mesh, *_ = build(mesh_sizes=sizes, model_overrides=wide)
    state, step_losses = run_steps(state, step, mesh, batches)
    states.append(state)
    losses.append(step_losses)
  shards = mesh_sizes.get("data", 1)
  assert (ROWS * SEQ // shards, 128) in traced, traced  # the encoder's LayerNorms ran the kernel on their shard
  np.testing.assert_allclose(losses[0], losses[1], rtol=2e-5)
  for a, b in zip(jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _all_gather_shapes(step, state, mesh):
  """Result shapes of the all-gathers in the compiled train step."""
  hlo = step.lower(state, sharding_lib.global_batch(synthetic_batch(), mesh)).compile().as_text()
  return re.findall(r"= (\S+\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo)


@pytest.mark.slow
def test_fsdp_gathers_weights_where_used_and_again_under_remat():
  """FSDP moves weights, never activations; with remat the backward pass gathers each block's weights again."""
  single_losses = single_device_losses()
  counts = {}
  for remat in ("none", "full"):
    state, step, mesh, *_ = build(mesh_sizes={"fsdp": 4}, model_overrides={"remat": remat})
    shapes = _all_gather_shapes(step, state, mesh)
    # A float [batch, length, ...] all-gather would be activations moving (integer inputs may move).
    activations = [shape for shape in shapes if shape.startswith(("f32", "bf16")) and f"[{ROWS},{SEQ}" in shape]
    assert shapes and not activations, activations
    counts[remat] = len(shapes)
    _, losses = run_steps(state, step, mesh, [synthetic_batch(seed=s) for s in range(2)])
    np.testing.assert_allclose(single_losses, losses, rtol=2e-5)
  assert counts["full"] > counts["none"], counts


@pytest.mark.slow
def test_fsdp_electra_with_shared_embeddings_equals_single_device():
  """The generator and discriminator read one embedding table: gathered at each use, the step is unchanged."""
  batches = [synthetic_batch(seed=s) for s in range(2)]
  losses = [run_steps(state, step, mesh, batches)[1]
            for state, step, mesh, *_ in (build("rtd"), build("rtd", mesh_sizes={"fsdp": 4},
                                                               model_overrides={"remat": "full"}))]
  np.testing.assert_allclose(losses[0], losses[1], rtol=2e-5)


@jax.custom_vjp
def _zero_with_infinite_gradient(x):
  return jnp.zeros((), jnp.float32)


_zero_with_infinite_gradient.defvjp(lambda x: (jnp.zeros((), jnp.float32), x),
                                    lambda x, g: (jnp.full_like(x, jnp.inf),))


class _InfiniteGradient:
  """The objective with a finite loss whose gradient for the MLM output bias is +inf."""

  def __init__(self, inner):
    self.inner, self.weights = inner, inner.weights

  def prepare(self, batch):
    return self.inner.prepare(batch)

  def denominators(self, inputs):
    return self.inner.denominators(inputs)

  def forward(self, params, inputs, rng, train):
    terms = dict(self.inner.forward(params, inputs, rng, train))
    terms["mlm_loss"] = terms["mlm_loss"] + _zero_with_infinite_gradient(params["mlm"]["predictions"]["output_bias"])
    return terms


def test_finite_loss_with_infinite_gradient_leaves_the_state_unchanged():
  """The guard is decided from the loss and the gradient norm, before the optimizer update."""
  state, _, mesh, objective, partitioning, shardings = build()
  config = make_config()
  tx, schedule = optim.make_optimizer(config.optim, total_steps=100)
  step = make_train_step(_InfiniteGradient(objective), tx, schedule, accum_steps=1, rng=jax.random.key(1),
                         partitioning=partitioning, state_shardings=shardings)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  state, metrics = step(state, sharding_lib.global_batch(synthetic_batch(), mesh))
  assert np.isfinite(float(metrics["loss"]))
  assert not np.isfinite(float(metrics["grad_norm"]))
  assert int(metrics["nonfinite"]) == 1
  assert int(state.step) == 1
  for got, want in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(got), want)


def test_nonfinite_loss_leaves_parameters_unchanged():
  state, step, mesh, *_ = build()
  before = jax.tree.map(np.asarray, state.params)
  bad = dict(jax.tree.map(np.asarray, state.params))
  poisoned = jax.tree.map(lambda x: x, before)
  poisoned["mlm"]["predictions"]["output_bias"] = np.full_like(poisoned["mlm"]["predictions"]["output_bias"], np.nan)
  del bad
  state = state.replace(params=jax.device_put(poisoned, jax.tree.map(lambda x: x.sharding, state.params)))
  state, metrics = step(state, sharding_lib.global_batch(synthetic_batch(), mesh))
  assert int(metrics["nonfinite"]) == 1
  assert int(state.step) == 1
  bias = np.asarray(state.params["mlm"]["predictions"]["output_bias"])
  assert np.isnan(bias).all()  # untouched, not updated
  np.testing.assert_array_equal(np.asarray(state.params["encoder"]["block_0"]["ffn"]["wo"]["kernel"]),
                                before["encoder"]["block_0"]["ffn"]["wo"]["kernel"])


def test_gpu_compiler_options(monkeypatch):
  """The GPU options on GPU only, each unless XLA_FLAGS sets it; this XLA knows the options."""
  from bert_jax.train import step as step_lib
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  assert step_lib.compiler_options("cpu") is None
  assert step_lib.compiler_options("gpu") == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true")
  assert step_lib.compiler_options("gpu") == {"xla_gpu_dot_merger_threshold_mb": 0}
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true --xla_gpu_dot_merger_threshold_mb=32")
  assert step_lib.compiler_options("gpu") is None
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm_longer_name=true")  # another flag: not the option
  assert step_lib.compiler_options("gpu") == step_lib.GPU_COMPILER_OPTIONS
  monkeypatch.undo()  # XLA reads XLA_FLAGS when the backend starts (here, if this test runs first): no fake flag.
  compiled = jax.jit(lambda x: x @ x, compiler_options=step_lib.GPU_COMPILER_OPTIONS).lower(jnp.ones((4, 4))).compile()
  np.testing.assert_allclose(np.asarray(compiled(jnp.ones((4, 4)))), 4.0)


def test_schedule_warmup_and_decay():
  config = config_lib.pretrain_defaults().optim
  config.lr, config.warmup_steps, config.schedule = 1.0, 10, "linear"
  schedule = optim.learning_rate_schedule(config, 110)
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10), schedule(60), schedule(110)],
                             [0.0, 0.5, 1.0, 0.5, 0.0], atol=1e-6)
  config.schedule = "cosine"
  np.testing.assert_allclose(optim.learning_rate_schedule(config, 110)(60), 0.5, atol=1e-6)


def test_weight_decay_skips_biases_and_norms():
  params = {"dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "norm": {"scale": jnp.ones(2)}}
  assert optim.decay_mask(params) == {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False}}


def test_layerwise_lr_factors():
  params = {"encoder": {"embeddings": {"w": 0}, "block_0": {"w": 0}, "block_1": {"w": 0}}, "head": {"w": 0}}
  factors = optim.layerwise_lr_factors(params, num_layers=2, num_blocks=2, decay=0.5)
  assert factors["head"]["w"] == 1.0
  assert factors["encoder"]["block_1"]["w"] == 0.5
  assert factors["encoder"]["block_0"]["w"] == 0.25
  assert factors["encoder"]["embeddings"]["w"] == 0.125
  # Four layers, each its own block, in two groups that share their attention: a group's copy takes the depth of
  # its last layer.
  shared = {"block_0": {"w": 0}, "block_3": {"w": 0}, "shared_attention_0": {"w": 0}, "shared_attention_1": {"w": 0}}
  factors = optim.layerwise_lr_factors({"encoder": shared}, num_layers=4, num_blocks=4, decay=0.5, num_groups=2)
  assert factors["encoder"]["block_0"]["w"] == 0.5 ** 4 and factors["encoder"]["block_3"]["w"] == 0.5
  assert factors["encoder"]["shared_attention_0"]["w"] == 0.5 ** 3
  assert factors["encoder"]["shared_attention_1"]["w"] == 0.5


def test_global_norm_and_clipping_equal_optax():
  rng = np.random.default_rng(0)
  tree = {"kernel": jnp.asarray(rng.normal(size=(300, 400)), jnp.float32),
          "bias": jnp.asarray(rng.normal(size=400), jnp.float32),
          "norm": {"scale": jnp.asarray(rng.normal(size=(7,)), jnp.float32)},
          "scalar": jnp.asarray(3.0, jnp.float32)}
  np.testing.assert_allclose(optim.global_norm(tree), optax.global_norm(tree), rtol=1e-6)
  assert optim.global_norm({}) == 0.0
  half = jnp.asarray(rng.normal(size=400), jnp.bfloat16)  # squared and summed in float32
  np.testing.assert_allclose(optim.global_norm([half]), np.linalg.norm(np.asarray(half, np.float64)), rtol=1e-6)
  for max_norm in (1.0, 1e4):  # clipped, and left alone
    ours, state = optim.clip_by_global_norm(max_norm).update(tree, optim.clip_by_global_norm(max_norm).init(tree))
    reference, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
    assert state == optax.EmptyState()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-6), ours, reference)


def test_left_to_right_reports_next_token_terms_not_mlm():
  """BERT's "LTR & No NSP" row: its next-token loss and accuracy are lm_*, so no table puts them in an MLM column."""
  objective = objectives.make_objective(make_config("ltr"), tiny_model(), mask_id=4)
  assert objective.weights == {"lm": 1.0}
  import flax.linen as nn
  inputs = objective.prepare({k: jnp.asarray(v) for k, v in synthetic_batch().items()})
  params = nn.unbox(objective.init_variables(jax.random.key(0), synthetic_batch()))["params"]
  terms = objective.forward(params, inputs, None, train=False)
  assert set(terms) == {"lm_loss", "lm_correct"}
  assert set(objective.denominators(inputs)) == {"lm"}


def test_electra_15_percent_scores_replaced_token_detection_on_the_masked_positions_only():
  """loss.rtd_positions: "all" weighs every real token, "masked" only the positions the generator filled."""
  import jax.numpy as jnp
  from bert_jax.train import objectives
  inputs = {"pack_ids": jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]),
            "mlm_positions": jnp.array([[1, 3], [0, 0]]), "mlm_weights": jnp.array([[1.0, 1.0], [1.0, 0.0]])}
  np.testing.assert_array_equal(objectives.rtd_weights(inputs, "all"), [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(objectives.rtd_weights(inputs, "masked"), [[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]])
  with pytest.raises(ValueError, match="config.loss.rtd_positions='some'"):
    objectives.rtd_weights(inputs, "some")


def test_persistent_cache_hits_counts_the_compilations_the_cache_served():
  """A program compiled again (lowered anew) is read from the persistent cache the suite runs with; the counter
  sees both compilations ask the cache and the second one served."""
  from bert_jax.train import step as step_lib
  assert jax.config.jax_compilation_cache_dir  # conftest's cache, as `bert-jax` commands have their own
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # the suite writes slow compilations only
  try:
    salt = float(np.random.default_rng().integers(1 << 30))  # a program no earlier run has put in the cache
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    # A new function each time, as in another process: JAX's in-memory caches do not answer, the persistent one can.
    program = lambda: jax.jit(lambda x: jnp.tanh(x @ x.T + salt))  # noqa: E731
    with step_lib.persistent_cache_hits() as first:
      program().lower(x).compile()
    with step_lib.persistent_cache_hits() as second:
      program().lower(x).compile()
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
  assert first == {"requests": 1, "hits": 0} and second == {"requests": 1, "hits": 1}
  jax.monitoring.record_event("/jax/compilation_cache/cache_hits")  # closed: no longer counted
  assert second["hits"] == 1


@pytest.mark.parametrize("name,warmup", [("linear", 10), ("linear", 0), ("poly", 7), ("cosine", 10),
                                         ("constant", 5)])
def test_horizon_schedule_equals_optax_schedules(name, warmup):
  """The schedule with its step counts as arrays gives optax's rates (`learning_rate_schedule`) at every step."""
  config = config_lib.finetune_defaults().optim
  config.lr, config.end_lr, config.power, config.schedule = 3e-4, 1e-5, 2.0, name
  config.warmup_steps = warmup
  total = 110
  expected = optim.learning_rate_schedule(config, total)
  horizon = optim.HorizonSchedule(name, config.lr, config.end_lr, config.power)
  steps = np.arange(total + 5)  # Past the end the rate stays at end_lr, as optax's.
  got = jax.jit(horizon)(steps, warmup, total)
  np.testing.assert_allclose(np.asarray(got), [float(expected(step)) for step in steps], rtol=2e-6, atol=1e-12)


def test_horizon_in_state_updates_as_optax_and_compiles_once_for_every_length():
  """make_optimizer(horizon_in_state=True) updates as the optax chain does; its step counts are state, not code."""
  config = config_lib.finetune_defaults().optim
  config.lr, config.warmup_steps = 1e-2, 3
  params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.ones(3)}}
  grads = jax.tree.map(lambda p: jnp.cos(p) + 0.5, params)

  def run(tx, schedule, steps):
    state, out, rates = tx.init(params), params, []
    for step in range(steps):
      updates, state = tx.update(grads, state, out)
      out = optax.apply_updates(out, updates)
      rates.append(float(optim.rate_at(schedule, jnp.asarray(step), state)))
    return out, rates

  for total in (8, 20):
    reference = run(*optim.make_optimizer(config, total), steps=total)
    horizon = run(*optim.make_optimizer(config, total, horizon_in_state=True), steps=total)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), reference[0], horizon[0])
    np.testing.assert_allclose(horizon[1], reference[1], rtol=1e-6)
  # One update function for both lengths: the same lowered program, the counts its inputs.
  texts = []
  for total in (8, 20):
    tx, _ = optim.make_optimizer(config, total, horizon_in_state=True)
    texts.append(jax.jit(tx.update).lower(grads, tx.init(params), params).as_text())
  assert texts[0] == texts[1]
  with pytest.raises(ValueError, match="one HorizonState"):
    optim.rate_at(optim.HorizonSchedule("linear", 1.0, 0.0, 1.0), jnp.asarray(0), optax.EmptyState())
