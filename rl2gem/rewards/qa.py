"""Short-answer QA scoring: exact match and token F1 after SQuAD normalisation.

Normalisation (Rajpurkar et al., 2016, the SQuAD v1.1 evaluation script, also
used by Search-R1): lower-case, remove punctuation, remove the articles
``a``, ``an``, ``the``, collapse white space. A prediction is scored against
every gold answer and the best score counts. A gold answer that is nothing but
an article (the blood type "A") keeps its articles on both sides: removed, it
would be empty, and an empty or filler answer would match it.

Beyond SQuAD's ASCII-only script, text is first NFKC-normalised (a decomposed ``u`` + combining
diaeresis equals ``ü``, full-width ``ＰＡＲＩＳ`` equals ``PARIS``) and Unicode punctuation goes with
ASCII's (curly quotes, dashes, ``…``): a model's “Paris” matches Paris. On ASCII text the scores are
SQuAD's. A gold answer given as a number is compared as its text.
"""

from __future__ import annotations

import collections
import re
import string
import unicodedata
from collections.abc import Iterable, Mapping

__all__ = ["normalize_answer", "exact_match", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def _plain(text: str) -> str:
    """NFKC form, lower case, without ASCII punctuation (SQuAD's) nor Unicode punctuation (P*)."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_PUNCT)
    if text.isascii():
        return text
    return "".join(c for c in text if not unicodedata.category(c).startswith("P"))


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces (after NFKC, and
    Unicode punctuation removed too; see the module doc)."""
    return " ".join(_ARTICLES.sub(" ", _plain(text)).split())


def _golds(gold: str | int | float | Iterable[str | int | float]) -> list[str]:
    """The gold answers as text (a number as its ``str``).

    Raises:
        TypeError: ``gold`` (or one of them) is not text or a number (None, a mapping).
    """
    if isinstance(gold, (str, int, float)):
        answers = [gold]
    elif isinstance(gold, Iterable) and not isinstance(gold, Mapping):
        answers = list(gold)
    else:
        answers = [gold]
    for answer in answers:
        if not isinstance(answer, (str, int, float)):
            raise TypeError(f"a gold answer must be text or a number, got {type(answer).__name__}: {answer!r:.80}")
    return [str(answer) for answer in answers]


def _normalized_pair(prediction: str, gold: str) -> tuple[str, str]:
    """``prediction`` and ``gold`` normalised alike: SQuAD's normalisation, or without removing
    articles where that leaves nothing of the gold answer."""
    reference = normalize_answer(gold)
    if reference:
        return normalize_answer(prediction), reference
    return " ".join(_plain(prediction).split()), " ".join(_plain(gold).split())


def exact_match(prediction: str, gold: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    pairs = (_normalized_pair(prediction, answer) for answer in _golds(gold))
    return float(any(p == g for p, g in pairs))


def token_f1(prediction: str, gold: str | Iterable[str]) -> float:
    """Best token-level F1 (bag of normalised tokens) over the gold answers, in [0, 1]."""
    best = 0.0
    for g in _golds(gold):
        pred, ref = (text.split() for text in _normalized_pair(prediction, g))
        common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
        if not pred or not ref:
            best = max(best, float(pred == ref))
            continue
        if common:
            precision, recall = common / len(pred), common / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
