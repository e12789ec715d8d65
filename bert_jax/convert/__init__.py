"""Checkpoint conversion: Hugging Face import/export and our converted-model directories.

  huggingface  load_hf_checkpoint / save_hf_checkpoint (config and tensor mapping)
  mapping      the name and layout tables per family
  params       model kinds of a params tree, shapes, flattening
  pretrained   our directory format: save_pretrained / load_pretrained (either format)
  command      the `bert-jax convert` command (main)
"""

from bert_jax.convert.huggingface import CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from bert_jax.convert.params import build_model, encoder_params, model_kind
from bert_jax.convert.pretrained import Pretrained, detect_format, load_pretrained, save_pretrained

__all__ = ["CheckpointError", "load_hf_checkpoint", "save_hf_checkpoint", "build_model", "encoder_params",
           "model_kind", "Pretrained", "detect_format", "load_pretrained", "save_pretrained"]
