"""StructBERT pre-training (Wang et al. 2020): MLM + the word structural objective + the sentence structural one.

  bert-jax pretrain --config configs/structbert.py:size=base \
      --config.data.prepared=data/wiki --workdir runs/structbert_base
  bert-jax pretrain --config configs/structbert.py:scale=tiny --workdir runs/structbert_tiny

Word structural objective (objective mlm+wso): besides BERT's 15% masking, 5% of the trigrams of unmasked tokens
are shuffled (`masking.shuffle_rate`, `masking.shuffle_len`; each trigram gets one of its 5 non-identity orders,
uniformly) and the MLM head predicts the original token at every shuffled position, with MLM's weight (the
rules: `bert_jax.data.masking`'s docstring). Sentence structural objective (mlm+sso, format "sso"): segment
pairs whose B is the next segment of A, the previous one or a random other document's (1/3 each, labels 0, 1,
2), classified by a three-way head on [CLS]. scale=paper follows the paper's StructBERT-Base: BERT-Base, 512
tokens, batch 1024, Adam at 1e-4 with linear warmup over 10% of the steps and linear decay, 40 epochs of English
Wikipedia + BookCorpus (the default steps are that count estimated for ~4.4B word pieces an epoch).

scale=tiny: a 2-layer, width-64 float32 encoder for 300 steps of 16 x 64 tokens on the built-in corpus (a minute
or two on a 2-core CPU); scale=paper: the recipe above. Arguments: size (tiny|mini|small|medium|base|large|
L<n>-H<n>, at scale paper), objective (mlm+wso+sso, or mlm+wso / mlm+sso / mlm+nsp / mlm for the paper's
ablation), scale (paper|tiny), steps.
"""

from bert_jax.train.config_lib import ConfigError, model_section, parse_arg, pretrain_defaults

# Each objective's example format: the sentence structural objective reads "sso" pairs, NSP BERT's pairs.
FORMATS = {"mlm+wso+sso": "sso", "mlm+sso": "sso", "mlm+wso": "full_sentences", "mlm+nsp": "segment_pair",
           "mlm": "full_sentences"}
SCALES = ("paper", "tiny")


def get_config(arg=None):
  args = parse_arg(arg, size="base", objective="mlm+wso+sso", scale="paper", steps=0)
  if args.objective not in FORMATS:
    raise ConfigError(f"structbert.py: objective={args.objective!r}; expected one of {sorted(FORMATS)}")
  if args.scale not in SCALES:
    raise ConfigError(f"structbert.py: scale={args.scale!r}; expected one of {SCALES}")
  config = pretrain_defaults()
  config.objective = args.objective
  config.data.format = FORMATS[args.objective]
  config.masking.shuffle_rate, config.masking.shuffle_len = 0.05, 3
  config.masking.dynamic = True
  config.optim.name = "adamw"
  config.optim.weight_decay = 0.01
  if args.scale == "tiny":
    # 128 positions: room for the fine-tuning configs' 128-token rows.
    config.model = model_section("bert", "tiny", num_layers=2, hidden_size=64, num_heads=2, intermediate_size=128,
                                 max_position_embeddings=128, dtype="float32")
    config.data.builtin, config.data.builtin_vocab_size = True, 2000
    config.data.seq_len, config.masking.max_predictions = 64, 10
    config.optim.lr, config.optim.warmup_steps = 2e-3, 6
    config.train.batch_size, config.train.steps = 16, args.steps or 300
    config.train.log_every, config.train.eval_every, config.train.checkpoint_every = 25, config.train.steps, 100
    config.train.eval_batches = 4
    return config
  config.model = model_section("bert", args.size)
  config.data.seq_len = 512
  config.masking.max_predictions = 80
  config.train.batch_size = 1024
  # 40 epochs of ~4.4B word pieces at 1024 x 512 tokens a step.
  config.train.steps = args.steps or 340_000
  config.optim.lr = 1e-4
  config.optim.warmup_steps = config.train.steps // 10
  return config


def get_sweep(arg=None):
  """StructBERT's ablation of its objectives: both, without the word objective, without the sentence objective, and
  BERT's MLM + NSP."""
  del arg
  return [{"objective": objective, "data.format": FORMATS[objective]}
          for objective in ("mlm+wso+sso", "mlm+sso", "mlm+wso", "mlm+nsp")]
