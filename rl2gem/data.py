"""Task data for envs: user files and Hugging Face datasets, cached preparation.

* :func:`load_table` reads a user's file (JSON, JSONL, CSV, Parquet, Arrow) or
  a Hugging Face dataset name with the ``datasets`` library and returns its
  rows as dicts.
* :func:`load_conversations` reads supervised fine-tuning data in RL2's formats
  (``{"prompt", "response"}`` or ``{"messages"}`` rows) as chat conversations.
* :func:`load_preferences` reads preference pairs in RL2's RM / DPO format
  (``{"prompt" | "messages", "chosen", "rejected"}`` rows).
* :func:`prepared` caches a list of dict records built by a function as a
  JSON-lines file in the rl2gem cache, and memoises it in the process, so the
  first env that needs a data set builds it, and every later env (64 in a
  vector, or the next run) only reads it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl2gem.assets import cache_dir, locked

__all__ = [
    "CHAT_ROLES",
    "FILE_FORMATS",
    "DataUnavailable",
    "PreferencePair",
    "assistant_extra_keys",
    "load_conversations",
    "load_preferences",
    "load_table",
    "missing_data_files",
    "prepared",
]

#: File suffix -> ``datasets`` builder name.
FILE_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


class DataUnavailable(RuntimeError):
    """A data set could not be loaded (offline hub, missing file, missing columns)."""


def missing_data_files(node: Any, prefix: str) -> list[tuple[str, str]]:
    """``(dotted key, path)`` of every string in ``node`` (a config value: a string, or mappings and
    lists of them, walked recursively under the key ``prefix``) that names a data file (its suffix
    is one of :data:`FILE_FORMATS`) which does not exist. Dataset names and built-in names are not
    files, so they are never reported."""
    if isinstance(node, Mapping):
        return [found for key, value in node.items() for found in missing_data_files(value, f"{prefix}.{key}")]
    if isinstance(node, Sequence) and not isinstance(node, str):
        return [found for i, value in enumerate(node) for found in missing_data_files(value, f"{prefix}.{i}")]
    is_file = isinstance(node, str) and Path(node).suffix.lower() in FILE_FORMATS
    return [(prefix, node)] if is_file and not Path(node).exists() else []


def _is_file_spec(source: str | Mapping[str, str]) -> bool:
    if isinstance(source, Mapping):
        return True
    return Path(source).suffix.lower() in FILE_FORMATS or os.path.exists(source)


def load_table(
    source: str | Mapping[str, str],
    split: str,
    *,
    required: tuple[str, ...] = (),
    config: str | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``split`` from a file, a ``{split: file}`` mapping or a Hugging Face dataset name.

    A single file serves every split. A Hugging Face name is loaded with
    ``datasets.load_dataset(source, config, split=split)``, which needs a hub
    (or its local cache).

    Args:
        source: path, ``{split: path}``, or dataset name.
        split: the split to read.
        required: columns every row must have.
        config: dataset configuration name (hub datasets only).

    Raises:
        DataUnavailable: missing file, unknown format, unreachable hub, missing columns or split.
    """
    import datasets

    datasets.disable_progress_bars()
    if _is_file_spec(source):
        files = dict(source) if isinstance(source, Mapping) else {split: str(source)}
        if split not in files:
            raise DataUnavailable(f"no file for split {split!r} in {dict(files)}")
        path = Path(files[split])
        if not path.exists():
            raise DataUnavailable(f"data file not found: {path}")
        fmt = FILE_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataUnavailable(f"unknown data file type {path.suffix!r}; use one of {sorted(FILE_FORMATS)}")
        if fmt == "json":  # JSON values as written: pandas (datasets' fallback for mixed types) turns "50" into 50
            return _checked_columns(source, _json_rows(path), required)
        ds = _load_file(datasets, fmt, path, split)
    else:
        try:
            ds = datasets.load_dataset(str(source), config, split=split)
        except Exception as e:
            raise DataUnavailable(
                f"could not load the Hugging Face dataset {source!r} (split {split!r}): {type(e).__name__}: {e}. "
                "Without access to the hub, download it elsewhere and pass the file path instead."
            ) from e
    return _checked_columns(source, [dict(row) for row in ds], required)


def _checked_columns(source, rows: list[dict[str, Any]], required: tuple[str, ...]) -> list[dict[str, Any]]:
    columns = sorted({key for row in rows for key in row})
    missing = [c for c in required if c not in columns]
    if missing:
        raise DataUnavailable(f"{source}: missing column(s) {missing}; found {columns}")
    return rows


def _json_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``.json`` file (a list of objects) or a ``.jsonl`` file (an object a line, blank
    lines skipped), each value as the JSON has it.

    Raises:
        DataUnavailable: an empty file, a line or file that is not JSON, or a row that is not an
            object (the message names the file and the line).
    """
    text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the JSON
    if not text.strip():
        raise DataUnavailable(f"{path}: the data file is empty")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError:  # JSON Lines
        rows = []
        for number, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may be in a string
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataUnavailable(f"{path}: could not read it as json: line {number}: {e}") from None
    if isinstance(rows, dict):  # a .jsonl file of one row, or a .json file of one object
        rows = [rows]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise DataUnavailable(f"{path}: a JSON data file holds objects (one a line, or a list of them)")
    return rows


def _load_file(datasets, fmt: str, path: Path, split: str):
    """``path`` read by ``datasets`` as format ``fmt`` (CSV, Parquet, Arrow). A CSV's cells stay
    text (pandas would turn ``4`` into an int and ``NA``/``null`` into a missing value), an empty
    cell is a missing value.

    Raises:
        DataUnavailable: the file is empty or ``datasets`` cannot read it (the message names it).
    """
    if path.stat().st_size == 0:
        raise DataUnavailable(f"{path}: the data file is empty")
    options: dict[str, Any] = {}
    if fmt == "csv":
        with open(path, encoding="utf-8", newline="") as handle:
            reader = csv.reader(handle)
            header, first = next(reader, []), next(reader, None)
        if first is None:
            raise DataUnavailable(f"{path}: the data file has no rows (a header only)")
        options = {
            "features": datasets.Features({column: datasets.Value("string") for column in header}),
            "keep_default_na": False,
            "na_values": [""],
        }
    if fmt == "parquet":
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_metadata(path).num_rows
        except Exception as e:  # not Parquet: pyarrow's ArrowInvalid
            raise DataUnavailable(f"{path}: could not read it as parquet: {type(e).__name__}: {str(e)[:300]}") from e
        if rows == 0:
            raise DataUnavailable(f"{path}: the data file has no rows")
    try:
        return datasets.load_dataset(fmt, data_files={split: str(path)}, split=split, **options)
    except Exception as e:  # datasets wraps the reader's error (DatasetGenerationError, StopIteration...)
        cause = e.__cause__ or e
        raise DataUnavailable(f"{path}: could not read it as {fmt}: {type(cause).__name__}: {str(cause)[:300]}") from e


#: Message roles :func:`load_conversations` accepts.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def load_conversations(source: str | Mapping[str, str], split: str = "train") -> list[list[dict[str, Any]]]:
    """Supervised fine-tuning conversations in RL2's data formats, read with :func:`load_table`.

    Row shapes:

    * ``{"prompt": str, "response": str}`` -> ``[user: prompt, assistant: response]``; a
      ``prompt`` that is already a list of messages (or its JSON string, a CSV cell) is kept as
      the messages before the response;
    * ``{"messages": [{"role", "content"}, ...]}`` -> the messages (multi-turn); a JSON string
      (a CSV cell) is parsed.

    Keys a file format fills with null for rows that lack them (a JSON file mixing both shapes,
    message keys only some messages have) are dropped.

    Args:
        source: a JSON, JSONL, CSV, Parquet or Arrow file, a ``{split: file}`` mapping, or a
            Hugging Face dataset name (see :func:`load_table`).
        split: the split to read.

    Returns:
        one list of ``{"role", "content", ...}`` dicts per row, in file order.

    Raises:
        DataUnavailable: anything :func:`load_table` raises; a row (numbered from 0) that has
            neither shape, a malformed message list, a role outside :data:`CHAT_ROLES`, a
            non-string content or response, no assistant turn, or an assistant turn first.
    """
    conversations = []
    for number, row in enumerate(load_table(source, split)):
        present = {key: value for key, value in row.items() if value is not None}
        where = f"{source}: row {number} (counting from 0)"
        if "messages" in present:
            messages = present["messages"]
            if isinstance(messages, str):
                try:
                    messages = json.loads(messages)
                except json.JSONDecodeError as e:
                    raise DataUnavailable(f"{where}: 'messages' is a string but not JSON ({e})") from None
        elif "prompt" in present and "response" in row and not present.get("response"):
            raise DataUnavailable(f"{where}: 'response' is empty: nothing to train on but the end of the turn")
        elif "prompt" in present and "response" in present:
            prompt, response = present["prompt"], present["response"]
            if not isinstance(prompt, (str, list)):
                raise DataUnavailable(
                    f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}"
                )
            if not isinstance(response, str):
                raise DataUnavailable(f"{where}: 'response' must be a string, got {type(response).__name__}")
            messages = [*_messages(prompt, "user", where), {"role": "assistant", "content": response}]
        else:
            raise DataUnavailable(
                f"{where}: unknown row shape with keys {sorted(present)}; "
                "expected {'prompt', 'response'} or {'messages'}"
            )
        conversations.append(_conversation(messages, where))
    return conversations


def assistant_extra_keys(message: dict[str, Any]) -> str:
    """Why an assistant ``message`` cannot be trained on as it is ('' when it can): an assistant turn
    is the tokens of its ``content`` (what the model writes), so another key with a value
    (OpenAI's ``tool_calls``, ``reasoning_content``) would be dropped without a word."""
    if message.get("role") != "assistant":
        return ""
    extra = sorted(key for key, value in message.items() if key not in ("role", "content") and _has_value(value))
    if not extra:
        return ""
    return (
        f"an assistant turn is trained on its 'content' only, and this one also has {extra}: write what the model "
        "should generate into 'content' (a tool call as the chat template renders it, e.g. "
        '<tool_call>{"name": ..., "arguments": ...}</tool_call>)'
    )


def _has_value(value: Any) -> bool:
    """Whether a message key holds anything: not None, nor an empty string, list or mapping (a
    data set's column that another row fills)."""
    return value is not None and not (isinstance(value, (str, list, tuple, dict)) and len(value) == 0)


def _conversation(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` checked and without null keys (see :func:`load_conversations`)."""
    out = []
    for position, message in enumerate(_message_list(messages, where)):
        if message.get("role") not in CHAT_ROLES:
            raise DataUnavailable(
                f"{where}: message {position} has role {message.get('role')!r}; expected one of {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(message.get("content"), str):
            raise DataUnavailable(f"{where}: message {position} has no string 'content'")
        extra = assistant_extra_keys(message)
        if extra:
            raise DataUnavailable(f"{where}: message {position}: {extra}")
        out.append(message)
    if not any(message["role"] == "assistant" for message in out):
        raise DataUnavailable(f"{where}: the conversation has no assistant turn")
    if out[0]["role"] == "assistant":
        raise DataUnavailable(f"{where}: the conversation starts with an assistant turn; it needs a prompt first")
    return out


@dataclass
class PreferencePair:
    """One preference pair: a shared prompt and two continuations of it.

    Attributes:
        prompt: the messages before the responses (at least one, the last not an assistant turn).
        chosen: the preferred continuation (one assistant message, or a multi-turn list that
            starts with an assistant turn: assistant turns and the env's replies).
        rejected: the other continuation, same shape.
        extra: the row's other keys (e.g. ``ref_chosen_logps`` / ``ref_rejected_logps``, rewards).
    """

    prompt: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rejected: list[dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)


def load_preferences(source: str | Mapping[str, str], split: str = "train") -> list[PreferencePair]:
    """Preference pairs in RL2's reward-model / DPO format, read with :func:`load_table`.

    Rows are ``{"prompt": str | messages, "chosen": ..., "rejected": ...}`` or
    ``{"messages": [...], "chosen": ..., "rejected": ...}`` (``messages`` is the prompt). A
    ``chosen`` / ``rejected`` string is one assistant message; a list of messages is a multi-turn
    continuation (``python -m rl2gem.collect pairs=true`` writes those for multi-turn envs). A
    string prompt is one user message; JSON strings (CSV cells) are parsed.

    Returns:
        one :class:`PreferencePair` per row, in file order.

    Raises:
        DataUnavailable: anything :func:`load_table` raises; a row (numbered from 0) without a
            prompt, chosen or rejected, a malformed message list, or a continuation that does
            not start with an assistant turn.
    """
    pairs = []
    for number, row in enumerate(load_table(source, split)):
        present = {key: value for key, value in row.items() if value is not None}
        where = f"{source}: row {number} (counting from 0)"
        prompt_key = "messages" if "messages" in present else "prompt"
        missing = [key for key in (prompt_key, "chosen", "rejected") if key not in present]
        if missing:
            raise DataUnavailable(
                f"{where}: missing {missing} (keys {sorted(present)}); "
                "expected {'prompt' or 'messages', 'chosen', 'rejected'}"
            )
        prompt = _messages(present[prompt_key], "user", f"{where}: {prompt_key!r}")
        if prompt[-1]["role"] == "assistant":
            raise DataUnavailable(f"{where}: the prompt ends with an assistant turn")
        sides = {}
        for side in ("chosen", "rejected"):
            continuation = _messages(present[side], "assistant", f"{where}: {side!r}")
            if continuation[0]["role"] != "assistant":
                raise DataUnavailable(f"{where}: {side!r} must start with an assistant turn")
            _conversation(prompt + continuation, where)
            sides[side] = continuation
        extra = {key: value for key, value in present.items() if key not in (prompt_key, "chosen", "rejected")}
        for key in ("ref_chosen_logps", "ref_rejected_logps"):
            if key in extra and not _is_number(extra[key]):
                raise DataUnavailable(
                    f"{where}: {key!r} must be a number (a sequence log-prob), got {extra[key]!r:.100}"
                )
        pairs.append(PreferencePair(prompt, sides["chosen"], sides["rejected"], extra))
    return pairs


def _is_number(value: Any) -> bool:
    """A real number, or text that reads as one (a CSV cell)."""
    if isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _messages(value: Any, role: str, where: str) -> list[dict[str, Any]]:
    """A string as one ``role`` message, a list (or its JSON string) as messages, checked."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.lstrip().startswith("[") else None
        except json.JSONDecodeError:
            parsed = None
        if not (isinstance(parsed, list) and parsed and all(isinstance(m, Mapping) for m in parsed)):
            return [{"role": role, "content": value}]  # text, even text like "[3]"
        value = parsed
    return _message_list(value, where)


def _message_list(value: Any, where: str) -> list[dict[str, Any]]:
    """A non-empty list of mappings, each without its null keys."""
    if not isinstance(value, list) or not value:
        raise DataUnavailable(f"{where}: messages must be a non-empty list, got {value!r:.200}")
    messages = []
    for position, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise DataUnavailable(f"{where}: message {position} is not a mapping: {message!r:.200}")
        messages.append({key: item for key, item in message.items() if item is not None})
    return messages


_memo: dict[str, list[dict[str, Any]]] = {}


def prepared(name: str, build: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Records ``build()`` returns, cached on disk as ``<cache>/prepared/<name>.jsonl`` and in memory.

    ``name`` must change whenever ``build`` would give other records (put the
    asset version and a format version in it). One process builds while the
    others wait for its file (an inter-process lock), so concurrent first uses
    (test workers, trainer ranks) build once.
    """
    if name in _memo:
        return _memo[name]
    path = cache_dir() / "prepared" / f"{name}.jsonl"
    if not path.exists():
        with locked(path.parent / f".{name}.lock"):
            if not path.exists():
                records = build()
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{name}-")
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    for r in records:
                        fh.write(json.dumps(r, ensure_ascii=False) + "\n")
                os.replace(tmp, path)
    with open(path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh]
    _memo[name] = records
    return records
