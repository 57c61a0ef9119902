"""``qfilters-mlx server``'s own part (no HTTP: that is tests/integration/test_server_smollm2.py):
cache flags to a configuration, refusals, the per-request log line, the pass-through of the rest."""

import pytest

from helpers.batch_helpers import config, tiny_llama
from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.commands import server, server_memory
from qfilters_mlx.commands.cli import build_parser


def _config(argv):
    p = server.cache_parser()
    args, rest = p.parse_known_args(argv)
    return server._config(p, args), rest


def test_default_filter_is_the_libraries_and_flags_pass_through(capsys):
    from qfilters_mlx import KVCacheConfig

    (cfg, described), rest = _config(["--budget", "64", "--port", "9", "--decode-concurrency", "4"])
    assert cfg == KVCacheConfig(qfilters_budget=64) and cfg.qfilters_filter_source == "calibrated"
    assert "budget=64" in described and "filter_source=calibrated" in described
    assert rest == ["--port", "9", "--decode-concurrency", "4"]
    assert capsys.readouterr().err == ""  # no silent switch to another filter


@pytest.mark.parametrize("argv", [["--filter-source", "queries"], ["--sign", "auto"]])
def test_query_configurations_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        _config(argv)
    assert "observed" in capsys.readouterr().err


@pytest.mark.parametrize("method, refused", [("qfilters", True), ("full", False)])
def test_kv_bits_with_a_draft_model_is_refused_at_start_for_eviction_caches(method, refused, capsys,
                                                                          monkeypatch):
    """A quantized eviction cache cannot rewind rejected drafts: refused before the model loads
    (mlx-lm's own server would keep the drafts); the full cache never evicts and goes on."""
    import argparse

    parser = build_parser()  # (imports every command first: none binds the patched function below)
    monkeypatch.setattr("qfilters_mlx.commands.model_path.resolve_model",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("past the check")))
    args = argparse.Namespace(server_args=["--method", method, "--draft-model", "d", "--kv-bits", "4"])
    with pytest.raises(SystemExit if refused else RuntimeError):
        server.run(parser, args)
    assert ("--kv-bits with --draft-model" in capsys.readouterr().err) is refused


def test_cli_routes_the_rest_to_the_server():
    args, extra = build_parser().parse_known_args(["server", "--budget", "8", "--host", "0.0.0.0"])
    assert args.passes_through and extra == ["--budget", "8", "--host", "0.0.0.0"]


def test_request_summary_compares_kept_and_full_kv_bytes_like_with_like():
    """The log line's two K/V figures are both rows x row bytes (kept rows, all tokens' rows);
    what the cache holds (buffers, scores, filter, journal: ``nbytes``) is given apart."""
    import mlx.core as mx

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, config())
    model(mx.array([list(range(40))]), cache=caches)
    line = server_memory.request_summary(caches, 40)
    c = caches[0]
    H, D = c.keys.shape[1], c.keys.shape[3]
    row = H * 2 * D * c.keys.dtype.size  # one token's K and V in one layer
    kept = len(caches) * c.tokens_kept * row
    full = len(caches) * 40 * row
    assert "40 tokens seen, 16 kept per layer" in line
    assert f"kept tokens {kept / 1e6:.2f} MB" in line and f"(a full cache) {full / 1e6:.2f} MB" in line
    assert f"holds {sum(x.nbytes for x in caches) / 1e6:.2f} MB" in line


def test_stored_conversations_never_ask_for_a_rewind_the_cache_cannot_do():
    """mlx-lm's prompt cache would trim a stored, evicted conversation back to a shared prefix;
    here a trim deeper than ``rewindable_tokens`` is never attempted (the shorter stored prefix
    is used), one within it is (exactly), and prefixes the new entry cannot rewind to are kept."""
    import mlx.core as mx
    import mlx_lm.models.cache as cache_module

    from qfilters_mlx.commands.server_cache import prompt_cache_class
    from qfilters_mlx.commands.server_calls import rewind_reach

    model = tiny_llama()
    store = prompt_cache_class(cache_module)()
    store.prefill_step = 12
    cfg = config()
    toks = list(range(1, 41))
    for _ in range(2):  # (a system prompt's checkpoint is stored once a second request repeats it)
        head = KVCacheBuilder.for_model(model, cfg, max_rewind=4)
        model(mx.array([toks[:10]]), cache=head)
        store.insert_cache("m", toks[:10], head, cache_type="system")
    full = KVCacheBuilder.for_model(model, cfg, max_rewind=4)
    for a in range(0, 40, 12):  # the calls of a 12-token prefill step
        model(mx.array([toks[a:a + 12]]), cache=full)
    assert full[0].evicted and rewind_reach(full) == 4
    store.insert_cache("m", toks, full)
    assert len(store) == 2  # the 10-token prefix is 30 tokens back: kept
    cache, rest = store.fetch_nearest_cache("m", toks[:36] + [99, 98])  # 4 back: a rewind
    assert rest == [99, 98] and cache[0].offset == 36
    # 2 back, inside the recorded call [36, 40): rewound to its start, a call boundary the
    # prompt's cold run also has (a multiple of the step), never into the call
    cache, rest = store.fetch_nearest_cache("m", toks[:38] + [99, 98])
    assert rest == toks[36:38] + [99, 98] and cache[0].offset == 36
    cache, rest = store.fetch_nearest_cache("m", toks[:20] + [99])  # 20 back: the prefix instead
    assert rest == toks[10:20] + [99] and cache[0].offset == 10


def test_the_generation_loop_restarts_and_fails_the_requests_in_flight():
    """mlx-lm's loop dies on an uncaught exception ("generation thread died" for every later
    request); ours restarts it, and a request it had taken gets a GenerationFailed (HTTP 500)."""
    import queue
    import time
    from types import SimpleNamespace

    import mlx_lm.server as mlx_server

    from qfilters_mlx.commands.server_errors import GenerationFailed, error_status
    from qfilters_mlx.commands.server_loop import generator_class

    calls = []

    class Provider:
        cli_args = SimpleNamespace()

        def load_default(self):
            calls.append(1)
            if len(calls) == 2:  # the second pass of the loop fails once a request was taken
                raise RuntimeError("boom")

    gen = None

    class Failing(generator_class(mlx_server)):
        def _generate(self):
            self.model_provider.load_default()
            while not self._stop:
                if self._next_request(timeout=0.05) is not None:
                    raise RuntimeError("a request broke the loop")

    gen = Failing(Provider(), mlx_server.LRUPromptCache(2))
    try:
        reply = queue.Queue()
        gen.requests.put((reply, None, None))
        err = reply.get(timeout=10)
        assert isinstance(err, GenerationFailed) and error_status(err) == 500
        deadline = time.time() + 10
        while gen.loop_restarts < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert gen.loop_restarts == 2 and gen.generation_available()
    finally:
        gen.stop_and_join()


def test_a_failing_load_stops_the_start_and_a_loop_failing_every_pass_gives_up():
    """The served model loads in the generation thread before the server answers: its error is
    raised to the starting thread. A loop that fails on every pass is restarted
    RESTARTS_ALLOWED times, then given up (unavailable, as mlx-lm's dead thread)."""
    import time
    from types import SimpleNamespace

    import mlx_lm.server as mlx_server

    from qfilters_mlx.commands import server_loop

    class BadFilters:
        cli_args = SimpleNamespace()

        def load_default(self):
            raise ValueError("not a filters file")

    with pytest.raises(ValueError, match="not a filters file"):
        server_loop.generator_class(mlx_server)(BadFilters(), mlx_server.LRUPromptCache(2))

    class Loads:
        cli_args = SimpleNamespace()

        def load_default(self):
            pass

    class AlwaysFails(server_loop.generator_class(mlx_server)):
        def _generate(self):
            raise RuntimeError("every pass")

    gen = AlwaysFails(Loads(), mlx_server.LRUPromptCache(2))
    deadline = time.time() + 10
    while gen.generation_available() and time.time() < deadline:
        time.sleep(0.05)
    assert not gen.generation_available() and gen.loop_restarts == server_loop.RESTARTS_ALLOWED
    gen.stop_and_join()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("when", ["before-any-token", "after-a-token"])
def test_a_request_that_fails_after_it_was_admitted_gets_an_error_never_an_empty_200(stream, when):
    """The generation side takes the request (a context comes back), then fails: a
    non-streaming reply answers the error's status (500 for the loop's failure) with a JSON
    error; a streaming one, whose 200 is already sent, ends with an SSE ``error`` event."""
    import http.client
    import json
    import threading
    from http.server import ThreadingHTTPServer
    from types import SimpleNamespace

    import mlx_lm.server as mlx_server

    from qfilters_mlx.commands.server_errors import GenerationFailed
    from qfilters_mlx.commands.server_http import handler_class
    from qfilters_mlx.commands.server_requests import Served

    class Generator:
        cli_args = SimpleNamespace(allowed_origins=[], num_draft_tokens=3, max_tokens=8, temp=0.0,
                                   top_p=1.0, top_k=0, min_p=0.0, model=None)
        model_provider = SimpleNamespace(served=Served(vocab_size=100))

        def generate(self, request, args, progress_callback=None):
            from mlx_lm.generate import TextStateMachine

            ctx = SimpleNamespace(tool_parser=None, text_sm=TextStateMachine({"normal": []}),
                                  initial_state="normal",
                                  prompt=[1, 2], prompt_cache_count=0, stop=lambda: None)

            def tokens():
                if when == "after-a-token":
                    yield mlx_server.Response("Hi", 5, -0.1, None, ())
                raise GenerationFailed("generation failed: RuntimeError")

            return ctx, tokens()

    handler = handler_class(mlx_server)
    gen = Generator()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(gen, *a))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=30)
        body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": stream})
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read().decode()
        if not stream:
            assert r.status == 500 and json.loads(data)["error"]
        else:
            assert r.status == 200
            events = [e for e in data.split("\n\n") if e.strip()]
            assert events[-1].startswith("event: error\ndata: ")
            err = json.loads(events[-1].split("data: ", 1)[1])["error"]
            assert err["code"] == 500 and "generation failed" in err["message"]
            assert "[DONE]" not in data
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("render,why", [([], "renders to no tokens"),
                                        (ZeroDivisionError("integer division by zero"),
                                         "could not be rendered: ZeroDivisionError")])
def test_a_prompt_that_renders_to_nothing_or_fails_is_the_requests_error(render, why):
    """A (client's) chat template that renders no tokens, or raises anything while rendering:
    a 400 naming ``messages`` from the generation side, before the prompt reaches mlx-lm's
    batch (an empty prompt there raised inside the loop and restarted it)."""
    from types import SimpleNamespace

    import mlx_lm.server as mlx_server

    from qfilters_mlx.commands.server_errors import error_status
    from qfilters_mlx.commands.server_loop import generator_class
    from qfilters_mlx.commands.server_requests import RequestError, Served

    class Tokenizer:
        has_chat_template, has_tool_calling, has_thinking = True, False, False
        response_initial_state = None

        def apply_chat_template(self, messages, **kw):
            if isinstance(render, Exception):
                raise render
            return render

    gen = object.__new__(generator_class(mlx_server))
    gen.model_provider = SimpleNamespace(processor=None, served=Served(max_prompt_tokens=100),
                                         cli_args=SimpleNamespace(chat_template_args={},
                                                                  prefill_step_size=2048))
    request = mlx_server.CompletionRequest("chat", "", [{"role": "user", "content": "x"}], None, None)
    args = SimpleNamespace(chat_template_kwargs=None)
    with pytest.raises(RequestError, match=why) as info:
        gen._tokenize(Tokenizer(), request, args)
    assert info.value.field == "messages" and error_status(info.value) == 400


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(server_memory._malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_release_freed_returns_mlx_pool_and_the_c_heap():
    """After a request, what MLX and the C heap freed leaves the resident set: MLX's pool is
    emptied, and 96 MB of 32 KiB blocks (below glibc's mmap threshold, also the server's)
    freed under a live one (so glibc cannot give them back from the heap's top by itself) are
    handed back by the trim."""
    import ctypes

    import mlx.core as mx

    a = mx.ones((1 << 20,))
    mx.eval(a)
    del a
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(32 << 10) for _ in range(3072)]
    for p in blocks:
        ctypes.memset(p, 1, 32 << 10)
    last = libc.malloc(32 << 10)
    for p in blocks:
        libc.free(p)
    before = _rss()
    server_memory.release_freed()
    after = _rss()
    libc.free(last)
    assert mx.get_cache_memory() == 0
    assert before - after >= 64 << 20, (before, after)


@pytest.mark.skipif(server_memory._malloc_trim() is None, reason="the C library is not glibc")
def test_map_large_blocks_returns_freed_blocks_at_once():
    """After ``map_large_blocks`` a freed 64 KiB block leaves the resident set at once (its own
    mapping), where glibc's default keeps it in the heap; in a fresh process each, since the
    setting is the process's."""
    import subprocess
    import sys

    code = (
        "import ctypes, os, sys\n"
        "from qfilters_mlx.commands import server_memory\n"
        "if sys.argv[1] == 'mapped': assert server_memory.map_large_blocks()\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
        "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p\n"
        "libc.free.argtypes = [ctypes.c_void_p]\n"
        "blocks = [libc.malloc(64 << 10) for _ in range(1536)]\n"
        "for p in blocks: ctypes.memset(p, 1, 64 << 10)\n"
        "last = libc.malloc(64 << 10)\n"
        "before = rss()\n"
        "for p in blocks: libc.free(p)\n"
        "print((before - rss()) >> 20)\n")
    freed = {mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                                      check=True).stdout) for mode in ("default", "mapped")}
    assert freed["mapped"] >= 90 and freed["default"] <= 8, freed


@pytest.mark.parametrize("text, n", [("20G", 20 * 10**9), ("500M", 500 * 10**6), ("1.5g", 15 * 10**8),
                                     ("4096", 4096), ("64KB", 64_000)])
def test_the_disk_bound_reads_sizes_with_suffixes(text, n):
    args, _ = server.cache_parser().parse_known_args(["--prompt-cache-disk-bytes", text])
    assert args.prompt_cache_disk_bytes == n


@pytest.mark.parametrize("argv, why", [
    (["--prompt-cache-disk-bytes", "5G"], "name the folder"),
    (["--prompt-cache-disk-bytes", "lots", "--prompt-cache-dir", "{tmp}/d"], "not a byte count"),
    (["--prompt-cache-disk-bytes", "0", "--prompt-cache-dir", "{tmp}/d"], "must be >= 1"),
    (["--prompt-cache-disk-bytes", "inf", "--prompt-cache-dir", "{tmp}/d"], "not a byte count"),
    (["--prompt-cache-dir", "{tmp}/open"], "chmod 700"),
    (["--prompt-cache-dir", "{tmp}/file"], "file: not a folder"),
    (["--prompt-cache-dir", "{tmp}/file/d"], "prompt-cache-dir .*/file/d: Not a directory"),
    (["--prompt-cache-dir", "{tmp}/locked"], "another server uses this folder"),
])
def test_bad_disk_flags_are_refused_before_the_model_loads(argv, why, tmp_path, capsys, monkeypatch):
    import argparse
    import os
    import re

    from qfilters_mlx.commands.server_files import lock_folder

    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o755)
    (tmp_path / "file").write_text("x")
    held = lock_folder(tmp_path / "locked")  # (another server)
    parser = build_parser()
    monkeypatch.setattr("qfilters_mlx.commands.model_path.resolve_model",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("past the check")))
    args = argparse.Namespace(server_args=[a.format(tmp=tmp_path) for a in argv])
    with pytest.raises(SystemExit):
        server.run(parser, args)
    assert re.search(why, capsys.readouterr().err)
    held.close()


def test_a_good_folder_passes_the_checks_and_is_created_private(tmp_path, monkeypatch):
    import argparse
    import stat

    parser = build_parser()
    monkeypatch.setattr("qfilters_mlx.commands.model_path.resolve_model",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("past the check")))
    args = argparse.Namespace(server_args=["--prompt-cache-dir", str(tmp_path / "a" / "b")])
    with pytest.raises(RuntimeError, match="past the check"):
        server.run(parser, args)
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700
