"""Train state, sharded initialisation and the jitted train / eval steps.

The step is one pure function `train_step(state, batch) -> (state, metrics)`,
compiled once with in/out shardings and the state donated (or, with
`steps_per_call` k, one call that scans the step over k batches). Gradient
accumulation scans over micro-batches, summing gradients of losses that are
already divided by the *whole* batch's counts, so it equals the direct step
(exactly without dropout and ELECTRA's sampling; with them each micro-batch
draws its own random numbers, so the two agree in distribution). A step
whose loss or gradients are not finite leaves the parameters unchanged and
reports `nonfinite=1`; the loop stops the run on it.

A task whose loss also reads parameters that are not trained (distillation's
teacher, `bert_jax.train.distill`) gets them from `TrainState.frozen`: the step
passes them to `task.with_frozen(frozen, inputs)` for each (micro-)batch,
outside the gradient, and the optimizer never sees them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Protocol, Sequence

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from bert_jax.parallel import sharding as sharding_lib
from bert_jax.train import optim

log = logging.getLogger(__name__)

Array = jax.Array


@flax.struct.dataclass
class TrainState:
  step: Array
  params: Any
  opt_state: Any
  # Parameters the loss reads and nothing trains (a distillation teacher): no gradient, no optimizer state, and
  # left out of checkpoints (a run reads them again from where they came from). Donated with the rest of the
  # state and returned unchanged, so the newest state holds the live copy.
  frozen: Any = None


class Objective(Protocol):
  """What the step needs from an objective: pre-training's (`objectives`) or fine-tuning's (`FinetuneObjective`)."""

  weights: dict[str, float]

  def prepare(self, batch: dict[str, Array]) -> dict[str, Array]: ...

  def denominators(self, inputs: dict[str, Array]) -> dict[str, Array]: ...

  def forward(self, params: Any, inputs: dict[str, Array], rng: Array | None, train: bool) -> dict[str, Array]: ...

  # A task that reads `TrainState.frozen` also has `with_frozen(frozen, inputs) -> inputs` (their outputs added).


def checkpointed(state: TrainState) -> dict[str, Any]:
  """What a checkpoint holds of `state`: all but `frozen`, in the layout of checkpoints written before it existed."""
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


@dataclasses.dataclass(frozen=True)
class Partitioning:
  mesh: Mesh
  rules: tuple

  @contextlib.contextmanager
  def context(self):
    """Mesh + logical rules in scope, so the model's logical constraints resolve."""
    with self.mesh, nn.logical_axis_rules(self.rules):
      yield


def create_state(init_variables: Callable[[Array], Any], tx: optax.GradientTransformation, rng: Array,
                 partitioning: Partitioning) -> tuple[TrainState, Any]:
  """Initialises the train state directly in its shards.

  Args:
    init_variables: rng -> boxed variables ({"params": ...}) with logical axes.
    tx: the optimizer.
    rng: init key.
    partitioning: mesh and rules.

  Returns:
    (state, state shardings).
  """
  init, shardings = make_state_init(init_variables, tx, partitioning, rng)
  return init(rng), shardings


def _split_microbatches(inputs: dict[str, Array], accum_steps: int) -> dict[str, Array]:
  """[B, ...] -> [accum, B / accum, ...] taking rows i, i + accum, ... so each device keeps its rows."""
  def split(x):
    rows = x.shape[0]
    return jnp.swapaxes(x.reshape((rows // accum_steps, accum_steps) + x.shape[1:]), 0, 1)

  return jax.tree.map(split, inputs)


def _loss_and_terms(task: Objective, params, inputs, rng, denominators, train, frozen=None):
  if frozen is not None:  # Not an argument the gradient is taken of: the frozen model runs forward only.
    inputs = task.with_frozen(jax.lax.stop_gradient(frozen), inputs)
  terms = task.forward(params, inputs, rng, train)
  loss = sum(weight * terms[f"{name}_loss"] / jnp.maximum(denominators[name], 1.0)
             for name, weight in task.weights.items())
  return loss, terms


def _model_params(partitioning: Partitioning, param_shardings: Any) -> Callable[[Any], Any]:
  """`params -> params as the model reads them`: under FSDP, boxed to be gathered whole where a module reads them.

  Left to itself, XLA keeps FSDP weights sharded and moves the activations
  instead (all-gathers and all-reduces of [batch, length, hidden] per layer).
  Each parameter is boxed (`sharding.GatherOnUse`) so that it is gathered where
  a module reads it: inside a rematerialised block (`model.remat`) the gather
  is recomputed in the backward pass, so only that block's weights are whole
  at a time. In the train step the gradients are reduced back into the shards.
  """
  if partitioning.mesh.shape.get("fsdp", 1) == 1:
    return lambda params: params
  gather_to = sharding_lib.gathered(param_shardings)
  return lambda params: jax.tree.map(sharding_lib.GatherOnUse, params, gather_to)


def make_train_step(task: Objective, tx: optax.GradientTransformation, schedule: Any, *, accum_steps: int,
                    rng: Array, partitioning: Partitioning, state_shardings: Any, param_norms: bool = False,
                    steps_per_call: int = 1) -> Callable[[TrainState, Any], tuple[TrainState, Any]]:
  """Returns `train_step(state, batch) -> (state, metrics)`, jitted with in/out shardings and the state donated.

  The step's random key is `fold_in(rng, state.step)` (and, under accumulation, folded again with the
  micro-batch index). The metrics always hold the loss, its terms, the gradients' global norm and the learning
  rate (of `schedule`, `make_optimizer`'s second result). With `param_norms` they also hold `param_norm` (the
  parameters before the update) and `update_norm` (the update the optimizer computed); off by default, as
  Megatron-LM's --log-params-norm, because the two extra reductions over every parameter slow the update
  (docs/performance.md).

  `steps_per_call` k > 1: `train_step(state, batches) -> (state, metrics)` takes a sequence of k batches and
  takes the step k times in one call (a `lax.scan` over the batches, one compiled step body), so the host's cost
  of a call is paid once per k steps; each metric has a leading axis of k, one entry a step, in order.
  """
  read = _model_params(partitioning, state_shardings.params)
  read_frozen = _model_params(partitioning, state_shardings.frozen)
  grad_fn = jax.value_and_grad(
      lambda task, params, inputs, rng, denominators, train, frozen: _loss_and_terms(
          task, read(params), inputs, rng, denominators, train, None if frozen is None else read_frozen(frozen)),
      argnums=1, has_aux=True)

  def train_step(state: TrainState, batch: dict[str, Array]) -> tuple[TrainState, dict[str, Array]]:
    with partitioning.context():
      step_rng = jax.random.fold_in(rng, state.step)
      inputs = task.prepare(batch)
      denominators = task.denominators(inputs)
      if accum_steps == 1:
        (loss, terms), grads = grad_fn(task, state.params, inputs, step_rng, denominators, True, state.frozen)
      else:
        micro = _split_microbatches(inputs, accum_steps)

        def body(carry, xs):
          grads_sum, loss_sum, terms_sum = carry
          micro_inputs, index = xs
          (loss, terms), grads = grad_fn(task, state.params, micro_inputs, jax.random.fold_in(step_rng, index),
                                         denominators, True, state.frozen)
          add = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
          return (add(grads_sum, grads), loss_sum + loss, add(terms_sum, terms)), None

        zeros_grads = jax.tree.map(jnp.zeros_like, state.params)
        abstract_terms = jax.eval_shape(lambda: _loss_and_terms(
            task, state.params, jax.tree.map(lambda x: x[0], micro), step_rng, denominators, True, state.frozen)[1])
        zeros_terms = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_terms)
        (grads, loss, terms), _ = jax.lax.scan(body, (zeros_grads, jnp.zeros((), jnp.float32), zeros_terms),
                                               (micro, jnp.arange(accum_steps)))
      grad_norm = optim.global_norm(grads)
      # Decided before the update so that each parameter's update and keep-or-discard fuse into one pass; with
      # finite gradients, parameters and moments the AdamW / LAMB update is finite too.
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
      new_state = state.replace(step=state.step + 1, params=keep(params, state.params),
                                opt_state=keep(opt_state, state.opt_state))
      metrics = summarize(task, terms, denominators)
      metrics.update(loss=loss, grad_norm=grad_norm, nonfinite=1 - finite.astype(jnp.int32),
                     learning_rate=optim.rate_at(schedule, state.step, state.opt_state))
      if param_norms:
        metrics.update(param_norm=optim.global_norm(state.params), update_norm=optim.global_norm(updates))
      return new_state, metrics

  batch_sharding = sharding_lib.batch_sharding(partitioning.mesh)
  if steps_per_call == 1:
    return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, sharding_lib.replicated(partitioning.mesh)), donate_argnums=0,
                   compiler_options=compiler_options())
  if steps_per_call < 1:
    raise ValueError(f"steps_per_call must be a positive integer, got {steps_per_call!r}")
  # Step-major [k, batch, ...]: each step's rows stay on the devices that hold them.
  stacked_sharding = jax.sharding.NamedSharding(partitioning.mesh,
                                                jax.sharding.PartitionSpec(None, *batch_sharding.spec))

  def train_steps(state: TrainState, batches) -> tuple[TrainState, dict[str, Array]]:
    if len(batches) != steps_per_call:
      raise ValueError(f"train_step takes {steps_per_call} batches a call (steps_per_call), got {len(batches)}")
    stacked = jax.lax.with_sharding_constraint(jax.tree.map(lambda *fields: jnp.stack(fields), *batches),
                                               stacked_sharding)
    # A loop over one compiled step body: it compiles in about one step's time, where unrolling compiles k bodies.
    return jax.lax.scan(train_step, state, stacked)

  return jax.jit(train_steps, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, sharding_lib.replicated(partitioning.mesh)), donate_argnums=0,
                 compiler_options=compiler_options())


# XLA options of the train, eval and predict steps on GPU, each measured faster on this model (docs/performance.md):
# - Triton GEMM fusions off: cuBLAS is faster on this model's matmul shapes and compiles faster.
# - The dot merger off: merged query and key projections lose the bias add that cuBLAS fuses into each GEMM.
GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}


def compiler_options(backend: str | None = None) -> dict[str, Any] | None:
  """`jax.jit(compiler_options=...)` for the steps: GPU_COMPILER_OPTIONS on GPU, None elsewhere.

  An option the user sets in XLA_FLAGS wins (it is left out here).
  """
  if (backend or jax.default_backend()) != "gpu":
    return None
  user_set = {flag.partition("=")[0] for flag in os.environ.get("XLA_FLAGS", "").split()}
  return {k: v for k, v in GPU_COMPILER_OPTIONS.items() if f"--{k}" not in user_set} or None


# What JAX's persistent compilation cache reports through `jax.monitoring`, per compilation that consults it.
_CACHE_EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "requests",
                 "/jax/compilation_cache/cache_hits": "hits"}


@contextlib.contextmanager
def persistent_cache_hits():
  """Counts, while open, the compilations that consulted JAX's persistent compilation cache and those it served.

  Yields {"requests": n, "hits": n}, filled in as compilations happen (in any thread: the listener is global, so
  compile nothing else meanwhile); both stay 0 where the cache is off.
  """
  counts = {"requests": 0, "hits": 0}

  def listener(event: str, **kwargs) -> None:
    del kwargs
    if event in _CACHE_EVENTS:
      counts[_CACHE_EVENTS[event]] += 1

  jax.monitoring.register_event_listener(listener)
  try:
    yield counts
  finally:
    jax.monitoring.unregister_event_listener(listener)


def compile_ahead(lowered: Sequence[Any]) -> tuple[list[Any], float, dict[str, int]]:
  """Compiles lowered steps before their first call, their XLA compilations in parallel threads: about the time of
  the largest instead of the sum, and none inside the timed steps.

  Returns:
    (the compiled steps in order, the seconds taken, `persistent_cache_hits`' counts).
  """
  started = time.perf_counter()
  with persistent_cache_hits() as cache, concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
    compiled = list(pool.map(lambda step: step.compile(), lowered))
  seconds = time.perf_counter() - started
  # Whether the persistent cache served them says whether another run (a sweep's other rows) compiled the same.
  log.info("%d steps compiled in %.1f s (%s)", len(lowered), seconds,
           f"{cache['hits']} of {cache['requests']} read from the persistent compilation cache" if cache["requests"]
           else "no persistent compilation cache")
  return compiled, seconds, cache


def summarize(task: Objective, terms: dict[str, Array], denominators: dict[str, Array]) -> dict[str, Array]:
  """Per-term mean loss and accuracy, plus the counts (for averaging over batches)."""
  metrics = {}
  for name in task.weights:
    count = jnp.maximum(denominators[name], 1.0)
    metrics[f"{name}_loss"] = terms[f"{name}_loss"] / count
    if f"{name}_correct" in terms:
      metrics[f"{name}_accuracy"] = terms[f"{name}_correct"] / count
  return metrics


def make_eval_step(task: Objective, partitioning: Partitioning, state_shardings: Any) -> Callable:
  """Returns the jitted `eval_step(params, batch) -> sums` (loss/correct sums and counts per term)."""
  read = _model_params(partitioning, state_shardings.params)

  def eval_step(params, batch):
    with partitioning.context():
      inputs = task.prepare(batch)
      denominators = task.denominators(inputs)
      terms = task.forward(read(params), inputs, None, False)
      sums = dict(terms)
      for name in task.weights:
        sums[f"{name}_count"] = denominators[name]
      return sums

  replicated = sharding_lib.replicated(partitioning.mesh)
  return jax.jit(eval_step, in_shardings=(state_shardings.params, sharding_lib.batch_sharding(partitioning.mesh)),
                 out_shardings=replicated, compiler_options=compiler_options())


def make_predict_step(task: Any, partitioning: Partitioning, param_shardings: Any) -> Callable:
  """Returns the jitted `predict_step(params, batch) -> outputs`, replicated on every device.

  `task` supplies `prepare(batch)` and `predict(params, inputs)`, which returns
  the head's raw outputs in evaluation mode (no dropout); fine-tuning reads
  logits through it for the official metrics.
  """
  read = _model_params(partitioning, param_shardings)

  def predict_step(params, batch):
    with partitioning.context():
      return task.predict(read(params), task.prepare(batch))

  replicated = sharding_lib.replicated(partitioning.mesh)
  return jax.jit(predict_step, in_shardings=(param_shardings, sharding_lib.batch_sharding(partitioning.mesh)),
                 out_shardings=replicated, compiler_options=compiler_options())


def make_state_init(init_variables: Callable[[Array], Any], tx: optax.GradientTransformation,
                    partitioning: Partitioning, example_rng: Array) -> tuple[Callable[..., TrainState], Any]:
  """`create_state` split into a jitted `init(rng, given=None) -> state` compiled once, and the state shardings.

  For runs that build many states of one model (fine-tuning seeds): each call
  initialises directly in its shards without compiling again. `given`, a tree of
  the params' structure holding arrays (placed with the params' shardings) or
  None, supplies the parameters not to draw: a pre-trained encoder. Their random
  initialisers are then dead code that XLA drops, so only the rest (a task head)
  is compiled and drawn, a fraction of the whole model's initialisation.

  Args:
    init_variables: rng -> boxed variables ({"params": ...}) with logical axes.
    tx: the optimizer.
    partitioning: mesh and rules.
    example_rng: any key of the kind that `init` will be given (for shapes).

  Returns:
    (init, state shardings).
  """
  def init_boxed(key):
    params = init_variables(key)["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  def init_unboxed(key, given):
    state = nn.unbox(init_boxed(key))
    if given is None:
      return state
    # The optimizer's initial state depends on the params' shapes only, so it stays as initialised.
    return state.replace(params=jax.tree.map(lambda value, drawn: drawn if value is None else value, given,
                                             state.params, is_leaf=lambda x: x is None))

  with partitioning.context():
    abstract = jax.eval_shape(init_boxed, example_rng)
    shardings = sharding_lib.logical_shardings(abstract, partitioning.mesh, partitioning.rules)
    jitted = jax.jit(init_unboxed, out_shardings=shardings)

  def init(rng: Array, given: Any = None) -> TrainState:
    with partitioning.context():
      return jitted(rng, given)

  return init, shardings
