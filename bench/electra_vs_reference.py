r"""ELECTRA's early learning, ours against an independent PyTorch `transformers` reference, one table.

  python -m bench.electra_vs_reference                 # CPU, ~2 minutes: the built-in corpus, 600 steps
  python -m bench.electra_vs_reference --steps 1500 --out bench/results/electra_vs_reference.md
  # a GPU, the ELECTRA Table 1 row's sizes and recipe on the Wikipedia sample (`bert-jax reproduce pack`'s carried
  # folder); the two sides run at once, on the same card
  python -m bench.electra_vs_reference --scale gpu --carry .carry_repro --out $OUT/electra_vs_reference.md

Ours: `bert-jax pretrain --config configs/ablations/electra_compute.py:scale=SCALE --config.objective=rtd` (a
discriminator, its generator `--generator-fraction` as wide at the same depth, embeddings shared; at scale tiny a
2-layer, width-64 discriminator, learning rate 1e-3, warm-up 30 steps, batch 16 x 64 tokens, on the built-in corpus;
at scale gpu the table's 4 layers of width 512, 5e-4, warm-up 300, batch 256 x 128, bf16). The reference is written
here from the paper's description with `ElectraForMaskedLM` (generator) and `ElectraForPreTraining`
(discriminator) sharing one embedding module and the generator's output projection, the same sizes, dropout,
optimiser (AdamW, eps 1e-6, weight decay 0.01 off biases and LayerNorm, clipping at 1.0, linear warm-up and decay
to 0), loss (MLM + 50 x replaced-token detection over every real token), masking rule (15% of the non-special
tokens, at most `max_predictions` a row; 80% [MASK], 10% a random token, 10% kept) and generator sampling, with
bf16 autocast on a GPU; it reads the same corpus through this project's pipeline (its own masking and random
draws). The two are not expected to agree step by step, only in how the discriminator learns: the table shows,
every `--every` steps, each side's generator MLM accuracy, replaced fraction, RTD loss, gradient norm (before
clipping) and the loss of always answering "original" at that replaced fraction (the constant's).

`--rtd-positions masked` trains both sides as ELECTRA's Table 5 "ELECTRA 15%" row (the discriminator's loss on the
masked positions only; ours: `--config.loss.rtd_positions=masked`); the RTD columns are then over those positions.
`--finetune-tasks stsb,conll2003_f1` then fine-tunes both discriminators with ELECTRA Table 5's downstream recipe
at the scale (`configs/ablations/electra_variants.py`, the paper's 3e-4 and layer-wise decay 0.8 unless --lr and
--layerwise-decay say otherwise; the reference saved as a Hugging Face `ElectraForPreTraining` directory, which
fine-tuning reads as any such checkpoint) and adds each side's dev score per task:

  python -m bench.electra_vs_reference --scale gpu --carry .carry_repro --generator-fraction 0.333333 \
      --rtd-positions masked --finetune-tasks stsb,conll2003_f1 --out $OUT/electra15_vs_reference.md

Longer than one call (a GPU machine's ten minutes): give a --scratch that the calls share (one warm machine) and a
--deadline; each side saves its state there when stopped (ours' trainer its checkpoint, the reference its models,
optimizer, random generators and position in the data), and the same command again goes on exactly where it
stopped, fine-tuning once both have reached --steps:

  python -m bench.electra_vs_reference --scale gpu --carry .carry_repro --generator-fraction 0.333333 \
      --rtd-positions masked --steps 30000 --scratch runs/ref --deadline 540 --finetune-tasks stsb,conll2003_f1 \
      --seeds 1,2,3 --out $OUT/electra15_vs_reference.md

`--ours-config KEY=VALUE` (repeatable) changes ours' pre-training alone, to test one suspected difference between the
two sides at a time, e.g. `--ours-config model.dtype=float32` for bf16's part.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
from bert_jax.data import pipeline
from bert_jax.models import ModelConfig, electra_generator_config

# Per scale: what ours' config sets at that scale (configs/ablations/electra_compute.py, `ablation.base_config`),
# written out again for the reference; the generator's sizes are ours' rule's (`generator_sizes`).
SCALES = {
    "tiny": dict(layers=2, hidden=64, heads=2, ffn=128, embed=64, positions=128, lr=1e-3, warmup=30, batch=16,
                 seq=64, max_predictions=10, steps=600),
    "gpu": dict(layers=4, hidden=512, heads=8, ffn=2048, embed=128, positions=512, lr=5e-4, warmup=300, batch=256,
                seq=128, max_predictions=20, steps=3000),
}


def constant_loss(replaced: float) -> float:
  return float(-(replaced * np.log(replaced) + (1 - replaced) * np.log(1 - replaced)))


def generator_sizes(size: dict, fraction: float) -> tuple[int, int, int]:
  """(hidden, heads, feed-forward) of the generator: ours' (`electra_generator_config`) for this discriminator."""
  generator = electra_generator_config(
      ModelConfig(vocab_size=1, hidden_size=size["hidden"], num_layers=size["layers"], num_heads=size["heads"],
                  intermediate_size=size["ffn"], embedding_size=size["embed"]), fraction)
  return generator.hidden_size, generator.num_heads, generator.intermediate_size


def ours_command(workdir: pathlib.Path, scale: str, steps: int, every: int, fraction: float,
                 prepared: pathlib.Path | None, rtd_positions: str = "all",
                 overrides: Sequence[str] = ()) -> list[str]:
  size = SCALES[scale]
  command = [sys.executable, "-m", "bert_jax.cli", "pretrain", "--config",
             str(REPO / "configs/ablations/electra_compute.py") + f":scale={scale}", "--workdir", str(workdir),
             "--config.objective=rtd", f"--config.train.steps={steps}", f"--config.train.log_every={every}",
             f"--config.train.eval_every={steps}", f"--config.train.checkpoint_every={steps}",
             f"--config.model.generator_fraction={fraction}", f"--config.loss.rtd_positions={rtd_positions}"]
  if scale == "tiny":  # the reference's settings, which the tiny scale does not set itself
    command += [f"--config.optim.warmup_steps={size['warmup']}", f"--config.optim.lr={size['lr']}",
                f"--config.train.batch_size={size['batch']}", f"--config.data.seq_len={size['seq']}",
                f"--config.masking.max_predictions={size['max_predictions']}"]
  if prepared is not None:
    command.append(f"--config.data.prepared={prepared}")
  return command + [f"--config.{override}" for override in overrides]


def read_ours(workdir: pathlib.Path) -> dict[int, dict[str, float]]:
  rows = {}
  for line in (workdir / "metrics.jsonl").read_text().splitlines():
    record = json.loads(line)
    if "train/rtd_loss" in record:
      rows[record["step"]] = {"mlm_accuracy": record["train/mlm_accuracy"], "rtd_loss": record["train/rtd_loss"],
                              "replaced": 1.0 - record["train/rtd_accuracy"],
                              "rtd_accuracy": record["train/rtd_accuracy"], "grad_norm": record["train/grad_norm"]}
  return rows


def special_ids(tokenizer_file: pathlib.Path) -> dict[str, int]:
  """[PAD], [CLS], [SEP] and [MASK]'s ids, from a WordPiece vocab.txt or a `tokenizers` JSON file."""
  names = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
  if tokenizer_file.suffix == ".txt":
    vocab = {token: i for i, token in enumerate(tokenizer_file.read_text(encoding="utf-8").splitlines())}
    return {name: vocab[name] for name in names}
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  tokenizer = Tokenizer.from_file(str(tokenizer_file))
  return {name: tokenizer.token_to_id(name) for name in names}


def reference(prepared: pathlib.Path, tokenizer_file: pathlib.Path, vocab_size: int, scale: str, steps: int,
              every: int, fraction: float, stop_at: float = float("inf"), rtd_positions: str = "all",
              save: pathlib.Path | None = None,
              state_file: pathlib.Path | None = None) -> tuple[dict[int, dict[str, float]], int]:
  """(the reference's interval means, the last step trained), until `steps` or the first interval's end past the
  `time.monotonic()` value `stop_at`; the discriminator's loss over every real token or the masked ones
  (`rtd_positions`). With `state_file`, it goes on from the state saved there (models, optimizer, schedule, random
  generators, the position in the data and the means so far) and saves its own there when it stops, so a run cut
  short by a deadline continues exactly in a later call. With `save`, once at `steps`, the discriminator written
  there as a Hugging Face directory with the tokenizer file."""
  import torch  # pylint: disable=import-outside-toplevel
  from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining  # pylint: disable=import-outside-toplevel

  size = SCALES[scale]
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  torch.manual_seed(0)
  ids_of = special_ids(tokenizer_file)
  mask_id = ids_of["[MASK]"]
  special = torch.tensor(sorted(ids_of[t] for t in ("[PAD]", "[CLS]", "[SEP]")), device=device)
  common = dict(vocab_size=vocab_size, embedding_size=size["embed"], max_position_embeddings=size["positions"],
                hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, layer_norm_eps=1e-12,
                num_hidden_layers=size["layers"])
  discriminator = ElectraForPreTraining(ElectraConfig(hidden_size=size["hidden"], num_attention_heads=size["heads"],
                                                      intermediate_size=size["ffn"], **common))
  gen_hidden, gen_heads, gen_ffn = generator_sizes(size, fraction)
  generator = ElectraForMaskedLM(ElectraConfig(hidden_size=gen_hidden, num_attention_heads=gen_heads,
                                               intermediate_size=gen_ffn, **common))
  generator.electra.embeddings = discriminator.electra.embeddings
  generator.generator_lm_head.weight = discriminator.electra.embeddings.word_embeddings.weight
  discriminator.to(device)
  generator.to(device)
  params = list({id(p): p for p in [*discriminator.parameters(), *generator.parameters()]}.values())
  optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
                                 {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                                lr=size["lr"], eps=1e-6)
  warmup = size["warmup"]
  schedule = torch.optim.lr_scheduler.LambdaLR(
      optimizer, lambda s: s / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup)))
  autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
  batches = pipeline.pretraining_iterator(prepared, example_format="full_sentences", seq_len=size["seq"],
                                          batch_size=size["batch"], seed=0, prefetch=2, workers=0)
  rows, window, step = {}, [], 0
  resumable = {"discriminator": discriminator, "generator": generator, "optimizer": optimizer, "schedule": schedule}
  if state_file is not None and state_file.exists():
    state = torch.load(state_file, map_location=device, weights_only=True)
    for name, part in resumable.items():
      part.load_state_dict(state[name])
    torch.set_rng_state(state["rng"])
    if device.type == "cuda":
      torch.cuda.set_rng_state_all(state["cuda_rng"])
    batches.set_state(state["batches"])
    rows, step = state["rows"], state["step"]
    print(f"reference: from step {step} ({state_file})", flush=True)
  for step in range(step + 1, steps + 1):
    batch = next(batches)
    ids = torch.as_tensor(np.asarray(batch["input_ids"]), dtype=torch.long, device=device)
    real = torch.as_tensor(np.asarray(batch["pack_ids"]) > 0, device=device)
    segments = torch.as_tensor(np.asarray(batch["segment_ids"]), dtype=torch.long, device=device)
    candidates = real & ~torch.isin(ids, special)
    order = torch.argsort(torch.rand(ids.shape, device=device) + (~candidates) * 10.0, dim=1)
    counts = torch.clamp(torch.round(0.15 * candidates.sum(1)).long(), 1, size["max_predictions"])
    positions = torch.arange(ids.shape[1], device=device)[None] < counts[:, None]
    masked = torch.zeros_like(candidates).scatter_(1, order, positions) & candidates
    draw = torch.rand(ids.shape, device=device)
    generator_input = torch.where(masked & (draw < 0.8), torch.full_like(ids, mask_id), ids)
    generator_input = torch.where(masked & (draw >= 0.8) & (draw < 0.9),
                                  torch.randint(0, vocab_size, ids.shape, device=device), generator_input)
    with autocast:
      # The generator's head on the masked positions only (what ElectraForMaskedLM does at every position).
      hidden = generator.electra(input_ids=generator_input, attention_mask=real.long(),
                                 token_type_ids=segments).last_hidden_state[masked]
      logits = generator.generator_lm_head(generator.generator_predictions(hidden)).float()
      mlm_loss = torch.nn.functional.cross_entropy(logits, ids[masked])
      with torch.no_grad():
        corrupted = ids.clone()
        corrupted[masked] = torch.distributions.Categorical(logits=logits).sample()
      replaced = (corrupted != ids).float()
      rtd_logits = discriminator(input_ids=corrupted, attention_mask=real.long(), token_type_ids=segments).logits
      scored = real if rtd_positions == "all" else masked
      rtd_loss = torch.nn.functional.binary_cross_entropy_with_logits(rtd_logits[scored].float(), replaced[scored])
    optimizer.zero_grad()
    (mlm_loss + 50.0 * rtd_loss).backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)  # before clipping, as ours logs it
    optimizer.step()
    schedule.step()
    # Kept on the device and read once an interval: a read a step would wait for the step.
    window.append(torch.stack([(logits.argmax(-1) == ids[masked]).float().mean(), rtd_loss.detach().float(),
                               replaced[scored].mean(),
                               ((rtd_logits[scored] > 0).float() == replaced[scored]).float().mean(),
                               grad_norm.detach().float()]))
    if step % every == 0:
      mlm_accuracy, loss, replaced_fraction, rtd_accuracy, norm = torch.stack(window).mean(0).tolist()
      rows[step] = {"mlm_accuracy": mlm_accuracy, "rtd_loss": loss, "replaced": replaced_fraction,
                    "rtd_accuracy": rtd_accuracy, "grad_norm": norm}
      window = []
      if time.monotonic() > stop_at:
        print(f"reference: stopped at the deadline after step {step}", flush=True)
        break
  if state_file is not None:
    torch.save({**{name: part.state_dict() for name, part in resumable.items()}, "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if device.type == "cuda" else [],
                "batches": batches.get_state(), "rows": rows,
                "step": step}, state_file)
  batches.close()
  if save is not None and step == steps:
    discriminator.save_pretrained(save)
    shutil.copy(tokenizer_file, save / tokenizer_file.name)
  return rows, step


def table(mine: dict, theirs: dict, title: str, rtd_positions: str = "all") -> str:
  constant = lambda row: constant_loss(row["replaced"])  # noqa: E731
  columns = [("MLM acc", "mlm_accuracy", 3), ("replaced", "replaced", 3), ("RTD loss", "rtd_loss", 4),
             ("grad norm", "grad_norm", 2), ("constant's", constant, 4)]
  sides = [("ours", mine, columns), ("reference", theirs, columns)]
  if rtd_positions == "masked":  # ours logs no replaced fraction there (1 - its accuracy is not one): its accuracy
    accuracy = ("RTD acc", "rtd_accuracy", 3)
    sides = [("ours", mine, [columns[0], accuracy, *columns[2:4]]),
             ("reference", theirs, [*columns[:2], accuracy, *columns[2:]])]
  header = ["step"] + [f"{side} {name}" if name != "constant's" else name for side, _, cols in sides
                       for name, _, _ in cols]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for step in sorted(set(mine) & set(theirs)):
    cells = [str(step)] + [f"{(key(rows[step]) if callable(key) else rows[step][key]):.{digits}f}"
                           for _, rows, cols in sides for _, key, digits in cols]
    lines.append("| " + " | ".join(cells) + " |")
  return title + "\n\n" + "\n".join(lines) + "\n"


def finetune_table(tasks: list[str], scale: str, seeds: tuple[int, ...], lr: float, decay: float):
  """ELECTRA Table 5's table config at `scale`, its suite narrowed to `tasks`, `seeds` and `lr` with layer-wise
  decay `decay` (an unknown task is the suite's ValueError)."""
  import dataclasses  # pylint: disable=import-outside-toplevel

  from bert_jax.experiments import ablation  # pylint: disable=import-outside-toplevel

  table_ = ablation.load_table(str(REPO / f"configs/ablations/electra_variants.py:scale={scale}"))
  suite = dataclasses.replace(table_.suite, tasks=tuple(tasks), seeds=seeds, lrs=(lr,),
                              overrides=(*table_.suite.overrides, f"optim.layerwise_lr_decay={decay}"))
  return dataclasses.replace(table_, suite=suite)


def finetune_both(models: dict[str, pathlib.Path], table_, data_dirs: dict[str, str], scratch: pathlib.Path) -> str:
  """Each model fine-tuned on each task of `table_`'s suite (`finetune_table`): a Markdown table of the dev
  medians over its seeds, and the first and last logged training loss of the first seed."""
  from bert_jax.experiments import ablation, suite as suite_lib  # pylint: disable=import-outside-toplevel
  from bert_jax.tasks.finetune import finetune  # pylint: disable=import-outside-toplevel

  suite = table_.suite
  lines = ["| task | " + " | ".join(f"{side} dev | {side} train loss" for side in models) + " |",
           "|---|" + "---|---|" * len(models)]
  for name in suite.tasks:
    task = suite_lib.TASKS[name]
    cells = [f"{name} ({task.metric})"]
    for side, model in models.items():
      config = ablation.finetune_config(table_, table_.rows[0], task, suite.lrs[0], model, data_dirs)
      workdir = scratch / f"finetune_{side}_{name}"
      result = finetune(config, workdir)
      scores = [seed["selected"]["metrics"][task.split][task.metric] for seed in result["seeds"]]
      losses = [json.loads(line).get("train/loss") for line in
                (workdir / f"seed_{suite.seeds[0]}" / "metrics.jsonl").read_text().splitlines()]
      losses = [loss for loss in losses if loss is not None]
      cells += [f"{float(np.median(scores)):.1f}", f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scale", choices=sorted(SCALES), default="tiny")
  parser.add_argument("--steps", type=int, help="default: the scale's (tiny 600, gpu 3000)")
  parser.add_argument("--every", type=int, default=100)
  parser.add_argument("--generator-fraction", type=float, default=0.25)
  parser.add_argument("--carry", type=pathlib.Path,
                      help="scale gpu: `bert-jax reproduce pack`'s carried folder (the Wikipedia sample and vocab.txt)")
  parser.add_argument("--scratch", type=pathlib.Path,
                      help="where the corpus is prepared and both sides keep their state, so that the same command "
                      "again goes on where a --deadline stopped it (default: a temporary folder)")
  parser.add_argument("--deadline", type=float, default=float("inf"),
                      help="seconds: stop both sides then, save their state in --scratch and show the steps both "
                      "reached; the fine-tuning waits for a call that reaches --steps")
  parser.add_argument("--out", help="also write the table to this Markdown file")
  parser.add_argument("--rtd-positions", choices=("all", "masked"), default="all",
                      help="the discriminator's loss over every token (ELECTRA) or the masked ones (ELECTRA 15%%)")
  parser.add_argument("--finetune-tasks", help="then fine-tune both discriminators on these suite tasks, e.g. "
                      "stsb,conll2003_f1 (their data under --carry, or --data-dir)")
  parser.add_argument("--data-dir", action="append", default=[], metavar="KIND=PATH",
                      help="a task's data root (default: glue, squad and conll2003 under --carry)")
  parser.add_argument("--seeds", default="1", help="fine-tuning seeds, comma-separated")
  parser.add_argument("--lr", type=float, default=3e-4, help="fine-tuning peak learning rate")
  parser.add_argument("--layerwise-decay", type=float, default=0.8, help="fine-tuning layer-wise decay")
  parser.add_argument("--ours-config", action="append", default=[], metavar="KEY=VALUE",
                      help="an override of ours' pre-training config alone, e.g. model.dtype=float32 (to test "
                      "whether a difference between the two sides is bf16's)")
  args = parser.parse_args()
  if args.ours_config:  # checked here, not by ours' run after the corpus is prepared
    from bert_jax.train import config_lib  # pylint: disable=import-outside-toplevel
    try:
      config_lib.load_config(f"{REPO}/configs/ablations/electra_compute.py:scale={args.scale}", args.ours_config)
    except ValueError as error:
      parser.error(f"--ours-config {' '.join(args.ours_config)}: {error}")
  steps = args.steps or SCALES[args.scale]["steps"]
  if args.scale == "gpu" and args.carry is None:
    parser.error("--scale gpu reads the Wikipedia sample: give --carry (see `bert-jax reproduce pack`)")
  finetuning = None
  if args.finetune_tasks:  # checked before any training: the sweep's own parsing and data checks
    from bert_jax.experiments import ablation  # pylint: disable=import-outside-toplevel
    carried = [f"{kind}={args.carry / kind}" for kind in ("glue", "squad", "conll2003")] if args.carry else []
    try:
      data_dirs = ablation._parse_data_dirs([*carried, *args.data_dir])  # pylint: disable=protected-access
      seeds = tuple(int(seed) for seed in args.seeds.split(",") if seed)
      finetuning = finetune_table([task for task in args.finetune_tasks.split(",") if task], args.scale, seeds,
                                  args.lr, args.layerwise_decay)
      ablation._check_data_dirs(finetuning.suite, data_dirs)  # pylint: disable=protected-access
    except (ValueError, FileNotFoundError) as error:
      parser.error(f"--finetune-tasks {args.finetune_tasks} --seeds {args.seeds}: {error}")
  stop_at = time.monotonic() + args.deadline
  with tempfile.TemporaryDirectory() as tmp:
    scratch = args.scratch or pathlib.Path(tmp)
    workdir = scratch / f"ours_g{args.generator_fraction:g}"
    seconds = {}
    if args.scale == "tiny":  # the built-in corpus, prepared by ours' run, which therefore goes first
      start = time.perf_counter()
      print(f"ours: {steps} steps ...", flush=True)
      subprocess.run(ours_command(workdir, "tiny", steps, args.every, args.generator_fraction, None,
                                  args.rtd_positions, args.ours_config), check=True, cwd=REPO,
                     stdout=subprocess.DEVNULL)
      seconds["ours"] = time.perf_counter() - start
      prepared = workdir / "builtin_corpus" / "prepared"
      tokenizer_file = workdir / "tokenizer" / "tokenizer.json"
      ours_process = None
    else:  # the two at once on one card, ours' JAX leaving the reference room
      from bert_jax.experiments.reproduce import prepare_corpus  # pylint: disable=import-outside-toplevel
      # Ours' process, then this one's fine-tuning, leave the reference the rest of the card.
      os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.4")
      env = dict(os.environ)
      prepared, tokenizer_file = prepare_corpus(args.carry, scratch, "gpu", env), args.carry / "vocab.txt"
      workdir.mkdir(parents=True, exist_ok=True)
      print(f"ours and the reference: {steps} steps at once ...", flush=True)
      log = open(workdir.parent / f"{workdir.name}.log", "w")  # pylint: disable=consider-using-with
      ours_start = time.perf_counter()
      ours_process = subprocess.Popen(
          ours_command(workdir, "gpu", steps, args.every, args.generator_fraction, prepared, args.rtd_positions,
                       args.ours_config),
          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

      def time_ours():  # ours' own wall time, whichever side finishes first
        ours_process.wait()
        seconds.setdefault("ours", time.perf_counter() - ours_start)

      threading.Thread(target=time_ours, daemon=True).start()
    start = time.perf_counter()
    vocab_size = (len(tokenizer_file.read_text(encoding="utf-8").splitlines()) if tokenizer_file.suffix == ".txt"
                  else json.loads((workdir / "model_config.json").read_text())["vocab_size"])
    saved = scratch / "reference" if finetuning else None
    # In a scratch of the caller's, the reference keeps its state between calls (ours' trainer keeps its own).
    theirs, reached = reference(prepared, tokenizer_file, vocab_size, args.scale, steps, args.every,
                                args.generator_fraction, stop_at, args.rtd_positions, saved,
                                scratch / "reference_state.pt" if args.scratch else None)
    seconds["reference"] = time.perf_counter() - start
    if ours_process is not None:
      stopped = False
      try:
        ours_process.wait(timeout=max(1.0, stop_at - time.monotonic()))
      except subprocess.TimeoutExpired:  # the trainer saves and exits on SIGTERM; its metrics so far are kept
        print("ours: stopped at the deadline", flush=True)
        stopped = True
        ours_process.terminate()
        ours_process.wait()
      log.close()
      if (ours_process.returncode != 0 and not stopped) or not (workdir / "metrics.jsonl").exists():
        print((workdir.parent / f"{workdir.name}.log").read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"ours' pre-training failed (exit {ours_process.returncode})")
      seconds.setdefault("ours", time.perf_counter() - ours_start)
    mine = read_ours(workdir)
    import torch  # pylint: disable=import-outside-toplevel
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    size = SCALES[args.scale]
    loss_on = "" if args.rtd_positions == "all" else ", the discriminator's loss on the masked positions only"
    replaced_note = ("" if args.rtd_positions == "masked" else "; ours' replaced fraction is 1 - its RTD accuracy, "
                     "which is the replaced fraction while the discriminator answers 'original' everywhere")
    text = table(mine, theirs, (
        f"ELECTRA at scale {args.scale} ({size['layers']} layers, width {size['hidden']}, generator "
        f"{args.generator_fraction:g} of it{loss_on}"
        f"{''.join(f', ours with {override}' for override in args.ours_config)}), "
        f"{steps} steps of {size['batch']} x {size['seq']} tokens, ours against the transformers reference on {card} "
        f"(this call: ours {seconds['ours']:.0f} s, reference {seconds['reference']:.0f} s"
        f"{', at once' if ours_process is not None else ''}; means over each interval{replaced_note})"),
        args.rtd_positions)
    print("\n" + text, flush=True)
    if args.out:  # written before the fine-tuning, which may not finish
      pathlib.Path(args.out).write_text(text)
    if reached < steps or not (workdir / "checkpoints" / str(steps)).exists():
      print(f"stopped before step {steps} (the reference at step {reached}): "
            + ("the same command again, with the same --scratch, goes on from there" if args.scratch else
               "give --scratch to keep both sides' state for a later call"), flush=True)
      finetuning = None
    if finetuning:
      torch.cuda.empty_cache()  # the reference's cached blocks, for JAX's fine-tuning
      # In a fresh process: JAX's CUDA libraries beside torch's in one process are not a tested combination.
      with multiprocessing.get_context("spawn").Pool(1) as pool:
        finetuned = pool.apply(finetune_both, ({"ours": workdir, "reference": saved}, finetuning, data_dirs, scratch))
      text = (f"\nFine-tuned with ELECTRA Table 5's suite at scale {args.scale} (lr {args.lr:g}, layer-wise decay "
              f"{args.layerwise_decay:g}, seeds {args.seeds}): dev median, and the first seed's first and last logged "
              f"training loss\n\n{finetuned}")
      print(text)
      if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
          out.write(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
