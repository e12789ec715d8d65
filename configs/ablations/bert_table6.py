"""BERT Table 6 (Devlin et al. 2019): ablation over model size (#L layers, #H hidden, #A heads).

  bert-jax sweep --config configs/ablations/bert_table6.py:scale=gpu --workdir runs/bert_table6 \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/bert_table6

"LM (ppl)" is the masked-LM perplexity of held-out data (the pre-training evaluation). Arguments: scale
(tiny|gpu|paper); #L and #A are the paper's at every scale, #H is divided by 16 at scale=tiny (head size 4, so
the six rows run on a CPU) and by 4 at scale=gpu (the largest row then costs about 1.5 BERT-Small, so every row
fits one GPU's ten minutes).
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("mnli_m", "mrpc", "sst2"), seeds=(1, 2, 3, 4, 5), lrs=(5e-5, 4e-5, 3e-5, 2e-5),
                    tiny_task="mrpc")

SIZES = ((3, 768, 12), (6, 768, 3), (6, 768, 12), (12, 768, 12), (12, 1024, 16), (24, 1024, 16))
_COLUMNS = ("mlm_ppl", "mnli_m", "mrpc", "sst2")
_NUMBERS = ((5.84, 77.9, 79.8, 88.4), (5.24, 80.6, 82.2, 90.7), (4.68, 81.9, 84.8, 91.3),
            (3.99, 84.4, 86.7, 92.9), (3.54, 85.7, 86.9, 93.3), (3.23, 86.6, 87.8, 93.7))


def row_name(layers: int, hidden: int, heads: int) -> str:
  return f"L={layers} H={hidden} A={heads}"


PUBLISHED = {
    "paper": "Devlin et al. 2019, BERT: Pre-training of Deep Bidirectional Transformers for Language Understanding",
    "table": "Table 6",
    "source": ("shared/seeds (lecture notes quoting the paper's Table 6); dev set accuracy; checked against public "
               "copies of the text of arXiv:1810.04805 (https://arxiv.org/abs/1810.04805)"),
    "columns": {"mlm_ppl": "LM (ppl)", "mnli_m": "MNLI-m", "mrpc": "MRPC", "sst2": "SST-2"},
    "higher_is_better": {"mlm_ppl": False, "mnli_m": True, "mrpc": True, "sst2": True},
    "rows": {row_name(*size): dict(zip(_COLUMNS, numbers)) for size, numbers in zip(SIZES, _NUMBERS)},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`). The
# headline compares the smallest row with the largest one that fits a ten-minute call with its suite at the main
# budget (the 24-layer row does not).
FINDINGS = (
    findings.Finding("bigger models reach a lower MLM perplexity", row_name(12, 1024, 16), row_name(3, 768, 12),
                     columns=("mlm_ppl",), headline=True),
    findings.Finding("bigger models are better on the sentence tasks, small ones included", row_name(12, 1024, 16),
                     row_name(3, 768, 12), columns=("rte", "mrpc", "sst2"), headline=True),
    findings.Finding("more heads at the same width help", row_name(6, 768, 12), row_name(6, 768, 3),
                     columns=("rte", "mrpc", "sst2")),
    findings.Finding("24 layers beat 12 at width 1024", row_name(24, 1024, 16), row_name(12, 1024, 16),
                     columns=("rte", "mrpc", "sst2")),
)


def get_config(arg=None):
  return ablation.base_config("bert.py:size=base,phase=1", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  divisor = {"tiny": 16, "gpu": 4}.get(parse_arg(arg, scale="tiny").scale, 1)
  return [{"name": row_name(layers, hidden, heads),
           "overrides": {"model.num_layers": layers, "model.hidden_size": hidden // divisor,
                         "model.num_heads": heads, "model.intermediate_size": 4 * hidden // divisor}}
          for layers, hidden, heads in SIZES]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
