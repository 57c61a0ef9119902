"""Tiny random models for the query-observation tests, and each one's post-RoPE
queries recomputed independently from its attention module (q projection,
norms, RoPE at offset 0), without qfilters-mlx's hooks."""

import contextlib
import importlib
import sys
import types

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

VOCAB = 64


def _heads(x, B, L, H):
    return x.reshape(B, L, H, -1).transpose(0, 2, 1, 3)


def _import_olmo():
    """mlx_lm.models.olmo exits the process unless ``hf_olmo`` imports (it uses
    nothing from it): import it with a stand-in, then restore ``sys.modules``."""
    saved = {n: sys.modules.get(n) for n in ("hf_olmo", "mlx_lm.models.olmo")}
    import mlx_lm.models as pkg

    had_attr = hasattr(pkg, "olmo")
    sys.modules.setdefault("hf_olmo", types.ModuleType("hf_olmo"))
    try:
        return importlib.import_module("mlx_lm.models.olmo")
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
        if not had_attr and hasattr(pkg, "olmo"):
            delattr(pkg, "olmo")


def build(arch: str):
    """``(model, attention modules per layer or None, queries(attn, x) -> [B, H_q, L, D])``."""
    mx.random.seed(0)
    common = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB)
    if arch == "llama":
        from mlx_lm.models import llama as m
        model = m.Model(m.ModelArgs(model_type="llama", **common))
        q = lambda a, x: a.rope(_heads(a.q_proj(x), *x.shape[:2], a.n_heads))  # noqa: E731
    elif arch == "qwen3":
        from mlx_lm.models import qwen3 as m
        model = m.Model(m.ModelArgs(model_type="qwen3", max_position_embeddings=512, head_dim=16,
                                    tie_word_embeddings=True, rope_theta=10000.0, **common))
        q = lambda a, x: a.rope(a.q_norm(a.q_proj(x).reshape(*x.shape[:2], a.n_heads, -1)  # noqa: E731
                                         ).transpose(0, 2, 1, 3))
    elif arch == "olmo2":
        from mlx_lm.models import olmo2 as m
        model = m.Model(m.ModelArgs(model_type="olmo2", **common))
        q = lambda a, x: a.rope(_heads(a.q_norm(a.q_proj(x)), *x.shape[:2], a.n_heads))  # noqa: E731
    elif arch == "gemma2":
        from mlx_lm.models import gemma2 as m
        model = m.Model(m.ModelArgs(model_type="gemma2", head_dim=16, **common))
        q = lambda a, x: a.rope(_heads(a.q_proj(x), *x.shape[:2], a.n_heads))  # noqa: E731
    elif arch == "olmo":
        m = _import_olmo()
        model = m.Model(m.ModelArgs(model_type="olmo", d_model=64, n_layers=2, mlp_hidden_size=64,
                                    n_heads=4, vocab_size=VOCAB, embedding_size=VOCAB))
        q = lambda b, x: b.rope(_heads(mx.split(b.att_proj(x), 3, axis=-1)[0], *x.shape[:2], b.n_heads))  # noqa: E731
    elif arch == "plamo2":
        from mlx_lm.models import plamo2 as m
        model = m.Model(m.ModelArgs(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, hidden_size_per_head=16, intermediate_size=64,
                                    vocab_size=VOCAB, mamba_d_state=8, mamba_num_heads=4,
                                    mamba_chunk_size=16))

        def q(a, x):
            qd, kd = a.q_proj_dim, a.k_proj_dim
            qq = _heads(mx.split(a.qkv_proj(x), [qd, qd + kd], axis=-1)[0], *x.shape[:2], a.q_num_heads)
            return a.rope(mx.fast.rms_norm(qq, weight=None, eps=1e-6) * a.q_weight[:, None])
    elif arch.startswith("handwritten"):
        model = HandWritten(rope=arch.split("-")[1] if "-" in arch else "module")
        q = lambda a, x: a.rope(_heads(a.q_proj(x), *x.shape[:2], a.n_heads))  # noqa: E731
    else:
        raise ValueError(arch)
    mx.eval(model.parameters())
    return model, q


def attention_modules(model) -> list:
    """Per layer, ``(owner, attribute)`` of the module that receives the attention input
    (``None`` for layers without attention)."""
    out = []
    for layer in model.layers:
        for name in ("self_attn", "mixer", "attn"):
            sub = getattr(layer, name, None)
            if sub is not None and any(h in sub for h in ("q_proj", "qkv_proj")):
                out.append((layer, name))
                break
        else:
            out.append((layer, "attend") if hasattr(layer, "att_proj") else None)
    return out


@contextlib.contextmanager
def recording_inputs(model):
    """Record the input ``x [B, L, hidden]`` of every layer's attention (list per layer)."""
    seen = {i: [] for i in range(len(model.layers))}
    undo = []
    for i, spot in enumerate(attention_modules(model)):
        if spot is None:
            continue
        owner, name = spot
        if name == "attend":  # olmo: a method of the block
            orig = owner.attend

            def attend(x, *a, _o=orig, _i=i, **k):
                seen[_i].append(x)
                return _o(x, *a, **k)
            object.__setattr__(owner, "attend", attend)
            undo.append(lambda o=owner: object.__delattr__(o, "attend"))
        else:
            inner = getattr(owner, name)
            setattr(owner, name, _Recorder(inner, seen[i]))
            undo.append(lambda o=owner, n=name, m=inner: setattr(o, n, m))
    try:
        yield seen
    finally:
        for u in undo:
            u()


class _Recorder(nn.Module):
    def __init__(self, inner, log):
        super().__init__()
        self.inner = inner
        self._log = log

    def __call__(self, x=None, *args, **kwargs):
        if x is None:  # plamo2 passes hidden_states=
            x = kwargs.pop("hidden_states")
        self._log.append(x)
        return self.inner(x, *args, **kwargs)


def attention_of(model, i):
    owner, name = attention_modules(model)[i]
    return owner if name == "attend" else getattr(owner, name)


# --------------------------------------------------------------- hand-written model
def manual_rope(x, offset: int, base: float = 10000.0):
    """Non-traditional RoPE written with cos/sin (no mx.fast.rope): ``x [B, H, L, D]``."""
    D, L = x.shape[-1], x.shape[-2]
    inv = base ** (-mx.arange(0, D // 2, dtype=mx.float32) * 2 / D)
    ang = (offset + mx.arange(L, dtype=mx.float32))[:, None] * inv[None]
    cos, sin = mx.cos(ang), mx.sin(ang)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class _Attn(nn.Module):
    """Attention with no SDPA call at all: softmax(q k^T / sqrt(D) + mask) v by hand.

    ``rope``: ``"module"`` (nn.RoPE, i.e. mx.fast.rope), ``"manual"`` (cos/sin by
    hand: queries cannot be observed), ``"switch"`` (nn.RoPE for L <= 2, by hand
    beyond: a probe of short calls passes, a long prompt does not deliver).
    """

    def __init__(self, dim, heads, kv_heads, mode):
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.mode = heads, kv_heads, dim // heads, mode
        self.q_proj = nn.Linear(dim, heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o_proj = nn.Linear(heads * self.hd, dim, bias=False)
        self.rope = nn.RoPE(self.hd)

    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q, k, v = (_heads(p(x), B, L, h) for p, h in ((self.q_proj, self.n_heads),
                                                      (self.k_proj, self.n_kv), (self.v_proj, self.n_kv)))
        off = cache.offset if cache is not None else 0
        if self.mode == "manual" or (self.mode == "switch" and L > 2):
            q, k = manual_rope(q, off), manual_rope(k, off)
        else:
            q, k = self.rope(q, offset=off), self.rope(k, offset=off)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        r = self.n_heads // self.n_kv
        k, v = mx.repeat(k, r, axis=1), mx.repeat(v, r, axis=1)
        s = (q @ k.swapaxes(-1, -2)) * self.hd ** -0.5
        if isinstance(mask, mx.array):
            s = mx.where(mask, s, -1e9)
        elif mask == "causal":
            S = k.shape[2]
            s = mx.where(mx.arange(S)[None] <= (S - L + mx.arange(L))[:, None], s, -1e9)
        o = mx.softmax(s, axis=-1) @ v
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _Block(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.self_attn = _Attn(64, 4, 2, mode)
        self.norm = nn.RMSNorm(64)

    def __call__(self, x, mask, cache):
        return x + self.self_attn(self.norm(x), mask, cache)


class HandWritten(nn.Module):
    """A decoder whose attention is written by hand (no SDPA); ``rope``: one mode of
    :class:`_Attn` for every layer, or a list with one per layer."""

    def __init__(self, rope="module", n_layers=2):
        super().__init__()
        modes = [rope] * n_layers if isinstance(rope, str) else list(rope)
        self.embed = nn.Embedding(VOCAB, 64)
        self.layers = [_Block(m) for m in modes]
        self.args = types.SimpleNamespace(model_type="handwritten", hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, modes=modes)

    def __call__(self, inputs, cache=None):
        h = self.embed(inputs)
        cache = cache or [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.embed.as_linear(h)
