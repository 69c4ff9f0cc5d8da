"""Built-in reward components: answer extraction, math-verify, exact match, regex and format.

Each scorer is a pure function of the completion text (decoded, EOS removed) and the reference
answer, returning a score in [0, 1]. Extraction is shared and documented once, here:

- :func:`tagged` is the content of the *last* ``<tag>...</tag>`` pair (stripped), or None;
- :func:`final_answer` is that content when the tag is present, else the last non-empty line of
  the completion (stripped), else "".

math-verify bounds each parse and comparison with its own ``timeout`` parameters, which work by
``signal.alarm`` and so only in the main thread. Off the main thread (the learner evaluates in a
worker thread), :func:`math_score` sends the call to a child process
(:class:`~echo.tasks.reward_worker.RewardWorker`) whose main thread runs math-verify with the
same limits, and which is killed if it overruns them anyway.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

log = logging.getLogger(__name__)

# Completions are at most a few thousand tokens; a longer text here is not a completion.
MAX_SCORED_CHARS = 1 << 20


def _tag_span(text: str, tag: str) -> tuple[int, int] | None:
    """Where the content of the last ``<tag>...</tag>`` pair starts and ends: the last closing
    tag and the last opening tag before it. Two reverse scans, linear in the text whatever it
    holds (a regex over ``<tag>`` openers without a closer is quadratic)."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    opener = f"<{tag}>"
    start = text.rfind(opener, 0, close)
    return None if start < 0 else (start + len(opener), close)


def tagged(completion: str, tag: str = "answer") -> str | None:
    """Stripped content of the last ``<tag>...</tag>`` in ``completion``; None if there is none."""
    text = completion[:MAX_SCORED_CHARS]
    span = _tag_span(text, tag)
    return None if span is None else text[span[0] : span[1]].strip()


def final_answer(completion: str, tag: str = "answer") -> str:
    """The answer a completion gives: its last ``<tag>`` content, else its last non-empty line."""
    inside = tagged(completion, tag)
    if inside is not None:
        return inside
    lines = [line.strip() for line in completion[:MAX_SCORED_CHARS].splitlines()]
    return next((line for line in reversed(lines) if line), "")


# A plain decimal number, not glued to a word or another number's digits ("x2" and "1.2.3" hold
# no number here): what a short answer ends on.
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.]\d)")


def last_number_score(completion: str, answer: str, tag: str = "answer") -> float:
    """1.0 iff the last number in the ``<tag>`` content (else the whole completion) equals the
    numeric reference answer. Unlike math-verify, which evaluates the last expression (a
    completion cut at "To find 6 + 8," scores right for 14), an operand echoed from the
    question is only itself; 0.0 for a reference that is not a number."""
    try:
        want = float(answer.strip())
    except ValueError:
        return 0.0
    inside = tagged(completion, tag)
    text = inside if inside is not None else completion[:MAX_SCORED_CHARS]
    found = _NUMBER.findall(text)
    return 1.0 if found and float(found[-1]) == want else 0.0


def exact_score(completion: str, answer: str, tag: str = "answer") -> float:
    """1.0 iff :func:`final_answer` equals the stripped reference answer."""
    return 1.0 if final_answer(completion, tag) == answer.strip() else 0.0


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def regex_pattern(pattern: str, answer: str) -> re.Pattern[str]:
    """``pattern`` with each ``{answer}`` replaced by the escaped reference answer, compiled.

    :raises re.error: a pattern that does not compile.
    """
    return _compiled(pattern.replace("{answer}", re.escape(answer.strip())))


def regex_score(completion: str, pattern: str, answer: str) -> float:
    """1.0 iff :func:`regex_pattern` matches somewhere in the completion (``re.search``)."""
    return 1.0 if regex_pattern(pattern, answer).search(completion[:MAX_SCORED_CHARS]) else 0.0


def format_score(completion: str, tag: str = "answer") -> float:
    """1.0 iff the completion holds exactly one ``<tag>...</tag>`` pair with non-empty content
    and no text after it (a format reward: it checks shape, not correctness)."""
    text = completion[:MAX_SCORED_CHARS]
    if text.count(f"<{tag}>") != 1 or text.count(f"</{tag}>") != 1:
        return 0.0
    span = _tag_span(text, tag)
    if span is None or not text[span[0] : span[1]].strip():
        return 0.0
    return 1.0 if not text[span[1] + len(f"</{tag}>") :].strip() else 0.0


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str, timeout_s: int) -> Any:
    from math_verify import parse

    # A bare reference ("18", "3/4") and a LaTeX one ("\\frac{3}{4}") both parse: math-verify
    # tries LaTeX and plain expressions in turn.
    return parse(answer, parsing_timeout=timeout_s)


def math_verify_score(
    completion: str, answer: str, timeout_s: int = 5, tag: str = "answer"
) -> float:
    """math-verify's verdict, in this thread (which must be the main thread: its timeouts use
    ``signal.alarm``). The prediction is the ``<tag>`` content when present, else the whole
    completion, from which math-verify takes the boxed answer, LaTeX, or the last number.

    Returns 0.0 when either side does not parse or a limit is hit (math-verify logs it).
    """
    from math_verify import parse, verify

    gold = _parse_gold(answer.strip(), timeout_s)
    if not gold:
        return 0.0
    inside = tagged(completion, tag)
    text = inside if inside is not None else completion[:MAX_SCORED_CHARS]
    pred = parse(text, parsing_timeout=timeout_s)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0


_worker_lock = threading.Lock()
_math_workers: dict[int, Any] = {}


def _math_worker(timeout_s: int) -> Any:
    from echo.tasks.reward_worker import RewardWorker

    with _worker_lock:
        worker = _math_workers.get(timeout_s)
        if worker is None:
            # Two parses and one comparison, each bounded by math-verify, plus slack: the kill
            # is a backstop for code that ignores the alarm.
            worker = RewardWorker(
                "echo.tasks.rewards:math_verify_score", timeout_s=3 * timeout_s + 2
            )
            _math_workers[timeout_s] = worker
        return worker


def math_score(completion: str, answer: str, timeout_s: int = 5, tag: str = "answer") -> float:
    """:func:`math_verify_score` with its time bounded from any thread (see the module doc).

    Never raises for bad text: unparseable input, a timeout or a crashed worker score 0.0.
    """
    if threading.current_thread() is threading.main_thread():
        return math_verify_score(completion, answer, timeout_s, tag)
    from echo.tasks.reward_worker import RewardError

    try:
        return _math_worker(timeout_s).call(
            completion=completion, answer=answer, timeout_s=timeout_s, tag=tag
        )
    except RewardError as exc:
        log.warning("math reward scored 0: %s", exc)
        return 0.0
