"""Per-decode-step cost of the KV cache alone as the context grows (1k to 64k tokens).

Shapes of SmolLM2-135M (``--layers`` layers, H_kv 3, D 64, float32, B 1). For
every context length ``N`` and every arm, fresh per-layer caches are filled
with ``N`` tokens of seeded random keys/values in 2,048-token chunks (mlx-lm's
``prefill_step_size``; each chunk is ``make_mask`` + ``update_and_fetch`` on
every layer, then ``mx.eval`` of the caches' state), then ``--steps`` decode
steps are timed one by one. One decode step is what mlx-lm does per generated
token, minus the model: ``caches[0].make_mask(1)`` (the mask is built once
from the first layer's cache and shared), then ``update_and_fetch`` of one new
row on every layer, then one ``mx.eval`` of every returned ``(keys, values)``
(and the mask). As in ``generate_step``, nothing else is evaluated: work a cache
leaves lazy (an eviction gather consumed by the next append) is paid for in the
step that needs it, so the steady-state median counts it. The new rows are created and evaluated before the
timer starts. Reported: the median over the timed steps, and the same step
followed by ``mx.fast.scaled_dot_product_attention`` of one query (9 query
heads) over the returned keys/values ("+ sdpa", median of ``--sdpa-steps``
steps), which shows what the cache saves the model downstream.

Arms: ``qfilters-reference`` and ``qfilters-cpp`` (budget ``--budget``,
n_sink 4, recent budget/2, key-SVD filter with sign -1, calibrated on the
first 128 tokens), mlx-lm ``RotatingKVCache(max_size=budget, keep=4)``,
mlx-lm ``KVCache`` (full), and, when installed, ``veloxquant-mlx``'s
``QFiltersKVCache`` with the same settings (``--velox`` to include it; it runs
a Python loop over heads per layer, so it is slow).

Usage::

    python bench/bench_decode_step.py            # 30 layers, 1k..64k, writes results
    python bench/bench_decode_step.py --quick    # 1 layer, 1k..8k, no files written

Writes ``bench/results/decode_step.json`` and ``decode_step.png``.
"""

from __future__ import annotations

import common  # noqa: I001  (first: fast BLAS before MLX; same folder)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402

H_KV, H_Q, HEAD_DIM, DTYPE = 3, 9, 64, mx.float32
CHUNK = common.PREFILL_STEP
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
ARMS = ("full", "rotating", "qfilters-reference", "qfilters-cpp", "velox-qfilters")


def make_caches(arm: str, n_layers: int, budget: int) -> list:
    caches, _ = common.make_caches(arm, budget, n_layers=n_layers, head_dim=HEAD_DIM)
    return caches


def state_arrays(c) -> list:
    s = c.state
    return [a for a in (s if isinstance(s, (tuple, list)) else [s]) if isinstance(a, mx.array)]


def prefill(caches: list, n_tokens: int, seed: int) -> None:
    key = mx.random.key(seed)
    done = 0
    while done < n_tokens:
        L = min(CHUNK, n_tokens - done)
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((1, H_KV, L, HEAD_DIM), dtype=DTYPE, key=k1)
        v = mx.random.normal((1, H_KV, L, HEAD_DIM), dtype=DTYPE, key=k2)
        mx.eval(k, v)
        caches[0].make_mask(L, return_array=False, window_size=None)
        outs = [c.update_and_fetch(k, v) for c in caches]
        mx.eval(outs, [state_arrays(c) for c in caches])
        del outs
        done += L
    mx.clear_cache()


def time_steps(caches: list, steps: int, warmup: int, seed: int, sdpa: bool) -> list[float]:
    """Seconds per decode step (:func:`common.cache_step_times`), with one 9-head query's SDPA
    over every layer's returned keys/values when ``sdpa``."""
    q = mx.random.normal((1, H_Q, 1, HEAD_DIM), dtype=DTYPE, key=mx.random.key(seed + 2)) if sdpa else None
    return common.cache_step_times(caches, steps, warmup, H_KV, HEAD_DIM, seed=seed + 1, dtype=DTYPE, query=q)


def stored_tokens(c) -> int:
    if type(c).__module__.startswith("veloxquant_mlx"):
        return int(c.keys.shape[2]) if c.keys is not None else 0
    if hasattr(c, "size"):
        try:
            return int(c.size())
        except Exception:  # noqa: BLE001 - velox's size() comes from KVCache
            pass
    return int(c.keys.shape[2]) if c.keys is not None else 0


def run(args) -> dict:
    arms = [a for a in ARMS if a in args.arms]
    rows = []
    for N in args.contexts:
        for rep in range(args.repeats):
            order = arms if rep % 2 == 0 else arms[::-1]  # interleave, alternate order
            for arm in order:
                caches = make_caches(arm, args.layers, args.budget)
                t0 = time.perf_counter()
                prefill(caches, N, seed=N)
                t_prefill = time.perf_counter() - t0
                cache_t = time_steps(caches, args.steps, args.warmup, seed=N, sdpa=False)
                if stored_tokens(caches[0]) <= args.sdpa_max_keys:
                    both_t = time_steps(caches, args.sdpa_steps, 2, seed=N + 7, sdpa=True)
                else:  # mlx's CPU SDPA takes seconds per layer over > 16k keys
                    both_t = [float("nan")]
                rows.append({
                    "arm": arm, "context": N, "repeat": rep,
                    "step_ms": 1e3 * statistics.median(cache_t),
                    "step_ms_p90": 1e3 * sorted(cache_t)[int(0.9 * (len(cache_t) - 1))],
                    "step_sdpa_ms": 1e3 * statistics.median(both_t),
                    "prefill_s": t_prefill,
                    "stored_tokens": stored_tokens(caches[0]),
                })
                print(f"N={N:6d} {arm:20s} rep {rep}: step {rows[-1]['step_ms']:.3f} ms "
                      f"(+sdpa {rows[-1]['step_sdpa_ms']:.3f} ms), stored {rows[-1]['stored_tokens']}",
                      flush=True)
                del caches
                mx.clear_cache()
    # medians over repeats
    summary = []
    for N in args.contexts:
        for arm in arms:
            rs = [r for r in rows if r["arm"] == arm and r["context"] == N]
            summary.append({
                "arm": arm, "context": N,
                "step_ms": statistics.median(r["step_ms"] for r in rs),
                "step_sdpa_ms": statistics.median(r["step_sdpa_ms"] for r in rs),
                "stored_tokens": rs[0]["stored_tokens"],
            })
    return {"rows": rows, "summary": summary, "arms": arms}


def print_table(res: dict, contexts) -> str:
    arms = res["arms"]
    by = {(s["arm"], s["context"]): s for s in res["summary"]}
    rows = [[N] + [f"{by[a, N]['step_ms']:.3f} ({by[a, N]['step_sdpa_ms']:.2f})" for a in arms]
            for N in contexts]
    lines = ["cache-only ms per decode step (median; in brackets: + one-query SDPA)", "",
             *common.md_table(["context", *arms], rows, "r" * (len(arms) + 1))]
    text = "\n".join(lines)
    print(text)
    return text


def plot(res: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in res["arms"]:
        s = sorted((x for x in res["summary"] if x["arm"] == arm), key=lambda x: x["context"])
        ctx = [x["context"] for x in s]
        axes[0].plot(ctx, [x["step_ms"] for x in s], marker="o", label=arm)
        axes[1].plot(ctx, [x["step_sdpa_ms"] for x in s], marker="o", label=arm)
    for ax, t in zip(axes, ("cache only (update_and_fetch + make_mask)", "cache + one-query SDPA")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("ms per decode step (median)")
        ax.set_title(t, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 layer, contexts 1k..8k, 16 steps, no files")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--sdpa-max-keys", type=int, default=20000,
                   help="skip the + SDPA figure when a layer holds more keys (NaN in the results)")
    p.add_argument("--sdpa-steps", type=int, default=8,
                   help="steps timed for the cache + SDPA figure (full-cache SDPA is slow at 64k)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--contexts", type=common.int_list, default=list(CONTEXTS))
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    p.add_argument("--no-velox", action="store_true", help="drop the veloxquant-mlx arm")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.repeats = 1, 16, 1
        args.contexts = [c for c in args.contexts if c <= 8192]
    if args.no_velox:
        args.arms = [a for a in args.arms if a != "velox-qfilters"]
    args.arms, velox_note = common.available(args.arms)
    meta = common.run_meta(velox=velox_note)
    load0 = meta["loadavg_start"]
    t0 = time.time()
    res = run(args)
    meta.update({
        "layers": args.layers, "H_kv": H_KV, "H_q": H_Q, "head_dim": HEAD_DIM, "dtype": "float32",
        "budget": args.budget, "recent": args.budget // 2, "n_sink": 4, "prefill_chunk": CHUNK,
        "steps": args.steps, "warmup": args.warmup, "sdpa_steps": args.sdpa_steps, "sdpa_max_keys": args.sdpa_max_keys, "repeats": args.repeats,
        "loadavg_end": os.getloadavg(), "wall_s": time.time() - t0,
    })
    res["meta"] = meta
    table = print_table(res, args.contexts)
    print(f"load average start {load0}, end {meta['loadavg_end']}")
    if not args.quick:
        res["table_md"] = table
        common.write_results(args.out / "decode_step.json", res)
        plot(res, args.out / "decode_step.png",
             f"SmolLM2 shapes, {args.layers} layers, H_kv {H_KV}, D {HEAD_DIM}, float32, "
             f"budget {args.budget}; load avg {load0[0]:.1f}")
        print(f"wrote {args.out / 'decode_step.json'} and decode_step.png")


if __name__ == "__main__":
    main()
