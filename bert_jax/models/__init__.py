"""Model zoo: one encoder for BERT, RoBERTa, ALBERT and ELECTRA, its heads and the pre-training models (`model`)."""

from bert_jax.models.config import ModelConfig, electra_generator_config, model_config
from bert_jax.models.model import Dropout, ElectraModel, Encoder, PretrainingModel

__all__ = ["Dropout", "ModelConfig", "model_config", "electra_generator_config", "Encoder", "PretrainingModel",
           "ElectraModel"]
