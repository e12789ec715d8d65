"""StructBERT: word shuffling (closed-form and brute-force statistics), the three-way sentence structural examples,
and the objectives mlm+wso / mlm+sso / mlm+wso+sso (terms, gradients, the tiny config end to end).

Frequencies are compared with their probabilities within 5 binomial standard errors, as tests/test_masking.py.
"""

import itertools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_formats import corpus, document_of, plan  # noqa: F401  (corpus is a fixture)
from test_train_step import make_config, synthetic_batch, tiny_model
from test_trainer import prepared  # noqa: F401  (a fixture: the built-in corpus, prepared once a run)

from bert_jax.data import formats
from bert_jax.data.masking import MaskingConfig, mask_batch, non_identity_permutations, shuffle_slots
from bert_jax.models.model import PretrainingModel
from bert_jax.train import config_lib, objectives, pretrain_config, trainer

SIGMAS = 5.0
CLS, SEP, MASK = 1, 2, 3


def within(successes, trials, probability):
  return abs(successes / trials - probability) <= SIGMAS * math.sqrt(probability * (1 - probability) / trials)


def rows_of_distinct_tokens(rows, length, packs=1):
  """Rows of `packs` examples [CLS] t t ... [SEP] filling `length`, every text token distinct within its row (so a
  permutation is read back from the tokens)."""
  input_ids = np.zeros((rows, length), np.int32)
  special = np.zeros((rows, length), np.int32)
  pack_ids = np.zeros((rows, length), np.int32)
  bounds = np.linspace(0, length, packs + 1).astype(int)
  for pack, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
    pack_ids[:, start:end] = pack + 1
    input_ids[:, start], input_ids[:, end - 1] = CLS, SEP
    special[:, [start, end - 1]] = 1
  text = special == 0
  input_ids[text] = np.tile(10 + np.arange(text[0].sum()), rows)
  return {"input_ids": input_ids, "word_starts": np.ones_like(input_ids), "special_mask": special,
          "pack_ids": pack_ids, "example_ids": np.arange(rows, dtype=np.int32), "epoch": np.zeros(rows, np.int32)}


def shuffle(batch, config, seed=0):
  out = jax.jit(lambda b: mask_batch(jax.random.key(seed), b, config, mask_id=MASK, vocab_size=1000,
                                     shuffle_words=True))(batch)
  return {k: np.asarray(v) for k, v in out.items()}


def masked_positions(out):
  rows, slots = np.nonzero(out["mlm_weights"] > 0)
  chosen = np.zeros(out["input_ids"].shape, bool)
  chosen[rows, out["mlm_positions"][rows, slots]] = True
  return chosen


def trigrams(out, width=3):
  """Per row, the shuffled K-grams as (start, permutation): input[start + j] = original[start + permutation[j]]."""
  found = []
  for row in range(out["input_ids"].shape[0]):
    used = out["shuffled_weights"][row] > 0
    positions = out["shuffled_positions"][row][used].reshape(-1, width)
    labels = out["shuffled_ids"][row][used].reshape(-1, width)
    spans = []
    for span, originals in zip(positions, labels):
      shown = out["input_ids"][row, span]
      spans.append((int(span[0]), tuple(int(np.flatnonzero(originals == token)[0]) for token in shown)))
    found.append(spans)
  return found


def test_shuffled_positions_counts_labels_and_permutations():
  """Rows of n = 62 text tokens: round(0.15 n) = 9 masked; shuffle_rate 0.15 shuffles round(0.15 n / 3) = 3
  trigrams (rate 0.05 gives the minimum, one). Every trigram is 3 consecutive unmasked text tokens of one pack,
  its labels are its original tokens, nothing outside moves, and its order is one of the 5 non-identity orders,
  each with probability 1/5."""
  rows, length = 3000, 64
  batch = rows_of_distinct_tokens(rows, length)
  config = MaskingConfig(max_predictions=10, shuffle_rate=0.15)
  assert shuffle_slots(config, length) == 9
  out = shuffle(batch, config)
  chosen = masked_positions(out)
  assert (chosen.sum(1) == 9).all()
  shuffled = np.zeros_like(chosen)
  counts = {permutation: 0 for permutation in itertools.permutations(range(3))}
  for row, spans in enumerate(trigrams(out)):
    assert len(spans) == 3  # closed form: 3 trigrams, 9 of the 62 text tokens
    for start, permutation in spans:
      span = np.arange(start, start + 3)
      assert not shuffled[row, span].any()  # disjoint trigrams
      shuffled[row, span] = True
      counts[permutation] += 1
  original = batch["input_ids"]
  assert not (shuffled & chosen).any()  # never a masked position
  assert not (shuffled & (batch["special_mask"] > 0)).any()
  used = out["shuffled_weights"] > 0
  row_index = np.broadcast_to(np.arange(rows)[:, None], used.shape)
  np.testing.assert_array_equal(out["shuffled_ids"][used], original[row_index[used], out["shuffled_positions"][used]])
  untouched = ~shuffled & ~chosen
  np.testing.assert_array_equal(out["input_ids"][untouched], original[untouched])
  assert out["shuffled_ids"][~used].sum() == 0 and out["shuffled_positions"][~used].sum() == 0
  assert counts[(0, 1, 2)] == 0  # the identity is excluded
  trials = 3 * rows
  for permutation in non_identity_permutations(3):
    assert within(counts[tuple(permutation)], trials, 1 / 5), (permutation, counts)
  # The default rate: round(0.05 * 62 / 3) = 1 trigram a row, 5% of the tokens (at least one trigram).
  out = shuffle(batch, MaskingConfig(max_predictions=10))
  assert (out["shuffled_weights"].sum(1) == 3).all()


def test_each_free_trigram_start_is_equally_likely():
  """One trigram a row: given the masked positions, its start is uniform over the starts whose three tokens are
  unmasked text of one pack. Brute force over each row's free starts: P(start = t) = mean over rows of
  [t free] / (free starts), checked at every t; two packs, so no trigram may cross their boundary."""
  rows, length = 6000, 24
  batch = rows_of_distinct_tokens(rows, length, packs=2)
  out = shuffle(batch, MaskingConfig(rate=0.3, max_predictions=8))
  chosen = masked_positions(out)
  text = (batch["special_mask"] == 0) & ~chosen
  same_pack = batch["pack_ids"][:, :-2] == batch["pack_ids"][:, 2:]
  free = np.zeros_like(text)
  free[:, :-2] = text[:, :-2] & text[:, 1:-1] & text[:, 2:] & same_pack
  starts = np.array([spans[0][0] if spans else -1 for spans in trigrams(out)])
  assert np.array_equal(starts >= 0, free.any(1))  # a row without a free trigram shuffles none
  rows_with = free.any(1)
  free, starts = free[rows_with], starts[rows_with]
  assert free[np.arange(len(starts)), starts].all()
  expected = (free / free.sum(1, keepdims=True)).sum(0)
  observed = np.bincount(starts, minlength=length)
  for t in range(length):
    if expected[t] == 0:
      assert observed[t] == 0
    else:
      assert within(observed[t], len(starts), expected[t] / len(starts)), (t, observed[t], expected[t])


def test_word_shuffling_belongs_to_the_word_structural_objective():
  config = make_config("mlm+nsp")
  config.masking.shuffle_rate = 0.1
  with pytest.raises(ValueError, match=r"config.masking.shuffle_rate=0.1 applies to the word structural objective"):
    objectives.make_objective(config, tiny_model(), mask_id=4)
  with pytest.raises(ValueError, match="shuffle_len"):
    MaskingConfig(shuffle_len=1)


# Sentence structural examples --------------------------------------------------------------------------------------

def test_sso_labels_are_a_third_each(corpus):  # noqa: F811
  config = formats.FormatConfig("sso", seq_len=64)
  labels = np.array([example.label for seed in range(4) for example in plan(corpus, config, seed=seed)])
  assert set(labels) == {0, 1, 2}
  for label in range(3):
    assert within(np.sum(labels == label), len(labels), 1 / 3), np.bincount(labels)


@pytest.mark.parametrize("seq_len", [1024, 48])
def test_sso_next_previous_and_random_segments(corpus, seq_len):  # noqa: F811
  """Next: B follows A in A's document; previous: B precedes A there; random: B is another document's. With rows
  longer than any document nothing is truncated and the two segments meet exactly; at 48 tokens truncation may
  cut tokens between them, never reorder them."""
  config = formats.FormatConfig("sso", seq_len=seq_len, short_seq_prob=0.0)
  examples = plan(corpus, config, seed=1)
  assert {example.label for example in examples} == {0, 1, 2}
  exact = seq_len > int(np.diff(corpus.sentence_starts[corpus.document_starts]).max())
  for example in examples:
    (a_start, a_end), (b_start, b_end) = example.segment_a[0], example.segment_b[0]
    same_document = document_of(corpus, (a_start, a_end)) == document_of(corpus, (b_start, b_end))
    if example.label == formats.SSO_NEXT:
      assert same_document and (a_end == b_start if exact else a_end <= b_start)
    elif example.label == formats.SSO_PREVIOUS:
      assert same_document and (b_end == a_start if exact else b_end <= a_start)
    else:
      assert not same_document


# The objectives ----------------------------------------------------------------------------------------------------

def build(name, config=None, model_config=None, rows=8, seq=32, shapes_only=False):
  """(objective, prepared inputs, params) on a synthetic batch whose sentence labels are 0, 1, 2, 0, ...; with
  `shapes_only`, their shapes alone (nothing compiled)."""
  config = config or make_config(name)
  objective = objectives.make_objective(config, model_config or tiny_model(), mask_id=4)
  batch = synthetic_batch(rows=rows, seq=seq)
  batch["sentence_labels"] = np.arange(rows, dtype=np.int32)[:, None] % 3
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  run = jax.eval_shape if shapes_only else jax.jit
  params = nn.unbox(run(objective.init_variables, jax.random.key(0), batch) if shapes_only else
                    run(objective.init_variables)(jax.random.key(0), batch))["params"]
  return objective, run(objective.prepare, batch) if shapes_only else run(objective.prepare)(batch), params


def test_objectives_are_registered_with_their_terms_heads_and_formats():
  for name, terms in (("mlm+wso", {"mlm", "wso"}), ("mlm+sso", {"mlm", "sentence"}),
                      ("mlm+wso+sso", {"mlm", "wso", "sentence"})):
    objective, inputs, params = build(name, shapes_only=True)
    assert isinstance(objective, objectives.OBJECTIVES[name]) and set(objective.weights) == terms
    assert all(weight == 1.0 for weight in objective.weights.values())
    assert ("shuffled_positions" in inputs) == ("wso" in terms)
    if "sentence" in terms:
      assert objectives.SENTENCE_FORMATS[name] == "sso"
      assert params["sentence"]["classifier"]["kernel"].shape == (32, 3)
  assert "mlm+wso" not in objectives.SENTENCE_FORMATS


@pytest.mark.slow
def test_wso_is_the_mlm_heads_cross_entropy_at_the_shuffled_positions():
  objective, inputs, params = build("mlm+wso+sso")
  outputs = jax.jit(lambda p, x: objective.apply({"params": p}, x, False))(params, inputs)
  masked = inputs["mlm_positions"].shape[1]
  # The MLM head alone, read at the shuffled positions of the same input.
  alone = jax.jit(lambda p, x: PretrainingModel(objective.model_config, sentence_head=False).apply(
      {"params": {k: p[k] for k in ("encoder", "mlm")}}, x["input_ids"], x["shuffled_positions"],
      segment_ids=x["segment_ids"], position_ids=x["position_ids"], pack_ids=x["pack_ids"]))(params, inputs)
  np.testing.assert_allclose(outputs["mlm_logits"][:, masked:], alone["mlm_logits"], rtol=1e-5, atol=1e-5)
  logits = np.asarray(alone["mlm_logits"], np.float64)[..., :objective.model_config.vocab_size]
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  labels, weights = np.asarray(inputs["shuffled_ids"]), np.asarray(inputs["shuffled_weights"])
  expected = -np.sum(np.take_along_axis(log_probs, labels[..., None], -1)[..., 0] * weights)
  terms = objective.terms(outputs, inputs)
  np.testing.assert_allclose(terms["wso_loss"], expected, rtol=1e-5)
  assert objective.denominators(inputs)["wso"] == weights.sum() > 0
  assert outputs["sentence_logits"].shape == (8, 1, 3)
  # The three sentence labels are all scored: the loss is the three-way cross-entropy of [CLS].
  sentence = np.asarray(outputs["sentence_logits"][:, 0], np.float64)
  sentence_log_probs = sentence - np.log(np.exp(sentence).sum(-1, keepdims=True))
  np.testing.assert_allclose(terms["sentence_loss"],
                             -np.take_along_axis(sentence_log_probs, np.arange(8)[:, None] % 3, 1).sum(), rtol=1e-5)


@pytest.mark.slow
def test_the_tiny_config_has_a_finite_loss_and_gradients_reach_every_head():
  config = config_lib.load_config("configs/structbert.py:scale=tiny")
  assert (config.objective, config.data.format, config.data.builtin) == ("mlm+wso+sso", "sso", True)
  model_config = pretrain_config.build_model_config(config.model, 2000)
  objective, inputs, params = build(config.objective, config, model_config, rows=16, seq=config.data.seq_len)

  def loss(params):
    terms = objective.forward(params, inputs, jax.random.key(3), True)
    counts = objective.denominators(inputs)
    return sum(weight * terms[f"{term}_loss"] / counts[term] for term, weight in objective.weights.items())

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(value)
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(grads))
  for module in ("encoder", "mlm", "sentence"):
    assert any(np.any(leaf != 0) for leaf in jax.tree.leaves(grads[module])), module
  assert np.any(grads["sentence"]["classifier"]["kernel"][:, 2] != 0)  # the third class is trained
  for objective_name in ("mlm+wso", "mlm+sso", "mlm+nsp", "mlm"):
    config_lib.load_config(f"configs/structbert.py:scale=tiny,objective={objective_name}")
  with pytest.raises(config_lib.ConfigError, match=re.escape("objective='mlm+sop'; expected one of")):
    config_lib.load_config("configs/structbert.py:objective=mlm+sop")


@pytest.mark.slow
def test_the_tiny_config_pretrains_on_the_built_in_corpus(prepared, tmp_path):  # noqa: F811
  """The "sso" rows of the input pipeline, the shuffling and both heads through the trainer: every term is logged
  and evaluated, finite."""
  config = config_lib.load_config("configs/structbert.py:scale=tiny,steps=4",
                                  ["--config.data.builtin=False", f"--config.data.prepared={prepared}"])
  result = trainer.train_and_evaluate(config, tmp_path / "run")
  assert result["step"] == 4
  for term in ("mlm", "wso", "sentence"):
    assert np.isfinite(result["eval"][f"{term}_loss"]) and 0 <= result["eval"][f"{term}_accuracy"] <= 1
