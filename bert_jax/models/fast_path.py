"""The registry through which fast paths attach to the plain model.

`ModelConfig.kernels` names a provider: a module with the fast forms of the encoder's operations (`dense`,
`layer_norm`, `residual_layer_norm`, `activation`, `bias_add`, `Dropout`, `embedding_lookup`, `self_attention`,
`feed_forward`; `bert_jax.kernels.layers` is the reference). The model imports a provider only when a config
names it, by name here, so `bert_jax.models` holds no import of `bert_jax.kernels` and "off" never loads it.
"""

from __future__ import annotations

import importlib
import types

# kernels setting -> module providing the fast layers ("off": the plain Flax forms in `model.py`).
PROVIDERS: dict[str, str] = {"auto": "bert_jax.kernels.layers"}


def register(kernels: str, module: str) -> None:
  """Makes `ModelConfig.kernels=kernels` use the fast layers of `module` (an importable name)."""
  PROVIDERS[kernels] = module


def layers(kernels: str) -> types.ModuleType | None:
  """The provider module registered for `kernels`, or None for the plain path."""
  name = PROVIDERS.get(kernels)
  return importlib.import_module(name) if name else None
