"""RULER's synthetic tasks (Hsieh et al. 2024, arXiv:2404.06654; templates and generators of
NVIDIA/RULER ``scripts/data/synthetic``), deterministic from a seed.

A generator ``(sources, seed, n) -> Sample`` builds one sample whose haystack has ``n``
units (sentences, needles, list items or words); :func:`qfilters_mlx.evaluation.ruler.prompt.fit`
picks the largest ``n`` that fits a context length. Everything drawn from the seed that the
answer depends on (keys, values, chains, word choices) is drawn before anything that depends
on ``n``, so the expected answers of a seed do not change while ``n`` is searched.

Tasks (RULER's names): ``niah_single_1`` (noise haystack), ``niah_single_2`` / ``_3``
(prose; numbers / UUIDs), ``niah_multikey_1`` (prose, 3 distractor needles),
``niah_multikey_2`` / ``_3`` (a haystack of other needles; numbers / UUID keys and values),
``niah_multivalue`` (4 values for one key), ``niah_multiquery`` (4 keys asked),
``vt`` (1 chain of 4 hops in noise), ``cwe`` (10 words x 30 among words x 3), ``fwe``
(zeta-distributed coded words, alpha 2). RULER's QA tasks (SQuAD, HotpotQA) need data
downloads and are left out; RULER's few-shot example in ``cwe``/``vt`` is left out (it would
add its own context to every sample).

``max_new_tokens`` is below RULER's (128 for NIAH, 120 for cwe, 50 for fwe; vt's 30 kept):
the answers fit in it (a 7-digit number, 4 values, 10 words) and decoding stops at EOS.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from qfilters_mlx.evaluation.ruler.haystack import NOISE, key_words, random_number, random_uuid, word_list

__all__ = ["Sample", "Sources", "TASKS", "TooFewUnits", "quick_tasks"]


class TooFewUnits(ValueError):
    """The haystack size is too small for the task to have its answer (``fit`` grows it)."""


@dataclass(frozen=True)
class Sample:
    """One RULER sample: ``context`` (instruction + haystack, compressed), ``question`` and
    ``answer_prefix`` (outside the compression), the expected ``outputs`` (all must appear in
    the answer for a score of 100) and the answer length limit in tokens."""

    task: str
    context: str
    question: str
    answer_prefix: str
    outputs: tuple
    max_new_tokens: int


@dataclass(frozen=True)
class Sources:
    """Haystack material: the prose sentences (:func:`.haystack.essay_sentences`)."""

    sentences: tuple


# -------------------------------------------------------------------- needle in a haystack
NIAH_CONTEXT = ("Some special magic {v} are hidden within the following text. Make sure to memorize it. "
                "I will quiz you about the {v} afterwards.\n{context}\n")
NIAH_QUESTION = "What are all the special magic {v} for {query} mentioned in the provided text?"
NIAH_PREFIX = " The special magic {v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {v} for {key} is: {value}."


def _keys(rng, kind: str, n: int, avoid=()) -> list[str]:
    if kind == "uuids":
        return [random_uuid(rng) for _ in range(n)]
    out: list[str] = []
    while len(out) < n:
        k = key_words(rng, 1)[0]
        if k not in out and k not in avoid:
            out.append(k)
    return out


def _value(rng, kind: str) -> str:
    return random_uuid(rng) if kind == "uuids" else random_number(rng)


def _join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _insert(rng, units: list[str], items: list[str]) -> list[str]:
    """``items`` inserted in ``units`` at positions drawn uniformly (order of ``items`` kept)."""
    at = sorted(rng.randint(0, len(units)) for _ in items)
    out, prev = [], 0
    for pos, item in zip(at, items):
        out += units[prev:pos] + [item]
        prev = pos
    return out + units[prev:]


def niah(sources: Sources, seed: str, n: int, *, task: str, haystack: str, key: str = "words",
         value: str = "numbers", num_k: int = 1, num_v: int = 1, num_q: int = 1,
         max_new_tokens: int = 32) -> Sample:
    """RULER's ``niah.py``: needles ``One of the special magic {numbers|uuids} for {key} is:
    {value}.`` at uniform random positions of a haystack of ``n`` units (``"noise"``: RULER's
    repeated sentence; ``"essay"``: consecutive prose sentences from a random start, cyclically;
    ``"needle"``: needles of other keys), ``num_k`` keys with ``num_v`` values each, the
    first ``num_q`` keys asked.

    Raises:
        ValueError: the prose has fewer than ``n`` sentences.
    """
    rng = random.Random(seed)
    keys = _keys(rng, key, num_k)
    values = [[_value(rng, value) for _ in range(num_v)] for _ in keys]
    needles = [NEEDLE.format(v=value, key=k, value=x) for k, vs in zip(keys, values) for x in vs]
    rng.shuffle(needles)
    query = keys[:num_q]
    outputs = tuple(x for vs in values[:num_q] for x in vs)
    if haystack == "noise":
        units, sep = [NOISE] * n, " "
    elif haystack == "essay":
        if n > len(sources.sentences):
            raise ValueError(f"{task}: the prose haystack has {len(sources.sentences)} sentences, "
                             f"{n} needed")
        start = int(rng.random() * len(sources.sentences))  # (cyclic: grows with n)
        units = [sources.sentences[(start + i) % len(sources.sentences)] for i in range(n)]
        sep = " "
    elif haystack == "needle":
        others = _keys(rng, key, n, avoid=keys)
        units, sep = [NEEDLE.format(v=value, key=k, value=_value(rng, value)) for k in others], "\n"
    else:
        raise ValueError(f"unknown haystack {haystack!r}")
    context = sep.join(_insert(rng, units, needles))
    q = _join_query(query)
    return Sample(task, NIAH_CONTEXT.format(v=value, context=context), NIAH_QUESTION.format(v=value, query=q),
                  NIAH_PREFIX.format(v=value, query=q), outputs, max_new_tokens)


# ------------------------------------------------------------------ variable tracking
VT_CONTEXT = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
             "are assgined the value {query}, they are: ")  # (RULER's spelling)


def variable_tracking(sources: Sources, seed: str, n: int, *, task: str = "vt", hops: int = 4,
                      max_new_tokens: int = 30) -> Sample:
    """RULER's ``variable_tracking.py``: one chain ``VAR A = 12345``, ``VAR B = VAR A``, ...
    (``hops`` hops, 5-letter upper-case names) in ``n`` noise sentences, lines in order."""
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    context = "\n".join(_insert(rng, [NOISE] * n, chain))
    return Sample(task, VT_CONTEXT.format(context=context), VT_QUESTION.format(query=value),
                  VT_PREFIX.format(num_v=len(names), query=value), tuple(names), max_new_tokens)


# ------------------------------------------------------------ common-words extraction
CWE_CONTEXT = ("Below is a numbered list of words. In these words, some appear more often than others. "
               "Memorize the ones that appear most often.\n{context}\n")
CWE_QUESTION = "Question: What are the {k} most common words in the above list?"
CWE_PREFIX = " Answer: The top {k} words that appear most often in the list are:"


def common_words(sources: Sources, seed: str, n: int, *, task: str = "cwe", num_cw: int = 10,
                 freq_cw: int = 30, freq_ucw: int = 3, max_new_tokens: int = 64) -> Sample:
    """RULER's ``common_words_extraction.py``: ``num_cw`` words ``freq_cw`` times each and
    ``n`` other words ``freq_ucw`` times each, shuffled, as a numbered list; the words are the
    ``wonderwords`` nouns, adjectives and verbs (sorted, unique, shuffled by the seed)."""
    rng = random.Random(seed)
    pool = sorted(set(word_list("noun")) | set(word_list("adjective")) | set(word_list("verb")))
    rng.shuffle(pool)
    common, rare = pool[:num_cw], pool[num_cw:num_cw + n]
    if len(rare) < n:
        raise ValueError(f"{task}: {n} uncommon words needed, the word lists hold {len(rare)}")
    items = common * freq_cw + rare * freq_ucw
    random.Random(f"{seed}-{n}").shuffle(items)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    return Sample(task, CWE_CONTEXT.format(context=context), CWE_QUESTION.format(k=num_cw),
                  CWE_PREFIX.format(k=num_cw), tuple(common), max_new_tokens)


# ---------------------------------------------------------- frequent-words extraction
FWE_CONTEXT = ("Read the following coded text and track the frequency of each coded word. Find the three "
               "most frequently appeared coded words. {context}\n")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
                "most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def frequent_words(sources: Sources, seed: str, n: int, *, task: str = "fwe", alpha: float = 2.0,
                   vocab_size: int = 2000, word_len: int = 6, max_new_tokens: int = 32) -> Sample:
    """RULER's ``freq_words_extraction.py``: ``vocab_size`` random ``word_len``-letter coded
    words ranked by a seeded shuffle, rank ``k`` (1-based) repeated
    ``int(n * k**-alpha / zeta(alpha))`` times, shuffled; rank 1 is the noise word ``...``,
    the answer is ranks 2 to 4.

    Raises:
        TooFewUnits: ``n`` too small for ranks 2 to 5 to have distinct counts.
    """
    from scipy.special import zeta

    rng = random.Random(seed)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_len)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."
    k = np.arange(1, vocab_size + 1)
    counts = (n * k ** -alpha / zeta(alpha)).astype(int)
    if not (counts[1] > counts[2] > counts[3] > counts[4]):
        raise TooFewUnits(f"{task}: {n} words do not rank the three answers apart")
    text = [w for w, c in zip(words, counts) for _ in range(c)]
    random.Random(f"{seed}-{n}").shuffle(text)
    return Sample(task, FWE_CONTEXT.format(context=" ".join(text)), FWE_QUESTION, FWE_PREFIX,
                  tuple(words[1:4]), max_new_tokens)


Generator = Callable[[Sources, str, int], Sample]


def _niah(task, **kw) -> Generator:
    return partial(niah, task=task, **kw)


TASKS: dict[str, Generator] = {
    "niah_single_1": _niah("niah_single_1", haystack="noise", max_new_tokens=24),
    "niah_single_2": _niah("niah_single_2", haystack="essay", max_new_tokens=24),
    "niah_single_3": _niah("niah_single_3", haystack="essay", value="uuids", max_new_tokens=48),
    "niah_multikey_1": _niah("niah_multikey_1", haystack="essay", num_k=4, max_new_tokens=24),
    "niah_multikey_2": _niah("niah_multikey_2", haystack="needle", max_new_tokens=24),
    "niah_multikey_3": _niah("niah_multikey_3", haystack="needle", key="uuids", value="uuids",
                             max_new_tokens=48),
    "niah_multivalue": _niah("niah_multivalue", haystack="essay", num_v=4, max_new_tokens=64),
    "niah_multiquery": _niah("niah_multiquery", haystack="essay", num_k=4, num_q=4, max_new_tokens=64),
    "vt": partial(variable_tracking, task="vt"),
    "cwe": partial(common_words, task="cwe"),
    "fwe": partial(frequent_words, task="fwe"),
}
"""RULER's synthetic tasks, in RULER's order."""


def quick_tasks() -> dict[str, Generator]:
    """The tasks at sizes that fit a few hundred tokens (CI): ``cwe`` with 3 words x 4 among
    words x 1, ``fwe`` over 50 coded words; the others as in :data:`TASKS`."""
    out = dict(TASKS)
    out["cwe"] = partial(common_words, task="cwe", num_cw=3, freq_cw=4, freq_ucw=1)
    out["fwe"] = partial(frequent_words, task="fwe", vocab_size=50)
    return out
