"""DistilBERT (Sanh et al. 2019): general distillation of a BERT teacher into a student of half its depth.

  bert-jax pretrain --config configs/distilbert.py:layers=6 --config.distill.teacher=TEACHER \
      --config.data.prepared=data/wiki --workdir runs/distilbert

TEACHER is a pre-training workdir or a converted / Hugging Face model with its
MLM head (BertForMaskedLM, BertForPreTraining), and the prepared corpus uses its
tokenizer. The student has the teacher's architecture but its depth (size
L<layers>-H<width>, here BERT-Base's 768; override num_heads or
intermediate_size where the teacher's differ from H/64 and 4H) and starts from
teacher layers 0, k, 2k, ... (k = teacher layers / student layers), its
embeddings and MLM head (`config.distill.init_from_teacher`). A base model
without an MLM head (sentence-transformers' MiniLM) teaches through its hidden
states only: --config.distill.alpha=0, e.g. a 3-layer student of MiniLM-L6 is
layers=3,width=384 with --config.model.num_heads=12. The loss is DistilBERT's
5 L_ce + 2 L_mlm + 1 L_cos, divided by 7 (alpha 5/7 on the soft targets at T=2,
the MLM loss 1 - alpha, cos_weight 1/7); MLM only, dynamic masking, large
batches. Arguments: layers, width, steps, batch. `get_sweep()` varies the
student's depth.

The `distill` keys (`bert_jax.train.distill`): teacher, temperature, alpha,
cos_weight, hidden_projection (a student narrower than its teacher: learn a
map for the cosine loss; then init_from_teacher must be False), init_from_teacher.
"""

from bert_jax.train.config_lib import model_section, parse_arg, pretrain_defaults


def get_config(arg=None):
  args = parse_arg(arg, layers=6, width=768, steps=400_000, batch=4096)
  config = pretrain_defaults()
  config.objective = "mlm"
  config.model = model_section("bert", f"L{args.layers}-H{args.width}")
  config.data.format = "full_sentences"
  config.data.seq_len = 512
  config.masking.dynamic = True
  config.masking.max_predictions = 80
  config.distill.temperature = 2.0
  config.distill.alpha = 5 / 7
  config.distill.cos_weight = 1 / 7
  config.distill.init_from_teacher = True
  config.optim.lr = 5e-4
  config.optim.warmup_steps = 10_000
  config.optim.weight_decay = 0.01
  config.train.batch_size = args.batch
  config.train.steps = args.steps
  return config


def get_sweep(arg=None):
  """The student's depth: 3, 4 and 6 layers from a 12-layer teacher."""
  del arg
  return [{"model.size": f"L{layers}-H768"} for layers in (3, 4, 6)]
