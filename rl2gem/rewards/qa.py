"""Short-answer QA scoring: exact match and token F1 after SQuAD normalisation.

Normalisation (Rajpurkar et al., 2016, the SQuAD v1.1 evaluation script, also
used by Search-R1): lower-case, remove punctuation, remove the articles
``a``, ``an``, ``the``, collapse white space. A prediction is scored against
every gold answer and the best score counts. A gold answer that is nothing but
an article (the blood type "A") keeps its articles on both sides: removed, it
would be empty, and an empty or filler answer would match it.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Iterable

__all__ = ["normalize_answer", "exact_match", "token_f1"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _golds(gold: str | Iterable[str]) -> list[str]:
    return [gold] if isinstance(gold, str) else list(gold)


def _normalized_pair(prediction: str, gold: str) -> tuple[str, str]:
    """``prediction`` and ``gold`` normalised alike: SQuAD's normalisation, or without removing
    articles where that leaves nothing of the gold answer."""
    reference = normalize_answer(gold)
    if reference:
        return normalize_answer(prediction), reference
    return " ".join(prediction.lower().translate(_PUNCT).split()), " ".join(gold.lower().translate(_PUNCT).split())


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
