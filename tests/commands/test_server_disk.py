"""Stored conversations on disk (``commands/server_disk.py``, ``commands/server_files.py``),
without HTTP: the server's stored conversations with a folder, fed as the batch loop feeds them.

The rules written out here:

* a restart (a new store on the folder) reuses the whole stored conversation for a follow-up
  turn, with the tokens and caches the store that never restarted gives;
* an entry that left memory (count bound) is served from its file;
* every kind of damaged or foreign file (flipped bytes in the arrays or the header, a broken
  header length, truncation, bytes appended, an empty file, not a safetensors file, another
  identity, a file under another entry's name, a dangling symbolic link, a folder or a FIFO in
  its place) is skipped with a log line naming it, and the request is computed as cold: never a
  wrong cache, never an exception, never a blocked start;
* a crash before a follow-up's answer is written, or a failed write of it, leaves the older
  turn's file, which serves the conversation;
* an entry served from memory is used on disk too (the bound's order, also after a restart);
* files are mode 0600 in a 0700 folder, named by a hash only; a folder others may read is
  refused; a second store on a locked folder is refused;
* the bytes of the files stay within the bound at every write, least recently used removed first;
* a follow-up turn removes the file of the turn it replaces (one conversation, one answer file);
* a failed write leaves no file and the index as it was.
"""

from __future__ import annotations

import copy
import logging
import os
import stat

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import pytest

from helpers.batch_helpers import config, tiny_llama
from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.commands import server_files
from qfilters_mlx.commands.server_cache import prompt_cache_class
from qfilters_mlx.commands.server_disk import DiskIndex, cache_identity, disk_conversations_class
from qfilters_mlx.commands.server_files import file_name, pack_tokens, read_info

REWIND = 8


@pytest.fixture(scope="module")
def model():
    m = tiny_llama()
    KVCacheBuilder(max_rewind=REWIND).install(m, config())
    return m


def _tokens(n, seed):
    mx.random.seed(seed)
    return mx.random.randint(1, 90, (n,)).tolist()


def _store(folder, max_size=10, max_bytes=None, model=None):
    """A stored-conversations object with ``folder``, opened as the server opens it."""
    cls = disk_conversations_class(prompt_cache_class(cache_module), folder, max_bytes)
    store = cls(max_size)
    if model is not None:
        store.open_disk("m", model)
    return store


def _close(store):
    """What the end of the server's process does to the folder's lock."""
    store.disk._lock.close()


def serve(store, model, prompt, answer_tokens=6):
    """The batch loop for one request: reuse, prefill the prompt but its last token (stored as
    the ``"user"`` checkpoint), decode greedily, store the answer as a finished request.
    Returns ``(tokens reused, answer tokens, the answer's caches)``."""
    store.expect_calls(prompt, [len(prompt) - 1])
    cache, rest = store.fetch_nearest_cache("m", prompt)
    reused = len(prompt) - len(rest)
    caches = cache if cache is not None else cache_module.make_prompt_cache(model)
    if reused < len(prompt) - 1:
        model(mx.array([prompt[reused:-1]]), cache=caches)
        store.insert_cache("m", prompt[:-1], copy.deepcopy(caches), cache_type="user")
    y, out = prompt[-1], []
    for _ in range(answer_tokens):
        y = int(mx.argmax(model(mx.array([[y]]), cache=caches)[0, -1]).item())
        out.append(y)
    model(mx.array([[y]]), cache=caches)
    store.finishing = True
    store.insert_cache("m", prompt + out, copy.deepcopy(caches), cache_type="assistant")
    return reused, out, caches


def _same(a, b):
    for x, y in zip(a, b):
        assert x.offset == y.offset
        for u, v in zip(x.state[:4], y.state[:4]):
            assert mx.array_equal(u, v).item()


def _files(folder):
    return sorted(p for p in folder.iterdir() if p.suffix == ".safetensors")


def test_a_follow_up_after_a_restart_reuses_the_whole_conversation_and_answers_as_without(model, tmp_path):
    first = _tokens(40, 1)
    plain = prompt_cache_class(cache_module)(10)  # (no folder: the server that never restarted)
    _, out, _ = serve(plain, model, first)
    follow = first + out + _tokens(12, 2)
    want_reused, want_out, want_caches = serve(plain, model, follow)
    assert want_reused == len(first) + len(out)

    before = _store(tmp_path / "d", model=model)
    assert serve(before, model, first)[1] == out
    _close(before)
    after = _store(tmp_path / "d", model=model)  # the restart
    assert after.stored_stats()["disk"]["usable"] == 1
    reused, got, caches = serve(after, model, follow)
    assert (reused, got) == (want_reused, want_out)
    _same(caches, want_caches)
    assert after.disk.reads == 1
    # the follow-up's answer replaced the first turn's file: one conversation, one answer file
    assert [read_info(p)["type"] for p in _files(tmp_path / "d")] == ["assistant"]


def test_an_entry_that_left_memory_is_served_from_its_file(model, tmp_path):
    store = _store(tmp_path / "d", max_size=1, model=model)
    a, b = _tokens(30, 3), _tokens(30, 4)
    _, out_a, _ = serve(store, model, a)
    serve(store, model, b)  # (max_size 1: a's answer leaves memory)
    assert store.stored_stats()["conversations"] == 1 and len(_files(tmp_path / "d")) == 2
    reused, _, _ = serve(store, model, a + out_a + _tokens(5, 5))
    assert reused == len(a) + len(out_a) and store.disk.reads == 1


def _flip(at):
    def damage(path):
        data = bytearray(path.read_bytes())
        i = at(data)
        data[i] ^= 0x5A
        path.write_bytes(bytes(data))
    return damage


def _other_identity(path):
    """A valid file of this server's layout, written for another model."""
    other = tiny_llama(seed=7)
    KVCacheBuilder(max_rewind=REWIND).install(other, config())
    info = read_info(path)
    caches = cache_module.make_prompt_cache(other)
    other(mx.array([server_files.unpack_tokens(info["tokens"])]), cache=caches)
    server_files.write_entry(path.parent, path.name, caches, {
        "identity": cache_identity(other), "tokens": info["tokens"], "type": info["type"]})


def _replace_with(make):
    def damage(path):
        path.unlink()
        make(path)
    return damage


DAMAGE = {
    "arrays": _flip(lambda d: len(d) - 17),
    "appended": lambda p: p.write_bytes(p.read_bytes() + b"\0" * 64),
    "dangling-symlink": _replace_with(lambda p: p.symlink_to(p.parent / "gone.safetensors")),
    "folder": _replace_with(lambda p: p.mkdir()),
    "fifo": _replace_with(lambda p: os.mkfifo(p)),
    "header": _flip(lambda d: 8 + d[8:].index(b"qfilters_mlx_type") + 3),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "not-safetensors": lambda p: p.write_bytes(b"hello, this is not a cache" * 50),
    "other-identity": _other_identity,
    "header-length": _flip(lambda d: 5),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.parametrize("when", ["restart", "in-use"])
def test_a_damaged_or_foreign_file_is_skipped_named_and_the_request_computed_cold(
        model, tmp_path, caplog, kind, when):
    first = _tokens(40, 1)
    store = _store(tmp_path / "d", max_size=1, model=model)
    _, out, _ = serve(store, model, first)
    follow = first + out + _tokens(12, 2)
    serve(store, model, _tokens(20, 8))  # (first's answer leaves memory: only its file serves it)
    path = next(p for p in _files(tmp_path / "d") if read_info(p)["tokens"] == pack_tokens(first + out))
    DAMAGE[kind](path)
    if when == "restart":
        _close(store)
        store = _store(tmp_path / "d", max_size=1)
    with caplog.at_level(logging.INFO):
        if when == "restart":
            store.open_disk("m", model)
        reused, got, caches = serve(store, model, follow)
    cold = prompt_cache_class(cache_module)(10)
    cold_reused, cold_out, cold_caches = serve(cold, model, follow)
    assert (reused, got) == (cold_reused, cold_out) == (0, cold_out)
    _same(caches, cold_caches)
    assert str(path) in caplog.text
    assert store.disk.reads == 0


def test_a_file_under_another_entrys_name_is_never_used(model, tmp_path, caplog):
    first = _tokens(40, 1)
    store = _store(tmp_path / "d", model=model)
    _, out, _ = serve(store, model, first)
    _close(store)
    good = _files(tmp_path / "d")[0]
    wrong_key = pack_tokens(first + out + _tokens(12, 2)[:3])
    wrong = tmp_path / "d" / file_name(store.disk.identity, wrong_key)
    wrong.write_bytes(good.read_bytes())
    os.chmod(wrong, 0o600)
    with caplog.at_level(logging.INFO):
        store = _store(tmp_path / "d", model=model)
    assert store.stored_stats()["disk"]["usable"] == 1
    assert str(wrong) in caplog.text


def test_files_are_private_named_by_a_hash_and_the_folder_is_locked(model, tmp_path):
    folder = tmp_path / "d"
    store = _store(folder, model=model)
    prompt = _tokens(30, 1)
    serve(store, model, prompt)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for p in _files(folder):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert len(p.stem) == 64 and all(c in "0123456789abcdef" for c in p.stem)
    assert not list(folder.glob(".tmp-*"))
    with pytest.raises(RuntimeError, match="another server uses this folder"):
        _store(folder, model=model)
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(ValueError, match="chmod 700"):
        _store(open_dir, model=model)


def test_the_files_stay_within_the_bound_least_recently_used_removed_first(model, tmp_path):
    probe = _store(tmp_path / "probe", model=model)
    serve(probe, model, _tokens(30, 0))
    size = probe.disk.nbytes
    store = _store(tmp_path / "d", max_size=1, max_bytes=int(2.5 * size), model=model)
    prompts = [_tokens(30, 10 + i) for i in range(4)]
    outs = []
    for i, p in enumerate(prompts[:2]):
        outs.append(serve(store, model, p)[1])
    # reading the first conversation's file makes it the most recently used
    serve(store, model, prompts[0] + outs[0] + [3])
    for p in prompts[2:]:
        serve(store, model, p)
        assert store.disk.nbytes <= 2.5 * size
        assert sum(f.stat().st_size for f in _files(tmp_path / "d")) == store.disk.nbytes
    kept = {read_info(f)["tokens"] for f in _files(tmp_path / "d")}
    assert pack_tokens(prompts[1] + outs[1]) not in kept  # (the oldest use went first)


def test_a_failed_write_leaves_no_file_and_the_index_as_it_was(model, tmp_path, monkeypatch, caplog):
    store = _store(tmp_path / "d", model=model)
    serve(store, model, _tokens(30, 1))
    before = (_files(tmp_path / "d"), store.disk.nbytes, list(store.disk.entries))

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_module, "save_prompt_cache", fail)
    with caplog.at_level(logging.WARNING):
        serve(store, model, _tokens(30, 2))
    assert "No space left on device" in caplog.text
    assert (_files(tmp_path / "d"), store.disk.nbytes, list(store.disk.entries)) == before
    assert not list((tmp_path / "d").glob(".tmp-*"))


def test_another_cache_configuration_never_reads_the_files(tmp_path):
    a, b = tiny_llama(), tiny_llama()
    KVCacheBuilder(max_rewind=REWIND).install(a, config())
    KVCacheBuilder(max_rewind=REWIND).install(b, config(qfilters_budget=24))
    assert cache_identity(a) != cache_identity(b)
    store = _store(tmp_path / "d", model=a)
    prompt = _tokens(30, 1)
    _, out, _ = serve(store, a, prompt)
    _close(store)
    other = _store(tmp_path / "d", model=b)
    assert other.stored_stats()["disk"]["usable"] == 0
    assert serve(other, b, prompt + out + [4])[0] == 0
    assert len(_files(tmp_path / "d")) == 2  # (its file stays: it counts towards the bound only)


def test_a_stored_file_loads_with_mlx_lms_own_reader(model, tmp_path):
    store = _store(tmp_path / "d", model=model)
    _, _, caches = serve(store, model, _tokens(30, 1))
    (path,) = _files(tmp_path / "d")
    loaded, meta = cache_module.load_prompt_cache(str(path), return_metadata=True)
    _same(loaded, caches)
    assert meta["qfilters_mlx_type"] == "assistant"


def test_the_index_holds_what_it_counts(model, tmp_path):
    """The Python memory the rebuilt index keeps (tracemalloc) is within ``index_bytes`` plus the
    index object's own few kilobytes; the counts follow writes and removals."""
    import gc
    import tracemalloc

    store = _store(tmp_path / "d", model=model)
    for i in range(6):
        serve(store, model, _tokens(200 + 30 * i, i))
    identity = store.disk.identity
    counted = store.disk.index_nbytes
    _close(store)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = DiskIndex(tmp_path / "d", None, identity)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert index.index_nbytes == counted and index.stats()["usable"] == 6
    assert sum(len(e.key) for e in index.entries.values()) == 4 * sum(206 + 30 * i for i in range(6))
    assert held <= counted + 8192, (held, counted)
    index.remove(next(iter(index.entries)))
    assert index.stats()["usable"] == 5 and index.index_nbytes < counted


def test_a_crash_or_a_failed_write_before_the_follow_ups_answer_keeps_the_older_turn(
        model, tmp_path, monkeypatch):
    first = _tokens(40, 1)
    store = _store(tmp_path / "d", model=model)
    _, out, _ = serve(store, model, first)
    follow = first + out + _tokens(12, 2)
    # the follow-up's checkpoint is stored (in memory it replaces the first turn), then a crash
    store.expect_calls(follow, [len(follow) - 1])
    caches, rest = store.fetch_nearest_cache("m", follow)
    model(mx.array([rest[:-1]]), cache=caches)
    store.insert_cache("m", follow[:-1], copy.deepcopy(caches), cache_type="user")
    assert store.stored_stats()["conversations"] == 0  # (memory dropped the first turn)
    _close(store)
    store = _store(tmp_path / "d", model=model)
    assert serve(store, model, follow)[0] == len(first) + len(out)
    # a write that fails leaves the older turn's file too
    _, out2, _ = serve(store, model, follow + [7, 8])
    names = list(store.disk.entries)
    monkeypatch.setattr(cache_module, "save_prompt_cache",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    serve(store, model, follow + [7, 8] + out2 + _tokens(6, 3))
    assert [n for n in store.disk.entries if n in names] == names and all(
        (tmp_path / "d" / n).exists() for n in names)


def test_an_entry_served_from_memory_is_used_on_disk_too(model, tmp_path):
    store = _store(tmp_path / "d", model=model)
    a, b = _tokens(30, 1), _tokens(30, 2)
    _, out_a, _ = serve(store, model, a)
    serve(store, model, b)
    name_a = file_name(store.disk.identity, pack_tokens(a + out_a))
    assert list(store.disk.entries)[0] == name_a
    store.fetch_nearest_cache("m", a + out_a + [5])  # (served from memory)
    assert list(store.disk.entries)[-1] == name_a
    _close(store)
    assert list(_store(tmp_path / "d", model=model).disk.entries)[-1] == name_a


def test_the_server_flags_that_change_a_stored_cache_are_part_of_the_identity(model):
    plain = cache_identity(model, settings={"kv_bits": None, "kv_group_size": 64})
    assert plain == cache_identity(model, settings={"kv_group_size": 64, "kv_bits": None})
    assert plain != cache_identity(model, settings={"kv_bits": 4, "kv_group_size": 64})
    assert plain != cache_identity(model, settings={"kv_bits": None, "kv_group_size": 32})


def test_a_file_larger_than_the_bound_is_not_kept_and_says_so(model, tmp_path, caplog):
    store = _store(tmp_path / "d", max_bytes=1000, model=model)
    with caplog.at_level(logging.WARNING):
        serve(store, model, _tokens(30, 1))
    assert "larger than --prompt-cache-disk-bytes" in caplog.text
    assert store.disk.nbytes == 0 and not _files(tmp_path / "d")
