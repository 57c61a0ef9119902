"""The exact checks of ``qfilters-mlx eval ruler --quick`` (each a bool)."""

from __future__ import annotations

from qfilters_mlx.evaluation.ruler.prompt import fit, sample_tokens
from qfilters_mlx.evaluation.ruler.tasks import TASKS

__all__ = ["mlx_lm_greedy", "quick_checks"]


def mlx_lm_greedy(model, tokenizer, prompt: list[int], max_tokens: int) -> str:
    """Greedy answer of plain mlx-lm (``generate_step``, its own ``KVCache``), cut before the
    first end-of-sequence token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    ids = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                sampler=lambda logits: mx.argmax(logits, axis=-1)):
        tok = int(tok)
        if tok in eos:
            break
        ids.append(tok)
    return tokenizer.decode(ids)


def quick_checks(model, tokenizer, sources, settings, records: list[dict], tasks=None) -> dict[str, bool]:
    """``full_equals_mlx_lm``: every sample's full-cache answer is plain mlx-lm's greedy answer (its
    beginning, up to where every expected string is written, when the answer is right);
    ``ratio0_equals_full``: every compress-once arm at ratio 0 answers as the full cache (greedy
    answer, and teacher-forced log-likelihood within 1e-4 relative);
    ``generators_deterministic``: each sample regenerated from its seed is the same;
    ``answers_in_context``: every expected answer occurs in its sample's context."""
    tasks = TASKS if tasks is None else tasks
    checks = {"full_equals_mlx_lm": True, "ratio0_equals_full": True, "generators_deterministic": True,
              "answers_in_context": True}
    records = [r for r in records if "does_not_fit" not in r]
    if not records:
        return {k: False for k in checks}
    for r in records:
        build = lambda m, r=r: tasks[r["task"]](sources, r["seed"], m)  # noqa: E731
        sample, n = fit(build, tokenizer, r["length"])
        again, _ = fit(build, tokenizer, r["length"])
        checks["generators_deterministic"] &= (sample == again and n == r["units"]
                                               and list(sample.outputs) == r["outputs"])
        checks["answers_in_context"] &= all(o in sample.context for o in sample.outputs)
        context, question = sample_tokens(tokenizer, sample)
        full = mlx_lm_greedy(model, tokenizer, context + question, sample.max_new_tokens)
        ans = r["answers"]["full"]
        checks["full_equals_mlx_lm"] &= full == ans or (r["scores"]["full"] == 1.0 and full.startswith(ans))
        zero = [k for k in r["answers"] if k.startswith("compress_once/") and k.endswith("@0")]
        if 0.0 in settings.ratios and not zero:
            checks["ratio0_equals_full"] = False
        checks["ratio0_equals_full"] &= all(r["answers"][k] == r["answers"]["full"] for k in zero)
        full_ll = r["forced"]["full"]["loglik"]
        checks["ratio0_equals_full"] &= all(abs(r["forced"][k]["loglik"] - full_ll) <= 1e-4 * abs(full_ll)
                                            for k in zero)
    return {k: bool(v) for k, v in checks.items()}
