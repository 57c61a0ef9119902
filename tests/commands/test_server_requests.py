"""The request checks of ``qfilters-mlx server`` (``commands/server_requests.py``), without HTTP:
each field's bad values are refused naming the field; good bodies pass (normalised as
documented); raw bodies that are not UTF-8, too deep or not objects are refused; the corpus
the integration tier sends agrees with what the checks say. The rule written out here: the
OpenAI chat/completions field types plus the ranges in the module (vocabulary from ``Served``)."""

import json
import math
from types import SimpleNamespace

import pytest

from helpers.server_corpus import CHAT, FIELD_VALUES, cases
from qfilters_mlx.commands.server_requests import MAX_JSON_DEPTH, RequestError, Served, check_body, parse_body

VOCAB = 1000
SERVED = Served(model_names={"default_model", "/models/m", "m"}, vocab_size=VOCAB, max_rewind=16)
GOOD = {"messages": [{"role": "user", "content": "Hi"}]}


def _refused(body, endpoint="chat", served=SERVED):
    with pytest.raises(RequestError) as info:
        check_body(body, endpoint, served)
    return info.value


@pytest.mark.parametrize("name,value", [(k, v) for k, vs in FIELD_VALUES.items() for v in vs],
                         ids=lambda x: str(x)[:20])
def test_every_bad_field_value_is_refused_naming_the_field(name, value):
    err = _refused({**GOOD, name: value})
    assert err.field == name and err.status == 400 and name in str(err)


@pytest.mark.parametrize("body", [
    {},
    {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "top_p": 1, "top_k": VOCAB,
     "min_p": 0.05, "max_tokens": 1, "stop": ["\n", "END"], "logit_bias": {"0": -100, str(VOCAB - 1): 100},
     "seed": 0, "logprobs": True, "top_logprobs": -1, "n": 1, "stream": True,
     "stream_options": {}, "model": "m", "draft_model": "default_model",
     "xtc_probability": 1, "xtc_threshold": 0.5, "presence_penalty": -2, "repetition_penalty": 1.1,
     "repetition_context_size": 0, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "system", "content": None},
                  {"role": "user", "content": [{"type": "text", "text": "a"}]},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                  {"role": "user", "content": "b"}],
     "tools": [{"type": "function"}], "role_mapping": {"user": "U: "}, "user": "ignored-field"},
])
def test_good_bodies_pass_and_are_normalised(body):
    body = {**GOOD, **body} if "messages" not in body else body
    out = check_body(json.loads(json.dumps(body)), "chat", SERVED)
    if "stream_options" in body:
        assert out["stream_options"] == {"include_usage": False}
    for name in ("temperature", "top_p", "xtc_probability"):
        if name in body:
            assert isinstance(out[name], float) and out[name] == body[name]


def test_text_bodies_need_a_prompt_string():
    assert check_body({"prompt": "x", "max_tokens": 3}, "text", SERVED)["prompt"] == "x"
    for prompt in (None, 5, "", [1, 2]):
        assert _refused({"prompt": prompt}, "text").field == "prompt"


def test_names_are_refused_the_same_whether_the_path_exists_or_not(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    a = _refused({**GOOD, "model": str(tmp_path)})
    b = _refused({**GOOD, "model": str(tmp_path / "missing")})
    assert str(a) == str(b) and a.status == b.status == 400
    switch = Served(model_names={"default_model"}, allow_switch=True, vocab_size=VOCAB)
    assert check_body({**GOOD, "model": str(tmp_path)}, "chat", switch)["model"] == str(tmp_path)


def test_draft_tokens_beyond_the_rewind_depth_are_refused():
    drafting = Served(vocab_size=VOCAB, has_draft=True, max_rewind=4, default_draft_tokens=3)
    check_body({**GOOD, "num_draft_tokens": 4}, "chat", drafting)
    assert _refused({**GOOD, "num_draft_tokens": 5}, served=drafting).field == "num_draft_tokens"
    shallow = Served(vocab_size=VOCAB, has_draft=True, max_rewind=2, default_draft_tokens=3)
    assert _refused(dict(GOOD), served=shallow).field == "num_draft_tokens"  # the default, 3 > 2


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    check_body({**GOOD, "logit_bias": {str(VOCAB - 1): 1}}, "chat", SERVED)
    for tok in (VOCAB, -1, 10**12):
        assert "vocabulary" in str(_refused({**GOOD, "logit_bias": {str(tok): 1}}))


@pytest.mark.parametrize("raw,why", [
    (b"\xff\xfe{}", "UTF-8"),
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "nested"),
    (b'{"a": "' + b"[" * 1000 + b'"}', None),  # brackets inside a string do not nest
    (b'{"t": NaN}', "NaN"),
    (b'{"t": -Infinity}', "Infinity"),
    (b"{", "invalid JSON"),
    (b"[]", "object"),
])
def test_raw_bodies(raw, why):
    if why is None:
        assert parse_body(raw) == {"a": "[" * 1000}
        return
    with pytest.raises(RequestError, match=why) as info:
        parse_body(raw)
    assert info.value.status == 400 and info.value.field == "body"


def test_numbers_must_be_finite():
    body = parse_body(b'{"temperature": 1e309}')  # json reads an overflowing literal as inf
    assert math.isinf(body["temperature"])
    assert _refused({**GOOD, **body}).field == "temperature"


def test_the_corpus_agrees_with_the_checks():
    """Every corpus case sent as a well-formed chat or text body is refused by these checks
    with the status and field the integration tier expects (the rest are transport cases)."""
    for case in cases():
        if case.raw is None or case.status != 400 or case.param in ("body", None) \
                or case.name.startswith("after-tokenization."):
            continue  # (raw cases: test_raw_bodies; the rest: refused after tokenization)
        endpoint = "chat" if case.path == CHAT else "text"
        with pytest.raises(RequestError) as info:
            check_body(parse_body(case.raw), endpoint, Served(vocab_size=49152, max_prompt_tokens=8192))
        assert (info.value.status, info.value.field) == (400, case.param), case.name


@pytest.mark.parametrize("digits", [65, 4301, 100_000])
def test_integers_with_many_digits_are_a_400_naming_the_body(digits):
    """Python's parser raises its own ValueError over 4,300 digits (not a JSONDecodeError);
    each such literal is refused before it is converted."""
    with pytest.raises(RequestError, match="digits") as info:
        parse_body(b'{"max_tokens": ' + b"7" * digits + b"}")
    assert info.value.status == 400 and info.value.field == "body"
    assert parse_body(b'{"seed": ' + b"7" * 64 + b"}")["seed"] == int("7" * 64)


def test_a_client_chat_template_needs_the_operator_flag_and_goes_where_mlx_lm_reads_it():
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    for body, field in (({**GOOD, "chat_template": template}, "chat_template"),
                        ({**GOOD, "chat_template_kwargs": {"chat_template": template}},
                         "chat_template_kwargs")):
        assert _refused(body).field == field
        out = check_body(dict(body), "chat", Served(vocab_size=100, allow_chat_template=True))
        assert out["chat_template_kwargs"] == {"chat_template": template} and "chat_template" not in out
    for key in ("tokenize", "return_dict", "tools", "add_generation_prompt"):
        assert _refused({**GOOD, "chat_template_kwargs": {key: False}}).field == "chat_template_kwargs"
    ok = check_body({**GOOD, "chat_template_kwargs": {"enable_thinking": False}}, "chat",
                    Served(vocab_size=100))
    assert ok["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(RequestError):
        check_body({**GOOD, "chat_template": ""}, "chat", Served(vocab_size=100, allow_chat_template=True))


def test_stop_strings_and_messages_have_limits():
    from qfilters_mlx.commands.server_messages import MAX_MESSAGES
    from qfilters_mlx.commands.server_requests import MAX_STOP_CHARS

    check_body({**GOOD, "stop": ["s" * MAX_STOP_CHARS]}, "chat", Served(vocab_size=100))
    assert _refused({**GOOD, "stop": ["ok", "s" * (MAX_STOP_CHARS + 1)]}).field == "stop"
    msgs = [{"role": "user", "content": "x"}]
    check_body({**GOOD, "messages": msgs * MAX_MESSAGES}, "chat", Served(vocab_size=100))
    assert _refused({**GOOD, "messages": msgs * (MAX_MESSAGES + 1)}).field == "messages"


def test_prompt_text_far_over_the_token_limit_is_refused_before_tokenization():
    from qfilters_mlx.commands.server_requests import MAX_CHARS_PER_TOKEN

    served = Served(vocab_size=100, max_prompt_tokens=10)
    limit = 10 * MAX_CHARS_PER_TOKEN
    check_body({"prompt": "a" * limit}, "text", served)
    with pytest.raises(RequestError, match="characters") as info:
        check_body({"prompt": "a" * (limit + 1)}, "text", served)
    assert info.value.field == "prompt"
    msgs = [{"role": "system", "content": "a" * (limit // 2)},
            {"role": "user", "content": [{"type": "text", "text": "b" * (limit // 2 + 1)}]}]
    with pytest.raises(RequestError, match="characters") as info:
        check_body({"messages": msgs}, "chat", served)
    assert info.value.field == "messages"
    check_body({"messages": msgs}, "chat", Served(vocab_size=100))  # (no limit: not checked)


def test_every_alias_of_what_is_served_becomes_default_model(tmp_path):
    """mlx-lm keys loaded models by the literal string: a name of the served model other than
    ``default_model`` would reload it (or unload it, when the name is not a path). Every alias
    the server was started with (the ``--model`` value, the resolved path, the folder name,
    with or without a trailing ``/``) becomes ``default_model``; so do the draft model's, and
    the served adapters' are dropped (mlx-lm gives the default model its own adapters). Under
    ``--allow-model-switch`` too."""
    from qfilters_mlx.commands.server import _aliases

    folder = tmp_path / "SmolLM2-135M-Instruct-f32"
    folder.mkdir()
    names = {"default_model"} | _aliases("my-model-id", folder)
    assert {str(folder), folder.name, "my-model-id", str(folder.resolve())} <= names
    draft, adapters = _aliases(str(tmp_path / "draft")), _aliases(str(tmp_path / "lora"))
    for switch in (False, True):
        served = Served(model_names=names, draft_names=draft, adapter_names=adapters,
                        allow_switch=switch, vocab_size=VOCAB, has_draft=True, max_rewind=16)
        for alias in (str(folder), str(folder) + "/", folder.name, "my-model-id", "default_model"):
            body = check_body({**GOOD, "model": alias, "draft_model": "draft",
                               "adapters": str(tmp_path / "lora")}, "chat", served)
            assert body["model"] == body["draft_model"] == "default_model" and "adapters" not in body
    other = check_body({**GOOD, "model": "/other"}, "chat",
                       Served(model_names=names, allow_switch=True, vocab_size=VOCAB))
    assert other["model"] == "/other"  # (another model: mlx-lm's loader, as asked)


def test_the_served_names_include_the_registry_name_and_the_folder(tmp_path, monkeypatch):
    """Started with no ``--model`` the server serves the default model: its registry name
    (``smollm2-135m``) is an alias as well as its folder; started with a registry name, that
    name is. Another registry name is not an alias."""
    import argparse

    from qfilters_mlx import KVCacheConfig
    from qfilters_mlx.assets.models import DEFAULT_MODEL, model_names
    from qfilters_mlx.commands import server
    from qfilters_mlx.commands.server import _served

    monkeypatch.setattr(server, "_CONFIG", KVCacheConfig())  # (what `run` sets from the flags)
    folder = tmp_path / "SmolLM2-135M-Instruct-f32"
    folder.mkdir()
    for given, expected in ((None, DEFAULT_MODEL), ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b")):
        args = argparse.Namespace(model=given, draft_model=None, adapter_path=None,
                                  allowed_hosts="", allow_model_switch=False,
                                  max_tokens_limit=None, num_draft_tokens=3,
                                  allow_chat_template=False, max_prompt_tokens=None)
        served = _served(args, folder, quantized=True)
        assert {expected, folder.name, str(folder), "default_model"} <= served.model_names
        others = set(model_names()) - {expected}
        assert not others & served.model_names


@pytest.mark.parametrize("where", ["role", "name", "tools", "chat_template_kwargs", "tool_calls",
                                   "content-part", "role_mapping"])
def test_the_character_limit_counts_every_string_the_template_renders(where):
    """A 3 MB ``role`` was rendered and tokenized (1.87M tokens) before the token limit saw
    it: every string of messages, tools, template arguments and role mapping counts (keys
    too), checked before rendering; the same body a character shorter passes."""
    from qfilters_mlx.commands.server_requests import MAX_CHARS_PER_TOKEN, rendered_chars

    served = Served(vocab_size=VOCAB, max_prompt_tokens=10)
    limit = 10 * MAX_CHARS_PER_TOKEN

    def body(n):
        big = "r" * n
        msg = {"role": "user", "content": "Hi"}
        out = {"messages": [msg]}
        if where == "role":
            msg["role"] = big
        elif where == "name":
            msg["name"] = big
        elif where == "tools":
            out["tools"] = [{"type": "function", "function": {"name": "f", "description": big}}]
        elif where == "chat_template_kwargs":
            out["chat_template_kwargs"] = {"enable_thinking": big}
        elif where == "tool_calls":
            out["messages"] = [{"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "f", "arguments": {"x": big}}}]}, msg]
        elif where == "content-part":
            msg["content"] = [{"type": "text", "text": big}]
        else:
            out["role_mapping"] = {"user": big}
        return out

    base = rendered_chars(body(0), "chat")
    check_body(body(limit - base), "chat", served)
    assert _refused(body(limit - base + 1), served=served).field == "messages"


def test_max_tokens_over_the_operators_limit_is_refused_naming_it():
    served = Served(vocab_size=VOCAB, max_tokens_limit=100)
    check_body({**GOOD, "max_tokens": 100}, "chat", served)
    for name in ("max_tokens", "max_completion_tokens"):
        err = _refused({**GOOD, name: 101}, served=served)
        assert err.field == name and "at most 100" in str(err) and "--max-tokens-limit" in str(err)


@pytest.mark.parametrize("prompt,asked,limit,got", [
    (100, 50, None, 50), (100, None, None, 8), (8190, None, None, 2), (100, 8092, None, 8092),
    (100, 8093, None, "at most 8092"), (100, 60, 50, "at most 50"), (8192, 1, None, "no room"),
])
def test_max_tokens_is_capped_at_the_context_minus_the_prompt(prompt, asked, limit, got):
    """On the generation side, once the prompt is tokenized (context 8,192; the server's
    default max_tokens 8): a request asking more than ``context - prompt`` (or the operator's
    limit) is refused naming the cap; one asking nothing gets the default within the cap."""
    from qfilters_mlx.commands.server_loop import cap_max_tokens

    args = SimpleNamespace(max_tokens=asked)
    served = Served(vocab_size=VOCAB, context=8192, max_tokens_limit=limit)
    if isinstance(got, int):
        cap_max_tokens(args, prompt, served, 8, "messages")
        assert args.max_tokens == got
    else:
        with pytest.raises(RequestError, match=got):
            cap_max_tokens(args, prompt, served, 8, "messages")


@pytest.mark.parametrize("max_rewind,ndt,refused", [(None, 64, False), (0, 0, False), (0, 3, True)])
def test_a_draft_model_request_never_crashes_on_caches_without_a_rewind_depth(max_rewind, ndt, refused):
    """``--method full`` (caches that never evict: no depth, no limit) and ``--kv-bits``
    (quantized eviction caches: no journal, depth 0) with a requested ``draft_model``: the
    depth check compared an int with ``None`` (TypeError in the handler)."""
    served = Served(vocab_size=VOCAB, allow_switch=True, max_rewind=max_rewind)
    body = {**GOOD, "draft_model": "/some/draft", "num_draft_tokens": ndt}
    if refused:
        err = _refused(body, served=served)
        assert err.field == "num_draft_tokens" and "quantized" in str(err)
    else:
        check_body(body, "chat", served)
