"""Model-level evaluation (``qfilters-mlx eval``): arms, perplexity, retrieval, reports."""
