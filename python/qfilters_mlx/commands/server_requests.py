"""Checks of ``qfilters-mlx server``'s HTTP request bodies, before anything reaches generation.

mlx-lm's handler (``mlx_lm.server.APIHandler``) reads the fields of a chat or
text completion body and hands them to the generation thread, where a wrong
type or range either kills that thread (``"stop": 123``, ``"top_k": 10**9``) or
the process (a ``logit_bias`` token id outside the vocabulary indexes past the
logits). :func:`parse_body` turns the raw bytes into a JSON object or a
:class:`RequestError`; :func:`check_body` checks every field mlx-lm reads (its
names and meanings: OpenAI's chat and completions APIs plus mlx-lm's sampling
extensions) and returns the body with the optional ones normalised, so mlx-lm's
own parsing that runs after it sees only values it can serve.

Each error names the field (``RequestError.field``) and maps to an HTTP status:
400 for a bad value, 413 for a body over the size limit. Nothing here imports MLX.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from qfilters_mlx.commands.server_errors import RequestError
from qfilters_mlx.commands.server_messages import check_chat_template, check_messages

__all__ = ["MAX_BODY_BYTES", "MAX_JSON_DEPTH", "RequestError", "Served", "check_body", "parse_body",
           "rendered_chars"]

MAX_BODY_BYTES = 8 * 1024 * 1024
"""Default largest request body, in bytes (``--max-body-bytes``): far above any prompt this
server can hold in its context, far below what would exhaust its memory."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects accepted: chat bodies need about 6 levels (tools' JSON
schemas a few more); Python's parser raises ``RecursionError`` near 1,000."""

MAX_INT = 2**31 - 1  # int fields: what MLX's int32 indices and counters take
MAX_INT_DIGITS = 64
"""Longest integer literal in a body, in characters: far above any field's range; Python's
parser refuses over 4,300 digits with a ``ValueError`` of its own, and converting one costs
time quadratic in its length."""
MAX_CHARS_PER_TOKEN = 64
"""Characters of prompt text allowed per token of ``Served.max_prompt_tokens`` (checked
before tokenization; English prose is about 4 characters per token)."""
MAX_STOP_WORDS = 16
MAX_STOP_CHARS = 256
"""Longest stop string, in characters (each is matched at every generated token)."""
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 11  # mlx-lm's own limit


@dataclass
class Served:
    """What the server was started with, against which a body's names are checked.

    Attributes:
        model_names: the names that mean the served model (``"default_model"``, the
            ``--model`` value, its resolved path, the folder name).
        draft_names: names meaning the served draft model (empty: none served).
        adapter_names: names meaning the served adapters (empty: none).
        allow_switch: the operator's ``--allow-model-switch``: other names go to mlx-lm's loader.
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_rewind: tokens the caches can rewind after an eviction (a draft model's
            ``num_draft_tokens`` must not exceed it); ``None``: no limit (caches that never
            evict); 0: none (quantized eviction caches).
        has_draft: a draft model is served.
        default_draft_tokens: ``num_draft_tokens`` of a request that gives none.
        takes_images: the model has an image processor.
        allow_chat_template: the operator's ``--allow-chat-template``: a body may bring its
            own chat template (a Jinja program the server runs).
        max_prompt_tokens: longest prompt in tokens (checked after tokenization, on the
            generation side); ``None``: no limit.
        context: the model's context in tokens (``max_tokens`` is at most it minus the
            prompt); ``None``: unknown.
        max_tokens_limit: the operator's ``--max-tokens-limit`` (``None``: none).
        allowed_hosts: ``Host`` names accepted besides the loopback names
            (``--allowed-hosts``; ``"*"``: any).
    """

    model_names: set = field(default_factory=lambda: {"default_model"})
    draft_names: set = field(default_factory=set)
    adapter_names: set = field(default_factory=set)
    allow_switch: bool = False
    vocab_size: int = 2**31 - 1
    max_rewind: int | None = 0
    has_draft: bool = False
    default_draft_tokens: int = 3
    takes_images: bool = False
    allow_chat_template: bool = False
    max_prompt_tokens: int | None = None
    context: int | None = None
    max_tokens_limit: int | None = None
    allowed_hosts: set = field(default_factory=set)


def _depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` outside strings (a linear scan, no recursion)."""
    depth = deepest = 0
    in_str = escape = False
    for ch in text:
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _no_constant(name):
    raise RequestError("body", f"{name} is not a JSON number (NaN and Infinity are refused)")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise RequestError("body", f"an integer of {len(text.lstrip('-'))} digits (at most "
                                   f"{MAX_INT_DIGITS})")
    return int(text)


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body.

    Raises:
        RequestError: not UTF-8, nested deeper than :data:`MAX_JSON_DEPTH`, not JSON,
            ``NaN``/``Infinity`` literals, an integer over :data:`MAX_INT_DIGITS` digits, or
            not an object (400, field ``"body"``).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError("body", f"the body is not UTF-8 ({err.reason} at byte {err.start})") from None
    if _depth(text) > MAX_JSON_DEPTH:
        raise RequestError("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int)
    except json.JSONDecodeError as err:
        raise RequestError("body", f"invalid JSON: {err}") from None
    except (ValueError, RecursionError) as err:  # (what the parser raises besides)
        raise RequestError("body", f"invalid JSON: {err}"[:200]) from None
    if not isinstance(body, dict):
        raise RequestError("body", f"the body must be a JSON object, got {type(body).__name__}")
    return body


# ----------------------------------------------------------------- field checks
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body, name, lo, hi, *, allow=()):
    v = body.get(name)
    if v is None:
        return
    if not _is_int(v):
        raise RequestError(name, f"must be an integer, got {json.dumps(v)[:40]}")
    if v in allow:
        return
    if not lo <= v <= hi:
        raise RequestError(name, f"must be in [{lo}, {hi}], got {v}")


def _num(body, name, lo=-math.inf, hi=math.inf):
    v = body.get(name)
    if v is None:
        return
    if not _is_num(v):
        raise RequestError(name, f"must be a finite number, got {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise RequestError(name, f"must be in [{lo:g}, {hi:g}], got {v:g}")
    body[name] = float(v)  # (mlx-lm's own check wants floats for xtc_*)


def _bool(body, name):
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise RequestError(name, f"must be true or false, got {json.dumps(v)[:40]}")


def _names(body, name, accepted: set, allow_switch: bool, what: str) -> bool:
    """Check ``body[name]``; returns whether it names what the server was started with (then
    it is one of ``accepted``, compared as written and without a trailing ``/``)."""
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, str):
        raise RequestError(name, f"must be a string, got {json.dumps(v)[:40]}")
    served = v in accepted or (len(v) > 1 and v.rstrip("/") in accepted)
    if not served and not allow_switch:
        # Never touches the file system: the answer does not depend on whether `v` exists.
        raise RequestError(name, f"this server serves only the {what} it was started with; "
                                 "switching is disabled (operator flag: --allow-model-switch)")
    return served


def _max_tokens(body, served: Served):
    limit = MAX_INT if served.max_tokens_limit is None else served.max_tokens_limit
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if _is_int(v) and v > limit:
            raise RequestError(name, f"at most {limit} (server flag --max-tokens-limit), got {v}")
        _int(body, name, 1, MAX_INT)


def _stop(body):
    v = body.get("stop")
    if v is None:
        return
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise RequestError("stop", "must be a non-empty string or a list of non-empty strings")
    if len(words) > MAX_STOP_WORDS:
        raise RequestError("stop", f"at most {MAX_STOP_WORDS} stop strings, got {len(words)}")
    longest = max(len(w) for w in words)
    if longest > MAX_STOP_CHARS:
        raise RequestError("stop", f"a stop string is at most {MAX_STOP_CHARS} characters, got "
                                   f"{longest}")


def _logit_bias(body, vocab_size: int):
    v = body.get("logit_bias")
    if v is None:
        return
    if not isinstance(v, dict):
        raise RequestError("logit_bias", "must be an object mapping token ids to numbers")
    if len(v) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    for k, b in v.items():
        try:
            tok = int(k)
        except ValueError:
            raise RequestError("logit_bias", f"key {k[:40]!r} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise RequestError("logit_bias", f"token id {tok} is outside the vocabulary [0, {vocab_size})")
        if not _is_num(b) or not -100 <= b <= 100:
            raise RequestError("logit_bias", f"bias of token {tok} must be a finite number in "
                                             f"[-100, 100], got {json.dumps(b)[:40]}")


def rendered_chars(body: dict, endpoint: str) -> int:
    """Characters of every string the chat template (or the tokenizer) is given from
    ``body``: for a chat, every string in ``messages`` (roles, contents, names, tool calls,
    keys included), ``tools``, ``chat_template_kwargs`` and ``role_mapping``; for a text
    completion, ``prompt``. Iterative (no recursion)."""
    if endpoint == "text":
        return len(body["prompt"]) if isinstance(body.get("prompt"), str) else 0
    chars, stack = 0, [body.get(k) for k in ("messages", "tools", "chat_template_kwargs", "role_mapping")]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            chars += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return chars


def _prompt_chars(body, endpoint, max_tokens):
    """A prompt far longer than ``max_tokens`` tokens is refused before the generation thread
    renders and tokenizes it (which would stall every stream in progress): more than
    :data:`MAX_CHARS_PER_TOKEN` characters per allowed token in all the strings rendered
    (:func:`rendered_chars`)."""
    if max_tokens is None:
        return
    chars = rendered_chars(body, endpoint)
    field = "prompt" if endpoint == "text" else "messages"
    if chars > MAX_CHARS_PER_TOKEN * max_tokens:
        raise RequestError(field, f"{chars} characters of text to render is over the limit of "
                                  f"{MAX_CHARS_PER_TOKEN * max_tokens} ({MAX_CHARS_PER_TOKEN} per "
                                  f"token of the {max_tokens}-token prompt limit; roles, tools and "
                                  "template arguments count)")


def check_body(body: dict, endpoint: str, served: Served) -> dict:
    """Check every field of a chat (``endpoint="chat"``) or text (``"text"``) completion body.

    Returns the body with ``stream_options`` completed (``include_usage`` false when
    absent) and numbers of float fields as floats; unknown fields are left alone.

    Raises:
        RequestError: the first field that is missing, of the wrong type or out of range.
    """
    if endpoint == "chat":
        check_messages(body, served.takes_images)
    else:
        if not isinstance(body.get("prompt"), str) or not body["prompt"]:
            raise RequestError("prompt", "must be a non-empty string")
    _prompt_chars(body, endpoint, served.max_prompt_tokens)
    _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise RequestError("stream_options", "must be an object")
        if not isinstance(so.get("include_usage", False), (bool, type(None))):
            raise RequestError("stream_options", "include_usage must be true or false")
        so["include_usage"] = bool(so.get("include_usage"))
    default = _names(body, "model", served.model_names, served.allow_switch, "model")
    if default:
        body["model"] = "default_model"  # (mlx-lm keys models by the literal string)
    if _names(body, "draft_model", served.draft_names | {"default_model"}, served.allow_switch,
              "draft model"):
        body["draft_model"] = "default_model"
    if "adapters" in body:
        if _names(body, "adapters", served.adapter_names, served.allow_switch, "adapters") and \
                body.get("model", "default_model") == "default_model":
            del body["adapters"]  # (mlx-lm gives the served model its own adapters)
    _int(body, "n", 1, 1)
    _max_tokens(body, served)
    _num(body, "temperature", 0.0, 100.0)
    _num(body, "top_p", 0.0, 1.0)  # (0 and 1: no nucleus filtering, as mlx-lm reads them)
    _int(body, "top_k", 0, served.vocab_size)
    _num(body, "min_p", 0.0, 1.0)
    _num(body, "repetition_penalty", 0.0, 100.0)
    _num(body, "presence_penalty", -100.0, 100.0)
    _num(body, "frequency_penalty", -100.0, 100.0)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _int(body, name, 0, 1 << 20)
    _num(body, "xtc_probability", 0.0, 1.0)
    _num(body, "xtc_threshold", 0.0, 1.0)
    _bool(body, "logprobs")
    _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, allow=(-1,))
    _int(body, "seed", 0, 2**63 - 1)
    _stop(body)
    _logit_bias(body, served.vocab_size)
    check_chat_template(body, served.allow_chat_template)
    _int(body, "num_draft_tokens", 0, 64)
    drafting = served.has_draft or body.get("draft_model") not in (None, "default_model")
    ndt = body.get("num_draft_tokens", served.default_draft_tokens)
    if drafting and served.max_rewind is not None and ndt > served.max_rewind:
        why = ("quantized eviction caches (--kv-bits) cannot rewind rejected draft tokens"
               if served.max_rewind == 0 else
               f"the caches rewind {served.max_rewind} tokens after an eviction (server flag "
               "--max-rewind)")
        raise RequestError("num_draft_tokens", f"at most {served.max_rewind}: {why}")
    return body
