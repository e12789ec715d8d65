"""A fine-tuned model ready to predict: the one place a model is loaded for inference.

  model = load_for_inference("runs/rte")                  # best seed; any task
  examples = model.task.read_file("my_pairs.tsv")
  features = model.featurize(examples)
  predictions = model.task.predict(model.predict_outputs(features), features, examples)

`load_for_inference(workdir)` reads a fine-tuning workdir (or a folder laid
out like one: the head-pruned model that `bert-jax analyze` writes): its task,
model config, tokenizer and one seed's parameters, placed on the run's mesh.

`InferenceModel.predict_outputs` runs the jitted predict step over batches of
a fixed size whose rows are padded to one of a few lengths (`length_buckets`:
powers of two up to max_len). Rows are sorted by length first, so each batch
takes the shortest bucket its rows fit, and the step compiles at most once per
bucket, never per batch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Callable, Iterator, Sequence

from etils import epath
import jax
import ml_collections
import numpy as np

from bert_jax import paths
from bert_jax import progress as progress_lib
from bert_jax.data.tokenizers import load_tokenizer
from bert_jax.models import ModelConfig
from bert_jax.parallel import distributed
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.tasks.base import Task, TaskTokenizer
from bert_jax.tasks.batching import BatchMaker, fitted_max_len
from bert_jax.tasks.finetune_model import (QUANTIZATION_FILE, RUN_FILE, FinetuneObjective, build_model, task_model,
                                           task_tokenizer)
from bert_jax.tasks.kinds import task_kind
from bert_jax.tasks.registry import get_task
from bert_jax.train import checkpoint as checkpoint_lib
from bert_jax.train.step import Partitioning, make_predict_step

SMALLEST_BUCKET = 16
_TOKEN_FIELDS = ("input_ids", "segment_ids", "lengths")


def length_buckets(max_len: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
  """The padded lengths rows are run at: powers of two from `smallest` below max_len, then max_len."""
  buckets = []
  length = smallest
  while length < max_len:
    buckets.append(length)
    length *= 2
  return (*buckets, max_len)


def row_lengths(features: dict[str, np.ndarray]) -> np.ndarray:
  """Real tokens per feature row (the longest choice for multiple choice) [N]."""
  lengths = features["lengths"]
  return lengths.max(axis=-1) if lengths.ndim == 2 else lengths


@dataclasses.dataclass
class InferenceModel:
  """A task model with its parameters on the devices, its tokenizer and its bucketed predict step.

  Attributes:
    task: the fine-tuning task (reads files, featurises, decodes outputs).
    objective: `prepare(batch)` and `predict(params, inputs)` (the head's raw outputs); a `FinetuneObjective`.
    model_config: the encoder's config.
    params: the parameters, placed by the mesh's rules.
    tokenizer: the task view of the run's tokenizer.
    max_len: the longest row in tokens (the run's config.max_len, cut to the model's positions).
    partitioning: the mesh and logical rules the parameters are placed by.
    param_shardings: where each parameter lives.
    batch_size: rows per predict batch by default (the run's eval batch size).
    seed: the fine-tuning seed the parameters come from (None for a model that was not fine-tuned here).
    source: the folder it was loaded from.
  """

  task: Task
  objective: Any
  model_config: ModelConfig
  params: Any
  tokenizer: TaskTokenizer
  max_len: int
  partitioning: Partitioning
  param_shardings: Any
  batch_size: int
  seed: int | None = None
  source: epath.Path | None = None
  _predict_step: Any = None
  _from_storage: Any = None  # saved parameters -> the model's tree (an int8 folder's; None: as saved)

  @property
  def model(self):
    """The Flax module."""
    return self.objective.model

  @property
  def predict_step(self):
    """The jitted `predict_step(params, batch) -> outputs`, built on first use; one compilation per shape."""
    if self._predict_step is None:
      self._predict_step = make_predict_step(self.objective, self.partitioning, self.param_shardings)
    return self._predict_step

  def with_seed(self, seed: int) -> "InferenceModel":
    """The same fine-tuned model with another seed's parameters; the compiled predict step is shared."""
    if self.source is None:
      raise ValueError("with_seed needs a model loaded from a fine-tuning workdir (load_for_inference)")
    params = _seed_params(self.source, json.loads((self.source / RUN_FILE).read_text()), seed)
    if self._from_storage is not None:
      params = self._from_storage(params)
    return dataclasses.replace(self, params=jax.device_put(params, self.param_shardings), seed=seed,
                               _predict_step=self.predict_step)

  def featurize(self, examples: Sequence[Any]) -> dict[str, np.ndarray]:
    """The task's features of `examples` at max_len (see `bert_jax.tasks.base`)."""
    if not examples:
      raise ValueError(f"{self.task.name}: no examples to predict")
    return self.task.featurize(examples, self.tokenizer, self.max_len)

  def batches(self, features: dict[str, np.ndarray], batch_size: int | None = None
              ) -> list[tuple[np.ndarray, int]]:
    """(feature rows, padded length) of each batch: rows sorted by length, each batch at its shortest bucket."""
    batch_size = batch_size or self.batch_size
    lengths = row_lengths(features)
    order = np.argsort(lengths, kind="stable")
    buckets = np.asarray(length_buckets(features["input_ids"].shape[-1]))
    out = []
    for start in range(0, len(order), batch_size):
      rows = order[start:start + batch_size]
      out.append((rows, int(buckets[np.searchsorted(buckets, lengths[rows].max())])))
    return out

  def predict_outputs(self, features: dict[str, np.ndarray], batch_size: int | None = None,
                      progress: progress_lib.Progress | None = None) -> np.ndarray:
    """The head's raw outputs for every feature row, in feature order, as `Task.predict` takes them.

    Per-token outputs come back at the features' full length, the positions past a row's bucket at the kind's
    `TaskKind.token_output_fill` (span: the float32 minimum, never an answer; tagging: 0, never read).

    Args:
      features: `featurize`'s output (any length up to max_len).
      batch_size: rows per batch, a multiple of the data-parallel size; None for `batch_size`.
      progress: counts the rows done.
    """
    full_length = features["input_ids"].shape[-1]
    fill = task_kind(self.task.kind).token_output_fill
    outputs: np.ndarray | None = None
    pending = None

    def collect(rows, length, device_outputs):
      nonlocal outputs
      values = np.asarray(device_outputs)[:len(rows)]
      if fill is not None:  # per-token outputs
        widths = [(0, 0)] * values.ndim
        widths[1] = (0, full_length - length)
        values = np.pad(values, widths, constant_values=fill)
      if outputs is None:
        outputs = np.zeros((len(features["input_ids"]), *values.shape[1:]), np.float32)
      outputs[rows] = values
      if progress is not None:
        progress.update(len(rows))

    for rows, length, batch in self.device_batches(features, batch_size):
      # One batch in flight while the previous one's outputs come back to the host.
      launched = (rows, length, self.predict_step(self.params, batch))
      if pending is not None:
        collect(*pending)
      pending = launched
    collect(*pending)
    return outputs

  def device_batches(self, features: dict[str, np.ndarray], batch_size: int | None = None
                     ) -> Iterator[tuple[np.ndarray, int, dict[str, jax.Array]]]:
    """(feature rows, padded length, the batch on the mesh) of each of `batches`' batches.

    Raises:
      ValueError: `batch_size` is not a multiple of the data-parallel size.
    """
    batch_size = batch_size or self.batch_size
    data_parallel = sharding_lib.data_parallel_size(self.partitioning.mesh) * jax.process_count()
    if batch_size % data_parallel:
      raise ValueError(f"batch size {batch_size} is not divisible by the {data_parallel} data-parallel devices; "
                       f"give a multiple of {data_parallel}")
    make_batch = BatchMaker(_TOKEN_FIELDS, batch_size, self.partitioning.mesh)
    token_axis = features["input_ids"].ndim - 1
    for rows, length in self.batches(features, batch_size):
      batch_rows = {field: features[field][rows] for field in _TOKEN_FIELDS}
      for field in ("input_ids", "segment_ids"):
        batch_rows[field] = np.take(batch_rows[field], np.arange(length), axis=token_axis)
      yield rows, length, make_batch(batch_rows, np.arange(len(rows)), 0)


def inference_model(task: Task, model_config: ModelConfig, params: Any, tokenizer: TaskTokenizer, max_len: int,
                    model: Any = None, mesh_sizes: dict[str, int] | None = None,
                    rules: Sequence[Any] | None = None, batch_size: int = 128, devices: Sequence[Any] | None = None,
                    from_storage: Callable[[Any, Any], Any] | None = None, **extra: Any) -> InferenceModel:
  """An `InferenceModel` from parts: the task's model (default `FinetuneModel`) with host or device `params`.

  Args:
    task: the task whose head the model has.
    model_config: the encoder's config.
    params: {"encoder", "head"} parameters of `model`.
    tokenizer: the task view of the tokenizer.
    max_len: the longest row in tokens.
    model: the Flax module; None builds the task's plain fine-tuning model.
    mesh_sizes: config.mesh.sizes (None: data parallel over every device).
    rules: config.mesh.rules (None: the default rules).
    batch_size: default rows per batch.
    devices: the devices of the mesh (None: every device).
    from_storage: `(abstract params, params as saved) -> params` where the saved layout is not the model's tree
      (an int8 model's, `quantization.from_storage`); None: `params` are the model's tree.
    **extra: seed, source.
  """
  mesh = sharding_lib.create_mesh(dict(mesh_sizes or {"data": -1, "fsdp": 1, "tensor": 1}), devices)
  partitioning = Partitioning(mesh, sharding_lib.rules_from_config(rules))
  model = model if model is not None else build_model(model_config, task.kind, task.num_labels)
  objective = FinetuneObjective(model, task.kind, single_token_type=model_config.type_vocab_size == 1,
                                num_choices=task.num_choices)
  dummy = objective.example_batch(1, min(max_len, SMALLEST_BUCKET))
  with partitioning.context():
    abstract = jax.eval_shape(lambda: objective.init_variables(jax.random.key(0), dummy))["params"]
    param_shardings = sharding_lib.logical_shardings(abstract, mesh, partitioning.rules)
  if from_storage is not None:
    from_storage = functools.partial(from_storage, abstract)
    params = from_storage(params)
  return InferenceModel(task=task, objective=objective, model_config=model_config,
                        params=jax.device_put(params, param_shardings), tokenizer=tokenizer, max_len=max_len,
                        partitioning=partitioning, param_shardings=param_shardings, batch_size=batch_size,
                        _from_storage=from_storage, **extra)


def load_for_inference(workdir: str | os.PathLike, seed: int | None = None,
                       devices: Sequence[Any] | None = None, params: Any = None) -> InferenceModel:
  """The fine-tuned model of `workdir`, ready to predict.

  Args:
    workdir: a finished `bert-jax finetune` workdir, or a folder laid out like one (finetune_run.json, config.json,
      tokenizer/, seed_<s>/checkpoints: the pruned model of `bert-jax analyze ... prune`, the int8 model of
      `bert-jax quantize`, which its quantization.json marks).
    seed: whose parameters; None for the run's best seed.
    devices: the devices to run on (None: every device, on the run's mesh; else data parallel over these).
    params: the seed's saved parameters, already read (`checkpoint.restore_params`); None reads them.

  Raises:
    FileNotFoundError: when `workdir` is not such a folder or the seed has no saved parameters.
    ValueError: for a seed the run does not have.
  """
  distributed.initialize()
  workdir = paths.as_path(workdir)
  if not (workdir / RUN_FILE).exists():
    raise FileNotFoundError(f"{workdir / RUN_FILE} not found: give --workdir a finished fine-tuning run "
                            "(bert-jax finetune) or a pruned model folder (bert-jax analyze ... prune)")
  run_info = json.loads((workdir / RUN_FILE).read_text())
  config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  seed = run_info["best_seed"] if seed is None else seed
  params = _seed_params(workdir, run_info, seed) if params is None else params
  task = get_task(config.task, **config.task_options.to_dict())
  model_config = ModelConfig(**run_info["model_config"])
  model, from_storage = task_model(config, model_config, task), None
  if (workdir / QUANTIZATION_FILE).exists():  # quantised dense layers and tables through Qwix (the `quant` extra).
    from bert_jax.models import quantization  # noqa: PLC0415

    scheme = quantization.Scheme(**json.loads((workdir / QUANTIZATION_FILE).read_text()).get("scheme", {}))
    model, from_storage = quantization.quantized_model(model, scheme), quantization.from_storage
  return inference_model(task, model_config, params, task_tokenizer(load_tokenizer(workdir / "tokenizer")),
                         fitted_max_len(config.max_len, model_config), model=model, from_storage=from_storage,
                         mesh_sizes=None if devices is not None else config.mesh.sizes.to_dict(),
                         rules=config.mesh.rules, devices=devices,
                         batch_size=config.train.eval_batch_size or 128, seed=seed, source=workdir)


def _seed_params(workdir: epath.Path, run_info: dict[str, Any], seed: int) -> Any:
  """The saved parameters of one seed of a fine-tuning run, as host arrays."""
  if seed not in run_info["seeds"]:
    raise ValueError(f"seed {seed}: {workdir} has seeds {run_info['seeds']}")
  seed_dir = workdir / f"seed_{seed}"
  if not (seed_dir / "checkpoints").is_dir():
    raise FileNotFoundError(f"{seed_dir} holds no saved parameters (a run with --config.train.save_checkpoint="
                            "False keeps none): fine-tune again with checkpoints saved")
  return checkpoint_lib.restore_params(seed_dir)[1]
