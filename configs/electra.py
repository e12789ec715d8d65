"""ELECTRA pre-training (Clark et al. 2020): generator + discriminator, replaced-token detection (weight 50).

  bert-jax pretrain --config configs/electra.py:size=small \
      --config.data.prepared=data/wiki --workdir runs/electra_small

The generator shares the token, position and type embeddings with the
discriminator and is `generator_fraction` of its width (1/4 for small and
large, 1/3 for base in the paper). Arguments: size (small|base|large).
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults

_RECIPES = {  # size: (batch, lr, steps, seq_len, generator fraction)
    "small": (128, 5e-4, 1_000_000, 128, 0.25),
    "base": (256, 2e-4, 766_000, 512, 1 / 3),
    "large": (2048, 2e-4, 400_000, 512, 0.25),
}


def get_config(arg=None):
  args = parse_arg(arg, size="small")
  if args.size not in _RECIPES:
    raise ValueError(f"electra.py: size must be one of {sorted(_RECIPES)}, got {args.size!r}")
  batch, lr, steps, seq_len, fraction = _RECIPES[args.size]
  config = pretrain_defaults()
  config.objective = "rtd"
  config.model = model_section("electra", args.size)
  config.model.generator_fraction = fraction
  config.data.format = "full_sentences"
  config.data.seq_len = seq_len
  config.masking.max_predictions = 20 if seq_len == 128 else 80
  config.loss.rtd_weight = 50.0
  config.loss.generator_weight = 1.0
  config.optim.lr = lr
  config.optim.warmup_steps = 10_000
  config.optim.weight_decay = 0.01
  config.train.batch_size = batch
  config.train.steps = steps
  return config


def get_sweep(arg=None):
  """The generator-size ablation (ELECTRA Figure 3) and MLM at the same steps; ELECTRA vs MLM at equal compute is
  `configs/ablations/electra_compute.py`."""
  del arg
  return [{"model.generator_fraction": f} for f in (0.25, 0.5, 1.0)] + [{"objective": "mlm"}]
