"""What the benchmark scripts share: fast BLAS before MLX, the model and prompts, the cache
arms, timing, and the result files. Each script keeps only what it measures.

Import it before anything that imports MLX (``import common`` from a script in this
folder): it loads fast BLAS (:func:`qfilters_mlx.blas.enable_fast_blas`). The benchmarks
measure the installed package (``pip install .``: the compiled ``cpp`` back end lives there);
:func:`code_version` records whether the checkout's sources differ from the last commit.

* Model: SmolLM2-135M-Instruct, float32 (:func:`load_model`); prompts are exactly ``N``
  tokens of CPython's reference documentation from token :data:`PROMPT_START` on
  (:func:`prompts`), disjoint from the 2,048 perplexity-evaluation tokens.
* Arms (:func:`make_caches`): ``full`` (mlx-lm ``KVCache``), ``rotating``
  (``RotatingKVCache(max_size=budget, keep=4)``), ``qfilters-<backend>`` and
  ``qfilters-<backend>-queries`` (``QFiltersKVCache``: n_sink 4, recent budget/2,
  key-SVD filter from the first 128 keys with sign -1, or the paper's filter from the
  first 128 post-RoPE queries), ``velox-qfilters`` (the published ``veloxquant-mlx``
  package's Q-Filters cache with the same settings; it stores K/V in float16).
* Timing: :func:`time_call` (warm up, then repeated ``mx.eval``-timed calls, as mlx's
  ``benchmarks/python/time_utils.py``) and :func:`cache_step_times` (one decode step's
  cache calls without the model).
* Results: :func:`run_meta` (machine, versions, code measured, load), :func:`write_results`
  (``<name>.json`` and ``<name>.md``), :func:`md_table`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
import warnings
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

from qfilters_mlx.blas import enable_fast_blas  # noqa: E402

BLAS = enable_fast_blas()

import mlx.core as mx  # noqa: E402

PROMPT_START = 16384  # token offset of every prompt in the joined text
PREFILL_STEP = 2048  # mlx-lm's default prefill_step_size
N_SINK, CALIB, SIGN = 4, 128, -1
ARMS = ("full", "rotating", "qfilters-reference", "qfilters-cpp", "qfilters-cpp-queries",
        "velox-qfilters")
VELOX = "velox-qfilters"


def int_list(text: str) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]`` (argparse ``type``)."""
    return [int(x) for x in text.split(",")]


# ------------------------------------------------------------------ model and prompts
def load_model(name: str | None = None):
    """``(model, tokenizer)`` of a registered model, float32 (converted on first use; default
    SmolLM2-135M-Instruct, :mod:`qfilters_mlx.assets.models`)."""
    import mlx_lm

    from qfilters_mlx.assets.prepare_model import prepare_model

    return mlx_lm.load(str(prepare_model(name)))


def add_model_arg(parser) -> None:
    """``--model NAME``: a registered model (default ``smollm2-135m``)."""
    from qfilters_mlx.assets.models import DEFAULT_MODEL, model_names

    parser.add_argument("--model", choices=model_names(), default=DEFAULT_MODEL,
                        help=f"the model (default {DEFAULT_MODEL}); give another --out")


def model_of(results: dict, name: str, out) -> str:
    """Record ``name`` in a resumable results dict (a file of earlier runs without one is the
    default model's) and return the model's title; another model's file is refused
    (``SystemExit``)."""
    from qfilters_mlx.assets.models import DEFAULT_MODEL, get_model

    if results.setdefault("model", DEFAULT_MODEL if results.get("commands") else name) != name:
        raise SystemExit(f"{out} holds results of {results['model']}, not {name}; use another --out")
    return get_model(name).title


PROMPT_SOURCE = f"pydoc_data topics, tokens [{PROMPT_START}, {PROMPT_START}+N)"


def prompts(tokenizer, lengths) -> dict[int, mx.array]:
    """``{N: N token ids}`` from token :data:`PROMPT_START` of the joined reference text.

    Raises:
        ValueError: the text is shorter than ``PROMPT_START + max(lengths)`` tokens.
    """
    from qfilters_mlx.assets.prompts import source_text

    ids = tokenizer.encode(source_text(), add_special_tokens=False)
    if PROMPT_START + max(lengths) > len(ids):
        raise ValueError(f"text has {len(ids)} tokens, fewer than {PROMPT_START} + {max(lengths)}")
    return {n: mx.array(ids[PROMPT_START:PROMPT_START + n]) for n in lengths}


# ------------------------------------------------------------------------------- arms
def available(arms) -> tuple[list[str], str | None]:
    """``arms`` without ``velox-qfilters`` when ``veloxquant-mlx`` is not installed, and a note
    on the velox version (``None`` when it was not asked for)."""
    arms = list(arms)
    if VELOX not in arms:
        return arms, None
    try:
        import veloxquant_mlx
    except ImportError as e:
        return [a for a in arms if a != VELOX], f"not run: {e}"
    return arms, f"veloxquant-mlx {getattr(veloxquant_mlx, '__version__', '?')}"


def qf_config(budget: int, source: str = "keys", head_dim: int | None = None):
    """The benchmarks' Q-Filters setting: n_sink 4, recent budget/2, 128 calibration tokens,
    sign -1 for the key-SVD filter (+1 for the query filter). The kernel backend is a build
    option: the keyword ``backend=`` where the caches are built."""
    from qfilters_mlx import KVCacheConfig

    return KVCacheConfig(
        method="qfilters", qfilters_budget=budget, qfilters_n_sink=N_SINK,
        qfilters_recent=budget // 2, qfilters_calib_tokens=CALIB,
        qfilters_sign=SIGN if source == "keys" else 1,
        qfilters_filter_source=source, head_dim=head_dim,
    )


def _velox_caches(budget: int, model, n_layers: int, head_dim: int | None) -> list:
    from veloxquant_mlx.cache.base import KVCacheBuilder as VBuilder
    from veloxquant_mlx.cache.base import KVCacheConfig as VConfig
    from veloxquant_mlx.cache.qfilters_cache import QFiltersKVCache as VCache

    cfg = VConfig(method="qfilters", qfilters_budget=budget, qfilters_n_sink=N_SINK,
                  qfilters_recent=budget // 2, qfilters_calib_tokens=CALIB, qfilters_sign=SIGN,
                  qfilters_on_low_retention="ignore", **({} if head_dim is None else {"head_dim": head_dim}))
    if model is None:
        return [VCache(cfg) for _ in range(n_layers)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return VBuilder.for_model(model, cfg)


def make_caches(arm: str, budget: int, *, model=None, n_layers: int | None = None,
                head_dim: int | None = None) -> tuple[list, contextlib.AbstractContextManager]:
    """Fresh per-layer caches for ``arm`` and the context to run the model in.

    With ``model`` the caches are built for it (``KVCacheBuilder.for_model``); without,
    ``n_layers`` caches of keys ``head_dim`` wide (cache-only benchmarks).

    Raises:
        ValueError: unknown arm, or a ``-queries`` arm without a model (it observes queries).
    """
    n = len(model.layers) if model is not None else n_layers
    if arm == "full":
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in range(n)], contextlib.nullcontext()
    if arm == "rotating":
        from mlx_lm.models.cache import RotatingKVCache

        return [RotatingKVCache(max_size=budget, keep=N_SINK) for _ in range(n)], contextlib.nullcontext()
    if arm.startswith("qfilters-"):
        from qfilters_mlx import KVCacheBuilder, QFiltersKVCache, observe_queries

        backend, _, source = arm[len("qfilters-"):].partition("-")
        source = source or "keys"
        cfg = qf_config(budget, source, head_dim)
        if model is None:
            if source != "keys":
                raise ValueError(f"arm {arm!r} observes the model's queries: it needs a model")
            return [QFiltersKVCache(cfg, layer_idx=i, backend=backend) for i in range(n)], contextlib.nullcontext()
        caches = KVCacheBuilder.for_model(model, cfg, backend=backend)
        ctx = observe_queries(model, caches) if source == "queries" else contextlib.nullcontext()
        return caches, ctx
    if arm == VELOX:
        return _velox_caches(budget, model, n, head_dim), contextlib.nullcontext()
    raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")


# ----------------------------------------------------------------------------- timing
def time_call(fn: Callable[[], object], min_time: float = 0.25, min_iters: int = 5,
              max_iters: int = 200, warmup: int = 3) -> dict[str, float]:
    """Warm up, then time ``mx.eval(fn())`` repeatedly; seconds per call (min and median)."""
    for _ in range(warmup):
        mx.eval(fn())
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or (time.perf_counter() - start < min_time and len(times) < max_iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return {"min_s": min(times), "median_s": statistics.median(times), "iters": len(times)}


def cache_step_times(caches: list, steps: int, warmup: int, n_kv_heads: int, head_dim: int, *,
                     seed: int = 0, dtype=mx.float32, query: mx.array | None = None) -> list[float]:
    """Seconds per decode step of the caches alone, for ``steps`` steps after ``warmup``.

    One step is what mlx-lm asks of the caches per generated token, without the model:
    ``caches[0].make_mask(1)`` (built once from the first layer, shared), then
    ``update_and_fetch`` of one new row ``[1, n_kv_heads, 1, head_dim]`` on every layer,
    then one ``mx.eval`` of every returned ``(keys, values)`` and the mask (as in
    ``generate_step``: state a cache keeps lazily is paid for in the step that needs it).
    With ``query [1, H_q, 1, head_dim]`` each layer's step is followed by
    ``mx.fast.scaled_dot_product_attention`` of that query over the returned keys/values.
    The new rows (seeded) are created and evaluated before the timer starts.
    """
    shape = (steps + warmup, len(caches), 2, 1, n_kv_heads, 1, head_dim)
    kv = mx.random.normal(shape, dtype=dtype, key=mx.random.key(seed))
    mx.eval(kv)
    times = []
    for s in range(steps + warmup):
        new = [(kv[s, i, 0], kv[s, i, 1]) for i in range(len(caches))]
        mx.eval(new)
        mx.synchronize()
        t0 = time.perf_counter()
        mask = caches[0].make_mask(1, return_array=False, window_size=None)
        outs = [c.update_and_fetch(k, v) for c, (k, v) in zip(caches, new)]
        if query is not None:
            outs = [mx.fast.scaled_dot_product_attention(query, k, v, scale=head_dim ** -0.5, mask=mask)
                    for k, v in outs]
        mx.eval(outs, mask if isinstance(mask, mx.array) else [])
        mx.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------- results
def code_version() -> dict:
    """git HEAD and a hash of the package sources as run (the tree may be uncommitted)."""
    h = hashlib.sha1()
    for f in sorted((ROOT / "python" / "qfilters_mlx").rglob("*.py")) + sorted((ROOT / "csrc").glob("*.*")):
        h.update(f.read_bytes())
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "python", "csrc"],
                                    capture_output=True, text=True, check=False).stdout.strip())
    except OSError:
        head, dirty = "?", None
    return {"git_head": head, "package_dirty": dirty, "package_sources_sha1": h.hexdigest()[:12]}


def machine() -> str:
    return f"{platform.machine()} {os.cpu_count()} cpus"


def run_meta(**extra) -> dict:
    """Machine, mlx / mlx-lm versions, BLAS, the code measured and the load average at start."""
    import mlx_lm

    return {"machine": machine(), "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "blas": BLAS,
            "code": code_version(), "loadavg_start": os.getloadavg(), **extra}


def write_results(path: Path, data: dict, markdown: str | None = None) -> list[Path]:
    """``path`` (JSON, indent 1) and, given ``markdown``, the same name with ``.md``; returns them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    out = [path]
    if markdown is not None:
        out.append(path.with_suffix(".md"))
        out[-1].write_text(markdown)
    return out


def md_table(header: list[str], rows: list[list], align: str | None = None) -> list[str]:
    """Markdown table lines; ``align`` one character per column (``l`` left, ``r`` right)."""
    align = align or "l" * len(header)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return ["| " + " | ".join(header) + " |", sep] + ["| " + " | ".join(map(str, r)) + " |" for r in rows]
