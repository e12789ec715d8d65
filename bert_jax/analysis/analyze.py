"""`bert-jax analyze`: what a model's attention heads do and how many it needs; a Markdown report with figures.

  bert-jax analyze --model runs/mrpc --out analysis/mrpc [--max-examples 400]
  bert-jax analyze --model models/minilm --input sentences.txt --out analysis/minilm --only attention

--model is a converted or Hugging Face model directory, a pre-training workdir or a fine-tuning workdir.
Analyses (--only picks some; default every one the model allows):

  attention  attention to [CLS], [SEP], punctuation, the previous / next token and the token itself, and the
             attention entropy, per layer and head (Clark et al. 2019), on --input (one line per sentence, or
             two sentences separated by a tab) or a fine-tuning run's dev examples; the maps of --sentence.
  effective  effective attention (Brunner et al. 2020): the attention without its component in the left null
             space of each head's value-output transform, on the same lines; its correlation with the raw
             attention against the line length, and raw against effective attention to each token type.
  heads      fine-tuning runs: head importance I_h = E|dL/dxi_h| on the task's dev data, the score with each
             head disabled alone, with one head kept per layer, and the iterative-pruning curve by importance
             and in random order (Michel et al. 2019).
  probe      with --conll-dir: linear probes on every layer's frozen features for part-of-speech, chunk and
             named-entity tags (Tenney et al. 2019; Liu et al. 2019), trained on eng.train, scored on eng.testa.
  prune      fine-tuning runs: the heads of the importance curve at --prune-fraction removed from the weights,
             saved as a fine-tuning workdir (OUT/pruned_model, which `bert-jax evaluate` reads), its parameters
             and measured inference time against the unpruned model.

OUT gets report.md, results.json and PNG figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from bert_jax.analysis import attention as attention_lib
from bert_jax.analysis import heads as heads_lib

ANALYSES = ("attention", "effective", "heads", "prune", "probe")
TEXT_ANALYSES = ("attention", "effective")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="bert-jax analyze", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
  parser.add_argument("--model", required=True, help="model directory, pre-training or fine-tuning workdir")
  parser.add_argument("--out", required=True, help="output folder (report.md, results.json, figures)")
  parser.add_argument("--only", help=f"comma-separated subset of {','.join(ANALYSES)}")
  parser.add_argument("--input", help="attention, effective: text file, a sentence (or two, tab-separated) per line")
  parser.add_argument("--sentence", help="attention: the line whose maps are drawn (default: the first line)")
  parser.add_argument("--max-lines", type=int, default=256, help="attention, effective: lines read from the input")
  parser.add_argument("--max-len", type=int, default=128, help="attention, effective: tokens per line")
  parser.add_argument("--data-dir", help="heads, prune: the task's data (default: the run's config.data_dir)")
  parser.add_argument("--max-examples", type=int, help="heads, prune: the first N dev examples (default all)")
  parser.add_argument("--metric", help="heads, prune: the score (default: the task's selection metric)")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--step", type=float, default=0.1, help="heads: pruning-curve step, a fraction of the heads")
  parser.add_argument("--prune-fraction", type=float, default=0.4, help="prune: fraction of the heads removed")
  parser.add_argument("--seed", type=int, default=0, help="heads: the random pruning order")
  parser.add_argument("--conll-dir", help="probe: CoNLL-2003 folder with eng.train and eng.testa")
  parser.add_argument("--probe-train-sentences", type=int, default=2000, help="probe: eng.train sentences used")
  parser.add_argument("--probe-test-sentences", type=int, default=500, help="probe: eng.testa sentences scored")
  parser.add_argument("--probe-steps", type=int, default=300, help="probe: full-batch optimiser steps per probe")
  return parser


def _is_finetune_run(path: pathlib.Path) -> bool:
  from bert_jax.tasks.finetune_model import RUN_FILE  # noqa: PLC0415
  return (path / RUN_FILE).exists()


def _chosen(args, finetune_run: bool) -> list[str]:
  if args.only is None:
    chosen = list(ANALYSES) if finetune_run else list(TEXT_ANALYSES)
    return [name for name in chosen if name != "probe"] + (["probe"] if args.conll_dir else [])
  chosen = [name.strip() for name in args.only.split(",") if name.strip()]
  unknown = [name for name in chosen if name not in ANALYSES]
  if unknown or not chosen:
    raise ValueError(f"--only {args.only!r}: choose from {', '.join(ANALYSES)}")
  if not finetune_run and set(chosen) & {"heads", "prune"}:
    raise ValueError(f"--only {args.only}: heads and prune score a task, so --model must be a fine-tuning workdir "
                     f"(finetune_run.json); {args.model} is not one")
  if "probe" in chosen and not args.conll_dir:
    raise ValueError("probe needs --conll-dir, the CoNLL-2003 folder with eng.train and eng.testa")
  return chosen


def _attention_lines(args, model: pathlib.Path) -> list[str]:
  if args.input:
    lines = [line for line in pathlib.Path(args.input).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
      raise ValueError(f"--input {args.input}: no text lines")
    return lines[:args.max_lines]
  if not _is_finetune_run(model):
    raise ValueError("attention needs text: pass --input FILE (a sentence, or two tab-separated, per line)")
  data = heads_lib.load_task_data(model, args.data_dir, args.max_lines)
  lines = [example.text_a + (f"\t{example.text_b}" if getattr(example, "text_b", None) else "")
           for example in data.examples if hasattr(example, "text_a")]
  if not lines:
    raise ValueError(f"{data.task.name} examples are not sentences; pass --input FILE")
  return lines


@dataclasses.dataclass
class TextModel:
  """The encoder and the encoded lines that the text analyses read."""

  initial: Any  # `finetune_model.InitialModel`
  lines: list[str]
  encoded: list[tuple[list[int], list[int]]]
  max_len: int
  vocab: list[str]


def load_text_model(args) -> TextModel:
  from bert_jax.analysis.features import encode_line  # noqa: PLC0415
  from bert_jax.tasks.finetune_model import load_initial_model  # noqa: PLC0415

  model = pathlib.Path(args.model)
  lines = _attention_lines(args, model)
  initial = load_initial_model(model)
  config = initial.config
  max_len = min(args.max_len, config.max_position_embeddings - config.position_offset)
  encoded = [encode_line(initial.tokenizer, initial.family, line, max_len) for line in lines]
  return TextModel(initial, lines, encoded, max_len,
                   initial.tokenizer.convert_ids_to_tokens(list(range(config.vocab_size))))


def run_attention(text: TextModel, args, out: pathlib.Path) -> tuple[str, str, dict[str, Any]]:
  """The attention section: (Markdown, printed summary, results)."""
  from bert_jax.analysis.features import encode_line  # noqa: PLC0415

  initial, lines, max_len = text.initial, text.lines, text.max_len
  config, params, tokenizer = initial.config, initial.params["encoder"], initial.tokenizer
  patterns = attention_lib.attention_patterns(config, params, text.encoded, tokenizer.cls_id, tokenizer.sep_id,
                                              attention_lib.punctuation_ids(text.vocab), max_len, args.batch_size)
  sentence = args.sentence or lines[0]
  ids, segments = encode_line(tokenizer, initial.family, sentence, max_len)
  maps = attention_lib.sentence_attention(config, params, ids, segments)
  figures = attention_lib.write_figures(patterns, maps, tokenizer.convert_ids_to_tokens(ids), out)
  markdown = "\n".join([
      "## Attention patterns", "",
      f"![attention patterns]({figures[0].name})", "",
      attention_lib.patterns_markdown(patterns, len(lines)), "",
      f"Attention maps of: `{sentence}`", "", f"![sentence attention]({figures[1].name})"])
  results = {name: patterns[name].tolist() for name in attention_lib.PATTERNS}
  results.update(lines=len(lines), tokens=int(patterns["tokens"]))
  return markdown, attention_lib.patterns_summary(patterns), results


def run_effective(text: TextModel, args, out: pathlib.Path) -> tuple[str, str, dict[str, Any]]:
  """The effective-attention section: (Markdown, printed summary, results)."""
  from bert_jax.analysis import effective  # noqa: PLC0415

  config, tokenizer = text.initial.config, text.initial.tokenizer
  cls_token, sep_token = tokenizer.convert_ids_to_tokens([tokenizer.cls_id, tokenizer.sep_id])
  types = effective.token_types(text.vocab, cls_token, sep_token, attention_lib.punctuation_ids(text.vocab))
  stats = effective.effective_attention_stats(config, text.initial.params["encoder"], text.encoded, types,
                                              text.max_len, args.batch_size)
  effective.write_figure(stats, out)
  markdown, summary = effective.effective_markdown(stats, config.head_dim)
  results = {"correlations": stats["correlations"], "raw": stats["raw"].tolist(),
             "effective": stats["effective"].tolist(), "token_types": list(effective.TOKEN_TYPES)}
  return markdown, summary, results


def run_probe(args, out: pathlib.Path) -> tuple[str, str, dict[str, Any]]:
  """The probing section: (Markdown, printed summary, results)."""
  from bert_jax.analysis import probe  # noqa: PLC0415
  from bert_jax.tasks.finetune_model import load_initial_model  # noqa: PLC0415

  initial = load_initial_model(pathlib.Path(args.model))
  config = initial.config
  max_len = min(args.max_len, config.max_position_embeddings - config.position_offset)
  results = probe.run_probes(config, initial.params["encoder"], initial.tokenizer, args.conll_dir,
                             args.probe_train_sentences, args.probe_test_sentences, max_len, args.batch_size,
                             args.probe_steps)
  probe.write_figure(results, out)
  markdown, summary = probe.probe_markdown(results)
  return markdown, summary, results


def _percent_kept(score: float, base: float) -> str:
  return f"{100 * score / base:.0f}%" if base else "n/a"


def run_heads(data: heads_lib.TaskData, args, out: pathlib.Path) -> tuple[str, str, dict[str, Any]]:
  """The head-importance section; its results hold the importance-order masks ("curve_masks") for pruning."""
  base = data.score()
  importance = heads_lib.head_importance(data)
  disabled = heads_lib.disable_each(data)
  kept_one = heads_lib.keep_one_per_layer(data)
  fractions = [round(step * args.step, 6) for step in range(int(round(1 / args.step)))]
  by_importance = heads_lib.pruning_curve(data, fractions, "importance")
  by_random = heads_lib.pruning_curve(data, fractions, "random", args.seed)
  metric = data.metric or data.task.selection_metric
  figures = write_head_figures(importance, disabled, base, by_importance, by_random, metric, out)
  layers = data.config.num_layers
  lines = ["## Head importance and pruning", "",
           f"{data.task.name}, {len(data.examples)} dev examples; score: {metric} = {base:.2f} with every head.", "",
           f"![head importance]({figures[0].name}) ![disabling one head]({figures[1].name})", "",
           f"Disabling one head: the score ranges {disabled.min():.2f} .. {disabled.max():.2f} "
           f"(median {np.median(disabled):.2f}); {int(np.sum(disabled < base))} of {disabled.size} heads lower it, "
           f"{int(np.sum(disabled >= base))} leave it or raise it.", "",
           "All heads of a layer but one (the best head kept; delta against every head):", "",
           "| layer | best head kept | score | delta |", "|---|---|---|---|"]
  for layer in range(layers):
    head = int(np.argmax(kept_one[layer]))
    lines.append(f"| {layer + 1} | {head + 1} | {kept_one[layer, head]:.2f} | {kept_one[layer, head] - base:+.2f} |")
  lines += ["", f"![pruning curve]({figures[2].name})", "",
            "| heads pruned | by importance | random order |", "|---|---|---|"]
  for (fraction, score, _), (_, random_score, _) in zip(by_importance, by_random):
    lines.append(f"| {100 * fraction:.0f}% | {score:.2f} ({_percent_kept(score, base)}) | "
                 f"{random_score:.2f} ({_percent_kept(random_score, base)}) |")
  lines += ["", "Head importance I_h (rows: layers, columns: heads):", "",
            "| layer | " + " | ".join(f"h{h + 1}" for h in range(importance.shape[1])) + " |",
            "|---" * (importance.shape[1] + 1) + "|"]
  lines += [f"| {layer + 1} | " + " | ".join(f"{v:.3g}" for v in importance[layer]) + " |" for layer in range(layers)]
  summary = [f"heads: {metric} {base:.2f} with every head; one head disabled: {disabled.min():.2f} .. "
             f"{disabled.max():.2f}; pruned by importance / random:"]
  summary += [f"  {100 * f:3.0f}%  {s:6.2f}  {r:6.2f}" for (f, s, _), (_, r, _) in zip(by_importance, by_random)]
  results = {"metric": metric, "base_score": base, "importance": importance.tolist(),
             "disable_each": disabled.tolist(), "keep_one_per_layer": kept_one.tolist(),
             "pruning_by_importance": [[f, s] for f, s, _ in by_importance],
             "pruning_random": [[f, s] for f, s, _ in by_random],
             "curve_masks": {f: m for f, _, m in by_importance}}
  return "\n".join(lines), "\n".join(summary), results


def write_head_figures(importance, disabled, base, by_importance, by_random, metric, out: pathlib.Path):
  """head_importance.png, disable_one_head.png (Michel et al.'s Fig. 1), pruning_curve.png (their Fig. 3)."""
  import matplotlib  # noqa: PLC0415 - only for the figures
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  layers, heads = importance.shape
  paths = [out / "head_importance.png", out / "disable_one_head.png", out / "pruning_curve.png"]
  fig, axis = plt.subplots(figsize=(1.5 + 0.35 * heads, 1.2 + 0.35 * layers))
  image = axis.imshow(importance, cmap="magma", aspect="auto")
  axis.set_xticks(range(heads), [str(h + 1) for h in range(heads)], fontsize=7)
  axis.set_yticks(range(layers), [str(layer + 1) for layer in range(layers)], fontsize=7)
  axis.set_xlabel("head")
  axis.set_ylabel("layer")
  axis.set_title("head importance E|dL/dxi_h|")
  fig.colorbar(image, ax=axis)
  fig.tight_layout()
  fig.savefig(paths[0], dpi=110)
  plt.close(fig)
  fig, axis = plt.subplots(figsize=(5, 3.2))
  axis.hist(disabled.ravel(), bins=30, color="tab:blue")
  axis.axvline(base, color="black", linestyle="--", label=f"every head ({base:.2f})")
  axis.set_xlabel(f"{metric} with one head disabled")
  axis.set_ylabel("heads")
  axis.legend()
  fig.tight_layout()
  fig.savefig(paths[1], dpi=110)
  plt.close(fig)
  fig, axis = plt.subplots(figsize=(5, 3.2))
  axis.plot([100 * f for f, _, _ in by_importance], [s for _, s, _ in by_importance], "o-", label="by importance")
  axis.plot([100 * f for f, _, _ in by_random], [s for _, s, _ in by_random], "s--", label="random order")
  axis.set_xlabel("heads pruned (%)")
  axis.set_ylabel(metric)
  axis.legend()
  axis.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(paths[2], dpi=110)
  plt.close(fig)
  return paths


def run_prune(data: heads_lib.TaskData, keep_lh: np.ndarray, args, out: pathlib.Path
              ) -> tuple[str, str, dict[str, Any]]:
  """Removes the heads where `keep_lh` is False, saves the model, compares size, score and speed."""
  from bert_jax.tasks.finetune_model import FinetuneObjective, build_model  # noqa: PLC0415

  config, encoder = heads_lib.prune_heads(data.config, data.params["encoder"], keep_lh)
  params = {"encoder": encoder, "head": data.params["head"]}
  objective = FinetuneObjective(build_model(config, data.task.kind, data.task.num_labels), data.task.kind,
                                single_token_type=data.objective.single_token_type,
                                num_choices=data.objective.num_choices)
  pruned = dataclasses.replace(data, config=config, objective=objective, params=params, _steps={})
  heads_lib.save_pruned_run(pathlib.Path(args.model), out / "pruned_model", config, params)
  masked_score, pruned_score = data.score(keep_lh.astype(np.float32)), pruned.score()
  difference = float(np.max(np.abs(data.outputs(keep_lh.astype(np.float32)) - pruned.outputs())))
  seconds = heads_lib.time_predictions(data, data.params), heads_lib.time_predictions(pruned, params)
  sizes = heads_lib.count_params(data.params), heads_lib.count_params(params)
  encoder_sizes = data.config.num_params(), config.num_params()
  removed = int(np.sum(~keep_lh))
  metric = data.metric or data.task.selection_metric
  lines = ["## Pruned model", "",
           f"{removed} of {keep_lh.size} heads removed (the importance curve at {100 * args.prune_fraction:.0f}%); "
           f"heads per layer {list(config.heads_per_layer)}; saved to `pruned_model/` "
           "(`bert-jax evaluate --workdir pruned_model`).", "",
           "| model | parameters | encoder parameters | " + metric + f" | predict {len(data.examples)} examples (s) |",
           "|---|---|---|---|---|",
           f"| unpruned | {sizes[0]:,} | {encoder_sizes[0]:,} | {data.score():.2f} | {seconds[0]:.3f} |",
           f"| pruned | {sizes[1]:,} | {encoder_sizes[1]:,} | {pruned_score:.2f} | {seconds[1]:.3f} |", "",
           f"The pruned model's outputs differ from the masked model's by at most {difference:.2g} (its score "
           f"{pruned_score:.2f}, masked {masked_score:.2f}); speed-up {seconds[0] / seconds[1]:.2f}x on this "
           "machine (best of 3 passes, batch " + f"{data.batch_size})."]
  summary = (f"prune: {removed} heads removed, parameters {sizes[0]:,} -> {sizes[1]:,}, {metric} "
             f"{pruned_score:.2f}, predict {seconds[0]:.3f} s -> {seconds[1]:.3f} s")
  results = {"heads_removed": removed, "heads_per_layer": list(config.heads_per_layer), "params": sizes,
             "encoder_params": encoder_sizes, "pruned_score": pruned_score, "masked_score": masked_score,
             "max_output_difference": difference, "predict_seconds": seconds}
  return "\n".join(lines), summary, results


def analyze(args) -> dict[str, Any]:
  """Runs the chosen analyses and writes OUT/report.md and OUT/results.json; returns the results."""
  model = pathlib.Path(args.model)
  finetune_run = _is_finetune_run(model)
  chosen = _chosen(args, finetune_run)
  if "prune" in chosen and not 0 < args.prune_fraction < 1:
    raise ValueError(f"--prune-fraction {args.prune_fraction}: give a fraction in (0, 1)")
  if not 0 < args.step < 1:
    raise ValueError(f"--step {args.step}: give a fraction in (0, 1), e.g. 0.1")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  sections, summaries, results = [f"# Analysis of `{args.model}`"], [], {}
  text = load_text_model(args) if set(chosen) & set(TEXT_ANALYSES) else None
  if text is not None and args.only is None and (text.initial.config.heads_per_layer
                                                 or text.initial.config.num_shared_groups):
    chosen.remove("effective")  # it reads each layer's own, unpruned projections
  for name, run in (("attention", run_attention), ("effective", run_effective)):
    if name in chosen:
      markdown, summary, results[name] = run(text, args, out)
      sections.append(markdown)
      summaries.append(summary)
  if set(chosen) & {"heads", "prune"}:
    data = heads_lib.load_task_data(model, args.data_dir, args.max_examples, args.batch_size, args.metric)
    curve_masks: dict[float, np.ndarray] = {}
    if "heads" in chosen:
      markdown, summary, results["heads"] = run_heads(data, args, out)
      curve_masks = results["heads"].pop("curve_masks")
      sections.append(markdown)
      summaries.append(summary)
    if "prune" in chosen:
      keep_lh = next((mask for fraction, mask in curve_masks.items() if abs(fraction - args.prune_fraction) < 1e-9),
                     None)
      if keep_lh is None:  # the same steps as the heads analysis's curve, up to the fraction
        steps = {round(k * args.step, 6) for k in range(1, int(args.prune_fraction / args.step + 1e-9) + 1)}
        keep_lh = heads_lib.pruning_curve(data, sorted(steps | {args.prune_fraction}), "importance")[-1][2]
      try:
        markdown, summary, results["prune"] = run_prune(data, np.asarray(keep_lh) > 0, args, out)
      except ValueError as error:  # e.g. a layer left without heads: keep the head analyses' report
        if "heads" not in chosen:
          raise
        markdown, summary = f"## Pruned model\n\nNot pruned: {error}", f"prune: not pruned: {error}"
      sections.append(markdown)
      summaries.append(summary)
  if "probe" in chosen:
    markdown, summary, results["probe"] = run_probe(args, out)
    sections.append(markdown)
    summaries.append(summary)
  (out / "report.md").write_text("\n\n".join(sections) + "\n")
  (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
  print("\n".join(summaries) + f"\nreport: {out / 'report.md'}")
  return results


def main(argv: list[str]) -> int:
  """Runs `bert-jax analyze` on `argv` (the arguments after `analyze`); returns the exit status."""
  analyze(_parser().parse_args(argv))
  return 0
