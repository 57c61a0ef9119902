"""Model-level evaluation (``qfilters-mlx eval``): ``arms`` (the methods, as data),
``multi_arm`` (many arms in one batch), ``perplexity``, ``retrieval``, ``score_quality``,
``run`` (the resumable protocol) and ``report`` (tables and plots)."""
