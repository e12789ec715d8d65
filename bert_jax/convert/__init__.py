"""Checkpoint conversion: Hugging Face import/export and our converted-model directories."""

from bert_jax.convert.hf import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from bert_jax.convert.params import build_model, encoder_params, model_kind
from bert_jax.convert.pretrained import detect_format, load_pretrained, save_pretrained

__all__ = ["CheckpointError", "load_hf_checkpoint", "save_hf_checkpoint", "build_model", "encoder_params",
           "model_kind", "detect_format", "load_pretrained", "save_pretrained"]
