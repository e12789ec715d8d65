"""SQuAD v1.1 / v2.0 span extraction with BERT's recipe.

  bert-jax finetune --config configs/finetune/squad.py:version=1.1 --workdir runs/squad11 \
      --config.init.model=MODEL_DIR --config.data_dir=DIR_WITH_train-v1.1.json_AND_dev-v1.1.json

Rows are [CLS] question [SEP] context window [SEP] with 384 tokens, windows
every 128 context tokens, questions cut at 64 tokens; answers decoded from the
20 best starts and ends, at most 30 tokens long. v2.0 reports the official
metrics at `task_options.null_score_threshold` and the best threshold on dev
(best_exact_thresh / best_f1_thresh), which selects checkpoints by best_f1.

Defaults follow BERT (Devlin et al. 2019, Sec. 4.2-4.3): v1.1 3 epochs,
lr 5e-5, batch 32; v2.0 2 epochs, lr 5e-5, batch 48. `get_sweep()` is the
learning-rate grid {5e-5, 3e-5, 2e-5}.
"""

from bert_jax.tasks.finetune_config import finetune_defaults
from bert_jax.train.config_lib import ConfigError, parse_arg

VERSIONS = {"1.1": dict(epochs=3, batch_size=32), "2.0": dict(epochs=2, batch_size=48)}
LEARNING_RATES = (5e-5, 3e-5, 2e-5)


def get_config(arg=None):
  args = parse_arg(arg, version="1.1")
  version = {"1": "1.1", "2": "2.0"}.get(args.version, args.version)
  if version not in VERSIONS:
    raise ConfigError(f"squad.py: version={args.version!r}; expected one of {sorted(VERSIONS)}")
  config = finetune_defaults()
  config.task = f"squad/v{version}"
  config.task_options.doc_stride = 128
  config.task_options.max_query_length = 64
  config.task_options.n_best_size = 20
  config.task_options.max_answer_length = 30
  config.task_options.null_score_threshold = 0.0
  config.max_len = 384
  config.seeds = (1,)
  config.optim.lr = 5e-5
  config.train.epochs = VERSIONS[version]["epochs"]
  config.train.batch_size = VERSIONS[version]["batch_size"]
  config.train.eval_batch_size = 96
  return config


def get_sweep(arg=None):
  del arg
  return [{"optim.lr": lr} for lr in LEARNING_RATES]
