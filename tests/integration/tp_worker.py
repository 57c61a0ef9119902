"""One rank of the tensor-parallel check (tests/integration/test_tensor_parallel.py).

Run as ``python tp_worker.py OUT MODEL`` in one process (the reference) or under
``mlx.launch --backend ring -n 3`` (each rank holds one of SmolLM2's 3 KV heads).
Writes ``OUT/started<rank>`` once the group is up, then, per rank:

1. ``qfilters-mlx calibrate`` (the command's ``main``) over a small text -> ``OUT/filters.safetensors``
   (rank 0 writes), stdout in ``OUT/calibrate<rank>.txt``;
2. ``for_model`` with that file: each budgeted cache's filter (the rank's slice);
3. the default configuration (the calibrated query filter, found or made by ``for_model``: all
   ranks calibrate together, rank 0 stores the file in this run's own ``QFILTERS_MLX_HOME``)
   through ``stream_generate`` with no ``observe_queries``: filters, tokens, kept positions;
   a greedy generation with the online query filter past several evictions (prefill in
   chunks of 8, then decoding): generated token ids, kept positions of every (layer, local
   KV head), KV bytes; a shorter one with the key filter oriented by the queries
   (``sign="auto"``); head groups (a whole-model ``HeadBudgets`` with the budgets 24 / 16 / 8
   rotated over the KV heads per layer, sliced to the rank's head): tokens and the kept
   positions of every (layer, KV head) of the whole model; layer 0's ``k_proj`` weight
   (which heads the rank holds);
4. ``qfilters-mlx generate`` with the filters file, stdout in ``OUT/generate<rank>.txt``.

All arrays go to ``OUT/rank<rank>.npz`` (``OUT/single.npz`` outside mlx.launch).
"""

import contextlib
import io
import json
import sys
from pathlib import Path

from qfilters_mlx.blas import enable_fast_blas

enable_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

PROMPT = ("The Roman Empire was the post-Republican state of ancient Rome. It included large "
          "territorial holdings around the Mediterranean Sea in Europe, North Africa, and "
          "Western Asia, ruled by emperors.")
BUDGET, N_SINK, CALIB, STEP, MAX_TOKENS = 16, 2, 8, 8, 6


def barrier(group):
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def main(out: Path, model_path: str) -> None:
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    tag = f"rank{rank}" if size > 1 else "single"
    (out / f"started{rank}").write_text("1")

    from mlx_lm.generate import generation_stream, stream_generate
    from mlx_lm.utils import load, sharded_load

    from qfilters_mlx.cache.builder import KVCacheBuilder
    from qfilters_mlx.commands import cli
    from qfilters_mlx.config import KVCacheConfig
    from qfilters_mlx.filters.observe import observe_queries

    filters = out / f"filters-{'tp' if size > 1 else 'single'}.safetensors"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["calibrate", "--model", model_path, "--out", str(filters), "--tokens", "48",
                       "--chunk", "48", "--samples", "48"])
    assert rc == 0
    (out / f"calibrate{rank}.txt").write_text(buf.getvalue())
    barrier(group)  # rank 0 has written the file

    model, tok = sharded_load(model_path) if size > 1 else load(model_path)
    from_file = KVCacheBuilder.for_model(model, KVCacheConfig(
        qfilters_budget=BUDGET, qfilters_n_sink=N_SINK, qfilters_filters=str(filters)))
    file_filters = mx.stack([c.filter for c in from_file])  # [layers, local heads, D]

    ids = tok.encode(PROMPT)

    def generate(config, step, max_tokens, watch=True, heads=None):
        caches = KVCacheBuilder.for_model(model, config, tokenizer=tok, heads=heads)
        tokens = []
        with observe_queries(model, caches) if watch else contextlib.nullcontext():
            for r in stream_generate(model, tok, ids, max_tokens=max_tokens, prompt_cache=caches,
                                     prefill_step_size=step):
                tokens.append(r.token)
        mx.synchronize(generation_stream)  # its look-ahead step holds collectives
        if heads is not None:
            return caches, tokens, None
        return caches, tokens, mx.stack([c.kept_positions()[0] for c in caches])  # [layers, heads, T]

    # the default: the calibrated query filter, calibrated now (this run's own cache folder)
    import os

    os.environ["QFILTERS_MLX_HOME"] = str(out / "home")
    default, default_tokens, default_kept = generate(KVCacheConfig(
        qfilters_budget=BUDGET, qfilters_n_sink=N_SINK), STEP, MAX_TOKENS, watch=False)
    default_filters = mx.stack([c.filter for c in default])
    default_summary = default.report.summary()
    # the online query filter, estimated per rank
    caches, tokens, kept = generate(KVCacheConfig(
        qfilters_budget=BUDGET, qfilters_n_sink=N_SINK, qfilters_calib_tokens=CALIB,
        qfilters_filter_source="queries"), STEP, MAX_TOKENS)
    # the key-SVD filter oriented by the observed queries (sign="auto"), per rank
    _, auto_tokens, auto_kept = generate(KVCacheConfig(
        qfilters_budget=BUDGET, qfilters_n_sink=N_SINK, qfilters_calib_tokens=CALIB,
        qfilters_filter_source="keys", qfilters_sign="auto"), len(ids), 3)
    # head groups: the whole model's table, each rank building its own head's caches
    from qfilters_mlx.cache.head_groups import HeadGroupsKVCache
    from qfilters_mlx.config import HeadBudgets

    rows = [tuple((24, 16, 8)[(h + i) % 3] for h in range(3)) for i in range(30)]
    grouped, grouped_tokens, _ = generate(KVCacheConfig(qfilters_budget=BUDGET, qfilters_n_sink=N_SINK),
                                          STEP, MAX_TOKENS, watch=False,
                                          heads=HeadBudgets(rows, [tuple(b // 2 for b in r) for r in rows]))
    start = 0 if grouped.report.shard is None else grouped.report.shard.start
    grouped_kept = {}
    for i, c in enumerate(grouped):
        parts = zip(c.heads, c.kept_positions()) if isinstance(c, HeadGroupsKVCache) else [
            (range(c.kept_positions().shape[1]), c.kept_positions())]
        for hs, pos in parts:
            for j, h in enumerate(hs):
                grouped_kept[f"{i}/{start + h}"] = [int(x) for x in np.array(pos)[0, j]]
    grouped_bytes = sum(c.nbytes for c in grouped)
    shard = caches.report.shard
    info = {"rank": rank, "size": size, "summary": caches.report.summary(),
            "shard": None if shard is None else [shard.rank, shard.size, shard.local_heads,
                                                 shard.n_kv_heads],
            "prompt_tokens": len(ids), "tokens_seen": [c.tokens_seen for c in caches],
            "kept_bytes": sum(c.qfilters_kept_bytes for c in caches),
            "full_bytes": sum(c.full_seq_bytes for c in caches),
            "kv_bytes": sum(c.keys.nbytes + c.values.nbytes for c in caches),
            "evicted": [bool(c.evicted) for c in caches], "default_summary": default_summary,
            "default_sizes": [c.size() for c in default], "grouped_kept": grouped_kept,
            "grouped_bytes": grouped_bytes}

    np.savez(out / f"{tag}.npz", tokens=np.array(tokens), kept=np.array(kept),
             auto_tokens=np.array(auto_tokens), auto_kept=np.array(auto_kept),
             file_filters=np.array(file_filters), default_tokens=np.array(default_tokens),
             default_kept=np.array(default_kept), default_filters=np.array(default_filters),
             grouped_tokens=np.array(grouped_tokens),
             k_proj=np.array(model.layers[0].self_attn.k_proj.weight),
             info=np.array(json.dumps(info)))
    del model, caches, from_file, default, grouped
    barrier(group)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["generate", "--model", model_path, "--prompt", PROMPT, "--max-tokens", "2",
                       "--budget", str(BUDGET), "--n-sink", str(N_SINK), "--filters", str(filters),
                       "--ignore-chat-template"])
    assert rc == 0
    (out / f"generate{rank}.txt").write_text(buf.getvalue())


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
