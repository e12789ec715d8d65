"""ELECTRA vs masked-LM pre-training at equal compute (Clark et al. 2020, Table 1's small models).

  bert-jax sweep --config configs/ablations/electra_compute.py:scale=gpu --workdir runs/electra_compute \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/electra_compute

Both rows share ELECTRA-Small's encoder and recipe. The MLM row trains for more steps, so that its
pre-training compute matches ELECTRA's generator + discriminator as the paper counts compute: its FLOPs
count charges every network's token embedding as a one-hot matmul, which makes an ELECTRA step cost about
1.3 MLM steps at these sizes (the paper trains BERT-Small 1.5M steps against ELECTRA-Small's 1M). Counting
the embedding as the gather it is would give about 1 + g^2 for a generator of width fraction g, which
undercounts ELECTRA's wall time on a GPU (about 1.5 MLM steps). Columns: the paper's GLUE dev score, then
ours per GLUE dev task. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.models.config import model_config
from bert_jax.train import objectives, pretrain_config
from bert_jax.train.config_lib import parse_arg

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli_m", "qnli", "rte")
SUITE = suite.Suite(tasks=GLUE_TASKS, seeds=(1, 2, 3, 4, 5), lrs=(3e-4, 1e-4, 5e-5))

# The paper's Table 1 prints one GLUE dev score per model (the average over the GLUE tasks: Spearman for STS,
# Matthews correlation for CoLA, accuracy for the rest), no per-task scores; `glue` is not a column our suite scores.
PUBLISHED = {
    "paper": "Clark et al. 2020, ELECTRA: Pre-training Text Encoders as Discriminators Rather Than Generators",
    "table": "Table 1 (small models)",
    "source": ("arXiv:2003.10555 (ICLR 2020) Table 1, GLUE dev set; read from a public copy of the paper's text, "
               "paper at https://arxiv.org/abs/2003.10555"),
    "columns": {"glue": "GLUE score"},
    "higher_is_better": {"glue": True},
    "rows": {"BERT-Small (MLM)": {"glue": 75.1}, "ELECTRA-Small": {"glue": 79.9}},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`).
FINDINGS = (
    findings.Finding("ELECTRA beats MLM at equal compute", "ELECTRA-Small", "BERT-Small (MLM)", headline=True),
)


def get_config(arg=None):
  return ablation.base_config("electra.py:size=small", parse_arg(arg, scale="tiny").scale)


def compute_ratio(config) -> float:
  """ELECTRA's training FLOPs per step over the MLM row's, on the config's model, with the token embedding charged
  as a one-hot matmul as the paper's count charges it (`ModelConfig.flops_per_token`)."""
  vocab = config.model.vocab_size or model_config(config.model.family, config.model.size).vocab_size
  model = pretrain_config.build_model_config(config.model, vocab)
  flops = {name: objectives.objective_class(name).from_config(config, model, mask_id=0).flops_per_token(
      config.masking.max_predictions, config.data.seq_len, dense_embedding_lookup=True) for name in ("rtd", "mlm")}
  return flops["rtd"] / flops["mlm"]


def _at_equal_compute(key):
  """The MLM row's `key` (steps, or an interval in steps): ELECTRA's times `compute_ratio`, from the config as
  given, to the nearest multiple of the steps a call takes (intervals must be multiples of it)."""
  def value(config):
    per_call = config.train.steps_per_call
    return per_call * int(round(config.train[key] * compute_ratio(config) / per_call))
  return value


def get_sweep(arg=None):
  del arg
  return [{"name": "BERT-Small (MLM)", "overrides": {"objective": "mlm",
                                                     **{f"train.{key}": _at_equal_compute(key)
                                                        for key in ("steps", "eval_every", "checkpoint_every")}}},
          {"name": "ELECTRA-Small", "overrides": {"objective": "rtd"}}]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
