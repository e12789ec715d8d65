"""float8 training (`ModelConfig.fp8`, `quantization.fp8_module`) on CPU.

A float8 dense layer against numpy (e4m3 input and kernel, e5m2 incoming gradient, one absmax scale per tensor):
forward and both gradients. A whole model keeps the float model's parameters, and its train step multiplies every
block's dense layers, and nothing else, in float8, on the plain path and the fast one. A run switches fp8 on
while it resumes. What float8 gains on a GPU is `bench/pretrain_vs_reference.py --fp8`'s to measure.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("qwix")

from bert_jax.models import quantization  # noqa: E402
from bert_jax.tasks import finetune_config  # noqa: E402
from bert_jax.train import config_lib, trainer  # noqa: E402
from test_tpu_lowering import lowered_train_step, pretraining_objective  # noqa: E402
from test_trainer import _continue, _continued, _losses_by_step, four_steps, prepared  # noqa: E402, F401

LAYERS = 2  # pretraining_objective's tiny model
BLOCK_DENSE = 6  # query, key, value, output, wi, wo


class _Dense(nn.Module):
  """One dense layer named as a block's feed-forward input is (the float8 rule matches on names)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, dtype=jnp.float32, name="wi")(x)


def _scaled(a: np.ndarray, dtype) -> tuple[np.ndarray, np.float32]:
  """a / s rounded to `dtype` (as float32) and s = absmax(a) / the format's largest value."""
  scale = np.float32(np.abs(a).max() / np.float32(ml_dtypes.finfo(dtype).max))
  return (a / scale).astype(dtype).astype(np.float32), scale


def test_a_float8_dense_layer_equals_its_numpy_reference():
  model = quantization.fp8_module(_Dense)()
  rng = np.random.default_rng(0)
  x, grad = rng.normal(size=(4, 32)).astype(np.float32), rng.normal(size=(4, 16)).astype(np.float32)
  params = model.init(jax.random.key(0), jnp.asarray(x))
  kernel, bias = (np.asarray(params["params"]["wi"][k]) for k in ("kernel", "bias"))
  y, vjp = jax.vjp(model.apply, params, jnp.asarray(x))
  d_params, dx = vjp(jnp.asarray(grad))

  x8, sx = _scaled(x, ml_dtypes.float8_e4m3fn)
  w8, sw = _scaled(kernel, ml_dtypes.float8_e4m3fn)
  g8, sg = _scaled(grad, ml_dtypes.float8_e5m2)
  np.testing.assert_allclose(y, (x8 @ w8) * sx * sw + bias, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dx, (g8 @ w8.T) * sg * sw, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(d_params["params"]["wi"]["kernel"], (x8.T @ g8) * sx * sg, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(d_params["params"]["wi"]["bias"], grad.sum(0), rtol=1e-6)
  # The roundings are real: float32's product differs by more than float32's own rounding.
  assert np.abs(np.asarray(y) - (x @ kernel + bias)).max() > 1e-3


def _dots(text: str) -> list[tuple[str, str]]:
  """The operand element types of every dot_general in a StableHLO module's text."""
  return re.findall(r"stablehlo\.dot_general.*?: \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)", text)


@pytest.mark.parametrize("kernels", [pytest.param("off", marks=pytest.mark.slow), "auto"])
def test_an_fp8_model_keeps_the_float_parameters_and_runs_each_block_dense_layer_in_float8(kernels):
  """Forward: e4m3 x e4m3 for each block's six dense layers; backward: each one's input and kernel gradients with
  the incoming gradient in e5m2. The heads, attention's products and everything else stay in the compute dtype."""
  plain = pretraining_objective("mlm", "bfloat16", kernels=kernels)
  fp8 = pretraining_objective("mlm", "bfloat16", kernels=kernels, fp8=True)
  batch = plain.example_batch(8, 32)
  variables = plain.init_variables(jax.random.key(0), batch)
  jax.tree.map(np.testing.assert_array_equal, variables, fp8.init_variables(jax.random.key(0), batch))

  # The float step lowered before and after the float8 one: no trace of either serves the other.
  float_before = _dots(lowered_train_step(plain, batch, "data8", platform="cpu").as_text())
  dots = _dots(lowered_train_step(fp8, batch, "data8", platform="cpu").as_text())
  float_after = _dots(lowered_train_step(plain, batch, "data8", platform="cpu").as_text())
  forward = [d for d in dots if d == ("f8E4M3FN", "f8E4M3FN")]
  backward = [d for d in dots if "f8E5M2" in d]
  assert len(forward) == BLOCK_DENSE * LAYERS, dots
  assert len(backward) == 2 * BLOCK_DENSE * LAYERS, dots
  assert all(set(d) <= {"f8E5M2", "f8E4M3FN"} for d in backward), backward
  assert [d for d in dots if "f8" not in d[0] + d[1]], "the MLM head's and attention's products stay bfloat16"
  assert not [d for d in float_before + float_after if "f8" in d[0] + d[1]]


@pytest.mark.slow
def test_fp8_is_a_switch_a_run_turns_on_as_it_resumes_and_finetuning_leaves_off(prepared, four_steps, tmp_path):
  """The parameters are the float run's, so fp8 is resume-safe: a float run continues in float8, its loss where it
  was. Fine-tuning starts from a run's model config with fp8 off unless its own config asks."""
  workdir = _continued(four_steps, tmp_path)
  config = _continue(prepared, 6)
  config.unlock()
  config.model.fp8 = True
  trainer.train_and_evaluate(config, workdir)
  losses = _losses_by_step(workdir)
  assert sorted(losses) == [1, 2, 3, 4, 5, 6]
  assert all(np.isfinite(list(losses.values())))
  assert abs(losses[5] - losses[4]) < 0.1 * losses[4], losses

  from bert_jax.models import model_config

  trained = model_config("bert", "tiny", fp8=True)
  finetuning = finetune_config.finetune_defaults()
  assert not finetune_config.model_config_for(trained, finetuning.model).fp8
  finetuning.model.fp8 = True
  assert finetune_config.model_config_for(trained.replace(fp8=False), finetuning.model).fp8


def test_fp8_with_quantisation_aware_training_is_refused_in_one_line():
  config = finetune_config.finetune_defaults()
  config.init.model, config.data_dir = "runs/demo", "data/glue"
  config.model.fp8, config.quant.qat = True, True
  with pytest.raises(ValueError, match=r"config\.model\.fp8=True with config\.quant\.qat=True"):
    finetune_config.validate(config, 1)
  assert config_lib.pretrain_defaults().model.fp8 is None  # the preset's own value: off


def test_without_qwix_an_fp8_model_says_what_to_install(monkeypatch):
  import sys

  import bert_jax.models
  from bert_jax.models import model_config
  from bert_jax.models.model import _block_class

  monkeypatch.setitem(sys.modules, "qwix", None)  # `import qwix` fails as it does where Qwix is not installed
  monkeypatch.delitem(sys.modules, "bert_jax.models.quantization")
  monkeypatch.delattr(bert_jax.models, "quantization")
  with pytest.raises(ModuleNotFoundError, match=r"fp8=True multiplies through Qwix.*pip install -e '\.\[quant\]'"):
    _block_class(model_config("bert", "tiny", fp8=True))
