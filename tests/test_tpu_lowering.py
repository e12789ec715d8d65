"""The whole steps lowered for TPU on this CPU: every pre-training objective, fine-tuning and distillation, on the
data x fsdp x tensor meshes of 8 fake devices, in float32 and bfloat16.

CI has no TPU. jax lowers for another platform than the one it runs on (`lowering_platforms=("tpu",)`, the
mechanism tests/test_kernels_lower.py uses for CUDA), so this builds each step's StableHLO module with its Shardy
mesh annotations as a TPU job would, and checks it holds no GPU-only operation (a CUDA custom call, a Triton,
Mosaic GPU or cuDNN kernel): a kernel whose "auto" switch leaked onto TPU would fail here. It does not compile:
XLA's TPU compiler needs a TPU (libtpu); this CPU's client would compile the module as CPU code. The cost figures
are therefore `Lowered.cost_analysis()`'s, XLA's estimate of the unoptimised, unpartitioned module (the whole
batch), not the TPU compiler's.

Each objective lowers on every mesh and in both dtypes; the fast set lowers each objective once, the rest is
marked slow.
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bert_jax.kernels import attention as attention_kernels
from bert_jax.models import model_config
from bert_jax.tasks.finetune_model import FinetuneModel
from bert_jax.parallel import sharding as sharding_lib
from bert_jax.tasks.finetune_model import FinetuneObjective
from bert_jax.train import config_lib, distill, objectives, optim
from bert_jax.train.step import Partitioning, make_eval_step, make_state_init, make_train_step
from test_kernels_lower import lower_for

ROWS, SEQ, VOCAB = 8, 32, 128
MESHES = {"data8": {"data": 8}, "fsdp8": {"fsdp": 8}, "2x2x2": {"data": 2, "fsdp": 2, "tensor": 2}}
DTYPES = ("float32", "bfloat16")
# A custom call or kernel that only a GPU runs: CUDA libraries and jax's CUDA custom calls (cu_threefry2x32,
# cu_lu_pivots...), Pallas' Triton kernels, Mosaic GPU, cuDNN attention.
GPU_ONLY = re.compile(r"cuda|\bcu_|cublas|cusolver|cusparse|cudnn|triton|mosaic_gpu|__gpu\$|rocm|\bhip")
# What a TPU program of the plain path may call: nothing but Shardy's and XLA's own sharding markers. Mosaic TPU
# kernels (`tpu_custom_call`) are counted apart.
NEUTRAL_TARGETS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"})
MOSAIC_TPU = "tpu_custom_call"


def custom_calls(text: str) -> list[str]:
  """The targets of every custom call in a StableHLO module's text, in order."""
  return re.findall(r"custom_call\s*@([\w$.]+)", text)


def gpu_only_ops(text: str) -> list[str]:
  """The GPU-only custom calls of a module, and the lines naming a GPU kernel anywhere else in it."""
  found = [target for target in custom_calls(text) if GPU_ONLY.search(target)]
  return found + [line.strip()[:160] for line in text.splitlines()
                  if "custom_call" not in line and re.search(r"triton|mosaic_gpu|cudnn", line)]


def tiny_model(dtype: str, **overrides):
  fields = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=256,
                max_position_embeddings=128, dtype=dtype)
  return model_config("bert", "tiny", **{**fields, **overrides})


def abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def partitioning_of(mesh_name: str) -> Partitioning:
  return Partitioning(sharding_lib.create_mesh(MESHES[mesh_name]), sharding_lib.DEFAULT_RULES)


def lowered_train_step(task, batch, mesh_name: str, frozen_task=None, platform: str = "tpu", evaluation=False,
                       before_step=lambda: None):
  """The train step of `task` (with a frozen teacher `frozen_task`, as distillation runs; with `evaluation` the
  eval step) lowered for `platform` from abstract state and batch: nothing is initialised or compiled.
  `before_step()` runs between the state's shapes and the step's tracing."""
  partitioning = partitioning_of(mesh_name)
  config = config_lib.pretrain_defaults()
  tx, schedule = optim.make_optimizer(config.optim, total_steps=100)
  init, shardings = make_state_init(lambda key: task.init_variables(key, batch), tx, partitioning, jax.random.key(0))
  state = jax.eval_shape(init, jax.random.key(0))
  if frozen_task is not None:
    with partitioning.context():
      boxed = jax.eval_shape(lambda: frozen_task.init_variables(jax.random.key(0), batch))["params"]
      frozen_shardings = sharding_lib.logical_shardings(boxed, partitioning.mesh, partitioning.rules)
    state, shardings = state.replace(frozen=nn.unbox(boxed)), shardings.replace(frozen=frozen_shardings)
  before_step()
  if evaluation:
    return lower_for(platform, make_eval_step(task, partitioning, shardings), state.params, abstract(batch))
  step = make_train_step(task, tx, schedule, accum_steps=1, rng=jax.random.key(1), partitioning=partitioning,
                         state_shardings=shardings)
  return lower_for(platform, step, state, abstract(batch))


def pretraining_objective(name: str, dtype: str, **model_overrides):
  config = config_lib.pretrain_defaults()
  config.objective = name
  config.masking.max_predictions = 5
  return objectives.make_objective(config, tiny_model(dtype, **model_overrides), mask_id=4)


def check_tpu_module(lowered, mesh_name: str, mosaic_kernels: int = 0) -> dict[str, float]:
  """Asserts the module is a TPU program of the mesh with no GPU-only op and `mosaic_kernels` distinct Mosaic TPU
  kernels (splash attention's; a kernel every layer calls is lowered once); returns its cost estimate."""
  text = lowered.as_text()
  assert not gpu_only_ops(text), gpu_only_ops(text)[:5]
  assert set(custom_calls(text)) <= NEUTRAL_TARGETS | {MOSAIC_TPU}, set(custom_calls(text))
  assert custom_calls(text).count(MOSAIC_TPU) == mosaic_kernels
  sizes = {"data": 1, "fsdp": 1, "tensor": 1, **MESHES[mesh_name]}
  assert re.search(r'sdy\.mesh @\w+ = <\["data"={data}, "fsdp"={fsdp}, "tensor"={tensor}\]>'.format(**sizes), text)
  cost = lowered.cost_analysis()
  assert cost["flops"] > 0 and cost["bytes accessed"] > 0
  return cost


# Every objective on every mesh, its dtype alternating so that each objective lowers in both and each mesh in both
# (dtype and mesh meet the objective's sharding rules apart: the full product adds no case of its own); one mesh of
# each objective in the fast set, the meshes in turn.
CASES = [pytest.param(name, DTYPES[(i + j) % 2], mesh, id=f"{name}-{DTYPES[(i + j) % 2]}-{mesh}",
                      marks=() if j == i % len(MESHES) else pytest.mark.slow)
         for i, name in enumerate(objectives.OBJECTIVES) for j, mesh in enumerate(MESHES)]


@pytest.mark.parametrize("name, dtype, mesh_name", CASES)
def test_pretraining_step_lowers_for_tpu(name, dtype, mesh_name):
  """The default switch (`kernels="auto"`, attention dropout on) on TPU: the plain path, no GPU op. The estimated
  FLOPs are at least the model's own count of a training step (`flops_per_token`, the matmuls), which the
  unoptimised module's elementwise work (masking, dropout, the optimizer) adds to."""
  objective = pretraining_objective(name, dtype)
  cost = check_tpu_module(lowered_train_step(objective, objective.example_batch(ROWS, SEQ), mesh_name), mesh_name)
  assert 1.0 <= cost["flops"] / (objective.flops_per_token(5, SEQ) * ROWS * SEQ) < 1.5


def finetune_task(dtype: str, kind: str = "classification") -> FinetuneObjective:
  return FinetuneObjective(FinetuneModel(tiny_model(dtype), kind, 3), kind)


def finetune_batch(kind: str = "classification") -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {"input_ids": rng.integers(5, VOCAB, (ROWS, SEQ)).astype(np.int32),
          "segment_ids": np.zeros((ROWS, SEQ), np.int32), "lengths": np.full(ROWS, SEQ, np.int32),
          "weights": np.ones(ROWS, np.float32), "seed": np.zeros(ROWS, np.int32),
          "labels": rng.integers(0, 3, ROWS).astype(np.int32)}


@pytest.mark.parametrize("dtype, mesh_name", [("bfloat16", "2x2x2"), ("float32", "fsdp8")])
def test_finetuning_step_lowers_for_tpu(dtype, mesh_name):
  check_tpu_module(lowered_train_step(finetune_task(dtype), finetune_batch(), mesh_name), mesh_name)


@pytest.mark.parametrize("dtype, mesh_name", [("bfloat16", "fsdp8"), ("float32", "data8")])
@pytest.mark.slow
def test_distillation_steps_lower_for_tpu(dtype, mesh_name):
  """Fine-tuning distillation (soft targets and BERT-PKD from a frozen teacher of twice the depth) and general
  distillation (an MLM teacher's soft targets and DistilBERT's cosine loss), the teacher in the state."""
  student, teacher = finetune_task(dtype), FinetuneObjective(FinetuneModel(tiny_model(dtype, num_layers=4),
                                                                           "classification", 3), "classification")
  task = distill.Distillation(student, teacher, student.model.config, teacher.model.config, temperature=2.0,
                              alpha=0.5, pkd_weight=1.0)
  check_tpu_module(lowered_train_step(task, finetune_batch(), mesh_name, frozen_task=teacher), mesh_name)

  pretraining = pretraining_objective("mlm", dtype, sparse_last_layer=False)
  mlm_teacher = distill.MaskedLMTeacher(model_config=tiny_model(dtype, num_layers=4), masking=pretraining.masking,
                                        mask_id=4, weights={"mlm": 1.0})
  general = distill.Distillation(pretraining, mlm_teacher, pretraining.model_config, mlm_teacher.model_config,
                                 temperature=2.0, alpha=0.5, cos_weight=1.0)
  check_tpu_module(lowered_train_step(general, pretraining.example_batch(ROWS, SEQ), mesh_name,
                                      frozen_task=mlm_teacher), mesh_name)


@pytest.fixture
def backend(monkeypatch):
  """`backend(name)`: the kernels' switches see `jax.default_backend() == name` until the test ends (they decide
  when a step is traced, so a step lowered meanwhile is the one that backend would run)."""
  def set_backend(name: str) -> None:
    monkeypatch.setattr(jax, "default_backend", lambda: name)
    attention_kernels._backend.cache_clear()

  yield set_backend
  monkeypatch.undo()
  attention_kernels._backend.cache_clear()


@pytest.mark.slow
def test_auto_kernels_take_the_plain_path_on_tpu_by_construction(backend):
  """Every GPU kernel's "auto" switch asks for a GPU backend, so on TPU the step runs the plain path; attention
  with dropout (pre-training's default) too, splash having no dropout. The same step on a GPU backend lowers its
  Triton kernels, which the check finds: a switch that let them through on TPU would fail the tests above."""
  from bert_jax.kernels import cross_entropy, ffn, ops

  backend("tpu")
  assert not ops.use_kernel("auto") and not cross_entropy.use_kernel() and not ffn._hopper(jnp.bfloat16)  # noqa: SLF001
  pick = lambda **kw: attention_kernels.resolve_implementation(  # noqa: E731
      "auto", dtype=jnp.bfloat16, head_dim=64, return_probs=False, **kw)
  assert pick(length=128, dropout_active=True, training=True) == "xla"
  objective = pretraining_objective("mlm+nsp", "bfloat16")
  batch = objective.example_batch(ROWS, SEQ)
  check_tpu_module(lowered_train_step(objective, batch, "2x2x2"), "2x2x2")

  # The state's shapes come from a forward pass, which on GPU would trace cuDNN (that needs its library here).
  leaked = gpu_only_ops(lowered_train_step(objective, batch, "2x2x2", platform="cuda",
                                           before_step=lambda: backend("gpu")).as_text())
  assert any("triton" in op for op in leaked), leaked[:5]


def test_auto_picks_splash_attention_on_tpu_where_attention_dropout_is_off(backend):
  """Evaluation (no dropout) and an ALBERT-like training step (attention dropout 0) at 128 tokens: splash's
  forward Mosaic TPU kernel (one function every layer calls), and in training its backward kernels (dq, dk/dv)
  beside it; no GPU op. Lengths off splash's 128-token blocks, returned probabilities and dropout keep the plain
  path."""
  backend("tpu")
  pick = lambda **kw: attention_kernels.resolve_implementation(  # noqa: E731
      "auto", dtype=jnp.bfloat16, head_dim=64, dropout_active=False, **kw)
  assert pick(length=128, return_probs=False) == "splash"
  assert pick(length=SEQ, return_probs=False) == "xla" and pick(length=128, return_probs=True) == "xla"
  heads_of_64 = dict(hidden_size=128, intermediate_size=512)
  objective = pretraining_objective("mlm+nsp", "bfloat16", **heads_of_64)
  batch = objective.example_batch(ROWS, 128)
  check_tpu_module(lowered_train_step(objective, batch, "2x2x2", evaluation=True), "2x2x2", mosaic_kernels=1)
  albert_like = pretraining_objective("mlm+sop", "bfloat16", attention_dropout=0.0, **heads_of_64)
  check_tpu_module(lowered_train_step(albert_like, batch, "fsdp8"), "fsdp8", mosaic_kernels=3)


@pytest.mark.parametrize("packed, causal", [pytest.param(False, False, id="padding"),
                                            pytest.param(True, True, id="packed-causal", marks=pytest.mark.slow)])
def test_splash_attention_equals_the_plain_path(packed, causal):
  """Splash in Pallas' interpreter against the plain path, forward and gradients: padding rows zero, packed
  examples apart, causal order kept."""
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 128, 2, 64)), jnp.float32) for _ in range(3))
  pack_ids = np.zeros((2, 128), np.int32)
  pack_ids[0, :100] = 1
  pack_ids[1, :40], pack_ids[1, 40:90] = 1, 2 if packed else 1

  def run(implementation):
    def loss(q, k, v):
      out, _ = attention_kernels.dot_product_attention(q, k, v, pack_ids=jnp.asarray(pack_ids), packed=packed,
                                                       causal=causal, implementation=implementation)
      return jnp.sum(out * jnp.arange(64)), out
    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

  (_, splash_out), splash_grads = run("splash")
  (_, plain_out), plain_grads = run("xla")
  np.testing.assert_allclose(splash_out, plain_out, atol=1e-5)
  assert not np.asarray(splash_out)[pack_ids == 0].any()
  for splash_grad, plain_grad in zip(splash_grads, plain_grads):
    np.testing.assert_allclose(splash_grad, plain_grad, atol=1e-4)
