"""int8 post-training quantisation of the dense layers (Q8BERT, Zafrir et al. 2019), through Qwix.

Every dense layer of the encoder and of a task head (attention's query, key, value and output projections, the
feed-forward layers, ALBERT's embedding projection, the pooler, the classifier...) computes

  y = (q_x @ q_w) * s_x * s_w + b

q_w: the kernel in int8 with one scale s_w per output feature (absmax / 127.5, fixed once by `quantize_params`);
q_x: the layer's input in int8 with one scale s_x per token, computed at run time (dynamic absmax); q_x @ q_w: an
int8 matmul accumulated in int32 (a `dot_general` of s8 operands with preferred_element_type s32, which XLA runs on
the GPU's and TPU's integer units). The embeddings, LayerNorms, biases, softmax and attention's two products
between activations stay in the compute dtype, as in Q8BERT.

Qwix (google/qwix) does all of it: `quantized_model` wraps a Flax module so that Qwix's PTQ provider intercepts
`jax.lax.dot_general` inside the modules `DENSE_LAYERS` names, and `quantize_params` turns the float parameters
into the model's int8 tree (each quantised kernel a `WithAux(QArray(qvalue int8, scale float32))`, shapes
[in..., out...] and [1..., out...]). The quantised model runs the plain path (`kernels="off"`): the hand-written
kernels take float operands.

`to_storage` / `from_storage` turn that tree into nested dicts of arrays (what Orbax saves and
`checkpoint.restore_params` reads back) and back.
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix

# Module paths (as Qwix writes them: "encoder/block_0/attention/query") of the dense layers quantised. The attention
# module itself ("encoder/block_0/attention") does not match, so its products between activations stay float.
DENSE_LAYERS = r"(.*/)?(query|key|value|output|wi|wi_gate|wo|embedding_projection|dense(_\d+)?|classifier|qa_outputs)"


def rules() -> list[qwix.QuantizationRule]:
  """int8 weights (per output feature) and int8 activations (per token, scales computed at run time)."""
  return [qwix.QuantizationRule(module_path=DENSE_LAYERS, weight_qtype=jnp.int8, act_qtype=jnp.int8,
                                act_static_scale=False, weight_calibration_method="absmax",
                                act_calibration_method="absmax")]


class _Provider(qwix.PtqProvider):
  """Qwix's PTQ provider, the dense layers' outputs in their inputs' dtype.

  Qwix returns a quantised matmul in its scales' dtype, float32 for the weights' scales: without the cast a
  bfloat16 model would run everything after its first dense layer (attention included) in float32.
  """

  def dot_general(self, lhs, rhs, *args, **kwargs):
    return super().dot_general(lhs, rhs, *args, **kwargs).astype(lhs.dtype)


def quantized_model(model: nn.Module) -> nn.Module:
  """`model` (any module with a `ModelConfig` field `config`: `FinetuneModel`, `FeatureBasedTagger`...) with its
  dense layers in int8; apply it to `quantize_params`' tree. Its encoder runs the plain path without remat."""
  plain = model.clone(config=model.config.replace(kernels="off", remat="none"))
  return qwix.quantize_model(plain, _Provider(rules()))


def quantize_params(params: Any, abstract_quantized: Any) -> Any:
  """The float `params` as the quantised model's tree (int8 kernels with their scales, the rest unchanged).

  Args:
    params: the float model's parameters (host or device arrays).
    abstract_quantized: the quantised model's parameters as `jax.eval_shape` of its init gives them (boxed or not);
      they tell Qwix which kernels to quantise and along which axes.
  """
  return qwix.quantize_params(jax.tree.map(jnp.asarray, params), nn.unbox(abstract_quantized))


def dequantize(tree: Any) -> Any:
  """The float parameters the quantised tree stands for (each int8 kernel as qvalue * scale), in the float model's
  structure."""
  is_kernel = lambda x: isinstance(getattr(x, "array", None), qwix.QArray)  # noqa: E731
  return jax.tree.map(lambda x: qwix.dequantize(x.array) if is_kernel(x) else x, tree, is_leaf=is_kernel)


def _key_name(key: Any) -> str:
  for field in ("key", "name", "idx"):
    if hasattr(key, field):
      return str(getattr(key, field))
  raise TypeError(f"unexpected tree key {key!r}")


def to_storage(tree: Any) -> dict[str, Any]:
  """Nested dicts of arrays, a quantised kernel as {"array": {"qvalue", "scale"}} under its parameter's name."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return flax.traverse_util.unflatten_dict({tuple(map(_key_name, path)): leaf for path, leaf in leaves})


def from_storage(abstract_quantized: Any, stored: dict[str, Any]) -> Any:
  """The quantised tree from `to_storage`'s dicts; `abstract_quantized` (boxed or not) gives its structure.

  Raises:
    ValueError: naming the missing or mis-shaped arrays (a folder written for another model).
  """
  abstract = nn.unbox(abstract_quantized)
  flat = flax.traverse_util.flatten_dict(stored)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
  values, problems = [], []
  for path, leaf in leaves:
    name = tuple(map(_key_name, path))
    value = flat.get(name)
    if value is None or tuple(np.shape(value)) != tuple(leaf.shape):
      problems.append(f"{'/'.join(name)}: expected {tuple(leaf.shape)} {leaf.dtype}, "
                      f"{'missing' if value is None else f'got {tuple(np.shape(value))}'}")
    values.append(value if value is None else np.asarray(value, leaf.dtype))
  if problems:
    raise ValueError("the stored int8 parameters do not fit this model:\n  " + "\n  ".join(problems))
  return jax.tree_util.tree_unflatten(treedef, values)


def param_bytes(tree: Any) -> int:
  """Bytes of every array in `tree` (int8 values and their float32 scales alike)."""
  return sum(int(np.prod(np.shape(leaf))) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def count_quantized(tree: Any) -> int:
  """The int8 kernels in a quantised tree."""
  return sum(isinstance(x, qwix.QArray) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, qwix.QArray)))
