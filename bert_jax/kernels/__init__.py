"""Hand-written GPU kernels and custom-gradient ops: the optional fast paths behind the model's seams.

The model (`bert_jax.models.model`) loads `layers` only where `ModelConfig.kernels` is "auto", by name through
`bert_jax.models.fast_path` (this package imports the model's shared functions, never the encoder), with
one seam per operation (attention, LayerNorm and the post-LN residual, the feed-forward block, the embedding
lookup, dense layers, dropout), and the MLM loss calls `cross_entropy.cross_entropy_sums`. Each kernel decides
where it applies (GPU, dtype, shapes) and falls back to its own XLA form elsewhere; every fast path is tested
against the plain model (`kernels="off"`).
"""
