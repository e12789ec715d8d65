"""`bert-jax convert`, and the conversion API in one place.

  bert-jax convert --from-hf DIR [--generator-dir DIR] --out DIR
  bert-jax convert --to-hf DIR --out DIR

--from-hf imports a Hugging Face checkpoint (an ELECTRA discriminator takes
its generator from --generator-dir) and writes our model directory
(`bert_jax.convert.pretrained`). --to-hf exports one of our directories (or
re-exports a Hugging Face one) as a checkpoint `transformers` loads; an
ELECTRA model writes its generator to OUT/generator. Tokenizer files travel
along both ways.

The functions behind it: `load_hf_checkpoint` and `save_hf_checkpoint`
(`bert_jax.convert.huggingface`), `load_pretrained` and `save_pretrained`
(`bert_jax.convert.pretrained`), all importable from `bert_jax.convert`.
"""

from __future__ import annotations

import argparse
import sys

from bert_jax.convert.huggingface import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from bert_jax.convert.params import flatten_params, model_kind
from bert_jax.convert.pretrained import find_tokenizer, load_pretrained, save_pretrained


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="bert-jax convert", description=__doc__.split("\n\nThe functions")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--from-hf", metavar="DIR", help="Hugging Face checkpoint directory to import")
  source.add_argument("--to-hf", metavar="DIR", help="model directory (ours or Hugging Face) to export")
  parser.add_argument("--generator-dir", metavar="DIR", help="ELECTRA generator (ElectraForMaskedLM) directory")
  parser.add_argument("--out", metavar="DIR", required=True, help="output directory")
  return parser


def main(argv: list[str]) -> int:
  """Runs the command on `argv` (the arguments after `convert`); returns the exit status."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.generator_dir and not args.from_hf:
    parser.error("--generator-dir goes with --from-hf")  # A command-line mistake: exit 2, as argparse does.
  try:
    if args.from_hf:
      family, config, params, extras = load_hf_checkpoint(args.from_hf, args.generator_dir)
      save_pretrained(args.out, family, config, params, tokenizer_dir=find_tokenizer(args.from_hf), extras=extras)
      written = [args.out]
    else:
      (family, config, params, tokenizer_path), extras = load_pretrained(args.to_hf, return_extras=True)
      written = save_hf_checkpoint(family, config, params, args.out, extras=extras, tokenizer_dir=tokenizer_path)
  except (CheckpointError, FileNotFoundError) as error:
    print(f"bert-jax convert: error: {error}", file=sys.stderr)
    return 1
  count = sum(leaf.size for leaf in flatten_params(params).values())
  print(f"{family} {model_kind(params)} model, {count / 1e6:.2f}M parameters -> {', '.join(map(str, written))}")
  return 0
