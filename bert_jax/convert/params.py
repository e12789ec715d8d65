"""Parameter trees of our models as converters see them: kinds, shapes, flattening.

A converted model is the params tree of one of three modules, told apart by
its top-level keys:

  "encoder"      `Encoder`           {embeddings, block_*, embedding_projection?}
  "pretraining"  `PretrainingModel`  {encoder, mlm, sentence?, sbo?}
  "electra"      `ElectraModel`      {embeddings, generator, generator_mlm,
                                      discriminator, rtd | mlm (+ copy)}

Trees are nested dicts of numpy float32 arrays (the "params" collection's
content, unboxed): `module.apply({"params": params}, ...)` takes them directly.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from bert_jax.models import ElectraModel, Encoder, ModelConfig, PretrainingModel
from bert_jax.models.model import Pooler, ReplacedTokenHead

Params = dict[str, Any]
MODEL_KINDS = ("encoder", "pretraining", "electra")
# Trees that Hugging Face base models or head-only checkpoints carry beside the
# main tree, by name: the base model's pooler, ELECTRA's RTD head without a generator.
EXTRA_MODULES = {"pooler": Pooler, "rtd": ReplacedTokenHead}


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
  for key, value in tree.items():
    name = f"{prefix}/{key}" if prefix else key
    if isinstance(value, Mapping):
      yield from _leaves(value, name)
    else:
      yield name, value


def flatten_params(tree: Params) -> dict[str, np.ndarray]:
  """{"a": {"b": x}} -> {"a/b": x}."""
  return {name: np.asarray(leaf) for name, leaf in _leaves(tree)}


def unflatten_params(flat: dict[str, np.ndarray]) -> Params:
  """{"a/b": x} -> {"a": {"b": x}}."""
  tree: Params = {}
  for name, leaf in flat.items():
    *parents, last = name.split("/")
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[last] = leaf
  return tree


def model_kind(params: Params) -> str:
  """Which of MODEL_KINDS a params tree belongs to."""
  if "discriminator" in params:
    return "electra"
  if "mlm" in params:
    return "pretraining"
  if "embeddings" in params:
    return "encoder"
  raise ValueError(f"not the params of an Encoder, PretrainingModel or ElectraModel: top-level keys {sorted(params)}")


def build_model(config: ModelConfig, params: Params, generator_config: ModelConfig | None = None) -> nn.Module:
  """The module whose params tree `params` is (`generator_config` is needed for ELECTRA)."""
  kind = model_kind(params)
  if kind == "encoder":
    return Encoder(config)
  if kind == "pretraining":
    return PretrainingModel(config, sentence_head="sentence" in params, span_boundary_head="sbo" in params)
  if generator_config is None:
    raise ValueError("an ElectraModel tree needs its generator config")
  return ElectraModel(config, generator_config, electra_head(params))


def electra_head(params: Params) -> str:
  """The `ElectraModel.head` of an "electra" tree: what its discriminator predicts."""
  return "rtd" if "rtd" in params else "all_tokens" if "copy" in params else "mlm"


def encoder_params(params: Params) -> Params:
  """The `Encoder` tree inside any model tree (ELECTRA: the discriminator with the shared embeddings)."""
  kind = model_kind(params)
  if kind == "encoder":
    return params
  if kind == "pretraining":
    return params["encoder"]
  return {"embeddings": params["embeddings"], **params["discriminator"]}


def param_shapes(module: nn.Module) -> Params:
  """Nested dict of the shapes of `module`'s params, computed without allocating them."""
  ids = jnp.zeros((1, 4), jnp.int32)
  positions = jnp.zeros((1, 2), jnp.int32)
  rngs = {"params": jax.random.key(0), "sample": jax.random.key(1)}
  if isinstance(module, Encoder):
    init = lambda: module.init(rngs, ids)  # noqa: E731
  elif isinstance(module, PretrainingModel):
    sbo = dict(sbo_left=positions, sbo_right=positions, sbo_offsets=positions) if module.span_boundary_head else {}
    init = lambda: module.init(rngs, ids, positions, **sbo)  # noqa: E731
  elif isinstance(module, ElectraModel):
    init = lambda: module.init(rngs, ids, positions, ids)  # noqa: E731
  else:
    hidden = jnp.zeros((1, 4, module.config.hidden_size), jnp.float32)
    init = lambda: module.init(rngs, hidden)  # noqa: E731
  variables = jax.eval_shape(init)
  return jax.tree.map(lambda leaf: tuple(leaf.shape), nn.unbox(variables["params"]))


def shape_problems(expected: Params, params: Params) -> list[str]:
  """Missing, unexpected and mis-shaped leaves of `params` against `param_shapes(...)` output."""
  want = dict(_leaves(expected))
  got = {name: tuple(np.shape(leaf)) for name, leaf in _leaves(params)}
  problems = [f"missing {name} {want[name]}" for name in sorted(want.keys() - got.keys())]
  problems += [f"unexpected {name} {got[name]}" for name in sorted(got.keys() - want.keys())]
  problems += [f"mis-shaped {name}: {got[name]}, expected {want[name]}"
               for name in sorted(want.keys() & got.keys()) if want[name] != got[name]]
  return problems
