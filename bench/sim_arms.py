"""The simulator's arms shared by the benches of the simulator (held-out perplexity, recall
beyond the window, KV directions, head rule): StreamingLLM, the default (its filter made as a
first use makes it), the oracle and head groups (``heads="calibrated"``), and head groups whose
big heads keep their tokens by another rule (:data:`BIG_HEAD_RULES`)."""

from __future__ import annotations

import os
import re
import tempfile

from qfilters_mlx.config import KVCacheConfig
from qfilters_mlx.evaluation.oracle import oracle_arms
from qfilters_mlx.evaluation.simulate import MaskedArm

N_SINK = 4
BIG_HEAD_RULES = ("heads_norm", "heads_window", "heads_oracle")
"""Head groups at the budgets and windows of ``heads`` (the other heads unchanged: their window
and the filter's score), the big heads keeping, beside their sinks and that window: the keys of
lowest L2 norm (``heads_norm``; Devoto et al. 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression"), a recent window of their whole budget (``heads_window``:
``n_sink`` sinks and ``budget - n_sink - 1`` recent), or the keys the full cache attends most
after they leave the window (``heads_oracle``: :func:`attention_received`, a ceiling that sees
the future)."""


def big_head_rows(arm: MaskedArm, budget: int, n_layers: int, n_heads: int) -> list[list[bool]]:
    """``[layers][KV heads]``: the heads ``arm`` gives more than ``budget`` tokens (none for an
    arm of one budget)."""
    return [[x > budget for x in (b if isinstance(b, tuple) else (b,) * n_heads)]
            for b in (arm.budget(i) for i in range(n_layers))]


def default_filters(model, tokenizer):
    """The filter ``KVCacheBuilder.for_model`` makes on first use (a fresh filters home, so no
    stored file is found): ``(filters [L, H_kv, D], origin)``."""
    from qfilters_mlx.filters.default_filters import resolve_filters

    before = os.environ.get("QFILTERS_MLX_HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["QFILTERS_MLX_HOME"] = home
        try:
            r = resolve_filters(model, KVCacheConfig(), tokenizer=tokenizer)
        finally:
            if before is None:
                del os.environ["QFILTERS_MLX_HOME"]
            else:
                os.environ["QFILTERS_MLX_HOME"] = before
    return r.filters, r.origin


def config(arm: str, budget: int, hd: int) -> KVCacheConfig:
    if arm == "streaming_llm":
        return KVCacheConfig(method="streaming_llm", head_dim=hd, qfilters_budget=budget, qfilters_n_sink=N_SINK)
    return KVCacheConfig(method="qfilters", head_dim=hd, qfilters_budget=budget, qfilters_n_sink=N_SINK)


class Arms:
    """The simulator's arms of one run, by name: ``streaming_llm`` and ``default`` by their
    :func:`config` (the default filters made on first use, their origin recorded in
    ``results["default_filters"]`` when ``results`` is given), ``oracle`` from one full-cache
    pass per token sequence (:func:`oracle_arms`), ``heads`` by :meth:`heads_arm`."""

    def __init__(self, model, tokenizer, hd: int, results: dict | None = None):
        self.model, self.tokenizer, self.hd, self.results = model, tokenizer, hd, results
        self.filters, self.heads = None, {}

    def default_filters(self):
        if self.filters is None:
            self.filters, origin = default_filters(self.model, self.tokenizer)
            if self.results is not None:
                self.results["default_filters"] = re.sub(r"/tmp/\S+ ", "", origin)
        return self.filters

    def heads_arm(self, budget: int) -> MaskedArm:
        """``heads="calibrated"`` at ``budget``: :func:`resolve_heads` on the default's config,
        with the default's filters (the ranking's origin and the big heads in ``results``)."""
        from qfilters_mlx.cache.head_group_build import resolve_heads
        from qfilters_mlx.filters.head_store import resolve_head_ranking

        cfg = config("heads", budget, self.hd)
        if budget not in self.heads:
            self.heads[budget] = resolve_heads("calibrated", self.model, cfg, self.tokenizer)
            if self.results is not None:
                hb = self.heads[budget]
                self.results["heads_ranking"] = resolve_head_ranking(self.model, self.tokenizer).origin
                self.results.setdefault("heads", {})[str(budget)] = {
                    "big": [[i, h] for i, row in enumerate(hb.budgets) for h, x in enumerate(row)
                            if x > budget], "budgets": hb.budgets, "recents": hb.recents,
                    "total_tokens": hb.total_tokens}
        hb = self.heads[budget]
        return MaskedArm(cfg, filters=self.default_filters(), budgets=hb.budgets, recents=hb.recents)

    def big_rule_arm(self, arm: str, budget: int, tokens) -> MaskedArm:
        """An arm of :data:`BIG_HEAD_RULES` at ``budget`` on ``tokens`` (the oracle's scores are
        those of ``tokens``)."""
        import mlx.core as mx

        from qfilters_mlx.evaluation.oracle import attention_received

        base = self.heads_arm(budget)
        big = big_head_rows(base, budget, len(base.budgets), len(base.budgets[0]))
        if arm == "heads_window":
            recents = tuple(tuple(b - N_SINK - 1 if g else r for b, r, g in zip(bs, rs, gs))
                            for bs, rs, gs in zip(base.budgets, base.recents, big))
            return MaskedArm(base.config, filters=base.filters, budgets=base.budgets, recents=recents)
        if arm == "heads_norm":
            def big_score(layer, keys):
                return -mx.sqrt((keys.astype(mx.float32) ** 2).sum(axis=-1))
        elif arm == "heads_oracle":
            received = attention_received(self.model, list(tokens)[:-1], [base.windows])[0]

            def big_score(layer, keys):
                if keys.shape[2] != len(received[layer][0]):
                    raise ValueError(f"heads_oracle: scores for {len(received[layer][0])} keys, asked for "
                                     f"{keys.shape[2]}")
                return mx.array(received[layer])[None]
        else:
            raise ValueError(f"unknown big-head rule {arm!r}; known: {', '.join(BIG_HEAD_RULES)}")

        def score(layer, keys):
            return mx.where(mx.array(big[layer])[None, :, None], big_score(layer, keys), base.scores(layer, keys))

        return MaskedArm(base.config, score=score, budgets=base.budgets, recents=base.recents)

    def for_tokens(self, tokens, todo) -> dict:
        """``{(arm, budget): MaskedArm}`` for ``todo`` (``(arm, budget)`` pairs) on ``tokens``."""
        bs = [b for arm, b in todo if arm == "oracle"]
        oracles = dict(zip(bs, oracle_arms(self.model, tokens, [config("oracle", b, self.hd) for b in bs]))) \
            if bs else {}
        return {(arm, b): oracles[b] if arm == "oracle" else self.heads_arm(b) if arm == "heads" else
                self.big_rule_arm(arm, b, tokens) if arm in BIG_HEAD_RULES else MaskedArm(
                    config(arm, b, self.hd), filters=self.default_filters() if arm == "default" else None)
                for arm, b in todo}


def heads_note(results: dict) -> str:
    """One sentence for a results table: where the ``heads`` arm's ranking came from, and per
    budget its big heads, their budget, the other heads' budget, the recent windows and the
    tokens held (from ``results["heads"]``, written by :meth:`Arms.heads_arm`)."""
    ranking = results["heads_ranking"]
    where = f"`{ranking.split(' (')[0].rsplit('/', 1)[-1]}` ({ranking.split(' (', 1)[1]}"
    per = []
    for b, v in results["heads"].items():
        sizes = sorted({x for row in v["budgets"] for x in row})
        recent = sorted({x for row in v["recents"] for x in row})
        per.append(f"at budget {b} the {len(v['big'])} big heads (layer, KV head) "
                   f"{', '.join(f'({i}, {h})' for i, h in v['big'])} hold {sizes[-1]} tokens, the other heads "
                   f"{sizes[0]}, recent window {', '.join(map(str, recent))} for all, {v['total_tokens']} tokens "
                   f"held in all (one budget everywhere: {int(b) * sum(len(row) for row in v['budgets'])})")
    return ("Head groups (`heads`): `resolve_heads(\"calibrated\")`, the rule of docs/head-groups.md over "
            f"the stored ranking {where}, with the default's filters; " + "; ".join(per) + ".")
