"""ERNIE 1.0's knowledge masking (Sun et al. 2019): basic-level masking alone against ERNIE's three stages, at one
budget of pre-training steps.

  # the corpus' named entities and noun phrases, as for SpanBERT's Table 6 (configs/ablations/spanbert_masking.py)
  bert-jax mark-spans --prepared data/wiki --ner runs/ner --chunker runs/np_chunker
  bert-jax sweep --config configs/ablations/ernie_masking.py:scale=gpu --workdir runs/ernie_masking \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/ernie_masking

The rows are `configs/ernie.py`'s recipe (MLM + NSP on segment pairs). Basic-level masking masks random whole
words for every step of the budget. ERNIE's stages take a third of the budget each, each starting from the last
one's parameters with a fresh optimizer and schedule (a sweep row that `continues` another): whole words, then
noun phrases, then named entities (with probability 1/2 per masked unit a whole tagged span, else a whole word,
`masking.granularity`). The first two stages are rows of their own, scored like the others, so the table shows
what each stage adds; only the last is ERNIE. Every row reads the marked corpus of config.data.prepared (`bert-jax
reproduce run` marks it first, as for SpanBERT's table). The paper's tasks are Chinese (XNLI, ChnSentiCorp, LCQMC,
MSRA-NER, NLPCC-DBQA): ours stand in for their kinds, named in advance. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("rte", "sst2", "mrpc", "conll2003_f1", "squad1.1_f1"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))


def _stage(config):
  """A third of the budget (whole calls of `train.steps_per_call` steps): one ERNIE stage's steps."""
  return config.train.steps // 3 // config.train.steps_per_call * config.train.steps_per_call


def _stage_overrides(granularity):
  return {"masking.granularity": granularity, "train.steps": _stage, "train.eval_every": _stage,
          "train.checkpoint_every": _stage, "optim.warmup_steps": lambda c: max(1, c.optim.warmup_steps // 3)}


BASIC, PHASE_1, PHASE_2, ERNIE = ("basic-level masking", "stage 1: basic-level", "stage 2: phrase-level",
                                  "ERNIE (stage 3: entity-level)")
ROWS = ({"name": BASIC, "overrides": {"masking.granularity": "whole_word"}},
        {"name": PHASE_1, "overrides": _stage_overrides("whole_word")},
        {"name": PHASE_2, "overrides": _stage_overrides("noun_phrase"), "continues": PHASE_1},
        {"name": ERNIE, "overrides": _stage_overrides("named_entity"), "continues": PHASE_2})
_COLUMNS = SUITE.tasks
PUBLISHED = {
    "paper": "Sun et al. 2019, ERNIE: Enhanced Representation through Knowledge Integration",
    "table": "knowledge masking",
    "source": ("arXiv:1904.09223, the ablation of the masking strategies (basic-level, then phrase-level, then "
               "entity-level) on XNLI: its numbers could not be read here, so none are given; the finding is the "
               "direction its text states (knowledge masking improves over basic-level masking), on the stand-ins "
               "for its five task kinds: RTE for XNLI, SST-2 for ChnSentiCorp, MRPC for LCQMC, CoNLL-2003 NER for "
               "MSRA-NER, SQuAD 1.1 for NLPCC-DBQA; paper at https://arxiv.org/abs/1904.09223"),
    "columns": {"rte": "RTE (for XNLI)", "sst2": "SST-2 (for ChnSentiCorp)", "mrpc": "MRPC (for LCQMC)",
                "conll2003_f1": "CoNLL-2003 NER (for MSRA-NER)", "squad1.1_f1": "SQuAD 1.1 (for NLPCC-DBQA)"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {row["name"]: {} for row in ROWS},
}

# The finding this table tests, fixed before the runs that judge it (`bert_jax/experiments/findings.py`). The
# stages' own rows are shown, not judged: each has fewer steps than the rows the finding compares.
FINDINGS = (
    findings.Finding("knowledge masking beats basic-level masking", ERNIE, BASIC, columns=_COLUMNS, headline=True),
)


def get_config(arg=None):
  config = ablation.base_config("ernie.py:size=base", parse_arg(arg, scale="tiny").scale)
  config.data.builtin = False  # Every row reads the marked corpus (config.data.prepared).
  return config


def get_sweep(arg=None):
  del arg
  return [dict(row) for row in ROWS]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
