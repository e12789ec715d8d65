"""Experiments: ablation-table sweeps (pre-train, fine-tune, score), their downstream suites and rendering."""
