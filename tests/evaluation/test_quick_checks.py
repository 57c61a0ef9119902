"""``eval --quick``'s own sanity checks (``check_quick``) against the rules written out
here: each flag must be False whenever its rule is broken, not
only True on a good run (the integration tier then re-checks the flags of a real
quick run from the numbers it saved, see ``tests/integration/test_eval_quick.py``).

Rules (docs/evaluation.md): with budget >= length every arm's perplexity equals
the full cache's within 1e-3 relative; the random arm rerun alone gives the same
per-token NLLs within 1e-4 absolute (batched vs alone: a different reduction order).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from qfilters_mlx.evaluation.run import check_quick

RNG = np.random.default_rng(0)
NLL = [float(x) for x in RNG.uniform(1, 4, 16)]


def good_results():
    full = float(np.exp(np.mean(NLL)))
    p = {"full": {"ppl": full, "nll": NLL}}
    for arm in ("qfilters-keys+1@r0", "l2norm@r0", "random@r0"):
        p[f"{arm}@512"] = {"ppl": full * (1 + 2e-4), "nll": NLL}  # budget covers the length
        p[f"{arm}@16"] = {"ppl": full * 1.5, "nll": [x + 0.3 for x in NLL]}
    p["random@r0@16"]["nll_rerun_alone"] = [x + 0.3 + 5e-5 for x in NLL]
    return {"settings": {"check_budget": 512}, "perplexity": p}


def rule_random_reproducible(res):
    cells = [c for k, c in res["perplexity"].items() if "nll_rerun_alone" in c]
    return bool(cells) and all(
        len(c["nll"]) == len(c["nll_rerun_alone"])
        and max(abs(a - b) for a, b in zip(c["nll"], c["nll_rerun_alone"])) <= 1e-4 for c in cells)


def rule_budget_covers(res):
    p, cb = res["perplexity"], res["settings"]["check_budget"]
    cover = [c for k, c in p.items() if k.endswith(f"@{cb}")]
    return bool(cover) and all(abs(c["ppl"] - p["full"]["ppl"]) <= 1e-3 * p["full"]["ppl"] for c in cover)


def broken(kind):
    res = good_results()
    p = res["perplexity"]
    if kind == "rerun differs":
        p["random@r0@16"]["nll_rerun_alone"][7] += 2e-4
    elif kind == "rerun missing":
        del p["random@r0@16"]["nll_rerun_alone"]
    elif kind == "rerun of another run":
        p["random@r0@16"]["nll_rerun_alone"] = [x + 0.31 for x in NLL]
    elif kind == "covering arm differs":
        p["l2norm@r0@512"]["ppl"] *= 1.002
    elif kind == "no covering arm":
        res["settings"]["check_budget"] = 1024
    return res


@pytest.mark.parametrize("kind", [None, "rerun differs", "rerun missing", "rerun of another run",
                                  "covering arm differs", "no covering arm"])
def test_quick_flags_follow_their_rules(kind):
    res = good_results() if kind is None else broken(kind)
    before = copy.deepcopy(res)
    got = check_quick(res)
    assert res == before  # a check reads, it does not change the results
    want = {"budget_covers_length_equals_full": rule_budget_covers(res),
            "random_reproducible": rule_random_reproducible(res)}
    assert got == want
    # each broken kind breaks exactly the flag it targets
    assert sum(not v for v in want.values()) == (0 if kind is None else 1)
