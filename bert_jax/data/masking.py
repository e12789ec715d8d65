"""Masked-LM corruption on device: token, whole-word, n-gram, span and linguistic-span masking.

`mask_batch` runs inside the jitted train step. Every row is masked with its
own key, `fold_in(fold_in(key, example_id), epoch)`, so a row gets the same
mask whatever its position in the batch, the batch size, the device count or
the sharding; dynamic masking is free and exactly reproducible. Static
masking is the input pipeline's business: with static examples its `epoch`
field names the copy of the examples (`pipeline.pretraining_iterator`'s
`duplicates`), so each copy keeps one mask.

How positions are chosen (per row; a row has `n` maskable tokens, i.e. tokens
that are neither special nor padding):

* The budget is `round(rate * n)` tokens as in BERT, at least 1 when n > 0,
  and at most `max_predictions` (M), the static number of prediction slots.
* "token": a uniformly random set of `budget` maskable tokens (one top-k).
* "whole_word", "ngram", "span", "named_entity", "noun_phrase": a bounded loop (at most M iterations, it
  stops early once every row is done) that adds one span of whole words per
  iteration. An anchor word is drawn uniformly among the unchosen words that
  still fit in the remaining budget; a span length in words is drawn (always 1
  for whole_word, p(n) ∝ 1/n for n <= max_ngram as in ALBERT, a geometric
  length truncated at span_max_len as in SpanBERT); the span grows right from
  the anchor word and stops early at a special token, a pack boundary, an
  already chosen word, or a word that would overflow the budget. Words are
  never split. (SpanBERT's code draws anchor tokens, which favours long words
  a little, and cuts the last span mid-word at the budget; ALBERT's resamples
  n where an n-gram does not fit. Truncating whole words keeps one rule.)

  "named_entity" and "noun_phrase" (SpanBERT's Table 6) draw, per unit,
  a coin: with probability `linguistic_prob` (the paper's 50%) the unit is
  a whole marked span of that kind (an entity or a noun phrase, from the
  span bits of `word_starts`, see `bert_jax.data.batch`) drawn uniformly
  among the unchosen spans that fit in the remaining budget, with priorities
  of their own; otherwise, or when no span fits, it is one whole word as in
  whole_word. A span is never cut: one that does not fit is not drawn. The
  paper says "50% of the time" without saying of what; per unit keeps one
  budget loop, and the share of chosen units that are spans stays 1/2 while
  spans fit.

  For whole_word this is exactly BERT's procedure (shuffle the words, take
  each one that still fits, skip the ones that would overflow): the next word
  BERT accepts is the first fitting word in a uniformly random order of the
  words not yet visited, and a skipped word never fits later because the
  remaining budget only shrinks, so it is a uniform draw among all unchosen
  fitting words.

Of the chosen tokens, `mask_token_prob` become [MASK], `random_token_prob` a
uniformly random id in [0, vocab_size), and the rest keep their id.

The span boundary objective (SpanBERT) needs, for every prediction, the
positions just outside its span and its offset inside it. Spans are the
contiguous runs of chosen tokens within one packed example, whatever the
granularity (two spans drawn next to each other form one run).

Word shuffling (StructBERT's word structural objective, `shuffle_words=True`):
after the MLM positions are chosen, the row's tokens are also reordered inside
a few trigrams of unchosen tokens, and the model predicts the original token at
every position of each shuffled trigram. The paper shuffles "5% of the
trigrams" of unmasked tokens and leaves the counting open; here a row of n
maskable tokens holds n/K disjoint K-grams, of which round(shuffle_rate * n / K)
are shuffled, at least one (K = `shuffle_len`, 3 in the paper), so
`shuffle_rate` is also the fraction of the row's tokens shuffled. A K-gram is K
consecutive maskable tokens of one packed example, none chosen by the MLM nor
in another shuffled K-gram (words may be cut: the paper shuffles tokens). The
K-grams are drawn one at a time, each start uniform among those still free (the
anchor rule of the spans above). Each K-gram is reordered by a permutation
drawn uniformly among the K! - 1 that are not the identity (5 for a trigram):
an identity "shuffle" would make the label the input token, a free prediction.
A permutation with a fixed point (a transposition of a trigram) leaves one token
in place; it is still predicted, as the paper predicts every position of the
shuffled span.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.data import batch as batch_lib

LINGUISTIC_GRANULARITIES = batch_lib.SPAN_KINDS  # Masked by the corpus' marked spans of that kind.
GRANULARITIES = ("token", "whole_word", "ngram", "span", *LINGUISTIC_GRANULARITIES)


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
  """How to choose and corrupt the positions the MLM predicts.

  Attributes:
    rate: fraction of the maskable tokens of a row to predict (BERT 0.15).
    mask_token_prob: fraction of the chosen tokens replaced by [MASK].
    random_token_prob: fraction replaced by a uniformly random token id; the
      remaining `1 - mask_token_prob - random_token_prob` keep their id.
    granularity: "token", "whole_word", "ngram" (ALBERT), "span" (SpanBERT), or
      "named_entity" / "noun_phrase" (SpanBERT's linguistic masking; the
      prepared corpus needs those spans marked, `bert-jax mark-spans`).
    max_ngram: largest n-gram in words; p(n) ∝ 1/n for n = 1..max_ngram.
    span_geometric_p: SpanBERT span length in words ~ Geometric(p) ...
    span_max_len: ... truncated at this many words and renormalised, as in the
      SpanBERT code (mean 3.8 words for p=0.2, max 10).
    linguistic_prob: for named_entity / noun_phrase, the probability that a
      masked unit is a marked span rather than a whole word.
    max_predictions: M, the static number of prediction slots per row; the
      budget never exceeds it.
    dynamic: True draws a new mask (and new examples) every epoch. False gives
      BERT's static masking: the examples are built `dupe_factor` ways once,
      each copy with its own mask, and epoch e trains on copy e mod dupe_factor
      (the trainer passes it to the input pipeline as `duplicates`).
    dupe_factor: the number of static copies (BERT: 10); unused when dynamic.
    shuffle_rate: word shuffling (the objective mlm+wso only): round(shuffle_rate * n / shuffle_len) K-grams of
      a row's n maskable tokens are shuffled, at least one (StructBERT: 5% of the trigrams).
    shuffle_len: K, the tokens of one shuffled K-gram (StructBERT: 3).
  """

  rate: float = 0.15
  mask_token_prob: float = 0.8
  random_token_prob: float = 0.1
  granularity: str = "token"
  max_ngram: int = 3
  span_geometric_p: float = 0.2
  span_max_len: int = 10
  linguistic_prob: float = 0.5
  max_predictions: int = 20
  dynamic: bool = True
  dupe_factor: int = 10
  shuffle_rate: float = 0.05
  shuffle_len: int = 3

  def __post_init__(self):
    if not 0.0 < self.rate <= 1.0:
      raise ValueError(f"MaskingConfig.rate must be in (0, 1], got {self.rate}")
    for name in ("mask_token_prob", "random_token_prob", "linguistic_prob"):
      if not 0.0 <= getattr(self, name) <= 1.0:
        raise ValueError(f"MaskingConfig.{name} must be in [0, 1], got {getattr(self, name)}")
    if self.mask_token_prob + self.random_token_prob > 1.0:
      raise ValueError(
          "MaskingConfig.mask_token_prob + random_token_prob must be <= 1, got "
          f"{self.mask_token_prob} + {self.random_token_prob}")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"MaskingConfig.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
    for name in ("max_ngram", "span_max_len", "max_predictions", "dupe_factor"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MaskingConfig.{name} must be an int >= 1, got {value!r}")
    if not 0.0 < self.span_geometric_p <= 1.0:
      raise ValueError(f"MaskingConfig.span_geometric_p must be in (0, 1], got {self.span_geometric_p}")
    if not 0.0 < self.shuffle_rate <= 1.0:
      raise ValueError(f"MaskingConfig.shuffle_rate must be in (0, 1], got {self.shuffle_rate}")
    # K! permutations are tabled; beyond 6 the table grows fast and no paper shuffles longer spans.
    if isinstance(self.shuffle_len, bool) or not isinstance(self.shuffle_len, int) or not 2 <= self.shuffle_len <= 6:
      raise ValueError(f"MaskingConfig.shuffle_len must be an int in [2, 6], got {self.shuffle_len!r}")


def span_length_probs(config: MaskingConfig) -> np.ndarray:
  """Probabilities of span lengths 1, 2, ... (in words) for `config`.

  Returns:
    float64 [K]: entry n-1 is p(length n). K is 1 for token, whole_word and
    the linguistic granularities (their words are drawn one at a time),
    max_ngram for ngram, span_max_len for span.
  """
  if config.granularity == "ngram":
    weights = 1.0 / np.arange(1, config.max_ngram + 1)
  elif config.granularity == "span":
    lengths = np.arange(1, config.span_max_len + 1)
    weights = config.span_geometric_p * (1.0 - config.span_geometric_p)**(lengths - 1)
  else:
    weights = np.ones(1)
  return weights / weights.sum()


# All the randomness of a row comes from one `jax.random.bits` call, turned
# into what each use needs by the helpers below: every threefry call adds
# about half a second of XLA compile time on CPU.


def _unit_floats(bits: jax.Array) -> jax.Array:
  """uint32 bits -> float32 uniform on [0, 1), 24 bits of resolution."""
  return (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))


def _span_lengths_from_bits(bits: jax.Array, config: MaskingConfig) -> jax.Array:
  """uint32 bits -> int32 span lengths in words (same shape), by inverting the CDF."""
  cdf = jnp.asarray(np.cumsum(span_length_probs(config))[:-1], jnp.float32)
  return 1 + (_unit_floats(bits)[..., None] >= cdf).sum(-1, dtype=jnp.int32)


def sample_span_lengths(key: jax.Array, config: MaskingConfig, shape: tuple[int, ...]) -> jax.Array:
  """Draws span lengths in words from `span_length_probs(config)`: int32 `shape`, values >= 1."""
  return _span_lengths_from_bits(jax.random.bits(key, shape), config)


def _shift_right(x: jax.Array, fill) -> jax.Array:
  """x[t-1] at t, `fill` at 0. x: [L]."""
  return jnp.concatenate([jnp.full((1,), fill, x.dtype), x[:-1]])


def _shift_left(x: jax.Array, fill) -> jax.Array:
  """x[t+1] at t, `fill` at L-1. x: [L]."""
  return jnp.concatenate([x[1:], jnp.full((1,), fill, x.dtype)])


def _choose_tokens(priority: jax.Array, maskable: jax.Array, budget: jax.Array, max_predictions: int) -> jax.Array:
  """A uniformly random set of `budget` maskable tokens.

  Args:
    priority: int32 [L] i.i.d. uniform on [0, 2**31).
    maskable: bool [L].
    budget: int32 [], at most min(max_predictions, maskable.sum()).
    max_predictions: M.

  Returns:
    bool [L], True at the chosen tokens.
  """
  length = maskable.shape[0]
  # Non-maskable tokens score below every maskable one, so they are never
  # among the `budget` highest scores. top_k of M is cheaper than a full sort.
  scores = jnp.where(maskable, priority, -1)
  _, highest = jax.lax.top_k(scores, min(max_predictions, length))
  taken = jnp.arange(highest.shape[0]) < budget
  return jnp.zeros((length,), bool).at[highest].set(taken)


def _choose_spans(priority: jax.Array, span_words: jax.Array, maskable: jax.Array, word_starts: jax.Array,
                  special_mask: jax.Array, pack_ids: jax.Array, budget: jax.Array, config: MaskingConfig,
                  span_priority: jax.Array | None = None, coins: jax.Array | None = None) -> jax.Array:
  """Whole-word spans (or marked linguistic spans) until the budget is spent (see the module docstring).

  Args:
    priority: int32 [L] i.i.d. uniform on [0, 2**31): the order anchors are tried in.
    span_words: int32 [M] the length in words of each span to draw.
    maskable: bool [L].
    word_starts, special_mask, pack_ids: int32 [L], as in the batch contract.
    budget: int32 [], at most min(max_predictions, maskable.sum()).
    config: granularity "whole_word", "ngram", "span", "named_entity" or "noun_phrase".
    span_priority: int32 [L] like `priority`, the order marked spans are tried in (linguistic granularities).
    coins: float32 [M] uniform on [0, 1): unit k is a marked span when coins[k] < linguistic_prob.

  Returns:
    bool [L], True at the chosen tokens; never splits a word or a marked span,
    never crosses a special token or a pack boundary within one span.
  """
  length = maskable.shape[0]
  positions = jnp.arange(length)
  special = special_mask > 0
  new_pack = pack_ids != _shift_right(pack_ids, -1)
  # Special tokens and pack boundaries always delimit words, even where the
  # word_starts column says otherwise, so every word is wholly maskable or not.
  is_start = ((word_starts & 1) > 0) | special | _shift_right(special, True) | new_pack
  word_index = jnp.cumsum(is_start) - 1
  word_end = jax.lax.cummin(jnp.where(_shift_left(is_start, True), positions, length), reverse=True)
  word_len = word_end - positions + 1  # Meaningful at word starts.
  linguistic = config.granularity in LINGUISTIC_GRANULARITIES
  if linguistic:
    start_bit, inside_bit = batch_lib.span_bits(config.granularity)
    in_span = ((word_starts & inside_bit) > 0) & maskable
    # A span also starts where a cut (truncation, a pack or a segment's edge) left only its tail.
    span_first = in_span & (((word_starts & start_bit) > 0) | ~_shift_right(in_span, False) | new_pack)
    span_last = in_span & _shift_left(~in_span | span_first | new_pack, True)
    span_end = jnp.minimum(jax.lax.cummin(jnp.where(span_last, positions, length), reverse=True), length - 1)
    span_len = span_end - positions + 1  # Meaningful at span starts.

  def add_span(step, state):
    remaining, chosen = state
    free = maskable & ~chosen
    candidates = is_start & free & (word_len <= remaining)
    has_candidate = candidates.any()
    # The anchor is the candidate of highest priority, drawn once for the row:
    # the candidate sets only shrink from one step to the next, so the
    # remaining candidates' priorities stay exchangeable and each anchor is a
    # uniform draw among them.
    anchor = jnp.argmax(jnp.where(candidates, priority, -1))
    num_words = span_words[step]
    blocked = ~free | (pack_ids != pack_ids[anchor])
    first_blocked = jnp.min(jnp.where(blocked & (positions >= anchor), positions, length))
    # Each condition holds on a prefix of the words from the anchor on, so the
    # span is contiguous; the budget test is on the word's end: no split words.
    span = ((positions >= anchor) & (positions < first_blocked)
            & (word_index - word_index[anchor] < num_words)
            & (word_end - anchor < remaining) & has_candidate)
    if linguistic:
      chosen_through = jnp.cumsum(chosen)
      chosen_inside = chosen_through[span_end] - chosen_through + chosen  # chosen tokens in [t, span_end[t]]
      span_candidates = span_first & (chosen_inside == 0) & (span_len <= remaining)
      use_span = (coins[step] < config.linguistic_prob) & span_candidates.any()
      # Separate priorities keep each kind of draw uniform among its own candidates.
      span_anchor = jnp.argmax(jnp.where(span_candidates, span_priority, -1))
      marked = (positions >= span_anchor) & (positions <= span_end[span_anchor])
      span = jnp.where(use_span, marked, span)
      has_candidate = has_candidate | use_span
    # A row with budget left but no word that fits is done.
    remaining = jnp.where(has_candidate, remaining - span.sum(), 0)
    return remaining, chosen | span

  # A fixed trip count, not a loop until the budget is spent: once it is, a step adds nothing, and a GPU runs a
  # loop of known length without reading its condition back to the host at every step.
  _, chosen = jax.lax.fori_loop(0, config.max_predictions, add_span, (budget, jnp.zeros((length,), bool)))
  return chosen


def max_shuffled_spans(config: MaskingConfig, seq_len: int) -> int:
  """The most K-grams a row of `seq_len` tokens shuffles: the static number of word-shuffling slots is K times it."""
  return max(1, round(config.shuffle_rate * seq_len / config.shuffle_len))


def shuffle_slots(config: MaskingConfig, seq_len: int) -> int:
  """The static number of word-shuffling predictions of a row (`mask_batch`'s shuffled_* width)."""
  return config.shuffle_len * max_shuffled_spans(config, seq_len)


def non_identity_permutations(length: int) -> np.ndarray:
  """int32 [length! - 1, length]: every permutation of range(length) but the identity, in lexicographic order."""
  return np.array(list(itertools.permutations(range(length)))[1:], np.int32)


def _shuffle_spans(priority: jax.Array, draws: jax.Array, free: jax.Array, pack_ids: jax.Array,
                   num_maskable: jax.Array, config: MaskingConfig) -> tuple[jax.Array, jax.Array]:
  """Chooses the K-grams to shuffle and their permutations (see the module docstring).

  Args:
    priority: int32 [L] i.i.d. uniform on [0, 2**31): the order K-gram starts are tried in.
    draws: uint32 [S] one draw per K-gram slot for its permutation.
    free: bool [L] maskable tokens the MLM did not choose.
    pack_ids: int32 [L].
    num_maskable: int32 [] the row's maskable tokens.
    config: shuffle_rate and shuffle_len.

  Returns:
    starts: int32 [S] first position of each shuffled K-gram, -1 for an unused slot.
    permutations: int32 [S, K] the new order: position start + j receives the token at start + permutations[j].
  """
  length, width = free.shape[0], config.shuffle_len
  positions = jnp.arange(length)
  most = draws.shape[0]
  wanted = jnp.maximum(jnp.round(config.shuffle_rate * num_maskable / width).astype(jnp.int32), 1)
  # Starts whose next width-1 tokens are in the same pack: a K-gram never crosses examples.
  same_pack = jnp.ones((length,), bool)
  for offset in range(1, width):
    same_pack &= jnp.concatenate([pack_ids[offset:] == pack_ids[:-offset], jnp.zeros((offset,), bool)])

  def add(step, state):
    taken, starts = state
    available = free & ~taken
    fits = same_pack & available
    for offset in range(1, width):
      fits &= jnp.concatenate([available[offset:], jnp.zeros((offset,), bool)])
    use = fits.any() & (step < wanted)
    # Candidate sets only shrink, so the highest priority among them is a uniform draw (as `_choose_spans`).
    anchor = jnp.argmax(jnp.where(fits, priority, -1)).astype(jnp.int32)
    span = (positions >= anchor) & (positions < anchor + width) & use
    return taken | span, starts.at[step].set(jnp.where(use, anchor, -1))

  _, starts = jax.lax.fori_loop(0, most, add, (jnp.zeros((length,), bool), jnp.full((most,), -1, jnp.int32)))
  table = non_identity_permutations(width)
  # The modulo's bias is below len(table) / 2**32: negligible.
  permutations = jnp.asarray(table)[(draws % len(table)).astype(jnp.int32)]
  return starts, permutations


def _mask_row(key: jax.Array, input_ids: jax.Array, word_starts: jax.Array, special_mask: jax.Array,
              pack_ids: jax.Array, *, config: MaskingConfig, mask_id: int, vocab_size: int,
              shuffle_words: bool = False) -> dict[str, jax.Array]:
  """Masks one row; arrays are [L]. Returns `mask_batch`'s fields without the batch axis."""
  length = input_ids.shape[0]
  num_slots = config.max_predictions
  positions = jnp.arange(length)
  linguistic = config.granularity in LINGUISTIC_GRANULARITIES
  most_shuffled = max_shuffled_spans(config, length) if shuffle_words else 0
  # The linguistic granularities and word shuffling draw more bits; the others keep the draws they always had.
  linguistic_bits = length + num_slots if linguistic else 0
  shuffle_bits = length + most_shuffled if shuffle_words else 0
  bits = jax.random.bits(key, (3 * length + num_slots + linguistic_bits + shuffle_bits,))
  priority = (bits[:length] >> 1).astype(jnp.int32)
  action = _unit_floats(bits[length:2 * length])
  # The modulo's bias is below vocab_size / 2**32: negligible.
  random_ids = (bits[2 * length:3 * length] % vocab_size).astype(input_ids.dtype)
  span_words = _span_lengths_from_bits(bits[3 * length:3 * length + num_slots], config)

  maskable = (special_mask == 0) & (pack_ids > 0)
  num_maskable = maskable.sum()
  budget = jnp.round(config.rate * num_maskable).astype(jnp.int32)
  budget = jnp.clip(budget, jnp.minimum(num_maskable, 1), num_slots)
  if config.granularity == "token":
    chosen = _choose_tokens(priority, maskable, budget, num_slots)
  else:
    extra = {}
    if linguistic:
      offset = 3 * length + num_slots
      extra = {"span_priority": (bits[offset:offset + length] >> 1).astype(jnp.int32),
               "coins": _unit_floats(bits[offset + length:offset + linguistic_bits])}
    chosen = _choose_spans(priority, span_words, maskable, word_starts, special_mask, pack_ids, budget, config,
                           **extra)

  to_mask = chosen & (action < config.mask_token_prob)
  to_random = chosen & ~to_mask & (action < config.mask_token_prob + config.random_token_prob)
  corrupted = jnp.where(to_mask, jnp.asarray(mask_id, input_ids.dtype), jnp.where(to_random, random_ids, input_ids))

  # Runs of chosen tokens, cut at pack boundaries, are the spans of the SBO.
  same_pack_as_prev = pack_ids == _shift_right(pack_ids, -1)
  same_pack_as_next = pack_ids == _shift_left(pack_ids, -1)
  run_start = chosen & ~(_shift_right(chosen, False) & same_pack_as_prev)
  run_end = chosen & ~(_shift_left(chosen, False) & same_pack_as_next)
  start_of_run = jax.lax.cummax(jnp.where(run_start, positions, -1))
  end_of_run = jax.lax.cummin(jnp.where(run_end, positions, length), reverse=True)

  (slot_positions,) = jnp.nonzero(chosen, size=num_slots, fill_value=0)
  used = jnp.arange(num_slots) < chosen.sum()

  def gather(values):
    return jnp.where(used, values[slot_positions], 0).astype(jnp.int32)

  outputs = {
      "input_ids": corrupted,
      "mlm_positions": slot_positions.astype(jnp.int32),
      "mlm_ids": gather(input_ids),
      "mlm_weights": used.astype(jnp.float32),
      "sbo_left": gather(jnp.clip(start_of_run - 1, 0, length - 1)),
      "sbo_right": gather(jnp.clip(end_of_run + 1, 0, length - 1)),
      "sbo_offsets": gather(positions - start_of_run),
  }
  if shuffle_words:
    offset = 3 * length + num_slots + linguistic_bits
    starts, permutations = _shuffle_spans((bits[offset:offset + length] >> 1).astype(jnp.int32),
                                          bits[offset + length:], maskable & ~chosen, pack_ids, num_maskable, config)
    in_use = jnp.repeat(starts >= 0, config.shuffle_len)
    targets = (starts[:, None] + jnp.arange(config.shuffle_len)).reshape(-1)
    sources = (starts[:, None] + permutations).reshape(-1)
    # Unused slots write past the row and are dropped; shuffled tokens were never chosen, so never corrupted.
    outputs["input_ids"] = corrupted.at[jnp.where(in_use, targets, length)].set(
        input_ids[jnp.where(in_use, sources, 0)], mode="drop")
    outputs["shuffled_positions"] = jnp.where(in_use, targets, 0).astype(jnp.int32)
    outputs["shuffled_ids"] = jnp.where(in_use, input_ids[jnp.where(in_use, targets, 0)], 0).astype(jnp.int32)
    outputs["shuffled_weights"] = in_use.astype(jnp.float32)
  return outputs


def mask_batch(key: jax.Array, batch: dict[str, jax.Array], config: MaskingConfig, *, mask_id: int,
               vocab_size: int, shuffle_words: bool = False) -> dict[str, jax.Array]:
  """Chooses and corrupts the MLM positions of every row of a batch.

  Jittable with static shapes; `config`, `mask_id` and `vocab_size` are
  static (close over them or pass them as static arguments).

  Args:
    key: the masking key of the run (a raw uint32 [2] key or a typed key).
    batch: the batch contract of `bert_jax.data.batch`; uses input_ids,
      word_starts, special_mask, pack_ids [B, L] and example_ids, epoch [B].
    config: how to mask.
    mask_id: id of the [MASK] token.
    vocab_size: random replacements are drawn uniformly from [0, vocab_size).
    shuffle_words: also shuffle K-grams of unchosen tokens (StructBERT's word structural objective).

  Returns:
    input_ids: [B, L] (dtype of the input) the corrupted inputs.
    mlm_positions: int32 [B, M] chosen positions, ascending; 0 in unused slots.
    mlm_ids: int32 [B, M] original ids at those positions; 0 in unused slots.
    mlm_weights: float32 [B, M] 1 for a real prediction, 0 for an unused slot.
    sbo_left, sbo_right: int32 [B, M] position just before / after the
      contiguous masked run of the prediction, clipped into [0, L); 0 unused.
    sbo_offsets: int32 [B, M] 0-based index of the prediction in its run.
    With shuffle_words, also (S = `shuffle_slots(config, L)`, K consecutive slots a K-gram):
    shuffled_positions: int32 [B, S] the positions of the shuffled K-grams; 0 in unused slots.
    shuffled_ids: int32 [B, S] the original ids there (the labels); 0 in unused slots.
    shuffled_weights: float32 [B, S] 1 for a shuffled position, 0 for an unused slot.
    input_ids then holds the shuffled tokens too.
  """

  def row_key(example_id, epoch):
    return jax.random.fold_in(jax.random.fold_in(key, example_id), epoch)

  row_keys = jax.vmap(row_key)(batch["example_ids"], batch["epoch"])
  mask_row = functools.partial(_mask_row, config=config, mask_id=mask_id, vocab_size=vocab_size,
                               shuffle_words=shuffle_words)
  return jax.vmap(mask_row)(row_keys, batch["input_ids"], batch["word_starts"], batch["special_mask"],
                            batch["pack_ids"])
