"""Effective attention (Brunner et al. 2020, "On Identifiability in Transformers").

A head's contribution to its layer's output is A T, with A [T, T] its attention and T = V_h W^O_h [T, H] the
value-output transform of the sequence (the head's values, bias included, times its slice of the output
projection). Any part of A's rows in the left null space of T, {x : x T = 0}, changes nothing, so attention
weights are not identifiable once the sequence is longer than the head size. The effective attention is A with
that part removed: A P, P the orthogonal projection onto the column space of T; it gives the same output,
A P T = A T. (Brunner et al. also keep the rows' probability constraints; this is the plain projection.)

Reported: the Pearson correlation of raw and effective attention per head and line, against the line's length
(it falls as the null space grows), and raw against effective attention to each token type.
"""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.analysis.features import padded_batches
from bert_jax.models import Encoder, ModelConfig

TOKEN_TYPES = ("[CLS]", "[SEP]", "punct", "other")


def value_output_transforms(config: ModelConfig, encoder: Any, hidden_lth: np.ndarray, layer: int) -> np.ndarray:
  """float64 [heads, T, H]: T_h = (x W^V + b^V)_h W^O_h for layer `layer`'s input hidden states [T, H] (pre-LN
  models: after the layer's attention LayerNorm)."""
  attention = encoder[f"block_{layer}"]["attention"]
  x_th = np.asarray(hidden_lth, np.float64)
  if config.norm == "pre":
    norm = encoder[f"block_{layer}"]["attention_norm"]
    mean, var = x_th.mean(-1, keepdims=True), x_th.var(-1, keepdims=True)
    x_th = (x_th - mean) / np.sqrt(var + config.layer_norm_eps) * norm["scale"] + norm["bias"]
  value_ehd = np.asarray(attention["value"]["kernel"], np.float64)
  heads, head_dim = value_ehd.shape[1:]
  values_thd = (x_th @ value_ehd.reshape(len(value_ehd), -1)).reshape(len(x_th), heads, head_dim)
  values_thd += np.asarray(attention["value"]["bias"], np.float64)
  return np.matmul(values_thd.transpose(1, 0, 2), np.asarray(attention["output"]["kernel"], np.float64))


def effective_attention(probs_hqk: np.ndarray, transforms_hke: np.ndarray) -> np.ndarray:
  """A P per head: the attention [heads, Q, K] without its component in the left null space of each head's
  transform [heads, K, H].

  P = U U^T, U the eigenvectors of T T^T [K, K] whose eigenvalues (the squared singular values of T) are above
  the rank threshold: one small batched eigendecomposition instead of an SVD of every [K, H] transform.
  """
  gram_hkk = np.matmul(transforms_hke, transforms_hke.transpose(0, 2, 1))
  eigenvalues_hk, vectors_hkk = np.linalg.eigh(gram_hkk)
  singular_hk = np.sqrt(np.maximum(eigenvalues_hk, 0.0))
  threshold_h1 = singular_hk.max(-1, keepdims=True) * max(transforms_hke.shape[1:]) * np.finfo(np.float32).eps
  basis_hkk = vectors_hkk * (singular_hk > threshold_h1)[:, None, :]  # the null space's eigenvectors zeroed
  return np.matmul(np.matmul(probs_hqk, basis_hkk), basis_hkk.transpose(0, 2, 1))


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
  a, b = a - a.mean(), b - b.mean()
  denominator = np.sqrt((a * a).sum() * (b * b).sum())
  return float((a * b).sum() / denominator) if denominator > 0 else float("nan")


def states_fn(config: ModelConfig):
  """A jitted (params, ids, segments, lengths) -> (attentions [layers, B, heads, L, L], hidden states
  [layers + 1, B, L, H]), float32."""
  encoder = Encoder(config)

  @jax.jit
  def states(params, ids_bl, segments_bl, lengths_b):
    pack_ids_bl = (jnp.arange(ids_bl.shape[1])[None, :] < lengths_b[:, None]).astype(jnp.int32)
    outputs = encoder.apply({"params": params}, ids_bl, segments_bl, pack_ids=pack_ids_bl, output_attentions=True,
                            output_hidden_states=True)
    return (jnp.stack(outputs["attentions"]).astype(jnp.float32),
            jnp.stack(outputs["hidden_states"]).astype(jnp.float32))

  return states


def effective_attention_stats(config: ModelConfig, params: Any, encoded: Sequence[tuple[list[int], list[int]]],
                              token_type_v: np.ndarray, max_len: int, batch_size: int = 16) -> dict[str, Any]:
  """Over the lines of `encoded`: "correlations" [(length, layer, head, r)], and "raw" / "effective" float
  [layers, heads, len(TOKEN_TYPES)], the mean attention a query gives to each token type (`token_type_v`
  [vocab]: an index into TOKEN_TYPES per vocabulary id)."""
  if config.heads_per_layer is not None or config.num_shared_groups:
    raise ValueError("effective attention reads each layer's own value and output projections: analyse a model "
                     "without pruned heads or shared layers")
  states = states_fn(config)
  params = jax.tree.map(np.asarray, params)
  sums = {"raw": np.zeros((config.num_layers, config.num_heads, len(TOKEN_TYPES))),
          "effective": np.zeros((config.num_layers, config.num_heads, len(TOKEN_TYPES)))}
  queries = 0
  correlations = []
  for rows, ids_bt, segments_bt, lengths_b in padded_batches(encoded, batch_size, max_len):
    probs_kbhqq, hidden_kbth = map(np.asarray, states(params, ids_bt, segments_bt, lengths_b))
    for row in range(len(rows)):
      length = int(lengths_b[row])
      types_t = token_type_v[ids_bt[row, :length]]
      one_hot_tc = np.eye(len(TOKEN_TYPES))[types_t]
      queries += length
      for layer in range(config.num_layers):
        probs_hqk = probs_kbhqq[layer, row, :, :length, :length].astype(np.float64)
        transforms = value_output_transforms(config, params, hidden_kbth[layer, row, :length], layer)
        effective_hqk = effective_attention(probs_hqk, transforms)
        sums["raw"][layer] += np.einsum("hqk,kc->hc", probs_hqk, one_hot_tc)
        sums["effective"][layer] += np.einsum("hqk,kc->hc", effective_hqk, one_hot_tc)
        correlations += [(length, layer, head, _pearson(probs_hqk[head], effective_hqk[head]))
                         for head in range(config.num_heads)]
  return {"correlations": correlations, "raw": sums["raw"] / max(queries, 1),
          "effective": sums["effective"] / max(queries, 1), "queries": queries}


def token_types(tokens: Sequence[str], cls_token: str, sep_token: str, punct_v: np.ndarray) -> np.ndarray:
  """int [vocab]: the TOKEN_TYPES index of every vocabulary entry."""
  types = np.full(len(tokens), TOKEN_TYPES.index("other"), np.int32)
  types[punct_v] = TOKEN_TYPES.index("punct")
  for index, token in enumerate(tokens):
    if token == cls_token:
      types[index] = TOKEN_TYPES.index("[CLS]")
    elif token == sep_token:
      types[index] = TOKEN_TYPES.index("[SEP]")
  return types


def effective_markdown(stats: dict[str, Any], head_dim: int) -> tuple[str, str]:
  """(the report's section, a printed line)."""
  correlations = np.array([[length, r] for length, _, _, r in stats["correlations"]], float)
  lengths, values = correlations[:, 0], correlations[:, 1]
  bins = [(0, head_dim), (head_dim, 2 * head_dim), (2 * head_dim, 4 * head_dim), (4 * head_dim, 10 ** 9)]
  lines = ["## Effective attention", "",
           "![effective attention](effective_attention.png)", "",
           f"Pearson correlation of raw and effective attention per head and line (head size d = {head_dim}; "
           "the left null space of T has dimension at least length - d):", "",
           "| line length | heads x lines | mean r | min r |", "|---|---|---|---|"]
  for low, high in bins:
    chosen = (lengths > low) & (lengths <= high)
    if chosen.any():
      label = f"{low + 1}..{high}" if high < 10 ** 9 else f"> {low}"
      lines.append(f"| {label} | {int(chosen.sum())} | {np.nanmean(values[chosen]):.3f} | "
                   f"{np.nanmin(values[chosen]):.3f} |")
  lines += ["", "Mean attention a query gives each token type (over heads and layers), raw -> effective:", "",
            "| token type | raw | effective |", "|---|---|---|"]
  for index, name in enumerate(TOKEN_TYPES):
    lines.append(f"| {name} | {stats['raw'][..., index].mean():.3f} | {stats['effective'][..., index].mean():.3f} |")
  summary = (f"effective attention: mean r(raw, effective) {np.nanmean(values):.3f}; attention to [CLS] / [SEP] "
             f"raw {stats['raw'][..., 0].mean():.3f} / {stats['raw'][..., 1].mean():.3f}, effective "
             f"{stats['effective'][..., 0].mean():.3f} / {stats['effective'][..., 1].mean():.3f}")
  return "\n".join(lines), summary


def write_figure(stats: dict[str, Any], out_dir: pathlib.Path) -> pathlib.Path:
  """effective_attention.png: r against line length (Brunner et al.'s Fig. 1a), and each head's raw and effective
  attention to each token type (their Fig. 1b, 1c)."""
  import matplotlib  # noqa: PLC0415 - only for the figure
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  correlations = np.array([[length, layer, r] for length, layer, _, r in stats["correlations"]], float)
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
  scatter = axes[0].scatter(correlations[:, 0], correlations[:, 2], c=correlations[:, 1] + 1, s=4, alpha=0.4,
                            cmap="viridis")
  axes[0].set_xlabel("line length (tokens)")
  axes[0].set_ylabel("Pearson r (raw, effective)")
  fig.colorbar(scatter, ax=axes[0], label="layer")
  rng = np.random.default_rng(0)
  for axis, kind in zip(axes[1:], ("raw", "effective")):
    values = stats[kind].reshape(-1, len(TOKEN_TYPES))
    for index in range(len(TOKEN_TYPES)):
      axis.scatter(index + rng.uniform(-0.2, 0.2, len(values)), values[:, index], s=6, alpha=0.5)
    axis.set_xticks(range(len(TOKEN_TYPES)), TOKEN_TYPES)
    axis.set_title(f"{kind} attention, one point per head")
    axis.axhline(0, color="gray", linewidth=0.5)
  fig.tight_layout()
  path = out_dir / "effective_attention.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
