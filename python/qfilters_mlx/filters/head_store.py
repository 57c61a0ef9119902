"""A model's retrieval-head ranking, found or measured once, stored beside its filter.

:func:`resolve_head_ranking` looks for :func:`heads_path` (``<model id>.heads.safetensors`` in
the filters folder of the user cache, :func:`qfilters_mlx.filters.default_filters.filters_home`,
beside the model's ``<model id>.safetensors`` filter; the id is
:func:`qfilters_mlx.identity.model_identity`). A file there, or one given by path, is checked
against the model (its identity fields and shape) and refused, naming the differing fields, when
it was measured on another model. Without a file the ranking is measured now
(:func:`qfilters_mlx.filters.head_ranking.rank_heads`: 12 full-cache passes over calibration
needles), stored, and one line on stderr says what was measured and where it was stored.

File: safetensors with one tensor ``ranking`` ``[n_layers, n_kv_heads]`` float32 and string
metadata ``format`` (:data:`FORMAT`), ``model_id``, ``model_fields`` (JSON of the identity
fields), ``n_layers``, ``n_kv_heads``, ``measure``, ``calibration_text``, ``prompts``,
``recalled``, ``seconds`` and ``qfilters_mlx_version``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "MEASURE", "ResolvedRanking", "heads_path", "load_ranking", "measure_and_store",
           "resolve_head_ranking", "save_ranking"]

FORMAT = "qfilters-mlx-heads-1"
MEASURE = "needle attention of the answer's key tokens (qfilters_mlx.filters.head_ranking)"


@dataclass(frozen=True)
class ResolvedRanking:
    """What :func:`resolve_head_ranking` found: ``ranking`` ``[n_layers, n_kv_heads]`` float32
    numpy, and ``origin``, one line naming the file and how it was had."""

    ranking: np.ndarray
    origin: str


def heads_path(model_id: str) -> Path:
    """``filters_home() / "<model_id>.heads.safetensors"``: the user-cache file of a model."""
    from qfilters_mlx.filters.default_filters import filters_home

    return filters_home() / f"{model_id}.heads.safetensors"


def _dims(model) -> tuple[int, int]:
    from qfilters_mlx.model_info import filters_dims

    n_layers, n_kv, _ = filters_dims(model)
    return n_layers, n_kv


def save_ranking(path: str, ranking, model, **info) -> None:
    """Write ``ranking`` ``[n_layers, n_kv_heads]`` for ``model`` with the module's metadata
    (``info`` adds string metadata; on a tensor-parallel model rank 0 writes).

    Raises:
        ValueError: ``ranking``'s shape is not the model's ``(n_layers, n_kv_heads)``.
    """
    import mlx.core as mx

    from qfilters_mlx import __version__
    from qfilters_mlx.identity import identity_fields, identity_of_fields
    from qfilters_mlx.sharding import rank_of

    r = np.asarray(ranking, dtype=np.float32)
    if r.shape != _dims(model):
        raise ValueError(f"head ranking of shape {r.shape}, the model has {_dims(model)} (n_layers, n_kv_heads)")
    fields = identity_fields(model)
    meta = {"format": FORMAT, "model_id": identity_of_fields(fields),
            "model_fields": json.dumps(fields, sort_keys=True), "n_layers": str(r.shape[0]),
            "n_kv_heads": str(r.shape[1]), "measure": MEASURE, "qfilters_mlx_version": __version__}
    meta.update({k: str(v) for k, v in info.items()})
    if rank_of(model)[0] == 0:
        mx.save_safetensors(str(path), {"ranking": mx.array(r)}, meta)


def load_ranking(path: str, model=None) -> tuple[np.ndarray, dict]:
    """Read a head-ranking file; with ``model``, check its identity and shape.

    Returns:
        ``(ranking [n_layers, n_kv_heads] float32, metadata)``.

    Raises:
        ValueError: not a head-ranking file; (with ``model``) a file of another model (the
            message names the differing identity fields) or of another shape.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            ranking = f.get_tensor("ranking") if "ranking" in f.keys() else None
    except Exception as err:  # (safetensors raises its own error types on a bad header)
        raise ValueError(f"{path} is not a qfilters-mlx head-ranking file ({type(err).__name__}: {err})") from err
    if meta.get("format") != FORMAT or ranking is None:
        raise ValueError(f"{path} is not a qfilters-mlx head-ranking file (format {meta.get('format')!r})")
    if model is not None:
        from qfilters_mlx.identity import identity_mismatch

        try:
            stored = json.loads(meta["model_fields"])
        except (KeyError, ValueError) as err:
            raise ValueError(f"{path}: unreadable model_fields metadata ({err!r})") from err
        diff = identity_mismatch(stored, model)
        if diff:
            raise ValueError(f"{path} was measured on another model (model_id {meta.get('model_id')}); "
                             f"differing fields: {'; '.join(diff)}")
        if ranking.shape != _dims(model):
            raise ValueError(f"{path}: ranking of shape {ranking.shape}, the model has {_dims(model)}")
    return ranking.astype(np.float32), meta


def _describe(path, meta: dict, how: str) -> str:
    return (f"retrieval-head ranking {path} ({how}; {meta.get('prompts', '?')} calibration needles, "
            f"{meta.get('recalled', '?')} answered by the full cache, from {meta.get('calibration_text', '?')})")


def measure_and_store(model, tokenizer, path: Path):
    """Measure the retrieval-head ranking of ``model`` (:func:`~.head_ranking.rank_heads`) and
    write it to ``path`` atomically with its metadata.

    Returns:
        ``(result, info, error)``: ``rank_heads``'s result, the metadata written, and the error
        text when the file could not be written (``None`` when it was).
    """
    from qfilters_mlx.filters.default_filters import store_atomically
    from qfilters_mlx.filters.head_ranking import rank_heads

    found = rank_heads(model, tokenizer)
    info = {"calibration_text": found.source, "prompts": found.prompts, "recalled": found.recalled,
            "seconds": f"{found.seconds:.1f}"}
    return found, info, store_atomically(path, lambda tmp: save_ranking(tmp, found.ranking, model, **info))


def resolve_head_ranking(model, tokenizer=None, model_path=None, path=None) -> ResolvedRanking:
    """The retrieval-head ranking of ``model``: the file ``path`` if given, else the stored file
    of the model's identity (:func:`heads_path`), else measured now and stored there.

    Args:
        model: an mlx-lm model.
        tokenizer: its tokenizer (mlx-lm's ``TokenizerWrapper`` or a Hugging Face tokenizer),
            needed only to measure.
        model_path: the folder the model was loaded from (its tokenizer is loaded when
            ``tokenizer`` is ``None`` and a measurement is needed).
        path: a head-ranking file to use instead of the stored one.

    Returns:
        :class:`ResolvedRanking`.

    Raises:
        ValueError: the file (given or found) was measured on another model or is no
            head-ranking file (a found file is not silently replaced); a measurement is needed but
            there is no tokenizer, the model is tensor-parallel (measure on the whole model), or a
            layer attends with its own mask.
    """
    from qfilters_mlx.filters.default_filters import model_tokenizer, say
    from qfilters_mlx.identity import model_identity

    if path is not None:
        ranking, meta = load_ranking(path, model)
        return ResolvedRanking(ranking, _describe(path, meta, "given"))
    stored = heads_path(model_identity(model))
    if stored.is_file():
        ranking, meta = load_ranking(stored, model)
        return ResolvedRanking(ranking, _describe(stored, meta, "found by model identity"))
    from qfilters_mlx.sharding import tensor_group

    if tensor_group(model) is not None:
        raise ValueError(f"no retrieval-head ranking at {stored}, and it cannot be measured on a "
                         "tensor-parallel model: measure it once on the whole model (same file)")
    tokenizer = model_tokenizer(tokenizer, model_path)
    if tokenizer is None:
        raise ValueError(f"no retrieval-head ranking at {stored}, and measuring one needs the model's "
                         "tokenizer (pass tokenizer= or model_path=)")
    found, info, error = measure_and_store(model, tokenizer, stored)
    where = f"stored in {stored}" if error is None else f"not stored ({error}): measured again next time"
    L, H = found.ranking.shape
    say(model, f"qfilters-mlx: measured retrieval heads ({L} layers x {H} KV heads) on {found.prompts} "
                f"calibration needles ({found.recalled} answered by the full cache) in "
                f"{found.seconds:.1f} s; {where}")
    how = f"measured now in {found.seconds:.1f} s" + ("" if error is None else ", not stored")
    return ResolvedRanking(found.ranking.astype(np.float32),
                           _describe(stored if error is None else "(in memory)", info, how))
