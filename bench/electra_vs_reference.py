"""ELECTRA's early learning, ours against an independent PyTorch `transformers` reference, one table.

  python bench/electra_vs_reference.py                 # CPU, ~2 minutes: the built-in corpus, 600 steps
  python bench/electra_vs_reference.py --steps 1500 --out bench/results/electra_vs_reference.md

Ours: `bert-jax pretrain --config configs/ablations/electra_compute.py:scale=tiny` (objective rtd: a 2-layer,
width-64 discriminator, its generator a quarter as wide, embeddings shared), learning rate 1e-3, warm-up 30 steps,
linear decay, batch 16 x 64 tokens. The reference is written here from the paper's description with
`ElectraForMaskedLM` (generator) and `ElectraForPreTraining` (discriminator) sharing one embedding module and the
generator's output projection, the same sizes, dropout, optimiser (AdamW, eps 1e-6, weight decay 0.01 off biases
and LayerNorm, clipping at 1.0), loss (MLM + 50 x replaced-token detection over every real token), masking rule
(15% of the non-special tokens, at most 10 a row; 80% [MASK], 10% a random token, 10% kept) and generator
sampling; it reads the same batches (this project's pipeline over the same prepared corpus). The two are not
expected to agree step by step (different initialisation and random draws), only in how the discriminator learns:
the table shows, every `--every` steps, each side's generator MLM accuracy, replaced fraction, RTD loss and the
loss of always answering "original" at that replaced fraction (the constant's).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bert_jax.data import pipeline  # noqa: E402  (after the path so that a checkout runs without installing)

LR, WARMUP, BATCH, SEQ, MAX_PREDICTIONS = 1e-3, 30, 16, 64, 10


def constant_loss(replaced: float) -> float:
  return float(-(replaced * np.log(replaced) + (1 - replaced) * np.log(1 - replaced)))


def ours(workdir: pathlib.Path, steps: int, every: int) -> dict[int, dict[str, float]]:
  command = [sys.executable, "-m", "bert_jax.cli", "pretrain", "--config",
             str(REPO / "configs/ablations/electra_compute.py") + ":scale=tiny", "--workdir", str(workdir),
             "--config.objective=rtd", f"--config.train.steps={steps}", f"--config.train.log_every={every}",
             f"--config.train.eval_every={steps}", f"--config.train.checkpoint_every={steps}",
             f"--config.optim.warmup_steps={WARMUP}", f"--config.optim.lr={LR}", f"--config.train.batch_size={BATCH}",
             f"--config.data.seq_len={SEQ}", f"--config.masking.max_predictions={MAX_PREDICTIONS}"]
  subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
  rows = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if "train/rtd_loss" in record:
      rows[record["step"]] = {"mlm_accuracy": record["train/mlm_accuracy"], "rtd_loss": record["train/rtd_loss"],
                              "replaced": 1.0 - record["train/rtd_accuracy"]}
  return rows


def reference(prepared: pathlib.Path, tokenizer_file: pathlib.Path, vocab_size: int, steps: int,
              every: int) -> dict[int, dict[str, float]]:
  import torch  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining  # pylint: disable=import-outside-toplevel

  torch.manual_seed(0)
  tokenizer = Tokenizer.from_file(str(tokenizer_file))
  mask_id = tokenizer.token_to_id("[MASK]")
  special = torch.tensor(sorted(tokenizer.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]")))
  common = dict(vocab_size=vocab_size, embedding_size=64, max_position_embeddings=128, hidden_act="gelu",
                hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, layer_norm_eps=1e-12, num_hidden_layers=2)
  discriminator = ElectraForPreTraining(ElectraConfig(hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                                      **common))
  generator = ElectraForMaskedLM(ElectraConfig(hidden_size=16, num_attention_heads=1, intermediate_size=32, **common))
  generator.electra.embeddings = discriminator.electra.embeddings
  generator.generator_lm_head.weight = discriminator.electra.embeddings.word_embeddings.weight
  params = list({id(p): p for p in [*discriminator.parameters(), *generator.parameters()]}.values())
  optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
                                 {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}], lr=LR, eps=1e-6)
  schedule = torch.optim.lr_scheduler.LambdaLR(
      optimizer, lambda s: s / WARMUP if s < WARMUP else max(0.0, (steps - s) / (steps - WARMUP)))
  batches = pipeline.pretraining_iterator(prepared, example_format="full_sentences", seq_len=SEQ, batch_size=BATCH,
                                          seed=0, prefetch=0, workers=0)
  rows, window = {}, []
  for step in range(1, steps + 1):
    batch = next(batches)
    ids = torch.as_tensor(np.asarray(batch["input_ids"]), dtype=torch.long)
    real = torch.as_tensor(np.asarray(batch["pack_ids"]) > 0)
    segments = torch.as_tensor(np.asarray(batch["segment_ids"]), dtype=torch.long)
    candidates = real & ~torch.isin(ids, special)
    order = torch.argsort(torch.rand(ids.shape) + (~candidates) * 10.0, dim=1)
    counts = torch.clamp(torch.round(0.15 * candidates.sum(1)).long(), 1, MAX_PREDICTIONS)
    masked = torch.zeros_like(candidates).scatter_(1, order, torch.arange(ids.shape[1])[None] < counts[:, None])
    masked &= candidates
    draw = torch.rand(ids.shape)
    generator_input = torch.where(masked & (draw < 0.8), torch.full_like(ids, mask_id), ids)
    generator_input = torch.where(masked & (draw >= 0.8) & (draw < 0.9), torch.randint(0, vocab_size, ids.shape),
                                  generator_input)
    logits = generator(input_ids=generator_input, attention_mask=real.long(), token_type_ids=segments).logits[masked]
    mlm_loss = torch.nn.functional.cross_entropy(logits, ids[masked])
    with torch.no_grad():
      corrupted = ids.clone()
      corrupted[masked] = torch.distributions.Categorical(logits=logits.float()).sample()
    replaced = (corrupted != ids).float()
    rtd_logits = discriminator(input_ids=corrupted, attention_mask=real.long(), token_type_ids=segments).logits
    rtd_loss = torch.nn.functional.binary_cross_entropy_with_logits(rtd_logits[real], replaced[real])
    optimizer.zero_grad()
    (mlm_loss + 50.0 * rtd_loss).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    window.append(((logits.argmax(-1) == ids[masked]).float().mean().item(), rtd_loss.item(),
                   replaced[real].mean().item()))
    if step % every == 0:
      mlm_accuracy, loss, fraction = np.mean(window, axis=0)
      rows[step] = {"mlm_accuracy": mlm_accuracy, "rtd_loss": loss, "replaced": fraction}
      window = []
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--every", type=int, default=100)
  parser.add_argument("--out", help="also write the table to this Markdown file")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = pathlib.Path(tmp) / "ours"
    print(f"ours: {args.steps} steps ...", flush=True)
    mine = ours(workdir, args.steps, args.every)
    vocab_size = json.loads((workdir / "model_config.json").read_text())["vocab_size"]
    print(f"reference: {args.steps} steps ...", flush=True)
    theirs = reference(workdir / "builtin_corpus" / "prepared", workdir / "tokenizer" / "tokenizer.json",
                       vocab_size, args.steps, args.every)
  lines = ["| step | ours MLM acc | ours replaced | ours RTD loss | constant's | reference MLM acc | reference replaced "
           "| reference RTD loss | constant's |", "|---|---|---|---|---|---|---|---|---|"]
  for step in sorted(set(mine) & set(theirs)):
    a, b = mine[step], theirs[step]
    lines.append(f"| {step} | {a['mlm_accuracy']:.3f} | {a['replaced']:.3f} | {a['rtd_loss']:.4f} | "
                 f"{constant_loss(a['replaced']):.4f} | {b['mlm_accuracy']:.3f} | {b['replaced']:.3f} | "
                 f"{b['rtd_loss']:.4f} | {constant_loss(b['replaced']):.4f} |")
  text = (f"ELECTRA at the tiny scale, {args.steps} steps of {BATCH} x {SEQ} tokens, ours against the transformers "
          "reference (means over each interval; ours' replaced fraction is 1 - its RTD accuracy, which is "
          "the replaced fraction while the discriminator answers 'original' everywhere)\n\n" + "\n".join(lines) + "\n")
  print("\n" + text)
  if args.out:
    pathlib.Path(args.out).write_text(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
