"""ELECTRA's efficiency analysis (Clark et al. 2020, Table 5): where ELECTRA's gains come from.

  bert-jax sweep --config configs/ablations/electra_variants.py:scale=gpu --workdir runs/electra_variants \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/electra_variants

BERT: masked LM. ELECTRA 15%: the discriminator's loss on the 15% masked-out positions only. Replace MLM:
masked positions get a generator's sample instead of [MASK], and the model predicts the original token there.
All-Tokens MLM: Replace MLM predicting the identity of every token, through the paper's copy mechanism
(p = D [input token] + (1 - D) p_MLM, D a sigmoid per token). Both train the generator jointly with its MLM, as
ELECTRA does. ELECTRA: replaced-token detection on all tokens. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli_m", "qnli", "rte")
SUITE = suite.Suite(tasks=GLUE_TASKS, seeds=(1, 2, 3, 4, 5), lrs=(3e-4, 1e-4, 5e-5))

# The paper's Table 5 prints one GLUE dev score per model (the average over the GLUE tasks), no per-task scores;
# `glue` is not a column our suite scores.
PUBLISHED = {
    "paper": "Clark et al. 2020, ELECTRA: Pre-training Text Encoders as Discriminators Rather Than Generators",
    "table": "Table 5",
    "source": ("arXiv:2003.10555 (ICLR 2020) Table 5, GLUE dev set; read from a public copy of the paper's text, "
               "paper at https://arxiv.org/abs/2003.10555"),
    "columns": {"glue": "GLUE score"},
    "higher_is_better": {"glue": True},
    "rows": {"BERT": {"glue": 82.2}, "ELECTRA 15%": {"glue": 82.4}, "Replace MLM": {"glue": 82.4},
             "All-Tokens MLM": {"glue": 84.3}, "ELECTRA": {"glue": 85.0}},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`).
FINDINGS = (
    findings.Finding("ELECTRA beats BERT", "ELECTRA", "BERT"),
    findings.Finding("learning from all tokens helps", "All-Tokens MLM", "BERT"),
    findings.Finding("All-Tokens MLM beats Replace MLM", "All-Tokens MLM", "Replace MLM"),
    findings.Finding("ELECTRA beats ELECTRA 15%", "ELECTRA", "ELECTRA 15%"),
)


def get_config(arg=None):
  return ablation.base_config("electra.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  return [{"name": "BERT", "overrides": {"objective": "mlm"}},
          {"name": "ELECTRA 15%", "overrides": {"objective": "rtd", "loss.rtd_positions": "masked"}},
          {"name": "Replace MLM", "overrides": {"objective": "replace_mlm"}},
          {"name": "All-Tokens MLM", "overrides": {"objective": "all_tokens_mlm"}},
          {"name": "ELECTRA", "overrides": {"objective": "rtd"}}]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
