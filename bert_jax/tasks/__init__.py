"""Fine-tuning tasks (GLUE, SQuAD, SWAG, CoNLL-2003): data, features and official metrics."""

from bert_jax.tasks.base import HFTokenizerAdapter, Task, TaskTokenizer
from bert_jax.tasks.registry import TASK_NAMES, get_task

__all__ = ["HFTokenizerAdapter", "Task", "TaskTokenizer", "TASK_NAMES", "get_task"]
