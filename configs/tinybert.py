"""TinyBERT (Jiao et al. 2020): Transformer distillation, general then task-specific, through the `distill` section.

  stage=general       pre-training: a student learns a pre-trained teacher's embeddings, hidden states and
                      attention scores on a general corpus; no prediction layer (the MLM loss has weight 0)
  stage=intermediate  fine-tuning from the general student: the same three losses from a teacher fine-tuned on the
                      task; the head is not trained yet, and the last evaluation's parameters are kept
  stage=prediction    fine-tuning from the intermediate stage: the teacher's soft targets at temperature 1 alone

Each loss and the layer map are in `bert_jax.train.distill`: student layer m learns teacher layer g(m) = m N / M
(`distill.layer_map`), attention on the unnormalised scores q . k / sqrt(d) as the paper, hidden states and
embeddings through learned maps W_h and W_e (`distill.hidden_projection`). The task-specific stages are one
command with different weights: the intermediate stage sets prediction_weight 0, the prediction stage sets the
intermediate losses' weights to 0 and alpha 1.

  bert-jax pretrain --config configs/tinybert.py:stage=general --config.distill.teacher=TEACHER \
      --config.data.prepared=data/wiki --workdir runs/tinybert_general
  bert-jax finetune --config configs/tinybert.py:stage=intermediate,task=rte --workdir runs/tinybert_rte_int \
      --config.init.model=runs/tinybert_general --config.distill.teacher=runs/glue/rte --config.data_dir=GLUE_DIR
  bert-jax finetune --config configs/tinybert.py:stage=prediction,task=rte --workdir runs/tinybert_rte \
      --config.init.model=runs/tinybert_rte_int --config.distill.teacher=runs/glue/rte --config.data_dir=GLUE_DIR

TEACHER is a pre-training workdir or a converted / Hugging Face model (BERT-Base in the paper; its MLM head is not
read), the prepared corpus uses its tokenizer, and runs/glue/rte is that teacher fine-tuned on the task
(configs/finetune/glue.py). The student is TinyBERT_4: 4 layers, width 312, 12 heads, feed-forward 1200, from
scratch; a 12-layer teacher maps its layers 3, 6, 9, 12. The sentence-transformers MiniLM-L6 (6 layers, width 384,
12 heads, no MLM head) teaches a 3-layer student through layers 2, 4, 6: layers=3 (a 4-layer student of it needs
--config.distill.layer_map=2,3,5,6 or similar). The paper's recipe: general distillation for 3 epochs of English
Wikipedia at sequence length 128; the intermediate stage for 20 epochs at batch 32 and learning rate 5e-5, the
prediction stage for 3 epochs at batch 32 and a learning rate from {1e-5, 2e-5, 3e-5} (`get_sweep`), both on
data augmented 20-fold by word replacement, which this recipe does not do; sequence length 128 for pair tasks, 64
for single sentences. The general stage's batch, step count and learning rate here are ours (BERT's batch 256 for
about three epochs of Wikipedia, learning rate 1e-4).

scale=tiny shrinks every stage for a CPU: general distillation on a prepared corpus (--config.data.prepared) from a
tiny pre-training run's workdir, a 2-layer width-32 student, a few dozen steps; the task stages a few epochs.

Arguments: stage (general|intermediate|prediction), task (a GLUE task, for the task stages), layers, width, heads,
ffn (the student; the task stages read it from init.model), scale (paper|tiny), steps (general), epochs (task
stages; 0: the paper's).
"""

import pathlib

from bert_jax.train.config_lib import ConfigError, load_config, model_section, parse_arg, pretrain_defaults

STAGES = ("general", "intermediate", "prediction")
SCALES = ("paper", "tiny")
PREDICTION_LEARNING_RATES = (1e-5, 2e-5, 3e-5)
SINGLE_SENTENCE_TASKS = ("cola", "sst2", "sst-2")


def _intermediate_losses(distill, weight):
  distill.attention_weight = distill.hidden_weight = distill.embedding_weight = weight


def get_config(arg=None):
  args = parse_arg(arg, stage="general", task="rte", layers=4, width=312, heads=12, ffn=1200, scale="paper",
                   steps=0, epochs=0)
  if args.stage not in STAGES:
    raise ConfigError(f"tinybert.py: stage={args.stage!r}; expected one of {STAGES}")
  if args.scale not in SCALES:
    raise ConfigError(f"tinybert.py: scale={args.scale!r}; expected one of {SCALES}")
  tiny = args.scale == "tiny"
  if args.stage == "general":
    config = pretrain_defaults()
    config.objective = "mlm"
    config.data.format = "full_sentences"
    config.masking.dynamic = True
    config.distill.alpha = 0.0  # the MLM teacher's soft targets are prediction-layer distillation: not here
    config.distill.prediction_weight = 0.0
    _intermediate_losses(config.distill, 1.0)
    config.distill.hidden_projection = True
    config.optim.weight_decay = 0.01
    if tiny:
      config.model = model_section("bert", "tiny", num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64,
                                   max_position_embeddings=64, dtype="float32")
      config.data.seq_len, config.masking.max_predictions = 64, 10
      config.optim.lr, config.optim.warmup_steps = 2e-3, 4
      config.train.batch_size, config.train.steps = 16, args.steps or 30
      config.train.log_every, config.train.eval_every = 10, config.train.steps
      config.train.checkpoint_every, config.train.eval_batches = config.train.steps, 2
      return config
    config.model = model_section("bert", f"L{args.layers}-H{args.width}", num_heads=args.heads,
                                 intermediate_size=args.ffn)
    config.data.seq_len = 128
    config.masking.max_predictions = 20
    config.optim.lr = 1e-4
    config.train.batch_size = 256
    config.train.steps = args.steps or 300_000
    config.optim.warmup_steps = min(10_000, config.train.steps // 10)
    return config

  config = load_config(str(pathlib.Path(__file__).parent / "finetune" / "glue.py") + f":task={args.task}")
  config.unlock()
  config.max_len = 64 if args.task.lower() in SINGLE_SENTENCE_TASKS else 128
  config.distill.temperature = 1.0
  config.train.batch_size = 32
  config.train.save_checkpoint = True  # the next stage starts from it
  if args.stage == "intermediate":
    config.distill.prediction_weight = 0.0
    _intermediate_losses(config.distill, 1.0)
    config.distill.hidden_projection = True
    # The head is untrained, so the dev score says nothing: keep the last parameters, from one seed.
    config.train.selection = "last"
    config.seeds = (1,)
    config.optim.lr = 5e-5
    config.train.epochs = args.epochs or (3 if tiny else 20)
  else:
    config.distill.alpha = 1.0
    config.distill.prediction_weight = 1.0
    _intermediate_losses(config.distill, 0.0)
    config.optim.lr = 2e-5
    config.train.epochs = args.epochs or 3
  if tiny:
    config.seeds = (1,)
    config.optim.lr = 2e-3
  return config


def get_sweep(arg=None):
  """The prediction stage's learning rates (the paper's grid, picked on dev)."""
  del arg
  return [{"optim.lr": lr} for lr in PREDICTION_LEARNING_RATES]
