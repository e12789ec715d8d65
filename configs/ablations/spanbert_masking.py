"""SpanBERT Table 6 (Joshi et al. 2020): masking schemes, bi-sequence training with NSP.

  # the corpus' named entities and noun phrases, by taggers fine-tuned on CoNLL-2003 (bert_jax/tasks/spans.py)
  bert-jax finetune --config configs/finetune/ner.py --workdir runs/ner --config.init.model=MODEL \
      --config.data_dir=data/conll2003
  bert-jax finetune --config configs/finetune/ner.py:column=chunk --workdir runs/np_chunker \
      --config.init.model=MODEL --config.data_dir=data/conll2003
  bert-jax mark-spans --prepared data/wiki --ner runs/ner --chunker runs/np_chunker
  bert-jax sweep --config configs/ablations/spanbert_masking.py:scale=gpu --workdir runs/spanbert_masking \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/spanbert_masking

Subword Tokens: BERT's random subword masking; Whole Words: random whole words; Named Entities and Noun
Phrases: with probability 1/2 per masked unit a whole tagged entity / noun phrase, else a whole word
(`masking.granularity` named_entity / noun_phrase, `bert_jax.data.masking`); Geometric Spans: span lengths in
words ~ Geometric(0.2) clipped at 10. Every row reads the marked corpus of config.data.prepared, at every scale
(tiny too: the built-in corpus has no spans). The taggers' model must share the corpus' vocabulary (MODEL: a
pre-training workdir on it); `bert-jax reproduce mark` pre-trains one at the rows' size, fine-tunes both
taggers and marks the Wikipedia sample in one GPU call, and `bert-jax reproduce run` carries its spans file to
the table's call (or does the same first, when none is carried). The paper also reports NewsQA, TriviaQA,
SearchQA, HotpotQA, Natural Questions and coreference, which have no task here. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

SUITE = suite.Suite(tasks=("squad1.1_f1", "squad2.0_f1", "mnli_m", "qnli"), seeds=(1, 2, 3, 4, 5),
                    lrs=(5e-5, 3e-5, 2e-5))
SCHEMES = (("Subword Tokens", "token"), ("Whole Words", "whole_word"), ("Named Entities", "named_entity"),
           ("Noun Phrases", "noun_phrase"), ("Geometric Spans", "span"))
_COLUMNS = ("squad1.1_f1", "squad2.0_f1", "mnli_m", "qnli")

# The paper's Table 6 has no SQuAD 1.1 column (that cell stays empty); its NewsQA, TriviaQA, Coreference and
# GLUE (Avg) columns have no column of ours.
_PAPER_COLUMNS = ("squad2.0_f1", "mnli_m", "qnli")
_NUMBERS = {"Subword Tokens": (83.8, 86.7, 92.5), "Whole Words": (84.3, 86.3, 92.8),
            "Named Entities": (84.8, 86.0, 93.1), "Noun Phrases": (85.0, 86.5, 93.2),
            "Geometric Spans": (85.4, 87.0, 93.3)}

PUBLISHED = {
    "paper": "Joshi et al. 2020, SpanBERT: Improving Pre-training by Representing and Predicting Spans",
    "table": "Table 6",
    "source": ("arXiv:1907.10529 (TACL 2020) Table 6, dev set; read from a public copy of its text as rendered at "
               "https://ar5iv.labs.arxiv.org/html/1907.10529"),
    "columns": {"squad1.1_f1": "SQuAD 1.1 (F1)", "squad2.0_f1": "SQuAD 2.0 (F1)", "mnli_m": "MNLI-m", "qnli": "QNLI"},
    "higher_is_better": {column: True for column in _COLUMNS},
    "rows": {name: dict(zip(_PAPER_COLUMNS, _NUMBERS[name])) for name, _ in SCHEMES},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`).
FINDINGS = (
    findings.Finding("geometric spans beat subword tokens", "Geometric Spans", "Subword Tokens", headline=True),
    findings.Finding("geometric spans beat whole words", "Geometric Spans", "Whole Words"),
    findings.Finding("geometric spans beat named entities", "Geometric Spans", "Named Entities"),
    findings.Finding("noun phrases beat whole words", "Noun Phrases", "Whole Words"),
)


def get_config(arg=None):
  config = ablation.base_config("spanbert.py:size=base", parse_arg(arg, scale="tiny").scale)
  config.objective, config.data.format = "mlm+nsp", "segment_pair"
  config.data.builtin = False  # Every row reads the marked corpus (config.data.prepared).
  return config


def get_sweep(arg=None):
  del arg
  return [{"name": name, "overrides": {"masking.granularity": granularity}} for name, granularity in SCHEMES]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
