"""Math answer checking with Hugging Face's ``math-verify``.

:func:`score_math` takes the model's response and the reference answer and
returns a :class:`MathScore`. The response's final answer is the content of
its last ``\\boxed{...}``; equivalence (fractions, decimals, LaTeX, sets,
intervals, percentages, units in ``\\text{}``) is decided by ``math_verify``'s
``parse`` + ``verify`` (https://github.com/huggingface/Math-Verify), not by our
own comparer.

Timeouts: ``math_verify`` bounds its sympy work with ``signal.alarm``, which
only works in a process's main thread; an adversarial answer such as
``9^{9^{9^9}}`` would otherwise run forever. Called from the main thread, we
use its own timeout. Called from any other thread (an env's ``astep`` runs
there), the check runs in a persistent worker process (``python -m
rl2gem.rewards.math --worker``, started on first use, one per concurrent
caller) whose main thread has the alarm; a worker that does not answer within
``timeout + 10`` seconds is killed and the check scores 0 with
``error="timeout"``. So a reward never hangs a rollout.
"""

from __future__ import annotations

import json
import re
import select
import string
import subprocess
import sys
import threading
from dataclasses import dataclass

__all__ = ["MathScore", "extract_boxed", "score_math"]

#: Longest boxed answer that is parsed at all (longer ones score 0).
MAX_ANSWER_CHARS = 1_000


@dataclass(frozen=True)
class MathScore:
    """Outcome of one check.

    Attributes:
        reward: 1.0 if correct else 0.0.
        correct: the boxed answer is equivalent to the reference.
        format_ok: the response has a ``\\boxed{}`` answer.
        answer: the boxed text (``None`` without a box).
        parsed: ``math_verify``'s reading of it, as text (``None`` if unparsable).
        error: ``"timeout"``, ``"too_long"`` or a parser error; ``None`` when fine.
    """

    reward: float
    correct: bool
    format_ok: bool
    answer: str | None
    parsed: str | None = None
    error: str | None = None


_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*(\{)?")
_BOX_TOKEN = re.compile(r"[^\s$]+")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced,
    spaces before the brace allowed (``\\boxed {8}``); ``\\boxed 5`` without braces gives the
    run of characters after it up to a space or ``$``. ``None`` if absent or unbalanced."""
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    if last.group(1) is None:  # no brace: the token after it
        token = _BOX_TOKEN.match(text, last.end())
        return token.group(0) if token else None
    i = last.end()
    depth, j = 1, i
    while j < len(text):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
        j += 1
    return None  # unbalanced


def _verify(prediction: str, reference: str, timeout: float | None) -> tuple[bool, str | None, str | None]:
    """``prediction`` (a ``\\boxed{}`` answer, or free text math_verify's extraction searches)
    against ``reference`` (parsed as a boxed answer): ``(correct, parsed prediction, error)``."""
    from math_verify import parse, verify

    kw = {} if timeout is None else {"parsing_timeout": max(1, int(timeout))}
    try:
        gold = parse("\\boxed{" + reference + "}", **({"parsing_timeout": None} if timeout is None else kw))
        pred = parse(prediction, **({"parsing_timeout": None} if timeout is None else kw))
        if not pred:
            return False, None, "unparsable"
        ok = verify(gold, pred, timeout_seconds=None if timeout is None else max(1, int(timeout)))
        return bool(ok), str(pred[0]), None
    except Exception as e:
        return False, None, f"{type(e).__name__}: {e}"[:200]


class _Worker:
    """A persistent ``python -m rl2gem.rewards.math`` process answering JSON lines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rl2gem.rewards.math", "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )

    def ask(self, answer: str, reference: str, timeout: float) -> tuple[bool, str | None, str | None]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([answer, reference, timeout]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout + 10.0)
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise TimeoutError  # the worker died
        ok, parsed, err = json.loads(line)
        return ok, parsed, err

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


class _Pool:
    """Idle workers shared by all threads; a worker that overruns is killed, not reused."""

    lock = threading.Lock()
    idle: list[_Worker] = []

    @classmethod
    def run(cls, answer: str, reference: str, timeout: float) -> tuple[bool, str | None, str | None]:
        with cls.lock:
            worker = cls.idle.pop() if cls.idle else None
        if worker is None or worker.proc.poll() is not None:
            worker = _Worker()
        try:
            result = worker.ask(answer, reference, timeout)
        except (TimeoutError, OSError, ValueError):
            worker.kill()
            return False, None, "timeout"
        with cls.lock:
            cls.idle.append(worker)
        return result


def _serve() -> None:
    for line in sys.stdin:
        answer, reference, timeout = json.loads(line)
        sys.stdout.write(json.dumps(_verify(answer, reference, timeout)) + "\n")
        sys.stdout.flush()


def score_math(response: str, reference: str, *, require_boxed: bool = True, timeout: float = 5.0) -> MathScore:
    """Score a response against a reference answer with ``math_verify``.

    Args:
        response: the model's full response text.
        reference: the reference answer (a number or LaTeX, without ``\\boxed``).
        require_boxed: without a ``\\boxed{}`` holding something (not only spaces or
            punctuation) the response scores 0
            (``format_ok=False``). With ``False`` math_verify's own extraction searches the
            response's last :data:`MAX_ANSWER_CHARS` characters (LaTeX such as ``$-3$``, or the
            last number or expression: ``The answer is 42``).
        timeout: seconds allowed for parsing and comparing.

    Returns:
        A :class:`MathScore`; never raises for any response text.
    """
    answer = extract_boxed(response)
    if answer is not None and not answer.strip(string.whitespace + string.punctuation):
        answer = None  # an empty box (\boxed{}, \boxed{ . }) is no answer: no format credit either
    format_ok = answer is not None
    if answer is None:
        if require_boxed:
            return MathScore(0.0, False, False, None)
        answer = prediction = response[-MAX_ANSWER_CHARS:]
    elif len(answer) > MAX_ANSWER_CHARS:
        return MathScore(0.0, False, format_ok, answer[:80] + "...", None, "too_long")
    else:
        prediction = "\\boxed{" + answer + "}"
    if threading.current_thread() is threading.main_thread():
        ok, parsed, err = _verify(prediction, reference, timeout)
    else:
        ok, parsed, err = _Pool.run(prediction, reference, timeout)
    if err and "imeout" in err:
        err = "timeout"
    return MathScore(float(ok), ok, format_ok, answer, parsed, err)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _serve()
