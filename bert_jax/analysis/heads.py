"""Head masking, importance and pruning (Michel et al. 2019, "Are Sixteen Heads Really Better than One?").

A fine-tuned model's heads are gated by xi [layers, heads] (`Encoder`'s head_mask: each head's output times its
gate before the output projection; ones give the model's outputs). On a task's dev data:

  head_importance     I_h = E_x |dL(x)/dxi_h|, the expected absolute gradient of the example's loss
  disable_each        the score with each head disabled alone
  keep_one_per_layer  the score with every head of a layer disabled but one
  pruning_curve       the score as heads are pruned in steps, by importance (recomputed under the current mask
                      at every step, normalised per layer by its l2 norm, as Michel et al. do) or in random order
  prune_heads         the heads removed from the weights: smaller query/key/value/output projections and
                      `ModelConfig.heads_per_layer`, a model that runs without a mask

The score is one of the task's metrics (`TaskData.metric`; by default its selection metric, e.g. MRPC's F1).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.models import ModelConfig
from bert_jax.progress import Progress
from bert_jax.tasks.base import Task

Params = dict[str, Any]


@dataclasses.dataclass
class TaskData:
  """A fine-tuned model and the examples it is scored on.

  Attributes:
    config: the encoder's config.
    objective: the run's `FinetuneObjective` (its model takes a head mask).
    params: {"encoder", "head"}.
    task: the task (featurises, scores).
    examples: the examples scored.
    features: their feature arrays, rows padded to one length.
    batch_size: rows per device batch (the last batch is padded with weight-0 rows).
    metric: the metric `score` reports; None: the task's selection metric.
  """

  config: ModelConfig
  objective: Any
  params: Params
  task: Task
  examples: list[Any]
  features: dict[str, np.ndarray]
  batch_size: int = 32
  metric: str | None = None
  _steps: dict[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def num_rows(self) -> int:
    return len(self.features["input_ids"])

  def batches(self):
    """Host batches of the device fields, with `weights` (0 on padding rows) and `seed`."""
    from bert_jax.tasks.finetune_model import device_fields  # noqa: PLC0415 - tasks import analysis lazily
    for start in range(0, self.num_rows, self.batch_size):
      rows = np.arange(start, min(start + self.batch_size, self.num_rows))
      padded = np.concatenate([rows, np.zeros(self.batch_size - len(rows), rows.dtype)])
      batch = {field: self.features[field][padded] for field in device_fields(self.objective.kind)}
      batch["weights"] = (np.arange(self.batch_size) < len(rows)).astype(np.float32)
      batch["seed"] = np.zeros(self.batch_size, np.int32)
      yield len(rows), batch

  def jitted(self, name: str):
    """The compiled "predict" (params, batch, head_mask) or "gradient_sums" (the same) function."""
    if name not in self._steps:
      objective = self.objective

      def inputs_with(batch, head_mask):
        return {**objective.prepare(batch), "head_mask": head_mask}

      def predict(params, batch, head_mask):
        return objective.predict(params, inputs_with(batch, head_mask))

      def gradient_sums(params, batch, head_mask):
        """The sum over the batch's rows of |dL(row)/d head_mask| [layers, heads] (padding rows weigh 0)."""
        def row_gradient(row):
          one = jax.tree.map(lambda x: x[None], row)
          loss = lambda mask: objective.forward(params, inputs_with(one, mask), None, False)["task_loss"]  # noqa: E731
          return jax.grad(loss)(head_mask)
        return jnp.sum(jnp.abs(jax.vmap(row_gradient)(batch)), axis=0)

      self._steps = {"predict": jax.jit(predict), "gradient_sums": jax.jit(gradient_sums)}
    return self._steps[name]

  def ones(self) -> np.ndarray:
    return np.ones((self.config.num_layers, self.config.num_heads), np.float32)

  def outputs(self, head_mask: np.ndarray | None = None, params: Params | None = None) -> np.ndarray:
    """The head's raw outputs for every row under `head_mask` (None: all ones)."""
    head_mask = self.ones() if head_mask is None else np.asarray(head_mask, np.float32)
    predict = self.jitted("predict")
    params = self.params if params is None else params
    pending = [(count, predict(params, batch, head_mask)) for count, batch in self.batches()]
    return np.concatenate([np.asarray(out)[:count] for count, out in pending])

  def metrics(self, head_mask: np.ndarray | None = None) -> dict[str, float]:
    return self.task.evaluate(self.outputs(head_mask), self.features, self.examples)

  def score(self, head_mask: np.ndarray | None = None) -> float:
    return float(self.metrics(head_mask)[self.metric or self.task.selection_metric])


def head_importance(data: TaskData, head_mask: np.ndarray | None = None) -> np.ndarray:
  """I_h = mean over the examples of |dL(x)/dxi_h| at `head_mask` (None: all ones): float [layers, heads]."""
  head_mask = data.ones() if head_mask is None else np.asarray(head_mask, np.float32)
  gradient_sums = data.jitted("gradient_sums")
  total = sum(np.asarray(gradient_sums(data.params, batch, head_mask), np.float64) for _, batch in data.batches())
  return total / data.num_rows


def _scores_with(data: TaskData, desc: str, mask_for) -> np.ndarray:
  """float [layers, heads]: the score under `mask_for(layer, head)`, one scoring of the data per head."""
  scores = np.zeros((data.config.num_layers, data.config.num_heads))
  progress = Progress(scores.size, desc, unit="score")
  for layer, head in np.ndindex(*scores.shape):
    scores[layer, head] = data.score(mask_for(layer, head))
    progress.update(1)
  progress.close()
  return scores


def disable_each(data: TaskData) -> np.ndarray:
  """The score with head (l, h) disabled alone: float [layers, heads]."""
  def mask_for(layer, head):
    mask = data.ones()
    mask[layer, head] = 0
    return mask
  return _scores_with(data, "disable each head", mask_for)


def keep_one_per_layer(data: TaskData) -> np.ndarray:
  """The score with every head of layer l disabled except h: float [layers, heads]."""
  def mask_for(layer, head):
    mask = data.ones()
    mask[layer] = 0
    mask[layer, head] = 1
    return mask
  return _scores_with(data, "keep one head a layer", mask_for)


def pruning_curve(data: TaskData, fractions: Sequence[float], order: str, seed: int = 0
                  ) -> list[tuple[float, float, np.ndarray]]:
  """(fraction, score, mask) with round(fraction * heads) heads pruned, for each fraction in increasing order.

  order: "importance" prunes the heads of least importance (recomputed under the current mask at every step,
  each layer's scores divided by their l2 norm) first; "random" a fixed random order (`seed`).
  """
  layers, heads = data.config.num_layers, data.config.num_heads
  mask = data.ones()
  random_order = [tuple(index) for index in np.argwhere(mask)]
  np.random.default_rng(seed).shuffle(random_order)
  curve = []
  progress = Progress(len(fractions), f"pruning by {order}", unit="point")
  for fraction in sorted(fractions):
    target = int(round(fraction * layers * heads))
    while int(np.sum(mask == 0)) < target:
      missing = target - int(np.sum(mask == 0))
      if order == "random":
        chosen = [index for index in random_order if mask[index]][:missing]
      elif order == "importance":
        importance = head_importance(data, mask)
        importance = importance / np.maximum(np.linalg.norm(importance, axis=1, keepdims=True), 1e-20)
        candidates = sorted((importance[index], index) for index in map(tuple, np.argwhere(mask)))
        chosen = [index for _, index in candidates[:missing]]
      else:
        raise ValueError(f"pruning order {order!r}: expected 'importance' or 'random'")
      for index in chosen:
        mask[index] = 0
    curve.append((fraction, data.score(mask), mask.copy()))
    progress.update(1)
  progress.close()
  return curve


def prune_heads(config: ModelConfig, encoder: Params, keep_lh: np.ndarray) -> tuple[ModelConfig, Params]:
  """The encoder without the heads where `keep_lh` [layers, heads] is False: each layer's query, key, value
  kernels [E, heads, D] and biases, and output kernel [heads, D, E] keep the kept heads' slices, in order.

  Returns the config with `heads_per_layer` and the new encoder tree; its outputs equal the original's under the
  head mask `keep_lh` (a gate of 0 removes exactly the head's slice of the output projection's input).
  """
  keep_lh = np.asarray(keep_lh, bool)
  if config.num_shared_groups:
    raise ValueError("heads cannot be pruned from a model whose layers share parameters (ALBERT): each layer "
                     "would need its own")
  if keep_lh.shape[0] != config.num_layers:
    raise ValueError(f"head mask has {keep_lh.shape[0]} layers, the model {config.num_layers}")
  empty = [layer + 1 for layer in range(config.num_layers) if not keep_lh[layer, :config.layer_heads(layer)].any()]
  if empty:
    raise ValueError(f"pruning would remove every head of layer(s) {empty}; keep at least one head per layer "
                     "(a smaller --prune-fraction)")
  encoder = jax.tree.map(np.asarray, encoder)
  for layer in range(config.num_layers):
    kept = np.flatnonzero(keep_lh[layer, :config.layer_heads(layer)])
    attention = dict(encoder[f"block_{layer}"]["attention"])
    for name in ("query", "key", "value"):
      attention[name] = {"kernel": attention[name]["kernel"][:, kept], "bias": attention[name]["bias"][kept]}
    attention["output"] = {"kernel": attention["output"]["kernel"][kept], "bias": attention["output"]["bias"]}
    encoder[f"block_{layer}"] = {**encoder[f"block_{layer}"], "attention": attention}
  heads_per_layer = tuple(int(keep_lh[layer, :config.layer_heads(layer)].sum()) for layer in range(config.num_layers))
  return config.replace(heads_per_layer=heads_per_layer), encoder


def count_params(tree: Params) -> int:
  return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree))


def time_predictions(data: TaskData, params: Params, head_mask: np.ndarray | None = None, repeats: int = 3) -> float:
  """Seconds for one pass of predictions over every row (best of `repeats`, after a compiling pass)."""
  data.outputs(head_mask, params)
  best = math.inf
  for _ in range(repeats):
    started = time.perf_counter()
    data.outputs(head_mask, params)
    best = min(best, time.perf_counter() - started)
  return best


def save_pruned_run(run_dir: pathlib.Path, out_dir: pathlib.Path, config: ModelConfig, params: Params) -> None:
  """Writes the pruned model as a fine-tuning workdir with one seed, which `bert-jax evaluate`, `analyze` and
  `finetune --config.init.model` read: the run's config.json and tokenizer, finetune_run.json with the pruned
  model config, seed_<s>/checkpoints."""
  from bert_jax.tasks.finetune_model import RUN_FILE  # noqa: PLC0415
  from bert_jax.train import checkpoint as checkpoint_lib  # noqa: PLC0415

  run_info = json.loads((run_dir / RUN_FILE).read_text())
  seed = run_info["best_seed"]
  out_dir.mkdir(parents=True, exist_ok=True)
  shutil.copy(run_dir / "config.json", out_dir / "config.json")
  shutil.copytree(run_dir / "tokenizer", out_dir / "tokenizer", dirs_exist_ok=True)
  run_info.update(model_config=dataclasses.asdict(config), seeds=[seed], best_seed_dir=f"seed_{seed}")
  (out_dir / "model_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
  checkpointer = checkpoint_lib.Checkpointer(out_dir / f"seed_{seed}", keep=1, async_save=False)
  checkpointer.save(0, {"params": params}, {}, {"step": 0, "seed": seed, "pruned_from": str(run_dir)}, force=True)
  checkpointer.close()
  (out_dir / RUN_FILE).write_text(json.dumps(run_info, indent=2) + "\n")


def load_task_data(workdir: str | pathlib.Path, data_dir: str | None = None, max_examples: int | None = None,
                   batch_size: int = 32, metric: str | None = None) -> TaskData:
  """A fine-tuning workdir's best seed and the first `max_examples` (None: all) of its task's first dev split,
  read from `data_dir` (None: the run's config.data_dir), scored by `metric` (None: the selection metric)."""
  from bert_jax.data.tokenizers import load_tokenizer  # noqa: PLC0415
  from bert_jax.tasks.batching import padded_length, trim_features  # noqa: PLC0415
  from bert_jax.tasks.evaluate import load_split  # noqa: PLC0415
  from bert_jax.tasks.finetune_config import finetune_defaults  # noqa: PLC0415
  from bert_jax.tasks.finetune_model import RUN_FILE, FinetuneObjective, task_model, task_tokenizer  # noqa: PLC0415
  from bert_jax.tasks.registry import get_task  # noqa: PLC0415
  from bert_jax.train import checkpoint as checkpoint_lib  # noqa: PLC0415
  from bert_jax.train import run as run_lib  # noqa: PLC0415

  workdir = pathlib.Path(workdir)
  if not (workdir / RUN_FILE).exists():
    raise FileNotFoundError(f"{workdir / RUN_FILE} not found: the head analyses need a finished fine-tuning run "
                            "(bert-jax finetune), whose task data they score")
  run_info = json.loads((workdir / RUN_FILE).read_text())
  config = run_lib.saved_config(workdir, finetune_defaults())  # a key newer than the run at its default
  if config.feature_based.layers:
    raise ValueError(f"{workdir} is a feature-based run (frozen encoder, config.feature_based.layers): its heads "
                     "are not gated; analyse a fully fine-tuned run")
  task = get_task(config.task, **config.task_options.to_dict())
  if metric is not None and metric not in task.metric_names:
    raise ValueError(f"--metric {metric!r}: {task.name} reports {', '.join(task.metric_names)}")
  model_config = ModelConfig(**run_info["model_config"])
  examples = load_split(task, data_dir or config.data_dir, task.eval_splits[0])[:max_examples]
  if not examples:
    raise ValueError(f"{task.name}: no {task.eval_splits[0]} examples in {data_dir or config.data_dir}")
  features = task.featurize(examples, task_tokenizer(load_tokenizer(workdir / "tokenizer")), config.max_len)
  features = trim_features(features, task.kind, config.max_len, padded_length([features], config.max_len))
  objective = FinetuneObjective(task_model(config, model_config, task), task.kind,
                                single_token_type=model_config.type_vocab_size == 1, num_choices=task.num_choices)
  _, params = checkpoint_lib.restore_params(workdir / run_info["best_seed_dir"])
  return TaskData(model_config, objective, params, task, examples, features, batch_size, metric)
