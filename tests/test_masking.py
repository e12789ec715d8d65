"""Tests of on-device MLM masking (bert_jax.data.masking).

Statistical checks compare frequencies with closed-form probabilities and
allow 5 binomial standard errors (a false alarm about once in 1.7 million
checks).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bert_jax.data.batch import validate_batch
from bert_jax.data.masking import MaskingConfig, mask_batch, sample_span_lengths, span_length_probs

PAD, CLS, SEP, MASK = 0, 1, 2, 3
FIRST_WORD_ID = 10  # Word ids are >= this, so [MASK] and specials never come from the text.
VOCAB_SIZE = 30000
SIGMAS = 5.0
WORD_GRANULARITIES = ("whole_word", "ngram", "span")


def within_binomial_bound(successes, trials, probability):
  """True when successes/trials is within SIGMAS binomial standard errors of `probability`."""
  standard_error = np.sqrt(probability * (1.0 - probability) / trials)
  return abs(successes / trials - probability) <= SIGMAS * standard_error


def make_batch(rng, num_rows, length, *, word_lengths=(1, 1, 1, 2, 3), num_packs=1, fill=(0.6, 1.0), epoch=0,
               first_example_id=0):
  """Rows of `num_packs` packed examples `[CLS] words [SEP]`, then padding, as numpy arrays."""
  input_ids = np.full((num_rows, length), PAD, np.int32)
  word_starts = np.ones((num_rows, length), np.int32)
  special_mask = np.ones((num_rows, length), np.int32)
  pack_ids = np.zeros((num_rows, length), np.int32)
  for row in range(num_rows):
    used = int(rng.uniform(*fill) * length)
    bounds = np.linspace(0, used, num_packs + 1).astype(int)
    for pack, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
      pack_ids[row, start:end] = pack + 1
      input_ids[row, start], input_ids[row, end - 1] = CLS, SEP
      text = slice(start + 1, end - 1)
      input_ids[row, text] = rng.integers(FIRST_WORD_ID, VOCAB_SIZE, end - start - 2)
      special_mask[row, text] = 0
      word_starts[row, text] = 0
      starts = start + 1 + np.concatenate([[0], np.cumsum(rng.choice(word_lengths, end - start))])
      word_starts[row, starts[starts < end - 1]] = 1
  batch = {
      "input_ids": input_ids,
      "segment_ids": np.zeros_like(input_ids),
      "position_ids": np.zeros_like(input_ids),
      "pack_ids": pack_ids,
      "word_starts": word_starts,
      "special_mask": special_mask,
      "cls_positions": np.zeros((num_rows, num_packs), np.int32),
      "sentence_labels": np.zeros((num_rows, num_packs), np.int32),
      "sentence_weights": np.ones((num_rows, num_packs), np.float32),
      "example_ids": np.arange(first_example_id, first_example_id + num_rows, dtype=np.int32),
      "epoch": np.full((num_rows,), epoch, np.int32),
  }
  validate_batch(batch)
  return batch


def hand_batch(input_ids, special_mask, pack_ids, word_starts=None, num_copies=1):
  """A batch from one hand-written row, repeated with example ids 0..num_copies-1."""
  row = {
      "input_ids": np.asarray(input_ids, np.int32),
      "special_mask": np.asarray(special_mask, np.int32),
      "pack_ids": np.asarray(pack_ids, np.int32),
      "word_starts": np.ones(len(input_ids), np.int32) if word_starts is None else np.asarray(word_starts, np.int32),
  }
  batch = {name: np.tile(values, (num_copies, 1)) for name, values in row.items()}
  batch["example_ids"] = np.arange(num_copies, dtype=np.int32)
  batch["epoch"] = np.zeros(num_copies, np.int32)
  return batch


@functools.lru_cache(maxsize=None)
def masker(config):
  return jax.jit(functools.partial(mask_batch, config=config, mask_id=MASK, vocab_size=VOCAB_SIZE))


def run(config, batch, seed=0):
  device_batch = {name: jnp.asarray(values) for name, values in batch.items()}
  return jax.tree.map(np.asarray, masker(config)(jax.random.key(seed), device_batch))


def chosen_mask(output, length):
  """bool [B, L]: True at the positions in real prediction slots."""
  chosen = np.zeros((output["mlm_positions"].shape[0], length), bool)
  rows, slots = np.nonzero(output["mlm_weights"])
  chosen[rows, output["mlm_positions"][rows, slots]] = True
  return chosen


def budgets(config, batch):
  """BERT's number of predictions per row: round(rate * maskable), >= 1, <= max_predictions."""
  num_maskable = ((batch["special_mask"] == 0) & (batch["pack_ids"] > 0)).sum(1)
  budget = np.round(np.float32(config.rate) * num_maskable.astype(np.float32)).astype(int)
  return np.clip(budget, np.minimum(num_maskable, 1), config.max_predictions)


@pytest.mark.parametrize("field, value", [
    ("rate", 0.0), ("rate", 1.5), ("mask_token_prob", -0.1), ("random_token_prob", 0.3), ("granularity", "words"),
    ("max_ngram", 0), ("span_geometric_p", 0.0), ("span_max_len", 0), ("max_predictions", 2.5)])
def test_config_rejects_bad_values_naming_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    MaskingConfig(**{field: value})


@pytest.mark.parametrize("granularity, rate", [("token", 0.4), ("whole_word", 0.15), ("span", 0.3)])
def test_rate_on_long_rows(granularity, rate):
  # Long rows with plenty of one-token words, so every granularity can spend
  # its budget exactly: round(rate * maskable) predictions per row.
  config = MaskingConfig(rate=rate, granularity=granularity, max_predictions=512)
  batch = make_batch(np.random.default_rng(1), 64, 512, word_lengths=(1, 1, 2, 3))
  output = run(config, batch)
  np.testing.assert_array_equal(output["mlm_weights"].sum(1), budgets(config, batch))
  if granularity == "token":
    # No positional bias: each maskable position of a row is chosen with
    # probability budget / maskable, in the first and the second half alike.
    # (Fixed counts per row make the binomial standard error an upper bound.)
    chosen = chosen_mask(output, 512)
    maskable = (batch["special_mask"] == 0) & (batch["pack_ids"] > 0)
    row_probability = budgets(config, batch) / maskable.sum(1)
    for half in (slice(0, 256), slice(256, 512)):
      trials = maskable[:, half].sum(1)
      expected = (row_probability * trials).sum()
      standard_error = np.sqrt((row_probability * (1 - row_probability) * trials).sum())
      assert abs(chosen[:, half].sum() - expected) <= SIGMAS * standard_error


# Most checks share one batch (256 rows of 3 packed examples each, with
# padding) and one configuration per granularity: compiling is the slow part.
STANDARD_ROWS, STANDARD_LENGTH, STANDARD_SLOTS = 256, 128, 20


def standard_config(granularity):
  # 40% of the >= 70 maskable tokens of a row is above the 20 slots: the cap binds.
  return MaskingConfig(granularity=granularity, rate=0.4, max_predictions=STANDARD_SLOTS)


@pytest.fixture(scope="module")
def standard_batch():
  return make_batch(np.random.default_rng(3), STANDARD_ROWS, STANDARD_LENGTH, num_packs=3)


@pytest.fixture(scope="module")
def standard_outputs(standard_batch):
  return {granularity: run(standard_config(granularity), standard_batch)
          for granularity in ("token",) + WORD_GRANULARITIES}


@pytest.mark.parametrize("mask_prob, random_prob", [(0.8, 0.1), (0.5, 0.3)])
def test_mask_random_keep_split(mask_prob, random_prob, standard_batch, standard_outputs):
  config = dataclasses.replace(standard_config("token"), mask_token_prob=mask_prob, random_token_prob=random_prob)
  output = standard_outputs["token"] if config == standard_config("token") else run(config, standard_batch)
  chosen = chosen_mask(output, STANDARD_LENGTH)
  original, corrupted = standard_batch["input_ids"], output["input_ids"]
  np.testing.assert_array_equal(corrupted[~chosen], original[~chosen])
  trials = chosen.sum()
  # A random replacement hits [MASK] or the original id with probability 1/V each.
  random_hit = random_prob / VOCAB_SIZE
  assert within_binomial_bound((corrupted[chosen] == MASK).sum(), trials, mask_prob + random_hit)
  kept_prob = 1.0 - mask_prob - random_prob
  assert within_binomial_bound((corrupted[chosen] == original[chosen]).sum(), trials, kept_prob + random_hit)
  assert corrupted.min() >= 0 and corrupted.max() < VOCAB_SIZE


@pytest.mark.parametrize("granularity", ("token",) + WORD_GRANULARITIES)
def test_specials_padding_words_and_slots(granularity, standard_batch, standard_outputs):
  batch, output = standard_batch, standard_outputs[granularity]
  assert output["input_ids"].shape == (STANDARD_ROWS, STANDARD_LENGTH)
  assert output["input_ids"].dtype == np.int32 and output["mlm_weights"].dtype == np.float32
  for name in ("mlm_positions", "mlm_ids", "sbo_left", "sbo_right", "sbo_offsets"):
    assert output[name].shape == (STANDARD_ROWS, STANDARD_SLOTS) and output[name].dtype == np.int32, name
  chosen = chosen_mask(output, STANDARD_LENGTH)
  assert not (chosen & (batch["special_mask"] == 1)).any()
  assert not (chosen & (batch["pack_ids"] == 0)).any()
  # The cap binds: all 20 slots for tokens; words of up to 3 tokens may leave
  # at most 2 slots unspent.
  counts = output["mlm_weights"].sum(1)
  assert counts.max() == STANDARD_SLOTS
  assert counts.min() >= (STANDARD_SLOTS if granularity == "token" else STANDARD_SLOTS - 2)
  # Outputs agree with each other: ascending positions, unused slots zeroed.
  weights = output["mlm_weights"] > 0
  np.testing.assert_array_equal(weights.sum(1), chosen.sum(1))
  assert (np.diff(output["mlm_positions"], axis=1)[weights[:, 1:]] > 0).all()
  np.testing.assert_array_equal(output["mlm_ids"], np.where(
      weights, np.take_along_axis(batch["input_ids"], output["mlm_positions"], 1), 0))
  for name in ("mlm_positions", "sbo_left", "sbo_right", "sbo_offsets"):
    assert (output[name][~weights] == 0).all(), name
  # Every run in the SBO fields lies inside the prediction's packed example.
  rows = np.arange(STANDARD_ROWS)[:, None]
  for side in ("sbo_left", "sbo_right"):
    inner = output[side] + (1 if side == "sbo_left" else -1)
    same_pack = batch["pack_ids"][rows, inner] == batch["pack_ids"][rows, output["mlm_positions"]]
    assert same_pack[weights].all(), side
  if granularity != "token":
    # A word is chosen whole or not at all.
    word_index = np.cumsum(batch["word_starts"], axis=1)
    for row in range(STANDARD_ROWS):
      chosen_words = np.unique(word_index[row][chosen[row]])
      assert chosen[row][np.isin(word_index[row], chosen_words)].all()


def test_span_runs_are_longer_than_token_runs(standard_outputs):
  # Spans of 3.8 words on average (plus merges) against ~1.3-token runs of
  # 20 tokens scattered over ~100.
  def mean_run_length(output):
    weights = output["mlm_weights"] > 0
    return weights.sum() / (weights & (output["sbo_offsets"] == 0)).sum()

  assert mean_run_length(standard_outputs["span"]) > 2 * mean_run_length(standard_outputs["token"])


def test_max_predictions_above_length():
  config = MaskingConfig(rate=1.0, max_predictions=40)
  batch = make_batch(np.random.default_rng(5), 4, 16, fill=(1.0, 1.0))
  output = run(config, batch)
  np.testing.assert_array_equal(output["mlm_weights"].sum(1), 14)  # Every token but [CLS] and [SEP].
  assert output["mlm_weights"][:, 14:].sum() == 0


def test_whole_word_skips_words_that_would_overflow():
  # Words X (2 tokens), y, z, w (1 token each) and a budget of 3 tokens. BERT
  # visits the words in random order and skips a word that would overflow, so
  # X is taken iff it is among the first two visited: p = 1/2, and the budget
  # is always spent exactly (stopping at the first overflow would not).
  config = MaskingConfig(granularity="whole_word", rate=0.6)
  batch = hand_batch([CLS, 11, 12, 13, 14, 15, SEP], [1, 0, 0, 0, 0, 0, 1], [1] * 7,
                     word_starts=[1, 1, 0, 1, 1, 1, 1], num_copies=4000)
  output = run(config, batch)
  np.testing.assert_array_equal(output["mlm_weights"].sum(1), 3)
  chosen = chosen_mask(output, 7)
  assert (chosen[:, 1] == chosen[:, 2]).all()
  assert within_binomial_bound(chosen[:, 1].sum(), 4000, 0.5)


def test_spans_never_cross_pack_boundaries():
  # Two packed examples of two one-token words each, with no separator:
  # a1 a2 | b1 b2. Budget 2; span lengths nearly uniform on 1..10, so n >= 2
  # with p = 0.9. The pair {a2, b1} can only come from a span on one side
  # followed by a uniform second anchor among the 3 free words:
  # p = 1/4 * 1/3 (anchor a2) + 1/4 * 0.1 * 1/3 (anchor b1, n = 1) = 0.0917.
  # A span allowed to cross would give it with p ~ 0.24.
  config = MaskingConfig(granularity="span", rate=0.5, span_geometric_p=1e-9)
  batch = hand_batch([11, 12, 13, 14], [0, 0, 0, 0], [1, 1, 2, 2], num_copies=4000)
  chosen = chosen_mask(run(config, batch), 4)
  pair_a2_b1 = (chosen == [False, True, True, False]).all(1)
  assert within_binomial_bound(pair_a2_b1.sum(), 4000, 1 / 12 + 1 / 120)


@pytest.mark.parametrize("granularity, expected_mean", [("ngram", 18 / 11), ("span", 3.797097503983287)])
def test_span_length_distribution(granularity, expected_mean):
  config = MaskingConfig(granularity=granularity)
  probs = span_length_probs(config)
  lengths = np.arange(1, len(probs) + 1)
  if granularity == "ngram":  # ALBERT: p(n) ∝ 1/n, n <= 3.
    np.testing.assert_allclose(probs, (1 / lengths) / (1 + 1 / 2 + 1 / 3))
  else:  # SpanBERT: Geometric(0.2) truncated at 10 words and renormalised.
    np.testing.assert_allclose(probs, 0.2 * 0.8**(lengths - 1) / (1 - 0.8**10))
  np.testing.assert_allclose((probs * lengths).sum(), expected_mean)

  num_draws = 200_000
  draws = np.asarray(sample_span_lengths(jax.random.key(7), config, (num_draws,)))
  assert draws.min() >= 1 and draws.max() <= len(probs)
  for length, prob in zip(lengths, probs):
    assert within_binomial_bound((draws == length).sum(), num_draws, prob), length
  standard_error = np.sqrt((probs * (lengths - expected_mean)**2).sum() / num_draws)
  assert abs(draws.mean() - expected_mean) <= SIGMAS * standard_error


def test_sbo_fields_on_hand_built_rows():
  # Row 0: [CLS] a b c [SEP] d e [SEP] pad pad; row 1: two packed examples
  # without separators. With rate 1 every maskable token is chosen.
  config = MaskingConfig(rate=1.0, mask_token_prob=1.0, random_token_prob=0.0, max_predictions=10)
  words = list(range(11, 21))
  batch = {
      "input_ids": np.array([[CLS, 11, 12, 13, SEP, 14, 15, SEP, PAD, PAD], words], np.int32),
      "special_mask": np.array([[1, 0, 0, 0, 1, 0, 0, 1, 1, 1], [0] * 10], np.int32),
      "pack_ids": np.array([[1, 1, 1, 1, 1, 1, 1, 1, 0, 0], [1] * 5 + [2] * 5], np.int32),
      "word_starts": np.ones((2, 10), np.int32),
      "example_ids": np.array([0, 1], np.int32),
      "epoch": np.zeros(2, np.int32),
  }
  for granularity in ("token", "span"):
    output = run(dataclasses.replace(config, granularity=granularity), batch)
    np.testing.assert_array_equal(output["mlm_weights"], [[1] * 5 + [0] * 5, [1] * 10])
    np.testing.assert_array_equal(output["mlm_positions"], [[1, 2, 3, 5, 6, 0, 0, 0, 0, 0], list(range(10))])
    np.testing.assert_array_equal(output["mlm_ids"], [[11, 12, 13, 14, 15, 0, 0, 0, 0, 0], words])
    np.testing.assert_array_equal(output["sbo_left"], [[0, 0, 0, 4, 4, 0, 0, 0, 0, 0], [0] * 5 + [4] * 5])
    np.testing.assert_array_equal(output["sbo_right"], [[4, 4, 4, 7, 7, 0, 0, 0, 0, 0], [5] * 5 + [9] * 5])
    np.testing.assert_array_equal(output["sbo_offsets"], [[0, 1, 2, 0, 1, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4] * 2])
    np.testing.assert_array_equal(output["input_ids"],
                                  [[CLS, MASK, MASK, MASK, SEP, MASK, MASK, SEP, PAD, PAD], [MASK] * 10])


def test_mask_is_a_function_of_seed_example_id_and_epoch_field(standard_batch, standard_outputs):
  # The row key does not depend on the granularity: span alone is checked. Static masking is the pipeline's
  # business (tests/test_pipeline.py): it repeats a copy's (example id, epoch field), and so its mask.
  epoch1 = dict(standard_batch, epoch=standard_batch["epoch"] + 1)
  config = standard_config("span")
  first, second = standard_outputs["span"], run(config, epoch1)
  # Two independent masks of 20 of ~100 tokens coincide with negligible probability.
  assert (first["mlm_positions"] != second["mlm_positions"]).any(1).all()
  assert (run(config, standard_batch, seed=1)["mlm_positions"] != first["mlm_positions"]).any(1).all()
  again = run(dataclasses.replace(config, dynamic=False), standard_batch)
  for name, value in first.items():
    np.testing.assert_array_equal(value, again[name], err_msg=name)


def test_same_example_same_mask_any_position_batch_or_sharding(standard_batch, standard_outputs):
  config, batch, reference = standard_config("span"), standard_batch, standard_outputs["span"]
  permutation = np.random.default_rng(11).permutation(STANDARD_ROWS)
  permuted = run(config, {name: values[permutation] for name, values in batch.items()})
  quarter = run(config, {name: values[64:128] for name, values in batch.items()})
  for name, value in reference.items():
    np.testing.assert_array_equal(permuted[name], value[permutation], err_msg=name)
    np.testing.assert_array_equal(quarter[name], value[64:128], err_msg=name)

  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  by_rows = NamedSharding(mesh, PartitionSpec("data"))
  sharded_batch = {name: jax.device_put(values, by_rows) for name, values in batch.items()}
  sharded = masker(config)(jax.random.key(0), sharded_batch)
  assert len(sharded["input_ids"].sharding.device_set) == 8
  for name, value in reference.items():
    np.testing.assert_array_equal(np.asarray(sharded[name]), value, err_msg=name)


def test_jit_compiles_once_for_repeated_calls():
  config = MaskingConfig(granularity="ngram")

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(key, batch):
    return mask_batch(key, batch, config, mask_id=MASK, vocab_size=VOCAB_SIZE)

  rng = np.random.default_rng(12)
  for call in range(3):
    batch = make_batch(rng, 8, 32, epoch=call, first_example_id=8 * call)
    step(jax.random.key(call), {name: jnp.asarray(values) for name, values in batch.items()})


@pytest.mark.parametrize("granularity", WORD_GRANULARITIES + ("named_entity",))
def test_word_and_span_masking_loop_a_known_number_of_times(granularity):
  """The loop over masked units runs max_predictions times (its later steps add nothing once the budget is spent):
  compiled with a known trip count, a GPU does not read a condition back to the host at every step."""
  batch = make_batch(np.random.default_rng(0), 4, 64)
  config = MaskingConfig(granularity=granularity, max_predictions=12)
  masked = jax.jit(lambda key, batch: mask_batch(key, batch, config, mask_id=MASK, vocab_size=VOCAB_SIZE))
  hlo = masked.lower(jax.random.key(0), batch).compile().as_text()
  loops = [line for line in hlo.splitlines() if " while(" in line]
  assert loops and all('"known_trip_count"' in line for line in loops), loops
  assert any('"known_trip_count":{"n":"12"}' in line for line in loops)
