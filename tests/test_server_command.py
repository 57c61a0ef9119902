"""``qfilters-mlx server``'s own part (no HTTP: that is tests/integration/test_server_smollm2.py):
cache flags to a configuration, refusals, the per-request log line, the pass-through of the rest."""

import pytest
from batch_helpers import config, tiny_llama

from qfilters_mlx.cache.builder import KVCacheBuilder
from qfilters_mlx.commands import server
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


def test_cli_routes_the_rest_to_the_server():
    args, extra = build_parser().parse_known_args(["server", "--budget", "8", "--host", "0.0.0.0"])
    assert args.passes_through and extra == ["--budget", "8", "--host", "0.0.0.0"]


def test_request_summary_counts_kept_tokens_and_bytes():
    import mlx.core as mx

    model = tiny_llama()
    caches = KVCacheBuilder.for_model(model, config())
    model(mx.array([list(range(40))]), cache=caches)
    line = server.request_summary(caches, 40)
    kv = sum(c.nbytes for c in caches) / 1e6
    assert "40 tokens seen, 16 kept per layer" in line and f"KV {kv:.2f} MB" in line
