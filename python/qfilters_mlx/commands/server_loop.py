"""The generation loop of ``qfilters-mlx server``: mlx-lm's ``ResponseGenerator`` made to
survive its users.

:func:`generator_class`: the served model is loaded in the generation thread before the
server answers (a load error, e.g. a bad ``--filters`` file, stops the start); the
generation loop restarts after an exception that escaped mlx-lm's handling (in-flight
requests get a 500), instead of dying and leaving every later request a "generation thread
died"; a prompt over ``Served.max_prompt_tokens`` is refused (400) before any of it is
processed, and ``max_tokens`` is capped at the context left by the prompt
(:func:`cap_max_tokens`); a prompt is cut at every multiple of ``--prefill-step-size`` and
where its last user turn's text starts (:func:`~.server_calls.prefill_segments`), so it is
prefilled in the calls ``mlx_lm.generate`` makes, and the stored conversations learn those
boundaries (``expect_calls``) before they are asked for a cache.

Imported lazily (its users import ``mlx_lm.server``, which imports MLX).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque

from qfilters_mlx.commands.server_calls import prefill_segments
from qfilters_mlx.commands.server_errors import GenerationFailed, RequestError

__all__ = ["RESTARTS_ALLOWED", "RESTART_WINDOW_S", "cap_max_tokens", "generator_class"]

RESTARTS_ALLOWED = 5
RESTART_WINDOW_S = 30.0
"""The loop gives up (``/health`` 503, as mlx-lm's dead thread) after this many failures within
this many seconds: a fault that every pass hits is not retried forever."""


class _Reply:
    """The generation loop's end of a request's reply queue: marks the put of ``None`` (the
    request is done) on the generator, so that the cache stored right after it is logged once."""

    def __init__(self, queue, owner):
        self._queue, self._owner = queue, owner

    def put(self, item):
        if item is None:
            self._owner.prompt_cache.finishing = True
        self._queue.put(item)


def cap_max_tokens(args, prompt_tokens: int, served, default: int, field: str) -> None:
    """``args.max_tokens`` at most the model's context minus the prompt and the operator's
    ``--max-tokens-limit``: a request asking more is refused (400 naming the cap); one that
    asked nothing (``None``, set by the handler) gets the server's default within the cap."""
    caps = []
    context = getattr(served, "context", None)
    if context is not None:
        if prompt_tokens >= context:
            raise RequestError(field, f"the prompt is {prompt_tokens} tokens: it leaves no room "
                                      f"to answer in the model's context of {context}")
        caps.append(context - prompt_tokens)
    limit = getattr(served, "max_tokens_limit", None)
    if limit is not None:
        caps.append(limit)
    cap = min(caps) if caps else None
    if args.max_tokens is None:
        args.max_tokens = default if cap is None else min(default, cap)
    elif cap is not None and args.max_tokens > cap:
        why = [f"the model's context is {context}"] if context is not None else []
        why += [f"server flag --max-tokens-limit {limit}"] if limit is not None else []
        raise RequestError("max_tokens", f"at most {cap} for this prompt of {prompt_tokens} tokens "
                                         f"({'; '.join(why)}), got {args.max_tokens}")


def generator_class(server):
    """``mlx_lm.server.ResponseGenerator`` whose loop restarts after an uncaught exception,
    that refuses prompts over the served limit and cuts prompts at every multiple of the
    prefill step (see the module docstring)."""

    class RestartingResponseGenerator(server.ResponseGenerator):
        """mlx-lm's generator; its loop never dies from one request (see the module docstring).

        Attributes:
            loop_restarts: how many times the loop failed and was restarted.
        """

        def __init__(self, model_provider, prompt_cache):
            self._in_flight = weakref.WeakSet()
            self.loop_restarts = 0
            self._loaded = threading.Event()
            self._load_error = None
            limit = getattr(model_provider.cli_args, "prompt_cache_bytes", None)
            if limit is not None and hasattr(prompt_cache, "stored_stats"):
                prompt_cache.max_bytes = int(limit)  # (checked at every insert)
            if hasattr(prompt_cache, "prefill_step"):
                prompt_cache.prefill_step = int(model_provider.cli_args.prefill_step_size or 0)
            super().__init__(model_provider, prompt_cache)
            self._loaded.wait()
            if self._load_error is not None:  # the served model or its --filters: no server
                self.join()
                raise self._load_error

        def _tokenize(self, tokenizer, request, args):
            field = "messages" if request.request_type == "chat" else "prompt"
            try:  # (rendering depends only on the request: a failure is the request's)
                prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
            except Exception as err:  # noqa: BLE001
                raise RequestError(field, f"the prompt could not be rendered: "
                                          f"{type(err).__name__}: {err}"[:500]) from err
            if not prompt:
                raise RequestError(field, "the prompt renders to no tokens")
            served = getattr(self.model_provider, "served", None)
            limit = getattr(served, "max_prompt_tokens", None)
            if limit is not None and len(prompt) > limit:
                raise RequestError(field, f"the prompt is {len(prompt)} tokens, over the limit of "
                                          f"{limit} (the model's context unless the server sets "
                                          "--max-prompt-tokens)")
            cap_max_tokens(args, len(prompt), served, self.cli_args.max_tokens, field)
            if vision is None:  # (requests with images are served whole, without segments)
                turn = self._turn_start(tokenizer, request, args, prompt, types)
                segments, types = prefill_segments(segments, types, self.cli_args.prefill_step_size,
                                                   cuts=[turn] if turn else [])
                if hasattr(self.prompt_cache, "expect_calls"):
                    ends = [sum(len(p) for p in segments[:i + 1]) for i in range(len(segments))]
                    self.prompt_cache.expect_calls(prompt, ends)
            return prompt, segments, types, state, vision

        def _turn_start(self, tokenizer, request, args, prompt, types):
            """Where the last user message's text starts in ``prompt`` (after the template's
            header of that turn) when it follows earlier messages: the divergence from the
            rendering with that message empty, as mlx-lm finds the system prompt's end;
            ``None`` when not a chat continued from earlier turns or not found."""
            msgs = getattr(request, "messages", None)
            if (request.request_type != "chat" or not msgs or len(msgs) < 2 or "user" not in types
                    or msgs[-1].get("role") != "user" or msgs[-2].get("role") == "system"):
                return None
            kwargs = dict(getattr(self.model_provider.cli_args, "chat_template_args", None) or {})
            kwargs.update(args.chat_template_kwargs or {})
            try:
                head = tokenizer.apply_chat_template(
                    msgs[:-1] + [{"role": "user", "content": ""}], add_generation_prompt=False,
                    tools=request.tools, **{**kwargs, "tokenize": True})
            except Exception:  # noqa: BLE001 (no cut: the prompt rendered, this one did not)
                return None
            head = head["input_ids"] if isinstance(head, dict) else head
            at = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), None)
            return at if at is not None and 0 < at < len(prompt) - 1 else None

        def _next_request(self, timeout=None):
            request = super()._next_request(timeout)
            if request is None:
                return None
            self._in_flight.add(request[0])  # (weakly: the handler waiting on it holds it)
            return (_Reply(request[0], self), *request[1:])

        def _run_generate(self):
            try:  # in this thread: the arrays it loads belong to its MLX stream
                self.model_provider.load_default()
                open_disk = getattr(self.prompt_cache, "open_disk", None)
                if open_disk is not None:  # (--prompt-cache-dir: its files, for this model)
                    p = self.model_provider
                    flags = ("kv_bits", "kv_group_size", "quantized_kv_start", "max_kv_size")
                    open_disk(p.model_key, p.model, p.draft_model,
                              {k: getattr(self.cli_args, k, None) for k in flags})
            except Exception as err:  # noqa: BLE001 (raised again in the starting thread)
                self._load_error = err
                self._generation_failed = True
                return
            finally:
                self._loaded.set()
            failures = deque(maxlen=RESTARTS_ALLOWED)
            while not self._stop:
                try:
                    self._generate()  # (its load_default finds the model loaded)
                    return
                except Exception as err:  # noqa: BLE001 (restart the loop; requests learn why)
                    self.loop_restarts += 1
                    failures.append(time.monotonic())
                    logging.exception(f"qfilters-mlx: generation loop failed ({err!r}); in-flight "
                                      f"requests get 500, the loop restarts "
                                      f"(restart {self.loop_restarts})")
                    for reply in list(self._in_flight):  # (a finished request's queue is unread)
                        reply.put(GenerationFailed(f"generation failed: {type(err).__name__}"))
                    self._in_flight = weakref.WeakSet()
                    if len(failures) == RESTARTS_ALLOWED and failures[-1] - failures[0] < RESTART_WINDOW_S:
                        logging.error(f"qfilters-mlx: {RESTARTS_ALLOWED} generation loop failures within "
                                      f"{RESTART_WINDOW_S:g} s: giving up (/health answers 503)")
                        self._generation_failed = True
                        return

    return RestartingResponseGenerator
