"""BFCL v4 function calling: ``rl2/FunctionCall-v0`` (single turn) and ``rl2/ToolUse-v0`` (multi-turn, executable).

Data and checkers come from ``bfcl-eval`` 2026.3.23 (the Berkeley Function
Calling Leaderboard, Patil et al., "The Berkeley Function Calling Leaderboard
(BFCL): From Tool Use to Agentic Evaluation of Large Language Models", ICML
2025), fetched once as a file by :mod:`rl2gem.assets` and imported from the
cache without its dependencies (which are model-vendor SDKs the checkers do
not use). Scoring is BFCL's own code:

* single turn: ``bfcl_eval.eval_checker.ast_eval.ast_checker.ast_checker``
  (function name, required arguments, each value among the allowed ones with
  BFCL's string normalisation, int accepted for float, any order for the
  ``parallel`` categories). Its only module-level obstacle, an import of every
  vendor handler for a name-mapping table, is replaced by a stub that maps no
  names. Irrelevance categories score 1.0 when the reply makes no call;
  ``live_relevance`` when it makes one (BFCL's relevance rule).
* multi turn: ``multi_turn_checker`` (after each user turn, the back-end
  instances' public state must equal the ground truth's, and the ground
  truth's call results must be among the agent's).

How the agent calls functions: Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks (or fenced JSON, see :func:`rl2gem.tools.parse_tool_calls`); BFCL's
own prompting format, a Python list of calls such as
``[f(a=1), g(b='x')]``, is read too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import json
import os
import pickle
import re
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any

from rl2gem.assets import fetch
from rl2gem.core import Env, StepResult, fit_tool_results
from rl2gem.tools import parse_tool_calls, tools_prompt
from rl2gem.tools.wrapper import format_tool_results

__all__ = [
    "FunctionCallEnv",
    "ToolUseEnv",
    "SINGLE_TURN_CATEGORIES",
    "MULTI_TURN_CATEGORIES",
    "load_single_turn",
    "load_multi_turn",
    "decode_calls",
    "bfcl_schema_to_json",
    "gold_calls",
]

SINGLE_TURN_CATEGORIES = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "irrelevance",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
    "live_irrelevance",
    "live_relevance",
)
#: Categories scored by "no call" (irrelevance) or "some call" (relevance) instead of the AST checker.
NO_CALL_CATEGORIES = ("irrelevance", "live_irrelevance")
ANY_CALL_CATEGORIES = ("live_relevance",)
MULTI_TURN_CATEGORIES = ("base", "long_context", "miss_param")
TEST_PERCENT = 20
_import_lock = threading.Lock()


def _bfcl_root() -> str:
    return str(fetch("bfcl-eval"))


def _data_file(*parts: str) -> str:
    return os.path.join(_bfcl_root(), "bfcl_eval", "data", *parts)


@functools.cache
def _bfcl() -> types.SimpleNamespace:
    """BFCL's checker and executor modules, imported from the pinned wheel in the cache."""
    with _import_lock:
        root = _bfcl_root()
        if root not in sys.path:
            sys.path.append(root)
        if "bfcl_eval.constants.model_config" not in sys.modules:
            # ast_checker imports MODEL_CONFIG_MAPPING only for convert_func_name(), which renames
            # dotted function names for vendors that forbid dots; rl2gem keeps names as offered.
            stub = types.ModuleType("bfcl_eval.constants.model_config")

            class _NoRename(dict):
                def __missing__(self, key):
                    return types.SimpleNamespace(underscore_to_dot=False)

            stub.MODEL_CONFIG_MAPPING = _NoRename()
            sys.modules[stub.__name__] = stub
        from bfcl_eval.constants.enums import Language
        from bfcl_eval.constants.executable_backend_config import (
            CLASS_FILE_PATH_MAPPING,
            MULTI_TURN_FUNC_DOC_FILE_MAPPING,
        )
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    return types.SimpleNamespace(
        ast_checker=ast_checker,
        python=Language.PYTHON,
        multi_turn_checker=multi_turn_checker,
        utils=multi_turn_utils,
        class_modules=CLASS_FILE_PATH_MAPPING,
        doc_files=MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    )


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _split_of(key: str) -> str:
    """``train`` or ``test`` (:data:`TEST_PERCENT`) by a hash of ``key``: what makes two items the
    same task (a single-turn item's request, a multi-turn item's number), not its id: BFCL repeats
    requests across categories under other ids (``multiple_172`` is ``simple_python_311``), and
    each multi-turn category holds variants of the same numbered conversations, which an id hash
    put on both sides."""
    return "test" if int(hashlib.md5(key.encode()).hexdigest(), 16) % 100 < TEST_PERCENT else "train"


_TYPES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "integer": "integer",
    "string": "string",
    "array": "array",
    "boolean": "boolean",
    "object": "object",
    "number": "number",
}


def bfcl_schema_to_json(schema: Any) -> Any:
    """A BFCL parameter schema (types ``dict``, ``float``, ``tuple``, ``any``...) as JSON Schema."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            if value in _TYPES:
                out["type"] = _TYPES[value]
        elif key == "properties" and isinstance(value, dict):
            out["properties"] = {k: bfcl_schema_to_json(v) for k, v in value.items()}
        elif key == "items":
            out["items"] = bfcl_schema_to_json(value)
        elif key in (
            "description",
            "enum",
            "default",
            "required",
            "format",
            "maximum",
            "minimum",
            "additionalProperties",
        ):
            out[key] = value
    return out


class _Spec:
    """A function offered to the model (what :func:`rl2gem.tools.tools_prompt` reads)."""

    instructions = ""

    def __init__(self, doc: dict[str, Any]):
        self.name = doc["name"]
        self.description = doc.get("description", "")
        self.parameters = bfcl_schema_to_json(doc.get("parameters", {"type": "dict", "properties": {}}))


def _offer(functions: Sequence[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    specs = [_Spec(f) for f in functions]
    if not specs:
        return "", []
    schemas = [
        {"type": "function", "function": {"name": s.name, "description": s.description, "parameters": s.parameters}}
        for s in specs
    ]
    return tools_prompt(specs), schemas  # type: ignore[arg-type]


# ----------------------------------------------------------------- decoding
def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _python_calls(text: str) -> list[tuple[str, list[Any], dict[str, Any]]] | None:
    """BFCL's prompting format, ``[f(a=1), g(b='x')]``: the calls, or ``None`` when the text is not that."""
    body = text.strip()
    fence = re.fullmatch(r"```[A-Za-z]*\n?(.*?)```", body, re.S)
    if fence:
        body = fence.group(1).strip()
    if not body or "(" not in body:
        return None
    if not body.startswith("["):
        body = f"[{body}]"
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    calls = []
    for node in nodes:
        if not isinstance(node, ast.Call):
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        except (ValueError, SyntaxError, TypeError):
            return None
        calls.append((name, args, kwargs))
    return calls


def decode_calls(text: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The function calls in a reply: ``([(name, arguments), ...], errors)``.

    ``<tool_call>`` blocks or fenced JSON first, then BFCL's Python-list
    format. Calls with positional arguments in the Python format are kept
    with the positions under ``"__args__"`` (the callers resolve or reject
    them). ``errors`` lists the calls that could not be read (bad JSON...).
    """
    items = ordered_calls(text)
    return [item for item in items if not isinstance(item, str)], [item for item in items if isinstance(item, str)]


def ordered_calls(text: str) -> list[tuple[str, dict[str, Any]] | str]:
    """The calls of a reply in their order, each ``(name, arguments)`` as :func:`decode_calls`
    gives them, or the error (a ``str``) of one that could not be read: its result's place."""
    parsed = parse_tool_calls(text)
    if parsed:
        return [c.error if c.error else (c.name, c.arguments) for c in parsed]
    py = _python_calls(text)
    if py is None:
        return []
    return [(name, dict(kwargs, __args__=args) if args else kwargs) for name, args, kwargs in py]


def gold_calls(ground_truth: list[dict[str, dict[str, list[Any]]]]) -> list[dict[str, dict[str, Any]]]:
    """One correct answer from BFCL's possible answers: per argument the first allowed value that
    is not ``""`` (``""`` marks an optional argument; one allowing only ``""`` is left out)."""

    def nested(d: Any) -> bool:  # a dict of allowed-value lists (BFCL's nested-argument form)
        return isinstance(d, dict) and bool(d) and all(isinstance(x, list) for x in d.values())

    def resolve(d: dict[str, list[Any]]) -> dict[str, Any]:
        return {k: val for k, sub in d.items() for ok, val in [pick(sub)] if ok}

    def pick(allowed: list[Any]) -> tuple[bool, Any]:
        for v in allowed:
            if v == "":
                continue
            if nested(v):
                return True, resolve(v)
            if isinstance(v, list) and v and all(nested(x) for x in v):
                return True, [resolve(d) for d in v]
            return True, v
        return False, None

    out = []
    for call in ground_truth:
        ((name, params),) = call.items()
        out.append({name: {k: val for k, allowed in params.items() for ok, val in [pick(allowed)] if ok}})
    return out


# -------------------------------------------------------------- single turn
@functools.cache
def load_single_turn(category: str) -> list[dict[str, Any]]:
    """Items of a single-turn category: ``{"id", "category", "messages", "functions", "ground_truth", "split"}``.

    Raises:
        ValueError: unknown category.
    """
    if category not in SINGLE_TURN_CATEGORIES:
        raise ValueError(f"unknown BFCL single-turn category {category!r}; choose from {SINGLE_TURN_CATEGORIES}")
    questions = _read_jsonl(_data_file(f"BFCL_v4_{category}.json"))
    answers: dict[str, Any] = {}
    answer_file = _data_file("possible_answer", f"BFCL_v4_{category}.json")
    if os.path.exists(answer_file):
        answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(answer_file)}
    return [
        {
            "id": q["id"],
            "category": category,
            "messages": [m for turn in q["question"] for m in turn],
            "functions": q.get("function", []),
            "ground_truth": answers.get(q["id"]),
            "split": _split_of(json.dumps(q["question"], sort_keys=True)),
        }
        for q in questions
    ]


def _resolve_categories(
    category: str | Sequence[str], known: Sequence[str], aliases: dict[str, str]
) -> tuple[str, ...]:
    if isinstance(category, str):
        category = known if category == "all" else (category,)
    cats = tuple(aliases.get(c, c) for c in category)
    bad = [c for c in cats if c not in known]
    if bad or not cats:
        raise ValueError(f"unknown BFCL categories {bad or category}; choose from 'all' or {tuple(known)}")
    return cats


def _render_messages(messages: list[dict[str, str]]) -> str:
    if len(messages) == 1:
        return messages[0]["content"]
    parts = []
    for m in messages:
        role = {"system": "Instructions", "user": "User", "assistant": "Assistant"}.get(m["role"], m["role"].title())
        parts.append(f"{role}: {m['content']}")
    return "\n\n".join(parts)


def _check_tool_prompt(tool_prompt: str | None) -> str | None:
    if tool_prompt not in ("append", None):
        raise ValueError(f"tool_prompt must be 'append' or None, got {tool_prompt!r}")
    return tool_prompt


class FunctionCallEnv(Env):
    """BFCL single-turn function calling (see the module doc).

    The observation is the user's request (with any system or earlier
    messages of the item) followed by the offered functions as JSON schemas
    and the ``<tool_call>`` format; ``info["tools"]`` has the schemas for a
    chat template. One step: the reply is decoded, scored (1.0 / 0.0) and the
    episode ends. ``info`` carries ``category``, ``calls`` (decoded),
    ``valid`` and BFCL's ``error`` / ``error_type``.

    Items are taken in a fixed shuffled order of the chosen categories
    (``reset(options={"index": i})``), so the first n items of ``"all"`` are a
    mix of every category in proportion to its size.

    Args:
        category: ``"all"`` (default), one of :data:`SINGLE_TURN_CATEGORIES`
            (``"simple"`` is an alias of ``"simple_python"``), or a list.
        split: ``"all"`` (the benchmark), or ``"train"`` / ``"test"``: a fixed
            80/20 split by a hash of the item id, for training on BFCL.
        tool_prompt: ``"append"`` (default) puts the functions and the call format
            after the request; ``None`` leaves them to the chat template
            (``info["tools"]``, ``RolloutConfig(tools_in_template=True)``).

    Raises:
        ValueError: unknown category or split, bad ``tool_prompt``.
    """

    invalid_action_terminates = True

    def __init__(
        self,
        category: str | Sequence[str] = "all",
        split: str = "all",
        *,
        tool_prompt: str | None = "append",
        render_mode: str | None = None,
    ):
        super().__init__(max_turns=1, render_mode=render_mode)
        self.categories = _resolve_categories(category, SINGLE_TURN_CATEGORIES, {"simple": "simple_python"})
        if split not in ("all", "train", "test"):
            raise ValueError(f"split must be 'all', 'train' or 'test', got {split!r}")
        self.split, self.tool_prompt = split, _check_tool_prompt(tool_prompt)
        self.item: dict[str, Any] | None = None

    @functools.cached_property
    def items(self) -> list[dict[str, Any]]:
        items = [it for c in self.categories for it in load_single_turn(c) if self.split in ("all", it["split"])]
        items.sort(key=lambda it: hashlib.md5(it["id"].encode()).hexdigest())
        return items

    def __len__(self) -> int:
        return len(self.items)

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        index = self.task_index(len(self.items), options)
        self.item = self.items[index]
        offer, schemas = _offer(self.item["functions"])
        obs = _render_messages(self.item["messages"]) + (f"\n\n{offer}" if offer and self.tool_prompt else "")
        return obs, {"index": index, "id": self.item["id"], "category": self.item["category"], "tools": schemas}

    def _step(self, action: str) -> StepResult:
        item = self.item
        assert item is not None
        calls, errors = decode_calls(action)
        category = item["category"]
        info: dict[str, Any] = {
            "category": category,
            "id": item["id"],
            "calls": [{n: a} for n, a in calls],
            "decode_errors": errors,
        }
        if category in NO_CALL_CATEGORIES or category in ANY_CALL_CATEGORIES:
            made_call = bool(calls)
            valid = made_call if category in ANY_CALL_CATEGORIES else not made_call
            info.update(
                valid=valid,
                error=[] if valid else ["a function was called" if made_call else "no function was called"],
                error_type=None if valid else "relevance",
            )
        elif errors or not calls:
            info.update(valid=False, error=errors or ["no function call in the reply"], error_type="decode")
        elif any("__args__" in a for _, a in calls):
            info.update(
                valid=False, error=["positional arguments; BFCL calls use keyword arguments"], error_type="decode"
            )
        else:
            result = _bfcl().ast_checker(
                item["functions"], [{n: a} for n, a in calls], item["ground_truth"], _bfcl().python, category, "rl2gem"
            )
            info.update(valid=bool(result["valid"]), error=result.get("error", []), error_type=result.get("error_type"))
        info["success"] = info["valid"]
        info["reward_components"] = {  # rl2gem.rewards.objectives
            "correctness": float(info["valid"]),
            "format": float(info["error_type"] != "decode"),
            "tool_calls": float(len(calls)),
        }
        return "", 1.0 if info["valid"] else 0.0, True, False, info

    def sample_random_action(self, rng=None) -> str:
        """A call of an offered function with no arguments, or a plain reply."""
        rng = self.action_rng(rng)
        funcs = self.item["functions"] if self.item else []
        if funcs and rng.random() < 0.7:
            name = funcs[int(rng.integers(len(funcs)))]["name"]
            return f'<tool_call>\n{{"name": "{name}", "arguments": {{}}}}\n</tool_call>'
        return "I cannot help with that."

    def make_solver(self):
        """An oracle: the first allowed value of each argument (no call for irrelevance)."""
        env = self

        def solve(observation: str) -> str:
            item = env.item
            if item["category"] in NO_CALL_CATEGORIES:
                return "None of the offered functions fits this request."
            if item["ground_truth"] is None:  # relevance: any call of an offered function
                return json.dumps({"name": item["functions"][0]["name"], "arguments": {}}).join(
                    ["<tool_call>", "</tool_call>"]
                )
            return "\n".join(
                "<tool_call>" + json.dumps({"name": n, "arguments": a}) + "</tool_call>"
                for call in gold_calls(item["ground_truth"])
                for n, a in call.items()
            )

        return solve


# --------------------------------------------------------------- multi turn
@functools.cache
def load_multi_turn(category: str) -> list[dict[str, Any]]:
    """Items of a multi-turn category (``base``, ``long_context``, ``miss_param``): BFCL's entry plus
    ``ground_truth`` (call strings per user turn), ``functions`` (docs of the involved classes) and ``split``.

    Raises:
        ValueError: unknown category.
    """
    if category not in MULTI_TURN_CATEGORIES:
        raise ValueError(f"unknown BFCL multi-turn category {category!r}; choose from {MULTI_TURN_CATEGORIES}")
    b = _bfcl()
    name = f"BFCL_v4_multi_turn_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(_data_file("possible_answer", name))}
    docs = {cls: _read_jsonl(_data_file("multi_turn_func_doc", f)) for cls, f in b.doc_files.items()}
    items = []
    for q in _read_jsonl(_data_file(name)):
        functions = [d for cls in q["involved_classes"] for d in docs[cls]]
        number = q["id"].rsplit("_", 1)[-1]  # multi_turn_base_12, multi_turn_long_context_12: one conversation
        items.append(dict(q, ground_truth=answers[q["id"]], functions=functions, split=_split_of(number)))
    return items


class _Backends(dict):
    """An episode's BFCL back-end instances by name, pickled so that BFCL's package is importable
    before they load (another process has not put its wheel on ``sys.path`` yet)."""

    def __reduce__(self) -> tuple:
        return _load_backends, (pickle.dumps(dict(self)),)


def _load_backends(data: bytes) -> dict[str, Any]:
    _bfcl()  # BFCL's wheel on sys.path, its modules imported: the instances' classes
    return pickle.loads(data)


class ToolUseEnv(Env):
    """BFCL multi-turn tool use over BFCL's executable back-ends (see the module doc).

    An episode is a conversation of 1-7 user turns with a file system, a
    trading bot, a travel agency, a vehicle, messaging... (the item's
    ``involved_classes``), instantiated fresh from the item's
    ``initial_config``. Within a user turn the agent calls functions (the
    results come back as ``role="tool"`` observations, and the calls change
    the back-ends' state); a reply without a call ends the user turn, and the
    next user message comes back (``role="user"``). After the last user turn
    BFCL's ``multi_turn_checker`` compares, turn by turn, the back-end state
    and the call results with the ground truth's: reward 1.0 when every turn
    matches, else 0.0 (``info["valid"]``, ``info["error_type"]``).

    More than ``max_steps_per_turn`` calling steps in one user turn truncates
    the episode (BFCL's force-quit at 20 steps; reward 0); an action refused before
    it is read (empty, too long) counts as such a step. Unknown functions
    and unreadable calls are answered with an ``Error: ...`` result and are
    not executed.

    Args:
        category: ``"base"`` (default), ``"long_context"`` or ``"miss_param"``.
        split: ``"all"``, ``"train"`` or ``"test"`` (80/20 by a hash of the id).
        max_steps_per_turn: calling steps allowed per user turn.
        tool_prompt: ``"append"`` (default) or ``None``, as for :class:`FunctionCallEnv`.

    Raises:
        ValueError: unknown category or split, bad ``tool_prompt``.
    """

    _counter = itertools.count()

    def __init__(
        self,
        category: str = "base",
        split: str = "all",
        *,
        max_steps_per_turn: int = 20,
        tool_prompt: str | None = "append",
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        if category not in MULTI_TURN_CATEGORIES:
            raise ValueError(f"unknown BFCL multi-turn category {category!r}; choose from {MULTI_TURN_CATEGORIES}")
        if split not in ("all", "train", "test"):
            raise ValueError(f"split must be 'all', 'train' or 'test', got {split!r}")
        if max_steps_per_turn < 1:
            raise ValueError("max_steps_per_turn must be >= 1")
        self.category, self.split, self.max_steps_per_turn = category, split, max_steps_per_turn
        self.tool_prompt = _check_tool_prompt(tool_prompt)
        self.item: dict[str, Any] | None = None
        self._names: list[str] = []

    @functools.cached_property
    def items(self) -> list[dict[str, Any]]:
        return [it for it in load_multi_turn(self.category) if self.split in ("all", it["split"])]

    def __len__(self) -> int:
        return len(self.items)

    # back-end instances live in BFCL's executor module under names unique to this episode
    def _new_name(self, role: str) -> str:
        name = f"rl2gem_{os.getpid()}_{next(self._counter)}_{role}"
        self._names.append(name)
        return name

    def _instances(self) -> dict[str, Any]:
        """This episode's back-end instances in BFCL's executor module, by their names."""
        prefixes = tuple(f"{n}_" for n in self._names)
        module_globals = vars(_bfcl().utils) if prefixes else {}
        return {key: value for key, value in list(module_globals.items()) if key.startswith(prefixes)}

    def __getstate__(self) -> dict[str, Any]:
        """Env's state with this episode's back-end instances (file system, trading bot...): they
        live in BFCL's module globals under names of this env, so a copy re-registers them under
        names of its own (:meth:`__setstate__`); ``deepcopy`` and ``pickle`` copy them, so the
        copy's calls change its own back-ends only. The items are read again (cached)."""
        state = super().__getstate__()
        state.pop("items", None)
        state["_backends"] = _Backends(self._instances())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        backends, names = state.pop("_backends", {}), state.get("_names", [])
        self.__dict__.update(state)
        self._names = []
        renamed = {name: self._new_name(name.rsplit("_", 1)[1]) for name in names}  # the role stays
        if getattr(self, "_exec_name", None) in renamed:
            self._exec_name = renamed[self._exec_name]
        module_globals = vars(_bfcl().utils) if backends else {}
        for key, value in backends.items():
            name = next(n for n in names if key.startswith(f"{n}_"))
            module_globals[renamed[name] + key[len(name) :]] = value

    def _forget_instances(self) -> None:
        if not self._names:
            return
        module_globals = vars(_bfcl().utils)
        for key in self._instances():
            module_globals.pop(key, None)
        self._names = []

    def _reset(self, options: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        self._forget_instances()
        index = self.task_index(len(self.items), options)
        item = self.item = self.items[index]
        self._exec_name = self._new_name("agent")
        self._user_turn, self._steps_in_turn = 0, 0
        self.calls: list[list[list[str]]] = [[]]
        self._functions = {f["name"]: f for f in item["functions"]}
        offer, schemas = _offer(item["functions"])
        obs = _render_messages(item["question"][0]) + (f"\n\n{offer}" if self.tool_prompt else "")
        return obs, {
            "index": index,
            "id": item["id"],
            "user_turn": 0,
            "num_user_turns": len(item["question"]),
            "tools": schemas,
        }

    def _call_string(self, name: str, args: dict[str, Any]) -> str:
        args = dict(args)
        positional = args.pop("__args__", [])
        if positional:  # BFCL's Python format may pass arguments by position: name them from the schema
            params = list(self._functions[name].get("parameters", {}).get("properties", {}))
            if len(positional) > len(params):
                raise ValueError(f"{name} takes at most {len(params)} arguments")
            args = dict(zip(params, positional, strict=False), **args)
        for k in args:
            if not k.isidentifier():
                raise ValueError(f"{k!r} is not an argument name")
        return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"

    def _step_limit(self, base_info: dict[str, Any]) -> StepResult | None:
        """Count a step of this user turn; past ``max_steps_per_turn``, the truncating result."""
        self._steps_in_turn += 1
        if self._steps_in_turn <= self.max_steps_per_turn:
            return None
        return (
            f"Step limit reached: at most {self.max_steps_per_turn} calling steps per request.",
            0.0,
            False,
            True,
            dict(base_info, role="tool", truncated_reason="max_steps_per_turn", valid=False, success=False),
        )

    def _rejected(self, reason: str) -> StepResult:
        """An action refused before :meth:`_step` (empty, too long, not UTF-8) counts as a step of
        the turn too: 500 whitespace actions played on without an end."""
        item = self.item
        assert item is not None
        base_info = {"id": item["id"], "user_turn": self._user_turn, "num_user_turns": len(item["question"])}
        return self._step_limit(base_info) or super()._rejected(reason)

    def _step(self, action: str) -> StepResult:
        item = self.item
        assert item is not None
        calls = ordered_calls(action)  # results go back in the calls' order, unreadable ones in place
        n_turns = len(item["question"])
        base_info = {"id": item["id"], "user_turn": self._user_turn, "num_user_turns": n_turns}
        if calls:
            if (limit := self._step_limit(base_info)) is not None:
                return limit
            results: list[str | None] = []
            runnable: list[str] = []
            for call in calls:
                if isinstance(call, str):  # could not be read
                    results.append(f"Error: {call}")
                    continue
                name, args = call
                if name not in self._functions:
                    results.append(f"Error: unknown function {name!r}.")
                    continue
                try:
                    runnable.append(self._call_string(name, args))
                    results.append(None)
                except ValueError as e:
                    results.append(f"Error: {e}.")
            executed: list[str] = []
            if runnable:
                executed, _ = _bfcl().utils.execute_multi_turn_func_call(
                    runnable,
                    item["initial_config"],
                    item["involved_classes"],
                    self._exec_name,
                    item["id"],
                    long_context=self.category == "long_context",
                )
                self.calls[self._user_turn].append(runnable)
            it = iter(executed)
            texts = fit_tool_results([r if r is not None else next(it) for r in results], self.observation_space)
            info = dict(base_info, role="tool", executed=runnable, tool_results=texts)
            if not runnable:
                info["invalid_action"] = "no runnable function call"
            return format_tool_results(texts), 0.0, False, False, info
        # a reply without calls ends this user turn
        self._user_turn += 1
        self._steps_in_turn = 0
        if self._user_turn < n_turns:
            self.calls.append([])
            return (
                _render_messages(item["question"][self._user_turn]),
                0.0,
                False,
                False,
                dict(base_info, user_turn=self._user_turn),
            )
        check_name = self._new_name("check")
        try:
            result = _bfcl().multi_turn_checker(
                self.calls, item["ground_truth"], item, f"multi_turn_{self.category}", check_name
            )
        finally:
            self._forget_instances()
        valid = bool(result.get("valid"))
        info = dict(
            base_info,
            valid=valid,
            success=valid,
            error_type=result.get("error_type"),
            error_message=result.get("error_message"),
            reward_components={
                "correctness": float(valid),
                "tool_calls": float(sum(len(step) for turn in self.calls for step in turn)),
            },
        )
        return "", 1.0 if valid else 0.0, True, False, info

    def _close(self) -> None:
        self._forget_instances()

    def sample_random_action(self, rng=None) -> str:
        """A call of an offered function with no arguments, or a reply that ends the user turn."""
        rng = self.action_rng(rng)
        names = sorted(self._functions) if self.item else []
        if names and rng.random() < 0.6:
            return f'<tool_call>{{"name": "{names[int(rng.integers(len(names)))]}", "arguments": {{}}}}</tool_call>'
        return "Done."

    def make_solver(self):
        """The scripted gold policy: per user turn, the ground-truth calls (as ``<tool_call>`` JSON, in
        order, one step), then a reply without calls."""
        env = self
        pending: dict[str, Any] = {"turn": -1, "sent": False}

        def solve(observation: str) -> str:
            turn = env._user_turn
            if pending["turn"] != turn or pending.get("id") != env.item["id"]:
                pending.update(turn=turn, sent=False, id=env.item["id"])
            gt = env.item["ground_truth"][turn]
            if pending["sent"] or not gt:
                return "Done."
            pending["sent"] = True
            return "\n".join(_call_to_tool_call(s, env._functions) for s in gt)

        return solve


def _call_to_tool_call(call: str, functions: dict[str, dict[str, Any]]) -> str:
    """A ground-truth call string (``sort('a.txt')``) as a ``<tool_call>`` JSON block."""
    node = ast.parse(call, mode="eval").body
    assert isinstance(node, ast.Call)
    name = _dotted(node.func)
    params = list(functions[name].get("parameters", {}).get("properties", {}))
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
