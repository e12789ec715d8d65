"""StructBERT's ablation of its objectives (Wang et al. 2020): both structural objectives, without the word one,
without the sentence one, and BERT's MLM + NSP, StructBERT-Base.

  bert-jax sweep --config configs/ablations/structbert_objectives.py:scale=gpu --workdir runs/structbert_objectives \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/structbert_objectives

The rows are `configs/structbert.py`'s objectives with their example formats: the word structural objective
(mlm+wso: 5% of the unmasked trigrams shuffled, their original tokens predicted by the MLM head) reads whole
sentences, the sentence structural objective (mlm+sso: next, previous or random segment, three ways) reads "sso"
pairs, BERT's NSP its segment pairs. The paper's numbers are not given here: its ablation table could not be read
from this machine, so the findings are the directions its text states (single-sentence tasks from the word
objective, sentence-pair tasks from the sentence objective), declared before any run. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("cola", "sst2", "mnli_m", "qqp", "squad1.1_f1"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))

ROWS = (("StructBERT", "mlm+wso+sso"), ("without the word structural objective", "mlm+sso"),
        ("without the sentence structural objective", "mlm+wso"), ("BERT (MLM + NSP)", "mlm+nsp"))
PUBLISHED = {
    "paper": ("Wang et al. 2020, StructBERT: Incorporating Language Structures into Pre-training for Deep Language "
              "Understanding"),
    "table": "objective ablation",
    "source": ("arXiv:1908.04577 (ICLR 2020), the ablation of the pre-training objectives on StructBERT-Base: its "
               "numbers could not be read here, so none are given; the findings are the directions its text "
               "states (the word objective matters most for single-sentence tasks, the sentence objective for "
               "sentence-pair tasks); its columns are the GLUE and SQuAD tasks of those two groups, SNLI left out "
               "(no task of ours); paper at https://arxiv.org/abs/1908.04577"),
    "columns": {"cola": "CoLA", "sst2": "SST-2", "mnli_m": "MNLI", "qqp": "QQP", "squad1.1_f1": "SQuAD 1.1 (F1)"},
    "higher_is_better": {"cola": True, "sst2": True, "mnli_m": True, "qqp": True, "squad1.1_f1": True},
    "rows": {name: {} for name, _ in ROWS},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`); MNLI
# and QQP are scored through their stand-ins, RTE and MRPC (`findings.STAND_INS`).
FINDINGS = (
    findings.Finding("the structural objectives beat BERT's MLM + NSP", "StructBERT", "BERT (MLM + NSP)",
                     columns=("cola", "sst2", "rte", "mrpc", "squad1.1_f1"), headline=True),
    findings.Finding("the word structural objective helps single-sentence tasks", "StructBERT",
                     "without the word structural objective", columns=("cola", "sst2")),
    findings.Finding("the sentence structural objective helps sentence-pair tasks", "StructBERT",
                     "without the sentence structural objective", columns=("rte", "mrpc", "squad1.1_f1")),
)


def get_config(arg=None):
  return ablation.base_config("structbert.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  # Each objective reads the example format `configs/structbert.py` gives it.
  return [{"name": name, "overrides": {
      "objective": objective,
      "data.format": ablation.base_config(f"structbert.py:objective={objective}", "paper").data.format}}
          for name, objective in ROWS]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
