"""Reference: fine-tune a pretrained BERT on SQuAD v1.1 or CoNLL-2003 with PyTorch `transformers`.

The PyTorch side of `bench/finetune_vs_reference.py` for the span (SQuAD) and
tagging (CoNLL-2003 NER) tasks: `BertForQuestionAnswering` /
`BertForTokenClassification` trained by a plain PyTorch loop with the recipe
`bert-jax finetune` uses:

  AdamW (torch's, fused on CUDA), betas (0.9, 0.999), eps 1e-8, weight decay
  0.01 on matrices and embedding tables only (not on biases or LayerNorm, the
  1-D parameters), 10% linear warmup then linear decay to 0
  (`get_linear_schedule_with_warmup`: lr 0 at the first update, as optax's
  schedule), gradient clipping at global norm 1.0, the checkpoint's dropout
  (0.1), bfloat16 autocast, float32 losses. SQuAD: (start CE + end CE) / 2
  averaged over windows, padding logits masked out of the softmax; NER: CE
  averaged over the first word pieces of words. The model after the last step
  is scored once on dev.

Only the model and the training loop are the reference's own. Reading the
files, the features (SQuAD sliding windows of 384 tokens every 128, questions
cut at 64 tokens; NER rows with the first word piece of each word labelled,
IOB1 tags) and the metrics (SQuAD n-best 20, answers of at most 30 tokens,
official answer normalisation, exact match and F1; conlleval entity F1) are
imported from `bert_jax.tasks`, so both sides train on identical rows, in the
same order (`np.random.default_rng([seed, epoch]).permutation` per epoch, as
bert_jax), and are scored by identical rules: the comparison isolates the
training framework. The one deliberate difference in the inputs: rows are
padded per batch to the batch's longest row (rounded up to 8) here, to the
task's longest row in bert_jax (fixed shapes for jit); padding is masked on
both sides, so this changes speed, not the arithmetic of real tokens.

  python3 -m bench.reference_hf_span_ner --task squad --model MODEL_DIR --data DIR_WITH_train-v1.1.json \\
      --seeds 1,2,3
  python3 -m bench.reference_hf_span_ner --task conll --model MODEL_DIR --data DIR_WITH_eng.train_AND_eng.testa

Prints one JSON line per seed: the task's metrics (SQuAD exact_match, f1;
CoNLL f1, precision, recall, on the 0-100 scale), train_s (the training loop,
device-synchronised) and eval_s (prediction and scoring).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import tokenizers
import torch
from transformers import BertForQuestionAnswering, BertForTokenClassification
from transformers.optimization import get_linear_schedule_with_warmup

from bert_jax.tasks.base import HFTokenizerAdapter, Task
from bert_jax.tasks.ner import Conll2003Task
from bert_jax.tasks.squad import SquadTask

# The squad.py / ner.py configs' task options (doc_stride 128, ... ; no document context).
TASKS = {"squad": lambda: SquadTask(version="1.1", doc_stride=128, max_query_length=64, n_best_size=20,
                                    max_answer_length=30),
         "conll": lambda: Conll2003Task(document_context=False)}
DEFAULT_EPOCHS = {"squad": 2, "conll": 3}
DEFAULT_MAX_LEN = {"squad": 384, "conll": 128}
LABEL_FIELDS = {"span": ("start_positions", "end_positions"), "tagging": ("labels",)}
_LENGTH_MULTIPLE = 8


def build_model(task: Task, model_dir: str, device: torch.device) -> torch.nn.Module:
  if task.kind == "span":
    model = BertForQuestionAnswering.from_pretrained(model_dir, dtype=torch.float32)
  else:
    model = BertForTokenClassification.from_pretrained(
        model_dir, num_labels=task.num_labels, id2label=dict(enumerate(task.labels)),
        label2id={label: i for i, label in enumerate(task.labels)}, dtype=torch.float32)
  return model.to(device)


def optimizer_and_schedule(model: torch.nn.Module, args, total_steps: int, device: torch.device):
  """AdamW with weight decay on >1-D parameters only, 10% linear warmup then linear decay."""
  decay = [p for p in model.parameters() if p.ndim > 1]
  no_decay = [p for p in model.parameters() if p.ndim <= 1]
  optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.999),
                                eps=1e-8, fused=device.type == "cuda")
  schedule = get_linear_schedule_with_warmup(optimizer, int(args.warmup_proportion * total_steps), total_steps)
  return optimizer, schedule


def batch_length(lengths: np.ndarray, max_len: int) -> int:
  longest = int(lengths.max())
  return min(max_len, -(-longest // _LENGTH_MULTIPLE) * _LENGTH_MULTIPLE)


def forward(model: torch.nn.Module, kind: str, tensors: dict[str, torch.Tensor], rows: torch.Tensor,
            length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
  """Float32 logits of `rows` cut to `length` tokens ([B, L, 2] span, [B, L, K] tagging) and the token mask."""
  input_ids = tensors["input_ids"][rows, :length]
  mask = torch.arange(length, device=device)[None, :] < tensors["lengths"][rows, None]
  with torch.autocast(device.type, dtype=torch.bfloat16):
    out = model(input_ids=input_ids, token_type_ids=tensors["segment_ids"][rows, :length],
                attention_mask=mask.long())
  if kind == "span":
    logits = torch.stack([out.start_logits, out.end_logits], dim=-1).float()
    return logits.masked_fill(~mask[..., None], torch.finfo(torch.float32).min), mask
  return out.logits.float(), mask


def loss_fn(kind: str, logits: torch.Tensor, tensors: dict[str, torch.Tensor], rows: torch.Tensor,
            length: int) -> torch.Tensor:
  if kind == "span":
    start = torch.nn.functional.cross_entropy(logits[..., 0], tensors["start_positions"][rows])
    end = torch.nn.functional.cross_entropy(logits[..., 1], tensors["end_positions"][rows])
    return (start + end) / 2
  labels = tensors["labels"][rows, :length]
  return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                           ignore_index=-1)


def predict(model: torch.nn.Module, task: Task, features: dict[str, np.ndarray], tensors: dict[str, torch.Tensor],
            batch_size: int, device: torch.device) -> np.ndarray:
  """Raw head outputs for every feature, padded back to the features' max_len ([N, L, 2] or [N, L, K])."""
  num_rows, max_len = features["input_ids"].shape
  width = 2 if task.kind == "span" else task.num_labels
  fill = np.finfo(np.float32).min if task.kind == "span" else 0.0
  outputs = np.full((num_rows, max_len, width), fill, np.float32)
  model.eval()
  with torch.no_grad():
    for start in range(0, num_rows, batch_size):
      rows = np.arange(start, min(start + batch_size, num_rows))
      length = batch_length(features["lengths"][rows], max_len)
      logits, _ = forward(model, task.kind, tensors, torch.as_tensor(rows, device=device), length, device)
      outputs[rows, :length] = logits.cpu().numpy()
  return outputs


def run_seed(task: Task, seed: int, args, train: dict[str, np.ndarray], dev: dict[str, np.ndarray],
             dev_examples: list, device: torch.device) -> dict:
  """Fine-tunes from the pretrained model with `seed` and scores dev."""
  torch.manual_seed(seed)
  np.random.seed(seed)
  model = build_model(task, args.model, device)
  fields = ("input_ids", "segment_ids", "lengths") + LABEL_FIELDS[task.kind]
  train_tensors = {k: torch.as_tensor(train[k], dtype=torch.long, device=device) for k in fields}
  dev_tensors = {k: torch.as_tensor(dev[k], dtype=torch.long, device=device) for k in fields}
  num_rows, max_len = train["input_ids"].shape
  steps_per_epoch = -(-num_rows // args.batch)
  total_steps = args.epochs * steps_per_epoch
  optimizer, schedule = optimizer_and_schedule(model, args, total_steps, device)
  losses = []
  if device.type == "cuda":
    torch.cuda.synchronize()
  started = time.perf_counter()
  model.train()
  for epoch in range(args.epochs):
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    for start in range(0, num_rows, args.batch):
      rows = order[start:start + args.batch]
      length = batch_length(train["lengths"][rows], max_len)
      rows_t = torch.as_tensor(rows, device=device)
      logits, _ = forward(model, task.kind, train_tensors, rows_t, length, device)
      loss = loss_fn(task.kind, logits, train_tensors, rows_t, length)
      loss.backward()
      torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
      optimizer.step()
      schedule.step()
      optimizer.zero_grad(set_to_none=True)
      losses.append(loss.detach())
  if device.type == "cuda":
    torch.cuda.synchronize()
  train_s = time.perf_counter() - started
  started = time.perf_counter()
  outputs = predict(model, task, dev, dev_tensors, args.eval_batch, device)
  metrics = task.evaluate(outputs, dev, dev_examples)
  eval_s = time.perf_counter() - started
  last_losses = torch.stack(losses[-steps_per_epoch:]).float().mean().item()
  return {"task": args.task, "seed": seed, "train_s": round(train_s, 3), "eval_s": round(eval_s, 3),
          "steps": total_steps, "last_epoch_loss": round(last_losses, 4),
          "n_train_rows": num_rows, "n_dev_examples": len(dev_examples), "n_dev_rows": len(dev["input_ids"]),
          "attention": getattr(model.config, "_attn_implementation", None), "device": str(device),
          **{name: float(metrics[name]) for name in task.metric_names}}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--task", required=True, choices=sorted(TASKS))
  parser.add_argument("--model", required=True, help="Hugging Face BERT directory (float32 weights, tokenizer.json)")
  parser.add_argument("--data", required=True, help="squad: train-v1.1.json, dev-v1.1.json; conll: eng.train, "
                      "eng.testa")
  parser.add_argument("--seeds", default="1")
  parser.add_argument("--lr", type=float, default=5e-5)
  parser.add_argument("--epochs", type=int, help="default: squad 2, conll 3")
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--eval-batch", type=int, default=128)
  parser.add_argument("--max-len", type=int, help="default: squad 384, conll 128")
  parser.add_argument("--weight-decay", type=float, default=0.01)
  parser.add_argument("--warmup-proportion", type=float, default=0.1)
  args = parser.parse_args()
  args.epochs = args.epochs or DEFAULT_EPOCHS[args.task]
  args.max_len = args.max_len or DEFAULT_MAX_LEN[args.task]
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  task = TASKS[args.task]()
  tokenizer = HFTokenizerAdapter(tokenizers.Tokenizer.from_file(str(pathlib.Path(args.model) / "tokenizer.json")))
  started = time.perf_counter()
  train_examples = task.load(args.data, "train")
  dev_examples = task.load(args.data, "dev")
  train = task.featurize(train_examples, tokenizer, args.max_len)
  dev = task.featurize(dev_examples, tokenizer, args.max_len)
  print(f"reference {args.task}: {len(train_examples)} train examples ({len(train['input_ids'])} rows), "
        f"{len(dev_examples)} dev ({len(dev['input_ids'])} rows), featurised in {time.perf_counter() - started:.1f} s; "
        f"device {device}, torch {torch.__version__}", file=sys.stderr, flush=True)
  for seed in (int(s) for s in args.seeds.split(",")):
    print(json.dumps(run_seed(task, seed, args, train, dev, dev_examples, device)), flush=True)


if __name__ == "__main__":
  main()
