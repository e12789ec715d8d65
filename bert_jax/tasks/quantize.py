"""`bert-jax quantize`: a fine-tuned model in int8 (Q8BERT-style post-training quantisation).

  bert-jax quantize --workdir runs/rte --out runs/rte-int8 [--seed S]
  bert-jax evaluate --workdir runs/rte-int8

Reads one seed of a fine-tuning run (its best by default), quantises its parameters
(`bert_jax.models.quantization`: dense layers with int8 weights, one scale per output feature, and activations
quantised per token at run time, int8 matmuls accumulated in int32; int8 embedding tables) and writes a folder
that reads like a one-seed fine-tuning run, so `bert-jax evaluate` scores it:

  config.json, tokenizer/             the run's
  finetune_run.json, model_config.json  the run's, for the one seed, the model on its plain path (no kernels, remat)
  quantization.json                   marks the folder: method, library, the source run and seed, sizes
  seed_<s>/checkpoints/<step>/        the int8 tree (Orbax, `quantization.to_storage`)

`load_quantized(folder)` gives the quantised model and its parameters, ready to apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from importlib import metadata
from typing import Any

from etils import epath
import jax
import ml_collections
import numpy as np

from bert_jax import paths
from bert_jax.data.tokenizers import load_tokenizer
from bert_jax.models import ModelConfig
from bert_jax.models import quantization
from bert_jax.tasks.finetune_model import QUANTIZATION_FILE, RUN_FILE, FinetuneObjective, task_model
from bert_jax.tasks.registry import get_task
from bert_jax.train import checkpoint as checkpoint_lib

METHOD = ("Q8BERT-style int8 post-training quantisation: dense-layer weights symmetric per output feature (absmax), "
          "their input activations symmetric per token at run time, int8 matmuls with int32 accumulation; embedding "
          "tables int8 per row; LayerNorms, biases and attention's products in the compute dtype")


def _read_run(workdir: epath.Path) -> tuple[dict[str, Any], ml_collections.ConfigDict]:
  if not (workdir / RUN_FILE).exists():
    raise FileNotFoundError(f"{workdir / RUN_FILE} not found: --workdir must be a finished fine-tuning run")
  return (json.loads((workdir / RUN_FILE).read_text()),
          ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text())))


def _objective(run_info: dict[str, Any], config: ml_collections.ConfigDict) -> FinetuneObjective:
  """The run's objective with the quantised model."""
  task = get_task(config.task, **config.task_options.to_dict())
  model_config = ModelConfig(**run_info["model_config"])
  model = quantization.quantized_model(task_model(config, model_config, task))
  return FinetuneObjective(model, task.kind, single_token_type=model_config.type_vocab_size == 1,
                           num_choices=task.num_choices)


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


def quantize_run(workdir: str | os.PathLike, out: str | os.PathLike, seed: int | None = None) -> dict[str, Any]:
  """Quantises `seed` (default: the best) of the fine-tuning run in `workdir` into the folder `out`.

  Returns:
    The content of out/quantization.json: method, library, source run and seed, the quantised dense layers and
    embedding tables, and "param_bytes" / "disk_bytes" of the float and int8 parameters with their ratios
    ("compression").

  Raises:
    FileNotFoundError: `workdir` is not a finished fine-tuning run.
    ValueError: `workdir` is already quantised, `seed` is not one of its seeds, or `out` holds files.
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
  step, params = checkpoint_lib.restore_params(workdir / f"seed_{seed}")
  objective = _objective(run_info, config)
  quantized = quantization.quantize_params(params, _abstract_params(objective, run_info["seq_len"]))
  stored = jax.tree.map(np.asarray, quantization.to_storage(quantized))
  model_config = dataclasses.asdict(objective.model.config)
  float_bytes, int8_bytes = quantization.param_bytes(params), quantization.param_bytes(stored)
  report = {"method": METHOD, "library": f"qwix {metadata.version('qwix')}", "source": str(workdir), "seed": seed,
            "step": step, "quantized": quantization.quantized_counts(quantized),
            "param_bytes": {"float": float_bytes, "int8": int8_bytes, "compression": float_bytes / int8_bytes}}
  out.mkdir(parents=True, exist_ok=True)
  int8_disk = _save_params(out / f"seed_{seed}", step, stored, {"step": step, "seed": seed})
  # The fine-tuning checkpoint holds the float parameters alone, saved the same way.
  float_disk = _disk_bytes(workdir / f"seed_{seed}" / "checkpoints" / str(step))
  report["disk_bytes"] = {"float": float_disk, "int8": int8_disk, "compression": float_disk / int8_disk}
  (out / "config.json").write_text((workdir / "config.json").read_text())
  load_tokenizer(workdir / "tokenizer").save(out / "tokenizer")
  (out / "model_config.json").write_text(json.dumps(model_config, indent=2) + "\n")
  (out / QUANTIZATION_FILE).write_text(json.dumps(report, indent=2) + "\n")
  # Last: RUN_FILE marks a finished folder.
  (out / RUN_FILE).write_text(json.dumps({**run_info, "model_config": model_config, "seeds": [seed],
                                          "best_seed": seed, "best_seed_dir": f"seed_{seed}"}, indent=2) + "\n")
  return report


def load_quantized(folder: str | os.PathLike, seed: int | None = None) -> tuple[FinetuneObjective, Any]:
  """The objective (its model quantised) and the int8 parameters of a `quantize_run` folder, loaded as every
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
  """bert-jax quantize --workdir FINETUNE_WORKDIR --out DIR [--seed S]."""
  parser = argparse.ArgumentParser(prog="bert-jax quantize", description=main.__doc__, allow_abbrev=False)
  parser.add_argument("--workdir", required=True, help="a finished fine-tuning run")
  parser.add_argument("--out", required=True, help="new folder for the int8 model (`bert-jax evaluate` reads it)")
  parser.add_argument("--seed", type=int, help="which seed to quantise (default: the run's best)")
  args = parser.parse_args(argv)
  report = quantize_run(args.workdir, args.out, args.seed)
  params, disk = report["param_bytes"], report["disk_bytes"]
  counts = report["quantized"]
  print(f"bert_jax quantize: seed {report['seed']} of {report['source']}: {counts['dense_layers']} dense layers and "
        f"{counts['embedding_tables']} embedding tables in int8 ({report['library']})\n"
        f"  parameters {_size(params['float'])} -> {_size(params['int8'])} "
        f"({params['compression']:.2f}x); on disk {_size(disk['float'])} -> {_size(disk['int8'])} "
        f"({disk['compression']:.2f}x)\n  wrote {args.out}; score it with bert-jax evaluate --workdir {args.out}")
  return 0
