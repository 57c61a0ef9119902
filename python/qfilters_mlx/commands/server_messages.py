"""Checks of the chat parts of ``qfilters-mlx server`` request bodies: messages, tools, and
client chat templates.

mlx-lm passes a body's ``chat_template_kwargs`` to the tokenizer's
``apply_chat_template``, so a client could run a Jinja program of its own in the server
(``chat_template``) or change what rendering returns (``tokenize``, ``return_dict``, ...).
Both are refused here, the template unless the operator allows it (``--allow-chat-template``).
A template that fails while rendering is answered 400 (``server_errors.error_status``).
"""

from __future__ import annotations

import json

from qfilters_mlx.commands.server_errors import RequestError

__all__ = ["MAX_MESSAGES", "TEMPLATE_RESERVED", "check_chat_template", "check_messages"]

MAX_MESSAGES = 4096
"""Most messages in one chat body (each is rendered by the chat template)."""

TEMPLATE_RESERVED = ("tokenize", "tools", "conversation", "messages", "add_generation_prompt",
                     "continue_final_message", "return_dict", "return_tensors",
                     "return_assistant_tokens_mask", "tokenizer_kwargs", "truncation", "padding",
                     "max_length", "documents")
"""``chat_template_kwargs`` keys the server sets itself (or that change what rendering
returns): refused in a body. ``chat_template`` is refused unless ``--allow-chat-template``."""


def check_chat_template(body: dict, allowed: bool) -> None:
    """``chat_template`` / ``chat_template_kwargs``: a client's template only if ``allowed``
    (moved into ``chat_template_kwargs``, where mlx-lm passes it to the tokenizer); no key
    of :data:`TEMPLATE_RESERVED`.

    Raises:
        RequestError: a client's template without ``allowed`` (field ``chat_template`` or
            ``chat_template_kwargs``), a template that is not a non-empty string, a reserved
            key, ``chat_template_kwargs`` not an object (400).
    """
    ctk = body.get("chat_template_kwargs")
    if ctk is not None and not isinstance(ctk, dict):
        raise RequestError("chat_template_kwargs", "must be an object")
    for key in TEMPLATE_RESERVED:
        if ctk and key in ctk:
            raise RequestError("chat_template_kwargs", f"{key!r} is set by the server")
    own = body.get("chat_template")
    inner = (ctk or {}).get("chat_template")
    if own is None and inner is None:
        return
    if not allowed:
        field = "chat_template" if own is not None else "chat_template_kwargs"
        raise RequestError(field, "this server renders prompts with the model's own chat template; "
                                  "a client's template is disabled (operator flag: "
                                  "--allow-chat-template)")
    for template in (own, inner):
        if template is not None and not (isinstance(template, str) and template):
            raise RequestError("chat_template", "must be a non-empty string")
    if own is not None:
        body["chat_template_kwargs"] = {**(ctk or {}), "chat_template": own}
        del body["chat_template"]


def _content(i, content, takes_images: bool):
    where = f"messages[{i}].content"
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise RequestError("messages", f"{where} must be a string, null or a list of parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError("messages", f"{where}[{j}] must be an object with a string 'type'")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise RequestError("messages", f"{where}[{j}].text must be a string")
        elif part["type"] in ("image_url", "input_image", "image"):
            if not takes_images:
                raise RequestError("messages", f"{where}[{j}]: this model takes no images")
            url = part.get("image_url", part.get("image"))
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise RequestError("messages", f"{where}[{j}]: images must be data: URLs "
                                               "(the server fetches nothing)")
        else:
            raise RequestError("messages", f"{where}[{j}]: unsupported part type {part['type'][:40]!r}")


def _tool_calls(i, calls):
    if calls is None:
        return
    if not isinstance(calls, list):
        raise RequestError("messages", f"messages[{i}].tool_calls must be a list")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise RequestError("messages", f"messages[{i}].tool_calls[{j}].function must be an object")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                json.loads(args)
            except json.JSONDecodeError:
                raise RequestError("messages", f"messages[{i}].tool_calls[{j}].function.arguments "
                                               "is not JSON") from None
        elif args is not None and not isinstance(args, dict):
            raise RequestError("messages", f"messages[{i}].tool_calls[{j}].function.arguments "
                                           "must be a JSON string or an object")


def check_messages(body: dict, takes_images: bool) -> None:
    """``messages`` (roles, contents, tool calls), ``tools`` and ``role_mapping`` of a chat body.

    Raises:
        RequestError: the first malformed entry, naming where it is (400).
    """
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages", "must be a non-empty list of messages")
    if len(msgs) > MAX_MESSAGES:
        raise RequestError("messages", f"at most {MAX_MESSAGES} messages, got {len(msgs)}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError("messages", f"messages[{i}] must be an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise RequestError("messages", f"messages[{i}].role must be a non-empty string")
        _content(i, m.get("content"), takes_images)
        _tool_calls(i, m.get("tool_calls"))
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools", "must be a list of objects")
    rm = body.get("role_mapping")
    if rm is not None and not (isinstance(rm, dict) and all(isinstance(x, str) for x in rm.values())):
        raise RequestError("role_mapping", "must be an object of strings")
