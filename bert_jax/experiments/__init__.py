"""Experiments built on the commands: sweeps over a config and their tables."""
