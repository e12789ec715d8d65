"""`bert-jax` entry point: prepare | mark-spans | pretrain | sample-rte | finetune | evaluate | predict | quantize |
convert | features | fill-mask | analyze | sweep | table | plot | reproduce | compression-runs | analysis-runs.

Intentionally thin: each subcommand is an importable `main(argv)` beside the code it runs.

  bert-jax pretrain --config configs/bert.py:size=base --config.optim.lr=1e-4 --workdir runs/bert
"""

from __future__ import annotations

import importlib
import logging
import os
import pathlib
import sys
import threading

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS = {
    "prepare": ("bert_jax.data.prepare", "tokenise a corpus once into shards with a manifest"),
    "mark-spans": ("bert_jax.tasks.spans", "mark named entities / noun phrases in a prepared corpus with taggers"),
    "pretrain": ("bert_jax.train.trainer", "pre-train from a config (resumes in the same workdir)"),
    "sample-rte": ("bert_jax.tasks.sample", "write a small RTE-format sample task (not GLUE) to try fine-tuning"),
    "finetune": ("bert_jax.tasks.finetune", "fine-tune on GLUE / SQuAD / SWAG / CoNLL-2003"),
    "evaluate": ("bert_jax.tasks.evaluate", "re-score a fine-tuned checkpoint"),
    "predict": ("bert_jax.tasks.predict", "a fine-tuned model's predictions for a file (JSON lines or submission)"),
    "quantize": ("bert_jax.tasks.quantize", "int8 post-training quantisation of a fine-tuned model"),
    "convert": ("bert_jax.convert.command", "import / export Hugging Face checkpoints"),
    "features": ("bert_jax.analysis.features", "per-token features from chosen layers (.npz)"),
    "fill-mask": ("bert_jax.train.fill_mask", "top predictions at each [MASK]"),
    "analyze": ("bert_jax.analysis.analyze", "attention patterns, head importance and pruning: report + figures"),
    "sweep": ("bert_jax.experiments.ablation", "pre-train a table's rows, fine-tune their downstream suite, score"),
    "table": ("bert_jax.experiments.table", "render a sweep's paper-style table with the published numbers, plots"),
    "plot": ("bert_jax.train.plot", "PNG plots of runs' metrics (loss, accuracy, learning rate, throughput)"),
    "reproduce": ("bert_jax.experiments.reproduce", "the ablation tables on a GPU machine: pack, run, publish, ..."),
    "compression-runs": ("bert_jax.experiments.compression_runs", "docs/compression.md's GPU runs: pack, run, render"),
    "analysis-runs": ("bert_jax.experiments.analysis_runs", "docs/analysis.md's GPU runs: pack, run"),
}


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


EXAMPLES = """examples:
  bert-jax pretrain --config configs/demo.py --workdir runs/demo
  bert-jax pretrain --config configs/bert.py:size=base,phase=1 --config.data.prepared=data/wiki --workdir runs/base
  bert-jax convert --from-hf path/to/hf_model --out models/minilm
  bert-jax finetune --config configs/finetune/glue.py:task=rte --config.init.model=models/minilm \\
      --config.data_dir=GLUE_DIR --workdir runs/rte
  bert-jax predict --workdir runs/rte --input GLUE_DIR/RTE/test.tsv --output rte.jsonl
  bert-jax fill-mask --model runs/demo "A list is a mutable [MASK] of items."
  bert-jax analyze --model runs/rte --out analysis/rte --max-examples 200
  bert-jax plot runs/demo runs/rte --out plots/

Run `bert-jax COMMAND --help` for a command's options."""


def usage() -> str:
  width = max(map(len, SUBCOMMANDS))
  lines = [f"  {name:<{width}} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
  return "usage: bert-jax COMMAND [args]  (bert-jax --version)\n\ncommands:\n" + "\n".join(lines) + "\n\n" + EXAMPLES


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    return _main(argv)
  except KeyboardInterrupt:  # Ctrl-C while a command loads (its imports take seconds): one line, no traceback.
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else ""
    print(f"bert-jax{' ' + command if command else ''}: error: stopped by Ctrl-C", file=sys.stderr)
    return 1


def _main(argv: list[str]) -> int:
  if argv and argv[0] == "--version":
    from importlib import metadata
    print(f"bert-jax {metadata.version('bert_jax')}")
    return 0
  if not argv or argv[0] in ("-h", "--help"):
    print(usage())
    return 0 if argv else 2
  if argv[0] not in SUBCOMMANDS:
    import difflib
    near = difflib.get_close_matches(argv[0], list(SUBCOMMANDS), n=1)
    hint = f"; did you mean `bert-jax {near[0]}`?" if near else ""
    print(f"bert-jax: error: unknown command {argv[0]!r}{hint}\nRun `bert-jax --help` for the commands.",
          file=sys.stderr)
    return 2
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax's per-save INFO lines drown the progress bar.
  for noisy in ("jax", "orbax"):
    logging.getLogger(noisy).setLevel(logging.ERROR)
  # Orbax logs through absl, a traceback per array of a failed save; the trainer reports that in one line.
  logging.getLogger("absl").setLevel(logging.CRITICAL)
  logging.getLogger("fsspec").setLevel(logging.WARNING)  # A gs:// path's every read logs its cache at INFO.
  command, rest = argv[0], argv[1:]
  enable_compilation_cache()
  try:
    module = importlib.import_module(SUBCOMMANDS[command][0])
    return module.main(rest)
  except (ValueError, OSError, FloatingPointError) as error:
    # Bad input (config, data, checkpoint, NaN loss) or storage (a full disk): the message names the problem; a
    # traceback would bury it. Every command's errors take this one form and exit 1 (a command line argparse
    # cannot read exits 2). BERT_JAX_TRACEBACK=1 shows the traceback anyway.
    if os.environ.get("BERT_JAX_TRACEBACK"):
      raise
    print(f"bert-jax {command}: error: {error}", file=sys.stderr)
    if isinstance(error, OSError):  # Library threads and exit hooks failing on the same storage add nothing.
      sys.unraisablehook = threading.excepthook = lambda *_: None
      logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # "Task exception was never retrieved" at exit.
    return 1


if __name__ == "__main__":
  sys.exit(main())
