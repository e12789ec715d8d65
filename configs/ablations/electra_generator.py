"""ELECTRA's generator size (Clark et al. 2020, Figure 3 left): GLUE against the generator's width fraction.

  bert-jax sweep --config configs/ablations/electra_generator.py:scale=gpu --workdir runs/electra_generator \
      --config.data.prepared=data/wiki --data-dir glue=data/glue --data-dir squad=data/squad \
      --data-dir conll2003=data/conll2003
  bert-jax table runs/electra_generator

The generator keeps the discriminator's depth and shares its embeddings; its hidden size is the fraction of
the discriminator's. Arguments: scale.
"""

from bert_jax.experiments import ablation, findings, suite
from bert_jax.train.config_lib import parse_arg

GLUE_TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli_m", "qnli", "rte")
SUITE = suite.Suite(tasks=GLUE_TASKS, seeds=(1, 2, 3, 4, 5), lrs=(3e-4, 1e-4, 5e-5))
FRACTIONS = ((0.25, "1/4"), (0.5, "1/2"), (0.75, "3/4"), (1.0, "1"))

PUBLISHED = {
    "paper": "Clark et al. 2020, ELECTRA: Pre-training Text Encoders as Discriminators Rather Than Generators",
    "table": "Figure 3 (left)",
    "source": ("arXiv:2003.10555 (ICLR 2020) Figure 3 (left), GLUE dev score against generator size: a plot whose "
               "points the text does not state, so no numbers are given (the text says generators 1/4-1/2 the "
               "discriminator's size work best); paper at https://arxiv.org/abs/2003.10555"),
    "columns": {"glue": "GLUE score"},
    "higher_is_better": {"glue": True},
    "rows": {f"generator {label} of the discriminator": {} for _, label in FRACTIONS},
}

# The findings this table tests, fixed before the runs that judge them (`bert_jax/experiments/findings.py`); the
# figure prints no numbers, its text the direction.
FINDINGS = (
    findings.Finding("a generator 1/4 of the discriminator beats one as large", "generator 1/4 of the discriminator",
                     "generator 1 of the discriminator"),
)


def get_config(arg=None):
  return ablation.base_config("electra.py:size=base", parse_arg(arg, scale="tiny").scale)


def get_sweep(arg=None):
  del arg
  return [{"name": f"generator {label} of the discriminator", "overrides": {"model.generator_fraction": fraction}}
          for fraction, label in FRACTIONS]


def get_suite(arg=None):
  return suite.scaled(SUITE, parse_arg(arg, scale="tiny").scale)
