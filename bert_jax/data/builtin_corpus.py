"""A real English corpus that every machine has offline: Python's own documentation.

`build_builtin_corpus(path)` writes, in BERT's format (one sentence per line, a
blank line between documents):

  * every topic of `pydoc_data.topics.topics` (the language reference pages
    behind `help('if')` and friends), one document each, and
  * the docstrings of `MODULES` and of their public classes, functions and
    methods, one document per docstring with at least two sentences.

Cleaning keeps prose only: interactive (`>>>`, `...`), indented and grammar lines,
reStructuredText underlines and directives are dropped, roles such as
:func:`len` and ``literals`` become their plain text, and lines of a paragraph
are joined before `text.split_sentences` splits it. The result is a few MB,
built in seconds and byte-identical across runs on one Python version (topics
and modules in a fixed order, members sorted by name). It feeds the demo
config: train a small WordPiece vocab on it, prepare it, pretrain a tiny BERT.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re

from bert_jax import paths
from bert_jax.data import text as text_lib

MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "html.parser", "http.client",
    "http.server", "inspect", "io", "ipaddress", "itertools", "json", "logging", "mailbox", "math",
    "multiprocessing", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
    "shlex", "shutil", "smtplib", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile",
)
_MIN_SENTENCES = 2
_ROLE = re.compile(r":[\w:.-]+:`(?:[^`<]*<)?([^`>]+)>?`")  # :func:`len` / :ref:`text <target>` -> len / text
_LITERAL = re.compile(r"``([^`]+)``")
_REFERENCE = re.compile(r"`([^`]+?)(?: <[^>]+>)?`_{1,2}")
_UNDERLINE = re.compile(r"^\s*([=\-~^*+#\"'`])\1{3,}\s*$")
_DIRECTIVE = re.compile(r"^\s*\.\. ")


def _clean_paragraphs(raw: str) -> list[str]:
  """Prose paragraphs of one documentation text, markup removed."""
  paragraphs, current = [], []
  for line in raw.splitlines():
    stripped = line.strip()
    # pydoc topics indent code blocks by 3 spaces (definition-list bodies too,
    # a loss we accept); "::=" is grammar, a wide gap before "#" a comment.
    code = line.startswith("   ") or stripped.startswith((">>>", "...")) or "::=" in line or "  #" in line
    if not stripped or code or _UNDERLINE.match(line) or _DIRECTIVE.match(line):
      paragraphs.append(" ".join(current))
      current = []
      continue
    current.append(stripped[:-1] if stripped.endswith("::") else stripped)
  paragraphs.append(" ".join(current))
  # Markup is removed per paragraph: a ``literal`` may span a line break.
  return [_REFERENCE.sub(r"\1", _LITERAL.sub(r"\1", _ROLE.sub(r"\1", p))) for p in paragraphs if p]


def _document(raw: str | None) -> list[str]:
  if not raw:
    return []
  sentences = []
  for paragraph in _clean_paragraphs(raw):
    sentences.extend(s for s in text_lib.split_sentences(paragraph) if any(c.isalpha() for c in s))
  return sentences if len(sentences) >= _MIN_SENTENCES else []


def _module_docstrings(module_name: str) -> list[str | None]:
  module = importlib.import_module(module_name)
  docstrings = [inspect.getdoc(module)]
  for name in sorted(getattr(module, "__all__", None) or dir(module)):
    if name.startswith("_"):
      continue
    member = getattr(module, name, None)
    if getattr(member, "__module__", None) != module.__name__:
      continue  # re-exported from elsewhere: documented under its own module
    if inspect.isclass(member):
      docstrings.append(inspect.getdoc(member))
      for method_name, method in sorted(vars(member).items()):
        if not method_name.startswith("_") and inspect.isfunction(method):
          docstrings.append(inspect.getdoc(method))
    elif inspect.isfunction(member):
      docstrings.append(inspect.getdoc(member))
  return docstrings


def iter_builtin_documents() -> list[list[str]]:
  """The corpus as documents of sentences (topics first, then module docstrings)."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  raw_texts = [topics.topics[name] for name in sorted(topics.topics)]
  for module_name in MODULES:
    raw_texts.extend(_module_docstrings(module_name))
  documents, seen = [], set()
  for raw in raw_texts:
    document = _document(raw)
    key = "\n".join(document)
    if document and key not in seen:  # inherited docstrings repeat
      seen.add(key)
      documents.append(document)
  return documents


def build_builtin_corpus(out_path: str | pathlib.Path) -> pathlib.Path:
  """Writes the corpus to `out_path` in BERT's format and returns the path.

  The file appears whole or not at all (`paths.write_text`): callers reuse it whenever it exists.

  Raises:
    paths.StorageError: it could not be written (disk full, quota, permission).
  """
  out_path = pathlib.Path(out_path)
  body = "\n\n".join("\n".join(document) for document in iter_builtin_documents()) + "\n"
  paths.write_text(out_path, body)
  return out_path
