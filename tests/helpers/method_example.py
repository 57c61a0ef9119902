"""The method page's usage example (the seed's "Usage" section), as text: tests run it with
``exec`` so that it stays verbatim. Adapted only where it cannot run here: the package's import
name (``veloxquant_mlx`` there) and the model path (:func:`run`)."""

from __future__ import annotations

EXAMPLE = '''\
import mlx_lm
from qfilters_mlx import KVCacheConfig, KVCacheBuilder

model, tokenizer = mlx_lm.load("mlx-community/Llama-3.2-3B-Instruct-4bit")

config = KVCacheConfig(
    method="qfilters",
    head_dim=128,
    qfilters_budget=512,        # max tokens kept (incl. sinks)
    qfilters_n_sink=4,          # leading positions never evicted
    qfilters_recent=0,          # trailing protected window (extension, off)
    qfilters_calib_tokens=128,  # tokens observed before the filter freezes
    qfilters_sign=1,            # +1 = paper direction; -1 = inverted ablation
)
caches = KVCacheBuilder.for_model(model, config)
model.make_cache = lambda *_a, **_k: caches
'''


def run(model_path, head_dim: int = 128) -> dict:
    """Run :data:`EXAMPLE` with ``model_path`` in place of the page's model id (and
    ``head_dim`` in place of 128, the page's model's key width, when the model's differs);
    returns its namespace (``model``, ``tokenizer``, ``config``, ``caches``)."""
    code = EXAMPLE.replace('"mlx-community/Llama-3.2-3B-Instruct-4bit"', repr(str(model_path)))
    code = code.replace("head_dim=128,", f"head_dim={head_dim},")
    namespace: dict = {}
    exec(compile(code, "method page usage example", "exec"), namespace)  # noqa: S102
    return namespace
