"""`bert-jax quantize`: a fine-tuned model in int8 or float8 (Q8BERT-style post-training quantisation).

  bert-jax quantize --workdir runs/rte --out runs/rte-int8 [--seed S]
  bert-jax quantize --workdir runs/rte --out runs/rte-fp8 --scheme fp8-static [--calibration-examples 512]
  bert-jax evaluate --workdir runs/rte-int8

Reads one seed of a fine-tuning run (its best by default), quantises its parameters
(`bert_jax.models.quantization`: dense layers with int8 or float8 weights, one scale per output feature, and their
inputs quantised the same way; int8 embedding tables) and writes a folder that reads like a one-seed fine-tuning
run, so `bert-jax evaluate` scores it. `--scheme` (`quantization.Scheme`):

  int8, fp8                 each dense layer's input scaled per token at run time (its absmax; the default: int8)
  int8-static, fp8-static   one scale per layer input, fixed here: the largest |value| it takes when the float model
                            runs over --calibration-examples of the run's training split (a fixed draw, as
                            config.train_examples draws), so inference computes no reduction before a matmul

Folder:
  config.json, tokenizer/             the run's
  finetune_run.json, model_config.json  the run's, for the one seed, the model on its plain path (no kernels, remat)
  quantization.json                   marks the folder: method, scheme, library, the source run and seed, sizes,
                                      and a static scheme's calibration (split, examples)
  seed_<s>/checkpoints/<step>/        the quantised tree (Orbax, `quantization.to_storage`)

`load_quantized(folder)` gives the quantised model and its parameters, ready to apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from importlib import metadata
from typing import Any, Callable

from etils import epath
import flax.linen as nn
import jax
import ml_collections
import numpy as np

from bert_jax import paths
from bert_jax.data.tokenizers import load_tokenizer
from bert_jax.models import ModelConfig
from bert_jax.models import quantization
from bert_jax.tasks.evaluate import load_split, subset
from bert_jax.tasks.finetune_model import QUANTIZATION_FILE, RUN_FILE, FinetuneObjective, task_model
from bert_jax.tasks.registry import get_task
from bert_jax.train import checkpoint as checkpoint_lib

def method(scheme: quantization.Scheme) -> str:
  """The quantisation in words, as quantization.json records it."""
  number = {"int8": "int8 matmuls with int32 accumulation", "fp8": "float8 (e4m3) matmuls with float32 "
            "accumulation"}[scheme.format]
  inputs = ("one scale per layer input, the largest |value| on calibration batches" if scheme.static
            else "per token at run time")
  return (f"Q8BERT-style post-training quantisation ({scheme.name}): dense-layer weights symmetric per output feature "
          f"(absmax), their input activations symmetric, {inputs}; {number}; embedding tables int8 per row; "
          "LayerNorms, biases and attention's products in the compute dtype")


def _read_run(workdir: epath.Path) -> tuple[dict[str, Any], ml_collections.ConfigDict]:
  if not (workdir / RUN_FILE).exists():
    raise FileNotFoundError(f"{workdir / RUN_FILE} not found: --workdir must be a finished fine-tuning run")
  return (json.loads((workdir / RUN_FILE).read_text()),
          ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text())))


def _objective(run_info: dict[str, Any], config: ml_collections.ConfigDict,
               make_model: Callable[[nn.Module], nn.Module]) -> FinetuneObjective:
  """The run's objective with `make_model` of its model."""
  task = get_task(config.task, **config.task_options.to_dict())
  model_config = ModelConfig(**run_info["model_config"])
  model = make_model(task_model(config, model_config, task))
  return FinetuneObjective(model, task.kind, single_token_type=model_config.type_vocab_size == 1,
                           num_choices=task.num_choices)


def _calibrate(workdir: epath.Path, seed: int, params: Any, run_info: dict[str, Any],
               config: ml_collections.ConfigDict, scheme: quantization.Scheme, examples: int, data_dir: str | None
               ) -> tuple[Any, dict[str, Any]]:
  """The largest |value| of each quantised layer input over `examples` training examples, and what was read;
  `params` are the seed's float parameters as read."""
  from bert_jax.tasks.inference import load_for_inference  # noqa: PLC0415 - it imports this package's modules

  data_dir = data_dir or config.data_dir
  model = load_for_inference(workdir, seed, params=params)
  try:
    rows = subset(load_split(model.task, data_dir, "train"), examples)
  except (FileNotFoundError, ValueError) as error:
    raise ValueError(f"calibrating static scales reads the run's training split: {error}; give its folder with "
                     "--data-dir") from None
  calibrating = _objective(run_info, config, lambda float_model: quantization.calibrating_model(float_model, scheme))

  @jax.jit
  def batch_stats(params, batch):
    _, stats = calibrating._apply(params, calibrating.prepare(batch), None, False,  # pylint: disable=protected-access
                                  mutable=["quant_stats"])
    return stats["quant_stats"]

  features = model.featurize(rows)
  calibration = quantization.merge_calibrations(*(jax.tree.map(np.asarray, batch_stats(model.params, batch))
                                                  for _, _, batch in model.device_batches(features)))
  return calibration, {"split": "train", "data_dir": str(data_dir), "examples": len(rows),
                       "feature_rows": len(features["input_ids"])}


def _abstract_params(objective: FinetuneObjective, seq_len: int) -> Any:
  """The quantised model's parameter tree, shapes only (boxed)."""
  batch = objective.example_batch(1, seq_len)
  return jax.eval_shape(lambda: objective.init_variables(jax.random.key(0), batch))["params"]


def _disk_bytes(directory: epath.Path) -> int:
  return sum(path.stat().length for path in paths.files(directory))


def _save_params(seed_dir: epath.Path, step: int, tree: Any, meta: dict[str, Any]) -> int:
  """Writes `tree` as a fine-tuning checkpoint's params (`checkpoint.restore_params` reads them); returns the
  checkpoint's bytes on disk."""
  checkpointer = checkpoint_lib.Checkpointer(seed_dir, keep=1, async_save=False)
  checkpointer.save(step, {"params": tree}, {}, meta, force=True)
  checkpointer.close()
  return _disk_bytes(seed_dir / "checkpoints" / str(step))


def quantize_run(workdir: str | os.PathLike, out: str | os.PathLike, seed: int | None = None,
                 scheme: quantization.Scheme = quantization.Scheme(), calibration_examples: int = 512,
                 data_dir: str | None = None) -> dict[str, Any]:
  """Quantises `seed` (default: the best) of the fine-tuning run in `workdir` into the folder `out`.

  A static `scheme` calibrates on `calibration_examples` of the run's training split (a fixed draw), read from
  `data_dir` (default: the run's config.data_dir).

  Returns:
    The content of out/quantization.json: method, scheme, library, source run and seed, the quantised dense layers
    and embedding tables, "param_bytes" / "disk_bytes" of the float and quantised parameters with their ratios
    ("compression"), and a static scheme's "calibration".

  Raises:
    FileNotFoundError: `workdir` is not a finished fine-tuning run.
    ValueError: `workdir` is already quantised, `seed` is not one of its seeds, `out` holds files, or a static
      scheme's training split cannot be read.
  """
  workdir, out = paths.as_path(workdir), paths.as_path(out)
  run_info, config = _read_run(workdir)
  if (workdir / QUANTIZATION_FILE).exists():
    raise ValueError(f"{workdir} is already quantised ({workdir / QUANTIZATION_FILE}); give the fine-tuning run")
  seed = run_info["best_seed"] if seed is None else seed
  if seed not in run_info["seeds"]:
    raise ValueError(f"--seed {seed}: {workdir} has seeds {run_info['seeds']}")
  if out.exists() and any(out.iterdir()):
    raise ValueError(f"--out {out} is not empty: give a new folder")
  if calibration_examples < 1:
    raise ValueError(f"--calibration-examples {calibration_examples}: give at least 1")
  step, params = checkpoint_lib.restore_params(workdir / f"seed_{seed}")
  calibration, calibrated = (_calibrate(workdir, seed, params, run_info, config, scheme, calibration_examples,
                                        data_dir) if scheme.static else (None, None))
  objective = _objective(run_info, config, lambda model: quantization.quantized_model(model, scheme))
  quantized = quantization.quantize_params(params, _abstract_params(objective, run_info["seq_len"]), calibration)
  stored = jax.tree.map(np.asarray, quantization.to_storage(quantized))
  model_config = dataclasses.asdict(objective.model.config)
  float_bytes, quantized_bytes = quantization.param_bytes(params), quantization.param_bytes(stored)
  report = {"method": method(scheme), "scheme": dataclasses.asdict(scheme),
            "library": f"qwix {metadata.version('qwix')}", "source": str(workdir), "seed": seed,
            "step": step, "quantized": quantization.quantized_counts(quantized),
            "param_bytes": {"float": float_bytes, "quantized": quantized_bytes,
                            "compression": float_bytes / quantized_bytes}}
  if calibrated is not None:
    report["calibration"] = calibrated
  out.mkdir(parents=True, exist_ok=True)
  quantized_disk = _save_params(out / f"seed_{seed}", step, stored, {"step": step, "seed": seed})
  # The fine-tuning checkpoint holds the float parameters alone, saved the same way.
  float_disk = _disk_bytes(workdir / f"seed_{seed}" / "checkpoints" / str(step))
  report["disk_bytes"] = {"float": float_disk, "quantized": quantized_disk, "compression": float_disk / quantized_disk}
  (out / "config.json").write_text((workdir / "config.json").read_text())
  load_tokenizer(workdir / "tokenizer").save(out / "tokenizer")
  (out / "model_config.json").write_text(json.dumps(model_config, indent=2) + "\n")
  (out / QUANTIZATION_FILE).write_text(json.dumps(report, indent=2) + "\n")
  # Last: RUN_FILE marks a finished folder.
  (out / RUN_FILE).write_text(json.dumps({**run_info, "model_config": model_config, "seeds": [seed],
                                          "best_seed": seed, "best_seed_dir": f"seed_{seed}"}, indent=2) + "\n")
  return report


def load_quantized(folder: str | os.PathLike, seed: int | None = None) -> tuple[FinetuneObjective, Any]:
  """The objective (its model quantised) and the quantised parameters of a `quantize_run` folder, loaded as every
  model is for inference (`inference.load_for_inference`).

  `objective.predict(params, objective.prepare(batch))` gives the head's outputs as for the float run.
  """
  from bert_jax.tasks.inference import load_for_inference  # noqa: PLC0415 - it imports this package's modules

  folder = paths.as_path(folder)
  if not (folder / QUANTIZATION_FILE).exists():
    raise FileNotFoundError(f"{folder / QUANTIZATION_FILE} not found: is {folder} a `bert-jax quantize` output?")
  model = load_for_inference(folder, seed)
  return model.objective, model.params


def _size(count: int) -> str:
  return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def main(argv: list[str]) -> int:
  """bert-jax quantize --workdir FINETUNE_WORKDIR --out DIR [--seed S] [--scheme SCHEME] [--calibration-examples N]
  [--data-dir DIR]."""
  parser = argparse.ArgumentParser(prog="bert-jax quantize", description=main.__doc__, allow_abbrev=False)
  parser.add_argument("--workdir", required=True, help="a finished fine-tuning run")
  parser.add_argument("--out", required=True, help="new folder for the quantised model (`bert-jax evaluate` reads it)")
  parser.add_argument("--seed", type=int, help="which seed to quantise (default: the run's best)")
  parser.add_argument("--scheme", default="int8", choices=quantization.Scheme.names(),
                      help="number format of the dense layers; -static: input scales calibrated here, not per token "
                           "at run time (default: int8)")
  parser.add_argument("--calibration-examples", type=int, default=512,
                      help="training examples a static scheme calibrates on (default: 512)")
  parser.add_argument("--data-dir", help="a static scheme's task data (default: the run's config.data_dir)")
  args = parser.parse_args(argv)
  report = quantize_run(args.workdir, args.out, args.seed, quantization.Scheme.parse(args.scheme),
                        args.calibration_examples, args.data_dir)
  params, disk = report["param_bytes"], report["disk_bytes"]
  counts = report["quantized"]
  calibrated = (f"; input scales from {report['calibration']['examples']} training examples"
                if "calibration" in report else "")
  print(f"bert_jax quantize: seed {report['seed']} of {report['source']}: {counts['dense_layers']} dense layers in "
        f"{args.scheme} and {counts['embedding_tables']} embedding tables in int8 ({report['library']}{calibrated})\n"
        f"  parameters {_size(params['float'])} -> {_size(params['quantized'])} "
        f"({params['compression']:.2f}x); on disk {_size(disk['float'])} -> {_size(disk['quantized'])} "
        f"({disk['compression']:.2f}x)\n  wrote {args.out}; score it with bert-jax evaluate --workdir {args.out}")
  return 0
