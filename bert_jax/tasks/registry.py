"""Task lookup by name: `get_task("glue/mrpc")`, `get_task("squad/v2.0", doc_stride=64)`."""

from __future__ import annotations

import functools
from typing import Any, Callable

from bert_jax.tasks.base import Task
from bert_jax.tasks.glue import SPECS, GlueTask
from bert_jax.tasks.ner import Conll2003Task
from bert_jax.tasks.squad import SquadTask
from bert_jax.tasks.swag import SwagTask

_FACTORIES: dict[str, Callable[..., Task]] = {
    **{f"glue/{name}": functools.partial(GlueTask, spec) for name, spec in SPECS.items()},
    "squad/v1.1": lambda **options: SquadTask(version="1.1", **options),
    "squad/v2.0": lambda **options: SquadTask(version="2.0", **options),
    "swag": SwagTask,
    "conll2003": Conll2003Task,
    "conll2003_chunk": lambda **options: Conll2003Task(column="chunk", **options),
}
TASK_NAMES = tuple(_FACTORIES)
# GLUE's folder names (SST-2, STS-B) are what people type as often as TFDS's.
_ALIASES = {f"glue/{spec.directory.lower()}": f"glue/{name}" for name, spec in SPECS.items()}


def get_task(name: str, **options: Any) -> Task:
  """Builds the task called `name` (case-insensitive), passing `options` to it.

  Args:
    name: one of `TASK_NAMES` ("glue/cola" ... "glue/wnli", "squad/v1.1",
      "squad/v2.0", "swag", "conll2003", "conll2003_chunk"); GLUE folder names such as
      "glue/SST-2" also work.
    **options: task settings, e.g. doc_stride for SQuAD, document_context
      for CoNLL-2003.

  Raises:
    ValueError: for an unknown name, listing the valid ones.
  """
  key = name.lower()
  key = _ALIASES.get(key, key)
  if key not in _FACTORIES:
    raise ValueError(f"unknown task {name!r}; valid names: {', '.join(TASK_NAMES)}")
  return _FACTORIES[key](**options)
