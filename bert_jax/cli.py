"""`bert-jax` entry point: prepare | pretrain | finetune | evaluate | convert | features | fill-mask | sweep.

Intentionally thin: each subcommand is an importable `main(argv)` elsewhere.

  bert-jax pretrain --config configs/bert.py:size=base --config.optim.lr=1e-4 --workdir runs/bert
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pathlib
import sys

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS = {
    "prepare": ("bert_jax.data.prepare", "tokenise a corpus once into shards with a manifest"),
    "pretrain": ("bert_jax.cli", "pre-train from a config (resumes in the same workdir)"),
    "finetune": ("bert_jax.tasks.finetune", "fine-tune on GLUE / SQuAD / SWAG / CoNLL-2003"),
    "evaluate": ("bert_jax.tasks.finetune", "re-score a fine-tuned checkpoint"),
    "convert": ("bert_jax.convert.hf", "import / export Hugging Face checkpoints"),
    "features": ("bert_jax.analysis.features", "per-token features from chosen layers (.npz)"),
    "fill-mask": ("bert_jax.analysis.fill_mask", "top predictions at each [MASK]"),
    "sweep": ("bert_jax.train.sweep", "run a config's sweep and render its table"),
}


def pretrain_main(argv: list[str]) -> int:
  """bert-jax pretrain --config FILE[:ARG] [--config.KEY=VALUE ...] --workdir DIR."""
  parser = argparse.ArgumentParser(prog="bert-jax pretrain", description=pretrain_main.__doc__, allow_abbrev=False)
  parser.add_argument("--config", required=True, help="configs/NAME.py[:arg]")
  parser.add_argument("--workdir", required=True, help="run directory; an existing one is resumed")
  args, rest = parser.parse_known_args(argv)
  overrides = [a for a in rest if a.startswith("--config.")]
  unknown = [a for a in rest if not a.startswith("--config.")]
  if unknown:
    parser.error(f"unrecognised arguments {unknown}; overrides look like --config.optim.lr=1e-4")

  from bert_jax.train import config_lib, trainer

  config = config_lib.load_config(args.config, overrides)
  result = trainer.train_and_evaluate(config, args.workdir)
  _report(config, result)
  return 0


def _report(config, result) -> None:
  import jax

  if jax.process_index() != 0:
    return
  if result["preempted"]:
    print(f"Preempted at step {result['step']}; run the same command again to resume.")
    return
  if config.train.fill_mask:
    from bert_jax.analysis import fill_mask

    model_cfg, params, tokenizer = fill_mask.load_run(result["workdir"])
    texts = list(config.train.fill_mask)
    print("\nFill-mask predictions:")
    print(fill_mask.format_predictions(texts, fill_mask.fill_mask(model_cfg, params, tokenizer, texts)))
  history = result["history"]
  if history:
    first, last = history[0], history[-1]
    print(f"\nMLM loss {first.get('mlm_loss', float('nan')):.3f} (step {first['step']}) -> "
          f"{last.get('mlm_loss', float('nan')):.3f} (step {last['step']})")
  if result["eval"]:
    print("Eval: " + ", ".join(f"{k}={v:.4g}" for k, v in result["eval"].items()))
  workdir = result["workdir"]
  print(f"Checkpoints: {workdir}/checkpoints\nMetrics: {workdir}/metrics.jsonl (TensorBoard: {workdir}/tensorboard)")


def enable_compilation_cache() -> None:
  """Turns on JAX's persistent compilation cache for this process.

  Where: $BERT_JAX_COMPILATION_CACHE (a directory, or "none" to leave it off),
  default ~/.cache/bert_jax/xla; an explicit $JAX_COMPILATION_CACHE_DIR wins.
  A rerun, a resumed run or another task with the same shapes then loads its
  compiled steps instead of compiling them again (on a GPU, tens of seconds
  per step function).
  """
  location = os.environ.get("BERT_JAX_COMPILATION_CACHE", str(pathlib.Path.home() / ".cache" / "bert_jax" / "xla"))
  if location == "none" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return
  import jax

  jax.config.update("jax_compilation_cache_dir", location)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
    lines = [f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    print("usage: bert-jax <command> [args]\n\ncommands:\n" + "\n".join(lines))
    return 0 if argv and argv[0] in ("-h", "--help") else 2
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax's per-save INFO lines drown the progress bar.
  for noisy in ("absl", "jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.ERROR)
  command, rest = argv[0], argv[1:]
  enable_compilation_cache()
  try:
    if command == "pretrain":
      return pretrain_main(rest)
    module = importlib.import_module(SUBCOMMANDS[command][0])
    entry = getattr(module, "evaluate_main" if command == "evaluate" else "main")
    return entry(rest)
  except (ValueError, FileNotFoundError, FloatingPointError) as error:
    # Bad input (config, data, checkpoint, NaN loss): the message names the problem; a traceback
    # would bury it. BERT_JAX_TRACEBACK=1 shows it anyway.
    if os.environ.get("BERT_JAX_TRACEBACK"):
      raise
    print(f"bert-jax {command}: error: {error}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
