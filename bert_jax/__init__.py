"""bert_jax: pretraining and fine-tuning BERT-family encoders in JAX/Flax."""

__version__ = "0.1.0"
