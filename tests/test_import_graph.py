"""The package's import graph: no circles, and the arrows its layers allow.

Every import counts, at module level or inside a function (a lazy import is still a dependency). The rules:
- no circle between modules;
- `bert_jax.models` never imports `bert_jax.kernels`: fast paths attach through `models/fast_path.py`'s registry
  (by module name), so the plain model loads no kernel code;
- `bert_jax.models` never imports the training, task, analysis or experiment code, and `bert_jax.train` never
  imports `bert_jax.tasks`, `bert_jax.analysis` or `bert_jax.experiments` (each knows nothing of its users);
- nothing in the package imports `bench` (benchmarks use the package, never the other way).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "bert_jax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
  """module -> the package modules (and top-level names outside it, e.g. "bench") it imports."""
  modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
  graph = {}
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        targets.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parent = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(parent + ([base] if base else []))
        for alias in node.names:  # `from pkg import module` imports the module, `from module import name` its module.
          targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    graph[name] = {t if t in modules or t.split(".")[0] != "bert_jax" else _owner(t, modules) for t in targets} - {name}
  return graph


def _owner(target: str, modules) -> str:
  while target and target not in modules:
    target = target.rpartition(".")[0]
  return target


def _internal(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  return {m: {t for t in targets if t in graph} for m, targets in graph.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in graph[node]:
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        component.append(member)
        if member == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


@pytest.fixture(scope="module")
def graph():
  return import_graph()


def _arrows(graph, source: str, target: str) -> list[str]:
  return sorted(f"{m} -> {t}" for m, targets in graph.items() if m == source or m.startswith(source + ".")
                for t in targets if t == target or t.startswith(target + "."))


def test_no_module_circles(graph):
  assert _cycles(_internal(graph)) == []


def test_the_cycle_finder_finds_a_circle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_models_reach_kernels_only_through_the_registry(graph):
  from bert_jax.models import fast_path

  assert _arrows(graph, "bert_jax.models", "bert_jax.kernels") == []
  assert set(fast_path.PROVIDERS.values()) <= set(graph)  # The registry's names are modules that exist.


@pytest.mark.parametrize("layer", ["bert_jax.tasks", "bert_jax.analysis", "bert_jax.experiments"])
def test_pre_training_does_not_import_what_uses_it(graph, layer):
  assert _arrows(graph, "bert_jax.train", layer) == []


@pytest.mark.parametrize("layer", ["bert_jax.train", "bert_jax.tasks", "bert_jax.analysis", "bert_jax.experiments"])
def test_the_models_import_none_of_their_users(graph, layer):
  assert _arrows(graph, "bert_jax.models", layer) == []


def test_the_package_never_imports_bench(graph):
  assert _arrows(graph, "bert_jax", "bench") == []


def test_the_plain_model_loads_no_kernel_code():
  """`kernels="off"`: a model built and run end to end without `bert_jax.kernels` in the process."""
  code = ("import sys, jax, jax.numpy as jnp\n"
          "from bert_jax.models import ModelConfig, PretrainingModel\n"
          "cfg = ModelConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,"
          " max_position_embeddings=16, kernels='off')\n"
          "ids = jnp.ones((1, 8), jnp.int32)\n"
          "model = PretrainingModel(cfg)\n"
          "positions = jnp.array([[1, 2]], jnp.int32)\n"
          "params = model.init(jax.random.PRNGKey(0), ids, positions)\n"
          "assert model.apply(params, ids, positions)['mlm_logits'].shape == (1, 2, 64)\n"
          "print(sorted(m for m in sys.modules if m.startswith('bert_jax.kernels')))\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
