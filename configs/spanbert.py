"""SpanBERT pre-training (Joshi et al. 2020): geometric span masking + span boundary objective, no NSP.

  bert-jax pretrain --config configs/spanbert.py:size=base \
      --config.data.prepared=data/wiki --workdir runs/spanbert_base

Spans of whole words with lengths ~ Geometric(0.2) clipped at 10, until 15%
of the tokens are masked; single segments of up to 512 tokens (DOC-SENTENCES).
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults


def get_config(arg=None):
  args = parse_arg(arg, size="base", steps=2_400_000)
  config = pretrain_defaults()
  config.objective = "mlm+sbo"
  config.model = model_section("bert", args.size)
  config.data.format = "doc_sentences"
  config.data.seq_len = 512
  config.masking.granularity = "span"
  config.masking.span_geometric_p = 0.2
  config.masking.span_max_len = 10
  config.masking.max_predictions = 80
  config.loss.sbo_weight = 1.0
  config.optim.lr = 1e-4
  config.optim.warmup_steps = 10_000
  config.optim.weight_decay = 0.01
  config.train.batch_size = 256
  config.train.steps = args.steps
  return config


def get_sweep(arg=None):
  """SpanBERT Table 6: masking scheme (token / whole word / n-gram / span) with and without SBO."""
  del arg
  schemes = [{"masking.granularity": g, "objective": "mlm"} for g in ("token", "whole_word", "ngram", "span")]
  return schemes + [{"masking.granularity": "span", "objective": "mlm+sbo"}]
