"""Commands under ``mlx.launch``: tensor-parallel loading, rank-0 output, per-rank KV bytes.

As mlx-lm's own sharded commands (``mlx_lm.chat``, ``mlx_lm.benchmark``,
``mlx_lm.server``) do: when ``mx.distributed.init()`` gives a group of more than
one rank, the model is loaded with ``mlx_lm.utils.sharded_load`` (``model.shard``:
each rank holds ``1/N`` of every layer's heads and their caches), every rank runs
the same generation, and only rank 0 prints. Launch, e.g. on this machine::

    mlx.launch --backend ring -n 3 -- python -m qfilters_mlx.commands.cli generate ...

What mlx-lm refuses in distributed mode (adapters, draft models) is refused here too.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

__all__ = ["check_args", "group", "kv_lines", "load_sharded", "only_rank0_prints", "settle", "shared_seed"]


def group():
    """The world group (``mx.distributed.init()``; a group of one outside ``mlx.launch``)."""
    import mlx.core as mx

    return mx.distributed.init()


def check_args(parser, args, size: int) -> None:
    """Refuse the flags that distributed mode does not support (``parser.error`` naming them)."""
    refused = [(getattr(args, "adapter_path", None), "--adapter-path",
                "adapters are not supported in distributed mode (as in mlx_lm.chat)"),
               (getattr(args, "draft_model", None), "--draft-model",
                "draft models are not supported in distributed mode (as in mlx_lm.server)"),
               (getattr(args, "compare", None), "--compare", "run the comparison in one process"),
               (getattr(args, "prompt_cache_file", None), "--prompt-cache-file",
                "prompt cache files hold one process's caches (all KV heads)"),
               (getattr(args, "context_file", None), "--context-file",
                "questions outside the compression run in one process")]
    for value, flag, why in refused:
        if value:
            parser.error(f"{flag}: not available under mlx.launch ({size} ranks): {why}")


def _heads(config: dict) -> tuple[int | None, int | None]:
    """``(n_kv_heads, n_heads)`` of a model folder's config.json (``text_config`` too)."""
    config = config.get("text_config", config)
    n_heads = config.get("num_attention_heads", config.get("n_head"))
    return config.get("num_key_value_heads", n_heads), n_heads


def load_sharded(parser, args, path):
    """``mlx_lm.utils.sharded_load`` with tensor parallelism over the world group.

    The model folder's KV heads (and attention heads) must divide by the group size,
    checked before anything is loaded; every failure is ``parser.error``.
    """
    from mlx_lm.utils import sharded_load

    from qfilters_mlx.sharding import check_divisible

    size = group().size()
    try:
        config = json.loads((Path(path) / "config.json").read_text())
        n_kv, n_heads = _heads(config)
        if n_kv is not None:
            check_divisible(int(n_kv), size, None if n_heads is None else int(n_heads))
    except (OSError, ValueError) as err:
        parser.error(f"--model {path}: {err}")
    trust = bool(getattr(args, "trust_remote_code", False))
    try:
        return sharded_load(str(path), None, group(), trust_remote_code=trust,
                            tokenizer_config={"trust_remote_code": True} if trust else None)
    except (FileNotFoundError, ValueError, KeyError, OSError) as err:
        parser.error(f"--model: cannot load {path} sharded over {size} ranks: "
                     f"{type(err).__name__}: {err}")


@contextlib.contextmanager
def only_rank0_prints(rank: int):
    """Send this rank's stdout to ``os.devnull`` unless it is rank 0 (errors still go to stderr)."""
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield


def shared_seed(seed: int | None) -> None:
    """Seed every rank's sampler alike (the ranks must sample the same token): ``seed``, or,
    without one, rank 0's random state summed over the group (as ``mlx_lm.server`` does)."""
    import mlx.core as mx

    if seed is None:
        g = group()
        own = mx.random.state[0] if g.rank() == 0 else mx.zeros_like(mx.random.state[0])
        seed = mx.distributed.all_sum(own, group=g, stream=mx.cpu).view(mx.uint64).item()
    mx.random.seed(int(seed) % 2**63)


def settle() -> None:
    """Wait for mlx-lm's generation stream (``mlx_lm.generate.generation_stream``): its last
    forward pass (evaluated ahead, ``mx.async_eval``) holds collectives, and a collective
    issued on another stream while it runs interleaves with them on the ranks' connections
    (the gathered values come back as garbage; seen with the ring backend)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    mx.synchronize(generation_stream)


def kv_lines(caches) -> list[tuple[str, str]]:
    """Summary lines for a tensor-parallel run: the rank's heads, KV bytes kept per rank and
    over all ranks, and full-cache bytes over all ranks (``mx.distributed.all_gather`` of
    every rank's ``qfilters_kept_bytes`` / ``full_seq_bytes`` sums; a collective)."""
    import mlx.core as mx

    from qfilters_mlx.commands import summary

    s = summary.cache_summary(caches)
    g = group()
    settle()
    per = mx.distributed.all_gather(mx.array([[s["kept_bytes"], s["full_bytes"]]], dtype=mx.int64),
                                    group=g, stream=mx.cpu).tolist()
    kept = [k for k, _ in per]
    report = getattr(caches, "report", None)
    shard = getattr(report, "shard", None)
    return [
        ("Tensor parallel", f"{g.size()} ranks; " + (shard.summary() if shard else f"rank {g.rank()}")),
        ("KV bytes kept per rank", ", ".join(f"rank {r}: {summary.human_bytes(k)} ({k} bytes)"
                                             for r, k in enumerate(kept))),
        ("KV bytes kept, all ranks", f"{summary.human_bytes(sum(kept))} ({sum(kept)} bytes)"),
        ("KV bytes full, all ranks", f"{summary.human_bytes(sum(f for _, f in per))} "
                                     f"({sum(f for _, f in per)} bytes)"),
    ]

