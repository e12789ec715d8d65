"""int8 quantisation (Q8BERT, Zafrir et al. 2019) through Qwix: post-training, and quantisation-aware training;
float8 training.

Every dense layer of the encoder and of a task head (attention's query, key, value and output projections, the
feed-forward layers, ALBERT's embedding projection, the pooler, the classifier...) computes

  y = (q_x @ q_w) * s_x * s_w + b

q_w: the kernel in int8 with one scale s_w per output feature (absmax / 127.5, fixed once by `quantize_params`);
q_x: the layer's input in int8 with one scale s_x per token, computed at run time (dynamic absmax); q_x @ q_w: an
int8 matmul accumulated in int32 (a `dot_general` of s8 operands with preferred_element_type s32, which XLA runs on
the GPU's and TPU's integer units). The embedding tables are int8 too, one scale per row, and a lookup scales
only the rows it gathers. LayerNorms, biases, softmax and attention's two products between activations stay in
the compute dtype, as in Q8BERT. That is `Scheme()`; `Scheme("fp8")` multiplies float8 (e4m3) operands instead, and
`activations="static"` fixes s_x per layer input before inference (the largest |value| on calibration batches,
`calibrating_model`), so that no reduction runs before a matmul.

Qwix (google/qwix) quantises the dense layers: `quantized_model` wraps a Flax module so that Qwix's PTQ provider
intercepts `jax.lax.dot_general` inside the modules `DENSE_LAYERS` names, and `quantize_params` turns the float
parameters into the model's int8 tree (each quantised kernel a `WithAux(QArray(qvalue int8, scale float32))`,
shapes [in..., out...] and [1..., out...]). Qwix's PTQ quantises only what enters a matmul, so the tables (a
`QArray`, shapes [rows, E] and [rows, 1]) are quantised and looked up by the few lines of `_Provider` with Qwix's
own `quantize`. The quantised model runs the plain path (`kernels="off"`): the hand-written kernels take float
operands.

Quantisation-aware training (Q8BERT's own recipe; `--config.quant.qat=True` in fine-tuning): `qat_model` wraps the
float model with Qwix's training-time (QT) provider, which quantises the same kernels and activations inside the
step, and reads each embedding table as its int8 values times their row scales. Its forward pass is the int8 model's
on `quantize_params` of its weights, so `bert-jax quantize` then runs what was trained. Gradients pass the roundings
unchanged (the straight-through estimator): a dense layer's are those of its matmul of the dequantised int8 operands,
a table's those of a plain lookup. The parameters stay float32, in the float model's tree.

`to_storage` / `from_storage` turn that tree into nested dicts of arrays (what Orbax saves and
`checkpoint.restore_params` reads back) and back.

float8 training (`ModelConfig.fp8`): `fp8_module` makes the encoder's transformer block class whose dense layers
(attention's query, key, value and output projections, the feed-forward's) multiply in float8 through Qwix's
training-time provider: the layer's input and kernel in e4m3, the incoming gradient of both backward matmuls in
e5m2, each with one scale per tensor (absmax / the format's largest value, at run time: "current" scaling, no
state to keep), the products accumulated and returned in the compute dtype. One scale per tensor is the form of
cuBLAS's float8 GEMMs (Hopper's float8 tensor cores). The parameters stay float32 and the tree is the float
model's, so a run switches fp8 on or off between steps. What it gains is measured by `bench/pretrain_vs_reference.py
--fp8`, not assumed.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from qwix._src.utils import flax_util as _flax_util

# Module paths (as Qwix writes them: "encoder/block_0/attention/query") of the dense layers quantised. The attention
# module itself ("encoder/block_0/attention") does not match, so its products between activations stay float.
DENSE_LAYERS = r"(.*/)?(query|key|value|output|wi|wi_gate|wo|embedding_projection|dense(_\d+)?|classifier|qa_outputs)"


@dataclasses.dataclass(frozen=True)
class Scheme:
  """How a quantised dense layer multiplies: the operands' number format, and where its input's scale comes from.

  format: "int8", or "fp8" (e4m3, whose exponent keeps small values' relative precision under one scale).
  activations: "dynamic", one scale per token from its absmax at run time; or "static", one scale per layer input
    fixed before inference from the largest |value| it took on calibration batches (`calibrating_model`), so the
    step computes no reduction before a matmul. The weights have one scale per output feature either way.
  """

  format: str = "int8"
  activations: str = "dynamic"

  FORMATS = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}

  def __post_init__(self):
    if self.format not in self.FORMATS:
      raise ValueError(f"quantisation format {self.format!r}: choose one of {sorted(self.FORMATS)}")
    if self.activations not in ("dynamic", "static"):
      raise ValueError(f"activation scales {self.activations!r}: choose 'dynamic' or 'static'")

  @property
  def static(self) -> bool:
    return self.activations == "static"

  @property
  def name(self) -> str:
    """"int8", "int8-static", "fp8" or "fp8-static" (`parse` reads it back)."""
    return self.format + ("-static" if self.static else "")

  @classmethod
  def names(cls) -> list[str]:
    """Every scheme's `name`, as `parse` reads them."""
    return [format_ + suffix for format_ in cls.FORMATS for suffix in ("", "-static")]

  @classmethod
  def parse(cls, name: str) -> "Scheme":
    format_, _, static = name.partition("-")
    if static not in ("", "static"):
      raise ValueError(f"quantisation scheme {name!r}: give FORMAT or FORMAT-static, FORMAT one of "
                       f"{sorted(cls.FORMATS)}")
    return cls(format_, "static" if static else "dynamic")

  def rules(self) -> list[qwix.QuantizationRule]:
    qtype = self.FORMATS[self.format]
    # A static scale spans the input's leading axes (rows and tokens): one number per layer input.
    static = {"act_static_scale": True, "act_batch_axes": (0, 1)} if self.static else {"act_static_scale": False}
    return [qwix.QuantizationRule(module_path=DENSE_LAYERS, weight_qtype=qtype, act_qtype=qtype,
                                  weight_calibration_method="absmax", act_calibration_method="absmax", **static)]


def rules() -> list[qwix.QuantizationRule]:
  """int8 weights (per output feature) and int8 activations (per token, scales computed at run time)."""
  return Scheme().rules()


def _quantize_table(table: jax.Array) -> qwix.QArray:
  """An embedding table [rows, E] in int8, one scale per row."""
  return qwix.quantize(table, jnp.int8, channelwise_axes=[0])


class _Provider(qwix.PtqProvider):
  """Qwix's PTQ provider with int8 embedding tables, the dense layers' outputs in their inputs' dtype."""

  def dot_general(self, lhs, rhs, *args, **kwargs):
    # Qwix returns a quantised matmul in its scales' dtype, float32 for the weights': without the cast a bfloat16
    # model would run everything after its first dense layer (attention included) in float32.
    return super().dot_general(lhs, rhs, *args, **kwargs).astype(lhs.dtype)

  def nn_param(self, module: nn.Module, name: str, *args, **kwargs):
    """At init, an `nn.Embed` table is created in int8 (stored boxed as the float one was)."""
    value = super().nn_param(module, name, *args, **kwargs)
    if not (isinstance(module, nn.Embed) and module.is_initializing()):
      return value
    value = _quantize_table(value)
    boxed = module.get_variable("params", name)
    if isinstance(boxed, nn.meta.AxisMetadata):
      module.put_variable("params", name, jax.tree.map(boxed.replace_boxed, value))
    else:
      module.put_variable("params", name, value)
    return value

  def take(self, table, indices, axis=None, **kwargs):
    """`jnp.take`, which `nn.Embed` looks rows up with; an int8 table's rows are scaled after the gather."""
    if isinstance(table, qwix.QArray):
      return (jnp.take(table.qvalue, indices, axis=0).astype(table.scale.dtype)
              * jnp.take(table.scale, indices, axis=0))
    return jnp.take(table, indices, axis=axis, **kwargs)

  def get_intercept_map(self):
    return super().get_intercept_map() | {"jax.numpy.take": self.take}


@jax.custom_vjp
def _fake_quantized_table(table: jax.Array) -> jax.Array:
  """The values `_Provider.take` gathers from the int8 table (qvalue * scale, row by row), with the identity as
  gradient (the straight-through estimator)."""
  return qwix.dequantize(_quantize_table(table))


_fake_quantized_table.defvjp(lambda table: (_fake_quantized_table(table), None), lambda _, grad: (grad,))


@jax.custom_vjp
def _gradient_in_own_dtype(x: jax.Array) -> jax.Array:
  """The identity, whose gradient comes back in `x`'s dtype: Qwix's training-time matmul returns a bfloat16
  input's gradient in float32, which the rest of the backward pass does not accept."""
  return x


_gradient_in_own_dtype.defvjp(lambda x: (x, jnp.zeros((), x.dtype)), lambda like, grad: (grad.astype(like.dtype),))


class _TrainingProvider(qwix.QtProvider):
  """Qwix's training-time (QT) provider with each quantised matmul's output and input gradient in the input's dtype
  (float8 training's, and the base of quantisation-aware training's)."""

  def dot_general(self, lhs, rhs, *args, **kwargs):
    # The output cast as `_Provider.dot_general`'s.
    return super().dot_general(_gradient_in_own_dtype(lhs), rhs, *args, **kwargs).astype(lhs.dtype)


class _QatProvider(_TrainingProvider):
  """The training-time provider computing the forward pass `_Provider` computes from the same float parameters:
  int8 kernels and activations (quantised inside the step), int8 embedding rows, float gradients through both
  roundings."""

  def nn_param(self, module: nn.Module, name: str, *args, **kwargs):
    """An `nn.Embed` table reads as its int8 values times their row scales (stored float, trained float)."""
    value = module.param(name, *args, **kwargs)
    if isinstance(module, nn.Embed) and not module.is_initializing():
      return _fake_quantized_table(value)
    return value

  def promote_dtype(self, *args, dtype=None, **kwargs):
    """Casts as flax does, except what `_Provider`'s model holds in float32: a quantised layer's kernel (its int8
    values are rounded from the float32 weights) and an embedding table (its rows are int8 times float32 scales).
    In a bfloat16 model both would otherwise be cast before the rounding."""
    module = _flax_util.get_current_module()
    if isinstance(module, nn.Embed):
      return list(args)
    quantised = re.fullmatch(DENSE_LAYERS, "/".join(map(str, module.path))) is not None
    kept = [quantised and x is not None and _flax_util.find_param(x) == "kernel" for x in args]
    promoted = nn.dtypes.promote_dtype(*[None if keep else x for x, keep in zip(args, kept)], dtype=dtype, **kwargs)
    return [x if keep else y for x, y, keep in zip(args, promoted, kept)]

  def get_intercept_map(self):
    return super().get_intercept_map() | {"flax.linen.Module.param": self.nn_param,
                                          "flax.linen.dtypes.promote_dtype": self.promote_dtype}


def qat_rules() -> list[qwix.QtRule]:
  """`rules()` for training: the same quantisation in the forward pass; in the backward pass each dense layer's
  gradients are those of its matmul of the int8 operands (as dequantised), passed unchanged through the rounding
  (Q8BERT's straight-through estimator)."""
  return [qwix.QtRule(**dataclasses.asdict(rule), additional_qt_config={"use_original_residuals": False})
          for rule in rules()]


def qat_model(model: nn.Module) -> nn.Module:
  """`model` fine-tuned with fake-quantised int8 (Q8BERT's quantisation-aware training): its forward pass is
  `quantized_model`'s on `quantize_params` of its parameters, which stay float32 and train as usual. Its encoder
  runs the plain path, its int8 rules in place of `fp8`'s."""
  plain = model.clone(config=model.config.replace(kernels="off", fp8=False))
  return qwix.quantize_model(plain, _QatProvider(qat_rules()))


# The dense layers of a transformer block that multiply in float8 (paths as Qwix writes them, relative or not):
# attention's products between activations and everything outside the blocks stay in the compute dtype.
FP8_LAYERS = r"(.*/)?(query|key|value|output|wi|wi_gate|wo)"


def fp8_rules() -> list[qwix.QtRule]:
  """e4m3 inputs and kernels, e5m2 incoming gradients, one scale per tensor from its absmax at run time."""
  return [qwix.QtRule(module_path=FP8_LAYERS, weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn,
                      bwd_qtype=jnp.float8_e5m2, act_static_scale=False, disable_channelwise_axes=True,
                      weight_calibration_method="absmax", act_calibration_method="absmax")]


@functools.cache
def fp8_module(module_class: type[nn.Module], *args: Any) -> type[nn.Module]:
  """A subclass of `module_class` (e.g. `encoder.TransformerBlock`) whose `__call__` runs the matmuls of its
  `FP8_LAYERS` in float8 (`fp8_rules`), with the same parameters; `args` construct one instance, which Qwix
  needs to make the class."""
  return type(qwix.quantize_model(module_class(*args, parent=None), _TrainingProvider(fp8_rules())))


def _plain(model: nn.Module) -> nn.Module:
  return model.clone(config=model.config.replace(kernels="off", remat="none", fp8=False))


def quantized_model(model: nn.Module, scheme: Scheme = Scheme()) -> nn.Module:
  """`model` (any module with a `ModelConfig` field `config`: `FinetuneModel`, `FeatureBasedTagger`..., or its
  `qat_model`) with its dense layers quantised by `scheme` (int8 with per-token scales by default) and its embedding
  tables in int8; apply it to `quantize_params`' tree. Its encoder runs the plain path without remat, these rules
  in place of `fp8`'s (a model fine-tuned in float8 quantises as a float one)."""
  return qwix.quantize_model(_plain(model), _Provider(scheme.rules()))


class _Calibrator(qwix.QuantizationProvider):
  """Runs the float model and keeps, for each dense layer input a static scheme quantises, the largest |value| of
  the batch, in the collection "quant_stats" under the name Qwix gives that input's scale (op ids are counted per
  module call the same way in both providers)."""

  def dot_general(self, lhs, rhs, *args, **kwargs):
    rule, op_id = self._get_current_rule_and_op_id("dot_general")
    if rule is not None and rule.act_qtype is not None:
      absmax = jnp.max(jnp.abs(lhs)).astype(jnp.float32).reshape((1,) * lhs.ndim)
      stat = _flax_util.get_or_create_variable("quant_stats", f"{op_id}_lhs", lambda: absmax)
      stat.value = jnp.maximum(stat.value, absmax)
    return jax.lax.dot_general(lhs, rhs, *args, **kwargs)

  def get_intercept_map(self):
    return super().get_intercept_map() | {"jax.lax.dot_general": self.dot_general}


def calibrating_model(model: nn.Module, scheme: Scheme) -> nn.Module:
  """`model` computing in float, as `quantized_model(model, scheme)` is laid out: applied to the float parameters
  with `mutable=["quant_stats"]`, it also returns each quantised layer input's largest |value| in the batch.
  `merge_calibrations` joins batches; `quantize_params` turns the result into the static scales."""
  return qwix.quantize_model(_plain(model), _Calibrator(scheme.rules()))


def merge_calibrations(*calibrations: Any) -> Any:
  """The calibration of several batches (their `calibrating_model` stats): the largest |value| of each input."""
  return jax.tree.map(lambda *absmax: np.max(np.stack(absmax), axis=0), *calibrations)


def _static_scale_names(abstract: Any) -> set[tuple[str, ...]]:
  return {path[:-1] + (path[-1][:-len("_scale")],) for path in flax.traverse_util.flatten_dict(abstract)
          if path[-1].endswith("_lhs_scale")}


def quantize_params(params: Any, abstract_quantized: Any, calibration: Any = None) -> Any:
  """The float `params` as the quantised model's tree (int8 or float8 kernels, int8 tables, with their scales; with
  a static scheme also each layer input's scale, its calibrated absmax over the format's largest value; the rest
  unchanged).

  Args:
    params: the float model's parameters (host or device arrays).
    abstract_quantized: the quantised model's parameters as `jax.eval_shape` of its init gives them (boxed or not);
      they tell Qwix which kernels to quantise and along which axes, and which leaves are int8 tables.
    calibration: for a static scheme, the "quant_stats" of `calibrating_model` (merged over batches).

  Raises:
    ValueError: a static scheme's calibration missing, or not covering every quantised input.
  """
  abstract = nn.unbox(abstract_quantized)
  needed = _static_scale_names(abstract)
  if needed:
    given = set(flax.traverse_util.flatten_dict(calibration or {}))
    if needed - given:
      raise ValueError(f"static activation scales need a calibration of every quantised input; missing "
                       f"{len(needed - given)} of {len(needed)}, e.g. {'/'.join(sorted(needed - given)[0])}")
  # Qwix's form of calibration statistics: a running sum of the absmax and its count (here one, the maximum).
  stats = jax.tree.map(lambda absmax: {"count": np.int32(1), "sum_of_absmax": jnp.asarray(absmax)},
                       calibration or {})
  quantized = qwix.quantize_params(jax.tree.map(jnp.asarray, params), abstract, stats)
  # The tables: where the abstract tree has a QArray and Qwix left an array (a kernel's QArray sits one level down,
  # inside Qwix's WithAux, so its path names no array of `quantized`).
  is_qarray = lambda x: isinstance(x, qwix.QArray)  # noqa: E731
  tables = {path for path, leaf in jax.tree_util.tree_leaves_with_path(abstract, is_leaf=is_qarray) if is_qarray(leaf)}
  return jax.tree_util.tree_map_with_path(lambda path, x: _quantize_table(x) if path in tables else x, quantized)


def dequantize(tree: Any) -> Any:
  """The float parameters the quantised tree stands for (each int8 kernel and table as qvalue * scale), in the
  float model's structure."""
  def restore(x):
    if isinstance(x, qwix.QArray):
      return qwix.dequantize(x)
    return qwix.dequantize(x.array) if isinstance(getattr(x, "array", None), qwix.QArray) else x

  quantized = lambda x: isinstance(x, qwix.QArray) or isinstance(getattr(x, "array", None), qwix.QArray)  # noqa: E731
  return jax.tree.map(restore, tree, is_leaf=quantized)


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


def quantized_counts(tree: Any) -> dict[str, int]:
  """{"dense_layers": int8 kernels, "embedding_tables": int8 tables} of a quantised tree."""
  is_qarray = lambda x: isinstance(x, qwix.QArray)  # noqa: E731
  paths = [path for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_qarray) if is_qarray(leaf)]
  kernels = sum(isinstance(path[-1], jax.tree_util.GetAttrKey) for path in paths)  # inside Qwix's WithAux
  return {"dense_layers": kernels, "embedding_tables": len(paths) - kernels}
