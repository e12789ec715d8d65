"""Optimizers and learning-rate schedules (AdamW, LAMB; warmup then decay).

Weight decay is decoupled and skips biases and LayerNorm parameters (every
1-D parameter), as BERT does. Fine-tuning may scale each layer's updates with
layer-wise learning-rate decay (ELECTRA), and keeps its schedule's warmup and
total steps in the optimizer state (`HorizonSchedule`), so that tasks of other
lengths run the same compiled step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

SCHEDULES = ("linear", "poly", "cosine", "constant")
OPTIMIZERS = ("adamw", "lamb")


def learning_rate_schedule(config: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
  """Linear warmup to `lr` over `warmup_steps`, then `schedule` decay to `end_lr` at `total_steps`."""
  if config.schedule not in SCHEDULES:
    raise ValueError(f"config.optim.schedule={config.schedule!r}: expected one of {SCHEDULES}")
  warmup = int(config.warmup_steps)
  if warmup < 0 or total_steps <= 0:
    raise ValueError(f"config.optim.warmup_steps={warmup} and total steps={total_steps} must be >= 0 / > 0")
  decay_steps = max(1, total_steps - warmup)
  if config.schedule == "constant":
    decay = optax.constant_schedule(config.lr)
  elif config.schedule == "cosine":
    decay = optax.cosine_decay_schedule(config.lr, decay_steps, alpha=config.end_lr / config.lr if config.lr else 0.0)
  else:
    power = 1.0 if config.schedule == "linear" else config.power
    decay = optax.polynomial_schedule(config.lr, config.end_lr, power, decay_steps)
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, config.lr, warmup), decay], [warmup])


def decay_mask(params: Any) -> Any:
  """True for parameters that get weight decay: matrices and embedding tables, not biases or norms."""
  return jax.tree.map(lambda p: p.ndim > 1, params)


def layer_index(path: str, num_layers: int, num_blocks: int, num_groups: int = 0) -> int:
  """Depth of a parameter for layer-wise LR decay: 0 = embeddings, 1..L blocks, L + 1 = heads.

  `num_blocks` counts the `block_{i}` modules; `num_groups` the `shared_{sublayer}_{g}` ones (ALBERT's groups
  sharing one kind of sub-layer, `ModelConfig.shared_sublayers`).
  """
  if "embeddings" in path or "embedding_projection" in path:
    return 0
  match = re.search(r"(block_|shared_[a-z]+_)(\d+)", path)
  if match:
    copies = num_blocks if match.group(1) == "block_" else num_groups
    # With sharing, a module serves several layers; it takes the depth of its last one.
    return (int(match.group(2)) + 1) * num_layers // copies
  return num_layers + 1


def layerwise_lr_factors(params: Any, num_layers: int, num_blocks: int, decay: float, num_groups: int = 0) -> Any:
  """decay ** (L + 1 - depth) per parameter (heads 1, top block `decay`, embeddings decay ** (L + 1))."""
  def factor(path, _):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    return decay ** (num_layers + 1 - layer_index(name, num_layers, num_blocks, num_groups))

  return jax.tree_util.tree_map_with_path(factor, params)


def scale_by_tree(factors: Any) -> optax.GradientTransformation:
  """Multiplies each update leaf by a constant factor of the same tree."""
  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, f: u * jnp.asarray(f, u.dtype), updates, factors), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


# Leaves of at most this many elements (biases, LayerNorm vectors) share one reduction in `global_norm`.
SMALL_LEAF = 1 << 16


def global_norm(tree: Any) -> jax.Array:
  """The square root of the sum of squares of every leaf, in float32 (optax.global_norm's value).

  Each large leaf is reduced on its own; the small ones (biases, LayerNorm vectors: half of BERT's ~200 leaves)
  are reduced together over their concatenation, so that the step runs one reduction kernel for them instead of
  one each.
  """
  leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(tree)]
  small = [x.ravel() for x in leaves if x.size <= SMALL_LEAF]
  total = sum((jnp.sum(jnp.square(x)) for x in leaves if x.size > SMALL_LEAF), jnp.zeros((), jnp.float32))
  if small:
    total += jnp.sum(jnp.square(jnp.concatenate(small)))
  return jnp.sqrt(total)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  """optax.clip_by_global_norm (same rule and state) with the norm of `global_norm`."""
  def update(updates, state, params=None):
    del params
    norm = global_norm(updates)
    clip = lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)  # noqa: E731
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@dataclasses.dataclass(frozen=True)
class HorizonSchedule:
  """`learning_rate_schedule`'s rates with the warmup and total steps as arrays: `schedule(step, warmup, total)`.

  The optimizer of `make_optimizer(..., horizon_in_state=True)` keeps the two counts in its state
  (`HorizonState`), so one compiled step serves runs of any length; `rate_at` reads them back to log the rate.
  """

  name: str
  lr: float
  end_lr: float
  power: float

  def __call__(self, step, warmup_steps, total_steps):
    step, warmup = jnp.asarray(step, jnp.float32), jnp.asarray(warmup_steps, jnp.float32)
    decay_steps = jnp.maximum(1.0, jnp.asarray(total_steps, jnp.float32) - warmup)
    done = jnp.clip(step - warmup, 0.0, decay_steps) / decay_steps  # The fraction of the decay behind.
    if self.name == "constant":
      decayed = jnp.full_like(done, self.lr)
    elif self.name == "cosine":
      alpha = self.end_lr / self.lr if self.lr else 0.0
      decayed = self.lr * ((1.0 - alpha) * 0.5 * (1.0 + jnp.cos(jnp.pi * done)) + alpha)
    else:
      power = 1.0 if self.name == "linear" else self.power
      decayed = (self.lr - self.end_lr) * (1.0 - done) ** power + self.end_lr
    return jnp.where(step < warmup, self.lr * step / jnp.maximum(warmup, 1.0), decayed)


class HorizonState(NamedTuple):
  count: jax.Array  # The updates applied so far (int32).
  warmup_steps: jax.Array
  total_steps: jax.Array


def scale_by_horizon_schedule(schedule: HorizonSchedule, warmup_steps: int,
                              total_steps: int) -> optax.GradientTransformation:
  """`optax.scale_by_learning_rate` for a `HorizonSchedule`, the step counts in the state."""

  def init(params):
    del params
    return HorizonState(jnp.zeros((), jnp.int32), jnp.asarray(warmup_steps, jnp.int32),
                        jnp.asarray(total_steps, jnp.int32))

  def update(updates, state, params=None):
    del params
    rate = schedule(state.count, state.warmup_steps, state.total_steps)
    updates = jax.tree.map(lambda u: jnp.asarray(-rate, u.dtype) * u, updates)  # As optax casts it.
    return updates, state._replace(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init, update)


def rate_at(schedule: Any, step: jax.Array, opt_state: Any) -> jax.Array:
  """The learning rate of `step`: `schedule(step)`, or a `HorizonSchedule`'s at the counts `opt_state` holds."""
  if not isinstance(schedule, HorizonSchedule):
    return schedule(step)
  found = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, HorizonState))
           if isinstance(leaf, HorizonState)]
  if len(found) != 1:
    raise ValueError(f"a HorizonSchedule needs one HorizonState in the optimizer state, found {len(found)}")
  return schedule(step, found[0].warmup_steps, found[0].total_steps)


def make_optimizer(config: ml_collections.ConfigDict, total_steps: int, lr_factors: Any | None = None,
                   horizon_in_state: bool = False) -> tuple[optax.GradientTransformation, Any]:
  """Builds the optimizer of `config.optim` (name, lr, b1, b2, eps, weight_decay, clip_norm, schedule...).

  horizon_in_state: the schedule's warmup and total steps live in the optimizer state as arrays, not in the
  compiled step (a `HorizonSchedule`); fine-tuning runs of different lengths then share their compilations.

  Returns:
    (transformation, learning-rate schedule: an optax schedule, or the `HorizonSchedule`; `rate_at` reads either).
  """
  if config.name not in OPTIMIZERS:
    raise ValueError(f"config.optim.name={config.name!r}: expected one of {OPTIMIZERS}")
  schedule = learning_rate_schedule(config, total_steps)  # Checks the schedule's settings in either case.
  parts = []
  if config.clip_norm and config.clip_norm > 0:
    parts.append(clip_by_global_norm(config.clip_norm))
  parts += [optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps),
            optax.add_decayed_weights(config.weight_decay, mask=decay_mask)]
  if config.name == "lamb":
    parts.append(optax.scale_by_trust_ratio())
  if lr_factors is not None:
    parts.append(scale_by_tree(lr_factors))
  if horizon_in_state:
    schedule = HorizonSchedule(config.schedule, config.lr, config.end_lr, config.power)
    parts.append(scale_by_horizon_schedule(schedule, int(config.warmup_steps), total_steps))
  else:
    parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts), schedule
