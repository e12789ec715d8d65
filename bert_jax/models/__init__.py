"""Model zoo: one encoder for BERT, RoBERTa, ALBERT and ELECTRA, plus heads."""

from bert_jax.models.config import ModelConfig, electra_generator_config, model_config
from bert_jax.models.encoder import Dropout, Encoder
from bert_jax.models.model import ElectraModel, PretrainingModel

__all__ = ["Dropout", "ModelConfig", "model_config", "electra_generator_config", "Encoder", "PretrainingModel",
           "ElectraModel"]
