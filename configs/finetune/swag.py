"""SWAG multiple choice (swagaf CSV files) with BERT's recipe.

  bert-jax finetune --config configs/finetune/swag.py --workdir runs/swag \
      --config.init.model=MODEL_DIR --config.data_dir=DIR_WITH_train.csv_AND_val.csv

Each of the four choices is the row [CLS] sent1 [SEP] sent2 + ending [SEP];
the pooled [CLS] of each row gets one score and the four scores a softmax.
Defaults follow BERT (Devlin et al. 2019, Sec. 4.4): 3 epochs, lr 2e-5,
batch 16. `get_sweep()` is the learning-rate grid {5e-5, 3e-5, 2e-5}.
"""

from bert_jax.tasks.finetune_config import finetune_defaults
from bert_jax.train.config_lib import parse_arg

LEARNING_RATES = (5e-5, 3e-5, 2e-5)


def get_config(arg=None):
  parse_arg(arg)
  config = finetune_defaults()
  config.task = "swag"
  config.max_len = 128
  config.seeds = (1,)
  config.optim.lr = 2e-5
  config.train.batch_size = 16
  config.train.epochs = 3
  config.train.eval_batch_size = 64
  return config


def get_sweep(arg=None):
  del arg
  return [{"optim.lr": lr} for lr in LEARNING_RATES]
