"""RULER-style synthetic prompts at an exact token count, generated from templates and a seed (no download).

The families and their settings are RULER's ``scripts/synthetic.yaml``; templates, needle sentences, answer
prefixes and generation budgets are its ``scripts/data/synthetic/constants.py``; how each family is built follows
its generators ``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py`` and
``freq_words_extraction.py`` (NVIDIA/RULER, commit c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a). kveval's own code;
where it departs from RULER, it says so below.

Families (:data:`FAMILIES`):

* ``niah_single_1`` / ``_2`` / ``_3``: one needle "One of the special magic numbers for {key} is: {value}." in a
  haystack of repeated noise ("The grass is green. ...", ``_1``) or of the config's corpus (the essay, ``_2``:
  number values, ``_3``: UUID values); word keys are ``adjective-noun`` pairs.
* ``niah_multikey_1``: four needles with four keys in the corpus, one asked; the other three are distractors.
  ``niah_multikey_2`` / ``_3``: the haystack is itself needles with other keys (word keys and number values /
  UUID keys and UUID values).
* ``niah_multivalue``: four values for one key, all asked. ``niah_multiquery``: four keys, all asked.
* ``vt`` (variable tracking): a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) in the noise; the answer
  is every variable that holds the value. One worked example (RULER's in-context example) precedes the task.
* ``cwe`` (common words extraction): a numbered list of words, 10 of them repeated more often than the rest (6
  times against once below 4096 tokens, 30 against 3 from 4096); the answer is those 10. One worked example first.
* ``fwe`` (frequent words extraction): coded six-letter words with Zipf frequencies (alpha 2), the most frequent
  one replaced by dots; the answer is the three most frequent words.

Layout (the model's chat template around the user turn when the tokenizer has one, as
:func:`kveval.tasks.common.prompts.chat_parts` makes it)::

    [template prefix] [worked example] instruction [context] question [end of user turn] answer prefix | answer

Exact length: the context is assembled in token space (every piece tokenized once on its own, with its leading
space or newline) and absorbs the budget, so ``len(input_ids) == prompt_tokens`` by construction:

* haystack families (needles, ``vt``): filler units (noise paragraphs or needle sentences on their own lines,
  corpus sentences after a space) are taken in order and the surplus is cut from the front of the first one (the
  haystack reads as an excerpt, as in the needle task); needles are never cut and go at true unit boundaries
  (depth 0 is after the fragment the cut leaves, when it leaves one).
* list families (``cwe``, ``fwe``): the largest list that fits is found by bisection on exact token counts, then
  (``cwe``) single extra words fill what they can, and the last few tokens are newlines before the question.
  RULER instead stops below the length; its counts per word are kept.

Depth: with ``depth=None``, each needle goes at a depth drawn without replacement from RULER's 40 depths (0, 3,
5, ..., 100 %), as RULER's ``niah.py`` does for the essay haystack (kveval uses the same draw for every haystack
and for the ``vt`` chain, whose links stay in order). With ``depth=d``, every needle that holds (part of) the
answer goes at the unit boundary nearest ``d`` × the filler tokens (adjacent, in order), distractors at random
depths; for ``vt``, the first link (the one with the value) goes at ``d`` and the other links after it. ``cwe``
and ``fwe`` have no needle and ignore the depth.

References: ``answers`` are RULER's (the strings the score looks for); ``reference`` is one answer text,
scored teacher-forced: values in the order they appear in the context, separated by ", "; ``vt``'s variables in
chain order, separated by spaces; ``cwe``'s words numbered ("1. apple 2. river ...") in order of first
appearance; ``fwe``'s words from the most frequent down.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kveval.errors import KvevalError
from kveval.tasks.common.prompts import MARKER, PASSKEY_FILLER, SentenceTokens, chat_parts
from kveval.tasks.ruler.words import ADJECTIVES, NOUNS, WORDS

DEPTH_GRID = tuple(round(100 * i / 39) / 100 for i in range(40))
"""RULER's needle depths: ``np.round(np.linspace(0, 100, 40))`` percent, as fractions."""

NOISE = " ".join(PASSKEY_FILLER)
"""RULER's ``noise`` haystack paragraph, repeated on its own lines."""

NEEDLE = "One of the special magic {type_plural} for {key} is: {value}."
_TYPE_NAMES = {"numbers": ("numbers", "number"), "words": ("words", "word"), "uuids": ("uuids", "uuid")}

VT_HOPS = 4
CWE_COMMON = 10
FWE_ALPHA = 2.0
FWE_WORD_LEN = 6
ZETA_ALPHA = math.pi ** 2 / 6  # Riemann zeta(2), the Zipf normaliser RULER takes from scipy


@dataclass(frozen=True)
class Family:
    """One RULER task configuration: ``kind`` (``niah``, ``vt``, ``cwe``, ``fwe``), RULER's generation budget
    (``tokens_to_generate``) and metric (``all`` / ``any``, :mod:`kveval.tasks.ruler.scoring`), and for needles
    the haystack (``noise``, ``essay``, ``needle``), key and value types and counts."""

    name: str
    kind: str
    tokens_to_generate: int
    metric: str = "all"
    haystack: str | None = None
    key_type: str = "words"
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("niah_single_1", "niah", 128, haystack="noise"),
    Family("niah_single_2", "niah", 128, haystack="essay"),
    Family("niah_single_3", "niah", 128, haystack="essay", value_type="uuids"),
    Family("niah_multikey_1", "niah", 128, haystack="essay", num_keys=4),
    Family("niah_multikey_2", "niah", 128, haystack="needle"),
    Family("niah_multikey_3", "niah", 128, haystack="needle", key_type="uuids", value_type="uuids"),
    Family("niah_multivalue", "niah", 128, haystack="essay", num_values=4),
    Family("niah_multiquery", "niah", 128, haystack="essay", num_keys=4, num_queries=4),
    Family("vt", "vt", 30, haystack="noise"),
    Family("cwe", "cwe", 120),
    Family("fwe", "fwe", 50),
)}
"""RULER's synthetic tasks (``scripts/synthetic.yaml``) but its two QA tasks, by RULER's names."""


@dataclass(frozen=True)
class Sample:
    """One built prompt. Token indices are into ``input_ids``; ``answer_spans`` / ``distractor_spans`` are
    ``(start, length)`` of the inserted needles (or ``vt`` links) that hold the answer / that do not; the haystack
    (or list) is ``input_ids[context_start : context_start + context_len]``; ``filler_tokens`` its filler part
    (without the needles); ``answer_depths`` where each answer needle went (its filler tokens before it /
    ``filler_tokens``)."""

    family: str
    input_ids: list[int]
    answers: tuple[str, ...]
    reference: str
    answer_ids: list[int]
    query: str
    depth: float | None
    context_start: int
    context_len: int
    filler_tokens: int
    answer_spans: tuple[tuple[int, int], ...] = ()
    distractor_spans: tuple[tuple[int, int], ...] = ()
    answer_depths: tuple[float, ...] = ()


class Pieces:
    """A tokenizer with a memo of the ids of short, recurring pieces (numbers, words, noise paragraphs)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._memo: dict[str, list[int]] = {}
        newline = self.encode("\n")
        if not newline:
            raise KvevalError("the tokenizer encodes a newline to no token")
        self.pad_id = newline[-1]  # a newline (SentencePiece's "\n" is ["▁", "<0x0A>"]: the last one)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens added), not memoised."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def __call__(self, text: str) -> list[int]:
        """Ids of ``text``, memoised."""
        ids = self._memo.get(text)
        if ids is None:
            ids = self._memo[text] = self.encode(text)
        return ids


def sample_rng(*, seed: int, family: str, length: int, sample: int) -> random.Random:
    """The generator of one sample: fresh values in every (family, length, sample), the same on every rerun
    (string seeds are hashed with SHA-512 by ``random``, independent of PYTHONHASHSEED)."""
    return random.Random(f"kveval-ruler|{seed}|{family}|{length}|{sample}")


# ---------------------------------------------------------------------------------------------------------------
# Haystack assembly
# ---------------------------------------------------------------------------------------------------------------
class _TooShort(Exception):
    """The prompt's budget cannot hold a family's fixed parts (the message says which)."""


@dataclass(frozen=True)
class _Insert:
    ids: list[int]
    depth: float
    answer: bool


def _assemble(unit: Callable[[int], list[int]], budget: int, inserts: Sequence[_Insert], start: int = 0):
    """The context of exactly ``budget`` tokens: filler units ``unit(start)``, ``unit(start + 1)``... cut at the
    front, with each insert at the unit boundary nearest ``depth * filler`` (inserts at one boundary keep their
    order; the fragment the cut leaves of the first unit is not split). Returns ``(ids, starts, cuts, filler)``: the context, where each insert starts in it, its boundary in
    filler tokens, and the number of filler tokens."""
    filler_budget = budget - sum(len(x.ids) for x in inserts)
    if filler_budget < 0:
        raise _TooShort(f"the needles alone take {budget - filler_budget} tokens")
    pieces: list[list[int]] = []
    total, i = 0, start
    while total < filler_budget:
        piece = unit(i)
        if not piece:
            raise KvevalError("a haystack unit encodes to no token")
        pieces.append(piece)
        total += len(piece)
        i += 1
    excess = total - filler_budget
    filler = [t for piece in pieces for t in piece][excess:]
    ends = [0]
    for piece in pieces:
        ends.append(ends[-1] + len(piece))
    # true unit boundaries only: the start of the context is one when the cut falls between two units (else a
    # needle there would run into the fragment the cut left)
    bounds = [e - excess for e in ends if e - excess > 0 or e == excess]
    cuts = [min(bounds, key=lambda b: (abs(b - x.depth * filler_budget), b)) for x in inserts]
    order = sorted(range(len(inserts)), key=lambda k: (cuts[k], k))
    ids: list[int] = []
    starts = [0] * len(inserts)
    at = 0
    for k in order:
        ids += filler[at:cuts[k]]
        at = cuts[k]
        starts[k] = len(ids)
        ids += inserts[k].ids
    ids += filler[at:]
    return ids, starts, cuts, filler_budget


def _draw(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))  # RULER: seven digits
    if kind == "words":
        return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _distinct(kind: str, rng: random.Random, n: int, avoid: set[str]) -> list[str]:
    """``n`` fresh values of ``kind``, different from each other and from ``avoid`` (which they join)."""
    out: list[str] = []
    while len(out) < n:
        v = _draw(kind, rng)
        if v not in avoid:
            avoid.add(v)
            out.append(v)
    return out


def _join_keys(keys: Sequence[str]) -> str:
    """RULER's query: ``a``, or ``a, b, c, and d``."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _random_depths(rng: random.Random, n: int) -> list[float]:
    """``n`` depths from RULER's grid, without replacement while the grid lasts."""
    out: list[float] = []
    while len(out) < n:
        out += rng.sample(DEPTH_GRID, min(n - len(out), len(DEPTH_GRID)))
    return out


class _NeedleHaystack:
    """RULER's ``needle`` haystack: needle sentences with fresh keys and values (never a key or value of the
    task's own needles), generated in order on demand and kept."""

    def __init__(self, pieces: Pieces, family: Family, rng: random.Random, keys: set[str], values: set[str]):
        self.pieces, self.family, self.rng = pieces, family, rng
        self.keys, self.values = keys, values
        self.units: list[list[int]] = []
        self.texts: list[str] = []

    def __call__(self, i: int) -> list[int]:
        while len(self.units) <= i:
            key = _distinct(self.family.key_type, self.rng, 1, set(self.keys))[0]
            value = _distinct(self.family.value_type, self.rng, 1, set(self.values))[0]
            text = NEEDLE.format(type_plural=_TYPE_NAMES[self.family.value_type][0], key=key, value=value)
            self.texts.append(text)
            self.units.append(self.pieces.encode("\n" + text))
        return self.units[i]


def _haystack_unit(pieces: Pieces, family: Family, rng: random.Random, essay: SentenceTokens | None,
                   keys: set[str], values: set[str]) -> tuple[Callable[[int], list[int]], int, str]:
    """``(unit, start, separator)`` of a family's haystack."""
    if family.haystack == "noise":
        return (lambda i: pieces("\n" + NOISE)), 0, "\n"
    if family.haystack == "needle":
        return _NeedleHaystack(pieces, family, rng, keys, values), 0, "\n"
    if essay is None:
        raise KvevalError(f"ruler {family.name}: the essay haystack needs the corpus sentences")
    return essay.__getitem__, rng.randrange(len(essay)), " "


def _finish(pieces: Pieces, family: Family, user: str, answer_prefix: str, prompt_tokens: int, chat_template: bool,
            build: Callable[[int], tuple]) -> tuple[list[int], int, int, tuple]:
    """Wrap a context of ``prompt_tokens - len(template)`` tokens (``build(budget)`` returns ``(ids, *rest)``)
    in the template: ``(input_ids, context_start, context_len, rest)``."""
    prefix, suffix = chat_parts(pieces.tokenizer, user, answer_prefix, chat_template=chat_template)
    budget = prompt_tokens - len(prefix) - len(suffix)
    try:
        if budget < 0:
            raise _TooShort(f"the instruction and question alone take {len(prefix) + len(suffix)} tokens")
        ids, *rest = build(budget)
    except _TooShort as exc:
        raise KvevalError(f"{family.name}: a prompt of {prompt_tokens} tokens is too short ({exc}); use longer "
                          "lengths") from None
    input_ids = prefix + ids + suffix
    assert len(input_ids) == prompt_tokens
    return input_ids, len(prefix), len(ids), tuple(rest)


# ---------------------------------------------------------------------------------------------------------------
# The four kinds
# ---------------------------------------------------------------------------------------------------------------
def _niah(pieces: Pieces, family: Family, rng: random.Random, prompt_tokens: int, depth: float | None,
          essay: SentenceTokens | None, chat_template: bool) -> Sample:
    used_keys: set[str] = set()
    used_values: set[str] = set()
    keys = _distinct(family.key_type, rng, family.num_keys, used_keys)
    values = [_distinct(family.value_type, rng, family.num_values, used_values) for _ in keys]
    asked = sorted(rng.sample(range(family.num_keys), family.num_queries))
    plural, singular = _TYPE_NAMES[family.value_type]
    texts = [(k, v, NEEDLE.format(type_plural=plural, key=keys[k], value=v))
             for k in range(family.num_keys) for v in values[k]]
    unit, start, sep = _haystack_unit(pieces, family, rng, essay, used_keys, used_values)
    holds = [k in asked for k, _, _ in texts]
    if depth is None:
        depths = _random_depths(rng, len(texts))
    else:
        others = iter(_random_depths(rng, len(texts)))
        depths = [depth if h else next(others) for h in holds]
    inserts = [_Insert(pieces.encode(sep + text), d, h) for (_, _, text), d, h in zip(texts, depths, holds)]

    query = _join_keys([keys[k] for k in asked])
    many = family.num_values * family.num_queries > 1
    kind = plural if many else singular
    user = ((f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
             f"I will quiz you about the {kind} afterwards.\n{MARKER}\n"
             f"What are all the special magic {kind} for {query} mentioned in the provided text?")
            if many else
            (f"A special magic {kind} is hidden within the following text. Make sure to memorize it. "
             f"I will quiz you about the {kind} afterwards.\n{MARKER}\n"
             f"What is the special magic {kind} for {query} mentioned in the provided text?"))
    answer_prefix = f"The special magic {kind} for {query} mentioned in the provided text {'are' if many else 'is'}"
    ids, c0, clen, (starts, cuts, filler) = _finish(
        pieces, family, user, answer_prefix, prompt_tokens, chat_template,
        lambda budget: _assemble(unit, budget, inserts, start))
    answers = [v for k in asked for v in values[k]]
    in_order = sorted(range(len(texts)), key=lambda j: starts[j])
    reference = " " + ", ".join(texts[j][1] for j in in_order if holds[j])
    return Sample(
        family=family.name, input_ids=ids, answers=tuple(answers), reference=reference,
        answer_ids=pieces.encode(reference), query=query, depth=depth, context_start=c0, context_len=clen,
        filler_tokens=filler,
        answer_spans=tuple((c0 + starts[j], len(inserts[j].ids)) for j in in_order if holds[j]),
        distractor_spans=tuple((c0 + starts[j], len(inserts[j].ids)) for j in in_order if not holds[j]),
        answer_depths=tuple(cuts[j] / max(filler, 1) for j in in_order if holds[j]),
    )


def _variables(rng: random.Random, n: int, avoid: set[str]) -> list[str]:
    """``n`` distinct five-letter uppercase variable names (RULER's), not in ``avoid`` (which they join)."""
    out: list[str] = []
    while len(out) < n:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in avoid:
            avoid.add(v)
            out.append(v)
    return out


def _chain(names: Sequence[str], value: str) -> list[str]:
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]


VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."


def _vt_question(value: str) -> tuple[str, str]:
    return (f"Question: Find all variables that are assigned the value {value} in the text above.",
            f"Answer: According to the chain(s) of variable assignment in the text above, {VT_HOPS + 1} variables "
            f"are assigned the value {value}, they are:")


def _vt(pieces: Pieces, family: Family, rng: random.Random, prompt_tokens: int, depth: float | None,
        chat_template: bool) -> Sample:
    used: set[str] = set()
    names = _variables(rng, VT_HOPS + 1, used)
    value = str(rng.randint(10000, 99999))
    # the worked example (RULER's in-context example, shorter): its own variables and value, links among noise
    ex_names = _variables(rng, VT_HOPS + 1, used)
    ex_value = str(rng.randint(10000, 99999))
    while ex_value == value:
        ex_value = str(rng.randint(10000, 99999))
    links = _chain(ex_names, ex_value)
    ex_context = "\n".join([links[0], NOISE, links[1], links[2], NOISE, links[3], links[4]])
    ex_question, ex_prefix = _vt_question(ex_value)
    example = f"{VT_INSTRUCTION}\n\n{ex_context}\n{ex_question} {ex_prefix} {' '.join(ex_names)}\n"

    if depth is None:
        depths = sorted(_random_depths(rng, VT_HOPS + 1))
    else:
        later = [d for d in DEPTH_GRID if d >= depth] or [depth]
        depths = [depth] + sorted(rng.choices(later, k=VT_HOPS))
    inserts = [_Insert(pieces.encode("\n" + line), d, True) for line, d in zip(_chain(names, value), depths)]
    question, answer_prefix = _vt_question(value)
    user = f"{example}{VT_INSTRUCTION}\n\n{MARKER}\n{question}"
    ids, c0, clen, (starts, cuts, filler) = _finish(
        pieces, family, user, answer_prefix, prompt_tokens, chat_template,
        lambda budget: _assemble(lambda i: pieces("\n" + NOISE), budget, inserts))
    reference = " " + " ".join(names)
    return Sample(
        family=family.name, input_ids=ids, answers=tuple(names), reference=reference,
        answer_ids=pieces.encode(reference), query=value, depth=depth, context_start=c0, context_len=clen,
        filler_tokens=filler, answer_spans=tuple((c0 + s, len(x.ids)) for s, x in zip(starts, inserts)),
        answer_depths=tuple(c / max(filler, 1) for c in cuts),
    )


CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.")
CWE_QUESTION = f"Question: What are the {CWE_COMMON} most common words in the above list?"
CWE_PREFIX = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_vocabulary(rng: random.Random, need: int) -> list[str]:
    """``need`` distinct words in a random order: :data:`WORDS` first, then ``adjective-noun`` pairs."""
    words = rng.sample(WORDS, len(WORDS))
    if need > len(words):
        pairs = len(ADJECTIVES) * len(NOUNS)
        picks = rng.sample(range(pairs), min(need - len(words), pairs))
        words += [f"{ADJECTIVES[p // len(NOUNS)]}-{NOUNS[p % len(NOUNS)]}" for p in picks]
    return words[:need]


def _cwe(pieces: Pieces, family: Family, rng: random.Random, prompt_tokens: int, length: int,
         chat_template: bool) -> Sample:
    short = length < 4096  # RULER's switch, on the whole length
    ex_words, ex_common_times, ex_rare_times = (20, 3, 1) if short else (40, 10, 3)
    common_times, rare_times = (6, 1) if short else (30, 3)
    # every distinct word the list could hold (each rare word takes at least two tokens per repetition)
    most = ex_words + CWE_COMMON + prompt_tokens // (2 * rare_times) + 1
    vocab = _cwe_vocabulary(rng, most)
    ex_common = vocab[:CWE_COMMON]
    ex_items = ex_common * ex_common_times + vocab[CWE_COMMON:ex_words] * ex_rare_times
    rng.shuffle(ex_items)
    ex_order = list(dict.fromkeys(w for w in ex_items if w in ex_common))
    example = f"{CWE_INSTRUCTION}\n{_numbered(ex_items)}\n{CWE_QUESTION} {CWE_PREFIX} {_numbered(ex_order)}\n"
    common = vocab[ex_words:ex_words + CWE_COMMON]
    rare_pool = vocab[ex_words + CWE_COMMON:]
    shuffle_rng = random.Random(rng.getrandbits(64))

    def number(i: int) -> list[int]:  # the first item opens its line: no space before it
        return pieces(f"{i}." if i == 1 else f" {i}.")

    def word(w: str) -> list[int]:
        return pieces(" " + w)

    def build(budget: int):
        common_tokens = common_times * sum(len(word(w)) for w in common)
        numbers = [0]  # numbers[n]: the tokens of the numbers 1..n
        words = [0]  # words[n]: the tokens of the first n rare words, once each

        def tokens(n_rare: int, n_single: int = 0) -> int:
            """The list's tokens with ``n_rare`` rare words (``rare_times`` each) and ``n_single`` once."""
            n = CWE_COMMON * common_times + n_rare * rare_times + n_single
            while len(numbers) <= n:
                numbers.append(numbers[-1] + len(number(len(numbers))))
            while len(words) <= n_rare + n_single:
                words.append(words[-1] + len(word(rare_pool[len(words) - 1])))
            return numbers[n] + common_tokens + rare_times * words[n_rare] + words[n_rare + n_single] - words[n_rare]

        if tokens(0) > budget:
            raise _TooShort(f"the {CWE_COMMON} common words alone take {tokens(0)} tokens")
        lo, hi = 0, len(rare_pool)
        while lo < hi:  # the most rare words that fit
            mid = (lo + hi + 1) // 2
            if tokens(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        if lo == len(rare_pool) and len(vocab) < most:
            raise KvevalError(f"{family.name}: a list of {budget} tokens needs more distinct words than the "
                              f"vocabulary's {len(vocab)}; use shorter lengths")
        singles = 0  # then words said once while they fit (fewer times than the common ones: the answer stands)
        while lo + singles < len(rare_pool) and tokens(lo, singles + 1) <= budget:
            singles += 1
        items = common * common_times + rare_pool[:lo] * rare_times + rare_pool[lo:lo + singles]
        shuffle_rng.shuffle(items)
        ids = [t for i, w in enumerate(items, 1) for t in number(i) + word(w)]
        return ids + [pieces.pad_id] * (budget - len(ids)), items

    user = f"{example}{CWE_INSTRUCTION}\n{MARKER}\n{CWE_QUESTION}"
    ids, c0, clen, (items,) = _finish(pieces, family, user, CWE_PREFIX, prompt_tokens, chat_template, build)
    order = list(dict.fromkeys(w for w in items if w in set(common)))
    reference = " " + _numbered(order)
    return Sample(family=family.name, input_ids=ids, answers=tuple(common), reference=reference,
                  answer_ids=pieces.encode(reference), query="", depth=None, context_start=c0, context_len=clen,
                  filler_tokens=clen)


FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. "
                   "Find the three most frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


def fwe_counts(n: int, vocab_size: int) -> list[int]:
    """RULER's Zipf counts: word of rank k (1-based) repeated ``floor(n * k**-alpha / zeta(alpha))`` times."""
    return [int(n * k ** -FWE_ALPHA / ZETA_ALPHA) for k in range(1, vocab_size + 1)]


def _fwe(pieces: Pieces, family: Family, rng: random.Random, prompt_tokens: int, chat_template: bool) -> Sample:
    vocab_size = max(prompt_tokens // 50, 5)  # RULER: (length - tokens to generate) // 50
    coded: set[str] = set()
    while len(coded) < vocab_size:
        coded.add("".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN)))
    vocab = sorted(coded)
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent word is noise, as in RULER
    shuffle_rng = random.Random(rng.getrandbits(64))
    coded_ids = [pieces.encode(" " + w) for w in vocab]  # not memoised: fresh words in every sample

    def build(budget: int):
        sizes = [len(ids) for ids in coded_ids]

        def tokens(n: int) -> int:
            return sum(c * s for c, s in zip(fwe_counts(n, vocab_size), sizes))

        lo, hi = 0, 2 * budget + 10  # the dots alone (0.6 n) outgrow the budget before hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        counts = fwe_counts(lo, vocab_size)
        if not counts[1] > counts[2] > counts[3] > counts[4]:
            raise _TooShort(f"{tokens(lo)} tokens of coded words are too few to rank the three most frequent")
        ranks = [k for k, c in enumerate(counts) for _ in range(c)]
        shuffle_rng.shuffle(ranks)
        ids = [t for k in ranks for t in coded_ids[k]]
        return ids + [pieces.pad_id] * (budget - len(ids)), counts

    user = f"{FWE_INSTRUCTION}{MARKER}\n{FWE_QUESTION}"
    ids, c0, clen, _ = _finish(pieces, family, user, FWE_PREFIX, prompt_tokens, chat_template, build)
    answers = vocab[1:4]
    reference = " " + " ".join(answers)
    return Sample(family=family.name, input_ids=ids, answers=tuple(answers), reference=reference,
                  answer_ids=pieces.encode(reference), query="", depth=None, context_start=c0, context_len=clen,
                  filler_tokens=clen)


def build_sample(pieces: Pieces, family: str, rng: random.Random, *, prompt_tokens: int, length: int | None = None,
                 depth: float | None = None, essay: SentenceTokens | None = None,
                 chat_template: bool = True) -> Sample:
    """The prompt of one sample of ``family``, exactly ``prompt_tokens`` ids long, its values drawn from ``rng``.

    ``length``: the whole sequence the sample is for (prompt + generation; ``cwe`` switches its word counts at
    4096, as RULER does), ``prompt_tokens`` by default. ``depth`` (0..1): where the answer's needles go (None:
    RULER's random depths). ``essay``: the corpus sentences (families with the essay haystack). Raises
    :class:`KvevalError` when the prompt cannot hold the family's fixed parts.
    """
    if family not in FAMILIES:
        raise KvevalError(f"unknown ruler family '{family}' (families: {', '.join(FAMILIES)})")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise KvevalError(f"ruler depth must be within [0, 1], got {depth}")
    fam = FAMILIES[family]
    if fam.kind == "niah":
        return _niah(pieces, fam, rng, prompt_tokens, depth, essay, chat_template)
    if fam.kind == "vt":
        return _vt(pieces, fam, rng, prompt_tokens, depth, chat_template)
    if fam.kind == "cwe":
        return _cwe(pieces, fam, rng, prompt_tokens, length or prompt_tokens, chat_template)
    return _fwe(pieces, fam, rng, prompt_tokens, chat_template)


__all__ = ["DEPTH_GRID", "FAMILIES", "Family", "NOISE", "Pieces", "Sample", "build_sample", "fwe_counts",
           "sample_rng"]
