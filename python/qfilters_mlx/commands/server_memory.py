"""What a stored entry of ``qfilters-mlx server`` and the server process hold: journal rows kept
at rest (:func:`journal_rows`), rows per layer (:func:`stored_rows`), the process's memory
(:func:`process_memory`), the line logged after each request (:func:`request_summary`), the
hand-back of freed memory after it (:func:`release_freed`) and the C heap's policy for large
blocks (:func:`map_large_blocks`)."""

from __future__ import annotations

import functools

__all__ = ["MMAP_THRESHOLD", "journal_rows", "map_large_blocks", "process_memory", "release_freed",
           "request_summary", "stored_rows"]

MMAP_THRESHOLD = 64 << 10
"""Bytes from which a block gets its own mapping in the server process (glibc; its default is
128 KiB, raised up to 32 MB as large blocks are freed)."""
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def journal_rows(cache) -> int:
    """Rows of rewind journal a stored eviction cache keeps: its rewind depth
    (``max_rewind``; 0 when it is ``"auto"``, i.e. no depth was asked for)."""
    depth = getattr(cache, "max_rewind", 0)
    return depth if isinstance(depth, int) else 0


def stored_rows(caches) -> int:
    """Rows per layer a stored entry holds: the largest K/V buffer over its layers
    (allocated rows, live or not), plus the K/V rows its rewind journal keeps."""
    rows = 0
    for c in caches:
        keys = getattr(c, "keys", None)
        n = 0 if keys is None else (keys[0] if isinstance(keys, tuple) else keys).shape[2]
        journal = getattr(c, "_journal", None)
        if journal is not None:
            n += journal.rows
        rows = max(rows, n)
    return rows


def release_freed() -> None:
    """Give the memory a finished request freed back to the system: MLX's pool of freed
    buffers (``mx.clear_cache``), then, where the C library is glibc, the free pages of its
    heaps (``malloc_trim(0)``). glibc keeps freed blocks below its mmap threshold, which
    rises to 32 MB as large blocks are freed, so without the trim a request's temporaries
    stay in the resident set after MLX has freed them. Elsewhere only the first step runs."""
    import mlx.core as mx

    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Where the C library is glibc, give every block of ``threshold`` bytes or more its own
    mapping (``mallopt(M_MMAP_THRESHOLD, threshold)``, which also stops glibc raising the
    threshold as large blocks are freed). A freed block then leaves the resident set at once,
    and the arrays a stored conversation keeps do not pin the heap pages of a request's
    temporaries around them. Measured with SmolLM2, 2,048-token requests run in a thread
    and their caches kept, :func:`release_freed` after each: the resident set grew by what
    the kept arrays hold plus 6-8 MB per request, against 10-34 MB with glibc's default.

    Returns:
        Whether the threshold was set (``False`` where the C library is not glibc).
    """
    mallopt = _libc("mallopt")
    return bool(mallopt is not None and mallopt(_M_MMAP_THRESHOLD, int(threshold)))


def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` where the C library has none."""
    return _libc("malloc_trim")


@functools.cache
def _libc(name: str):
    """The C library's function ``name`` as the process already links it (no library search,
    looked up once), or ``None`` where it has none."""
    import ctypes

    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def process_memory() -> dict:
    """What the process holds now: MLX's ``active_bytes`` and ``peak_bytes``
    (``mx.get_active_memory`` / ``get_peak_memory``: arrays alive, on every device) and the
    resident set ``rss_bytes`` (Linux ``/proc/self/statm``; ``None`` elsewhere)."""
    import mlx.core as mx

    rss = None
    try:
        import os

        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(),
            "rss_bytes": rss}


def request_summary(caches, prompt_tokens: int) -> str:
    """One log line for a finished request: tokens seen and kept; the kept K/V rows' bytes
    against the K/V bytes a full cache holds for the same tokens (both rows x row bytes);
    and everything the caches hold (``nbytes``: buffers, scores, filter, rewind journal)."""
    ours = [c for c in caches if hasattr(c, "tokens_kept")]
    if not ours:
        return f"request done: {prompt_tokens} tokens, no eviction caches"
    kept = max(c.tokens_kept for c in ours)
    kept_kv = sum(c.kept_kv_bytes for c in ours)
    full = sum(c.full_seq_bytes for c in ours)
    held = sum(c.nbytes for c in ours)
    return (f"request done: {ours[0].tokens_seen} tokens seen, {kept} kept per layer and KV head "
            f"({len(ours)} layers); K/V of the kept tokens {kept_kv / 1e6:.2f} MB, of all tokens "
            f"(a full cache) {full / 1e6:.2f} MB; the cache holds {held / 1e6:.2f} MB "
            f"(buffers, scores, filter, rewind journal)")
