"""ELECTRA's Table 5 objectives: Replace MLM and All-Tokens MLM (the corruption, the loss positions, gradients)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train_step import VOCAB, make_config, synthetic_batch, tiny_model

from bert_jax.train import losses, objectives

# The generator's distribution in `test_the_generator_samples_replace_exactly_the_masked_positions`.
SAMPLED = {10: 0.5, 20: 0.3, 30: 0.2}


def build(name, rows=16, seed=0):
  objective = objectives.make_objective(make_config(name), tiny_model(embedding_size=32), mask_id=4)
  batch = {k: jnp.asarray(v) for k, v in synthetic_batch(rows=rows, seed=seed).items()}
  # Compiled whole: op by op, each of the model's primitives would be compiled on its own.
  params = nn.unbox(jax.jit(objective.init_variables)(jax.random.key(0), batch))["params"]
  return objective, jax.jit(objective.prepare)(batch), params


def apply(objective, params, inputs, rng, train):
  """`objective.apply` compiled (`train` and the rng streams are static)."""
  return jax.jit(lambda p, x: objective.apply({"params": p}, x, train, rngs=objective.rngs(rng, train)))(params, inputs)


@pytest.mark.slow
def test_objectives_are_registered_with_their_heads_and_terms():
  for name, head, tree in (("replace_mlm", "mlm", {"mlm"}), ("all_tokens_mlm", "all_tokens", {"mlm", "copy"})):
    objective, _, params = build(name)
    assert isinstance(objective, objectives.OBJECTIVES[name]) and objective.model.head == head
    assert objective.weights == {"generator": 1.0, "mlm": 1.0}
    assert {"embeddings", "generator", "generator_mlm", "discriminator"} | tree == set(params)
  config = make_config("replace_mlm")
  config.loss.rtd_positions = "masked"
  with pytest.raises(ValueError, match="rtd_positions='masked' applies to objective 'rtd' only"):
    objectives.make_objective(config, tiny_model(embedding_size=32), mask_id=4)


@pytest.mark.slow
def test_the_generator_samples_replace_exactly_the_masked_positions():
  """A generator whose distribution is known (its logits are its output bias alone): every masked position, and
  only those, holds one of its samples, at its frequencies (both objectives corrupt through ELECTRA's one path)."""
  objective, inputs, params = build("all_tokens_mlm", rows=256)
  params["embeddings"]["word_embeddings"]["embedding"] = jnp.zeros_like(
      params["embeddings"]["word_embeddings"]["embedding"])
  bias = np.full(VOCAB, -1e4, np.float32)
  for token, probability in SAMPLED.items():
    bias[token] = np.log(probability)
  params["generator_mlm"]["predictions"]["output_bias"] = jnp.asarray(bias)
  outputs = apply(objective, params, inputs, jax.random.key(7), True)
  corrupted, original = np.asarray(outputs["corrupted_ids"]), np.asarray(inputs["original_ids"])
  masked = np.zeros(original.shape, bool)
  positions, weights = np.asarray(inputs["mlm_positions"]), np.asarray(inputs["mlm_weights"])
  rows = np.broadcast_to(np.arange(original.shape[0])[:, None], positions.shape)
  masked[rows[weights > 0], positions[weights > 0]] = True
  assert masked.sum() > 500
  np.testing.assert_array_equal(corrupted[~masked], original[~masked])  # [MASK]ed or not, only samples change
  samples = corrupted[masked]
  assert set(np.unique(samples)) <= set(SAMPLED)
  for token, probability in SAMPLED.items():  # within 4 standard deviations of a binomial frequency
    bound = 4 * np.sqrt(probability * (1 - probability) / samples.size)
    assert abs(np.mean(samples == token) - probability) < bound, (token, np.mean(samples == token), bound)
  np.testing.assert_array_equal(outputs["replaced"], corrupted != original)


def test_replace_mlm_scores_the_masked_positions_against_the_original_tokens():
  objective, inputs, params = build("replace_mlm")
  outputs = apply(objective, params, inputs, None, False)
  logits = np.asarray(outputs["token_logits"], np.float64)
  assert logits.shape[:2] == inputs["mlm_positions"].shape
  targets, weights = np.asarray(inputs["mlm_ids"]), np.asarray(inputs["mlm_weights"])
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  expected = -np.sum(np.take_along_axis(log_probs, targets[..., None], -1)[..., 0] * weights)
  original, positions = np.asarray(inputs["original_ids"]), np.asarray(inputs["mlm_positions"])
  np.testing.assert_array_equal(np.take_along_axis(original, positions, 1)[weights > 0], targets[weights > 0])
  terms = objective.terms(outputs, inputs)
  np.testing.assert_allclose(terms["mlm_loss"], expected, rtol=1e-5)
  assert objective.denominators(inputs)["mlm"] == weights.sum() == objective.denominators(inputs)["generator"]


@pytest.mark.slow
def test_all_tokens_mlm_scores_every_real_token_with_the_copy_mixture():
  objective, inputs, params = build("all_tokens_mlm")
  outputs = apply(objective, params, inputs, None, False)
  real = np.asarray(inputs["pack_ids"]) > 0
  logits, gate = np.asarray(outputs["token_logits"], np.float64), np.asarray(outputs["copy_logits"], np.float64)
  assert logits.shape[:2] == real.shape and gate.shape == real.shape
  corrupted, original = np.asarray(outputs["corrupted_ids"]), np.asarray(inputs["original_ids"])
  # p(t) = D [t == input token] + (1 - D) softmax(logits)_t, at every real token.
  copy = 1 / (1 + np.exp(-gate))
  mixture = (1 - copy)[..., None] * np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.put_along_axis(mixture, corrupted[..., None], np.take_along_axis(mixture, corrupted[..., None], -1)
                    + copy[..., None], -1)
  p_original = np.take_along_axis(mixture, original[..., None], -1)[..., 0]
  terms = objective.terms(outputs, inputs)
  np.testing.assert_allclose(terms["mlm_loss"], -np.sum(np.log(p_original) * real), rtol=1e-5)
  assert terms["mlm_correct"] == np.sum((mixture.argmax(-1) == original) & real)
  assert objective.denominators(inputs)["mlm"] == real.sum()
  assert objective.denominators(inputs)["generator"] == np.sum(inputs["mlm_weights"])


def test_copy_mixture_sums_is_stable_at_confident_gates():
  logits = jnp.array([[0.0, 50.0, -50.0]])
  for gate, input_id, target in ((60.0, 2, 2), (-60.0, 2, 1), (60.0, 0, 1)):
    loss, correct = losses.copy_mixture_sums(logits[None], jnp.array([[gate]]), jnp.array([[input_id]]),
                                             jnp.array([[target]]), jnp.ones((1, 1)))
    assert np.isfinite(loss)
  # A sure copy of the right token costs nothing; a sure copy of a wrong one costs log(1 / (1 - D)) + MLM's.
  loss, correct = losses.copy_mixture_sums(logits[None], jnp.array([[60.0]]), jnp.array([[2]]), jnp.array([[2]]),
                                           jnp.ones((1, 1)))
  assert float(loss) < 1e-6 and float(correct) == 1.0
  loss, correct = losses.copy_mixture_sums(logits[None], jnp.array([[60.0]]), jnp.array([[0]]), jnp.array([[1]]),
                                           jnp.ones((1, 1)))
  assert float(loss) == pytest.approx(60.0, abs=1e-3) and float(correct) == 0.0


@pytest.mark.parametrize("name,heads", [("replace_mlm", ("mlm",)), ("all_tokens_mlm", ("mlm", "copy"))])
@pytest.mark.slow
def test_gradients_are_finite_and_reach_the_generator_and_the_discriminator(name, heads):
  objective, inputs, params = build(name)

  def loss(params):
    terms = objective.forward(params, inputs, jax.random.key(3), True)
    counts = objective.denominators(inputs)
    return sum(weight * terms[f"{term}_loss"] / counts[term] for term, weight in objective.weights.items())

  grads = jax.jit(jax.grad(loss))(params)
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(grads))
  for module in ("generator", "generator_mlm", "discriminator", "embeddings") + heads:
    assert any(np.any(leaf != 0) for leaf in jax.tree.leaves(grads[module])), module


def test_flops_charge_each_networks_vocabulary_head_for_the_tokens_it_predicts():
  """The generator predicts the masked positions; the discriminator none (RTD), those (Replace MLM) or every token."""
  flops = {name: objectives.make_objective(make_config(name), tiny_model(embedding_size=32), mask_id=4)
           .flops_per_token(max_predictions=16, seq_len=128) for name in ("rtd", "replace_mlm", "all_tokens_mlm")}
  head = 6 * (32 * 32 + 32 * VOCAB)  # the discriminator's transform and tied projection, per predicted token
  assert flops["replace_mlm"] - flops["rtd"] == pytest.approx(head * 16 / 128)
  assert flops["all_tokens_mlm"] - flops["rtd"] == pytest.approx(head)


def test_a_dense_embedding_lookup_charges_each_network_a_one_hot_matmul():
  """ELECTRA's paper counts the token embedding as a matmul (E x vocab) per token in the generator and the
  discriminator alike: an ELECTRA step pays it twice, a masked LM's once."""
  for name, networks in (("rtd", 2), ("mlm", 1)):
    objective = objectives.make_objective(make_config(name), tiny_model(embedding_size=32), mask_id=4)
    sparse, dense = (objective.flops_per_token(max_predictions=16, seq_len=128, dense_embedding_lookup=dense)
                     for dense in (False, True))
    assert dense - sparse == pytest.approx(networks * 6 * 32 * VOCAB), name
