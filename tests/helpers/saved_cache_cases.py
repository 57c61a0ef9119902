"""Saved prompt-cache files of a tiny seeded model, and what each continues with.

Each case builds the eviction caches of :func:`tiny_model` with ``KVCacheBuilder.for_model``,
feeds a seeded prompt (``prompt`` chunks, then single tokens) so that the caches reach a given
state, saves them with mlx-lm's ``save_prompt_cache``, then runs a fixed continuation
(``continuation``: more tokens fed, chunks and single steps, and rewinds) and records, per step,
the model's logits and, at the end, every layer's kept positions and offset.

The committed files under ``tests/fixtures/saved_caches/format1/`` were written by the 0.2.0 code
(commit 9bc1663, the flat saved layout, "format 1"), installed in ``.venv`` by ``.ci/setup``,
from the repository root with::

    .venv/bin/python -m tests.helpers.saved_cache_cases tests/fixtures/saved_caches/format1

``<case>.safetensors`` is the saved cache, ``<case>.npz`` the continuation measured with that
code from the caches as they were before saving (``logits`` ``[steps, vocab]`` float32 of the
last position of each call; ``kept_<layer>`` int64 ``[B, H_kv, kept]``; ``offsets``).
tests/cache/test_saved_format.py loads each file with the current code and checks that it
continues exactly so.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from qfilters_mlx.blas import enable_fast_blas

enable_fast_blas()  # (before MLX is imported; the tests' conftest does the same)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import save_prompt_cache  # noqa: E402

from qfilters_mlx import CompressOnce, KVCacheBuilder, KVCacheConfig  # noqa: E402

try:  # (as tests/helpers, or as the package `tests.helpers` when run as a script)
    from helpers.batch_helpers import tiny_llama  # noqa: E402
except ImportError:
    from tests.helpers.batch_helpers import tiny_llama  # noqa: E402

VOCAB = 64
FORMAT1 = Path(__file__).resolve().parents[1] / "fixtures" / "saved_caches" / "format1"


def tiny_model(seed: int = 0):
    """A 2-layer float32 llama with random weights (head_dim 32: quantizable with group size
    32; 2 KV heads), scaled by 3 so that its logits vary."""
    return tiny_llama(seed, vocab_size=VOCAB, head_dim=32, intermediate_size=96)


@dataclass(frozen=True)
class Case:
    """One saved cache: how it is built, fed before saving, and continued after loading.

    ``prompt``: sizes of the calls before saving (a size > 1 is one multi-token call);
    ``continuation``: ``("feed", size)`` or ``("trim", tokens)`` after saving.
    """

    name: str
    config: dict
    build: dict = field(default_factory=dict)
    prompt: tuple = (16, 16, 8, 1, 1, 1)
    continuation: tuple = (("feed", 1), ("feed", 1), ("feed", 3), ("feed", 1), ("feed", 1))


_STREAM = dict(method="qfilters", qfilters_budget=16, qfilters_n_sink=2, qfilters_recent=4,
               qfilters_calib_tokens=8, qfilters_filter_source="keys")

CASES = (
    # streaming Q-Filters after eviction, saved in slot mode (mid-decode)
    Case("streaming", _STREAM, dict(backend="reference", max_rewind=0)),
    # compress-once: compressed at the prompt's end (the first single-token call), then grown
    Case("compress_once", dict(_STREAM, qfilters_recent=None, mode=CompressOnce(ratio=0.5, growth=3)),
         dict(backend="reference", max_rewind=0)),
    # quantized K/V storage (kv_bits), after eviction
    Case("quantized", dict(_STREAM, method="l2norm"),
         dict(backend="reference", max_rewind=0, kv_bits=4, kv_group_size=32)),
    # a rewindable cache (max_rewind 4: the journal is not saved, the depth is)
    Case("rewindable", _STREAM, dict(backend="reference", max_rewind=4),
         continuation=(("feed", 1), ("feed", 1), ("feed", 1), ("trim", 2), ("feed", 2), ("feed", 1))),
)


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def build(case: Case, model):
    """The case's fresh caches (one per layer)."""
    return list(KVCacheBuilder.for_model(model, KVCacheConfig(**case.config), **case.build))


def feed(model, caches, ids: list[int]) -> np.ndarray:
    """One call of ``ids``; the logits of its last position ``[vocab]`` float32."""
    out = model(mx.array([ids], dtype=mx.int32), cache=caches)
    return np.array(out[0, -1].astype(mx.float32))


def run_prompt(case: Case, model, caches) -> None:
    ids = tokens(sum(case.prompt), seed=1)
    at = 0
    for size in case.prompt:
        feed(model, caches, ids[at:at + size])
        at += size


def run_continuation(case: Case, model, caches) -> dict:
    """What the caches give for ``case.continuation``: ``{"logits", "offsets", "kept_<i>"}``."""
    ids = tokens(sum(n for op, n in case.continuation if op == "feed"), seed=2)
    at, logits = 0, []
    for op, n in case.continuation:
        if op == "trim":
            assert all(c.trim(n) == n for c in caches)
            continue
        logits.append(feed(model, caches, ids[at:at + n]))
        at += n
    out = {"logits": np.stack(logits), "offsets": np.array([c.offset for c in caches])}
    for i, c in enumerate(caches):
        out[f"kept_{i}"] = np.array(c.kept_positions())
    return out


def write(folder: Path) -> None:
    """Every case's saved file and recorded continuation, into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    model = tiny_model()
    for case in CASES:
        caches = build(case, model)
        run_prompt(case, model, caches)
        save_prompt_cache(str(folder / f"{case.name}.safetensors"), caches,
                          metadata={"case": case.name})
        np.savez(folder / f"{case.name}.npz", **run_continuation(case, model, caches))


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else FORMAT1)
