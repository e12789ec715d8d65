"""Benchmarks that print one table, each run from the repository's root as `python -m bench.NAME` (its docstring
has the calls). Experiment drivers are `bert-jax` commands (`bert_jax/experiments/`), not here."""
