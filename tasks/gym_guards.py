"""Guards in front of reasoning-gym scorers that hand an answer to an interpreter.

Several reasoning-gym scorers ``eval()`` the answer, expecting a Python list (spiral_matrix,
string_insertion, n_queens, binary_matrix), and others give it to sympy's ``parse_expr``, which
evaluates the Python it builds (countdown, puzzle24, polynomial_multiplication,
simple_integration, intermediate_integration). Every scorer runs in the scoring sandbox
(:mod:`echo.tasks.sandbox`) all the same; these guards make the answer unable to be code in the
first place:

- :func:`literal_only` stands in for ``eval`` in the first group's modules (a module global
  named ``eval`` shadows the builtin): :func:`ast.literal_eval`, which builds literals and
  nothing else, on at most :data:`MAX_LITERAL_CHARS`;
- :func:`guard_parse_expr` wraps ``parse_expr`` (and ``sympy.parse_expr`` seen through the
  module's ``sympy`` name) in the second group: an answer must be a short arithmetic or algebraic
  expression (:data:`EXPRESSION`), names from :data:`MATH_NAMES` only, so no attribute, string,
  subscript or dunder can reach the interpreter.

:func:`scorer_hazards` reads a dataset's module for interpreter calls that no guard covers; the
coordinator refuses a job on such a dataset unless its operator allows it by name.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import sys
import types
from collections.abc import Callable
from typing import Any

# Scorers whose ``eval(answer)`` expects a literal list or string.
EVAL_LITERAL = frozenset({"spiral_matrix", "string_insertion", "n_queens", "binary_matrix"})
# Scorers that give the answer to sympy's ``parse_expr``.
SYMPY_PARSE = frozenset(
    {
        "countdown",
        "puzzle24",
        "polynomial_multiplication",
        "simple_integration",
        "intermediate_integration",
    }
)
# Read by hand: their ``eval`` runs on the dataset's own generated text, never on an answer;
# propositional_logic's ``parse_expr`` is a small parser of its own, not sympy's.
REVIEWED = frozenset(
    {"basic_arithmetic", "bitwise_arithmetic", "number_sorting", "propositional_logic"}
)
# The largest matrix or board answer these datasets ask for is a few KB.
MAX_LITERAL_CHARS = 65536
# Answers to these datasets are short expressions; longer ones only buy a parser time.
MAX_EXPRESSION_CHARS = 1000
# Digits, names, arithmetic, parentheses, commas and spaces: nothing that subscripts, quotes or
# reaches an attribute.
EXPRESSION = re.compile(r"[0-9A-Za-z+\-*/^()., ]*")
_NAME = re.compile(r"[A-Za-z]+")
# A power whose exponent is itself a power (``9**9**9**9``, ``9^(9^9)``): a number no scorer
# can build in its time. Other large powers are left to the sandbox's limits.
POWER_TOWER = re.compile(r"(\*\*|\^)[\s(]*[\w.]+[\s)]*(\*\*|\^)")
# Names an answer may use: one-letter variables and sympy's elementary functions and constants.
MATH_NAMES = frozenset(
    {
        *("sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan"),
        *("sinh", "cosh", "tanh", "exp", "log", "ln", "sqrt", "pi", "E", "I", "oo"),
        *("Abs", "abs", "Rational"),
    }
)
# What :func:`scorer_hazards` looks for in a dataset's module.
_HAZARD = re.compile(
    r"(?<![\w.])(eval|exec|compile|__import__|sympify|parse_expr)\s*\(|\bsubprocess\b|\bpickle\b"
)


def literal_only(text: Any, *_scope: Any) -> Any:
    """``eval`` for answers that must be literals: :func:`ast.literal_eval` of a bounded str.

    :raises ValueError: not a str, too long, or not a literal (the scorers catch it: score 0).
    """
    if not isinstance(text, str) or len(text) > MAX_LITERAL_CHARS:
        raise ValueError("answer is not a short literal")
    try:
        return ast.literal_eval(text)
    except (SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError(f"answer is not a literal: {type(exc).__name__}") from None


def check_expression(text: Any) -> str:
    """``text`` if it is a short expression of :data:`MATH_NAMES` and one-letter names.

    :raises ValueError: anything else (the scorers catch it: score 0).
    """
    if not isinstance(text, str) or len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError("answer is not a short expression")
    if not EXPRESSION.fullmatch(text):
        raise ValueError("answer holds characters an expression does not")
    if POWER_TOWER.search(text):
        raise ValueError("answer raises a power to a power")
    for name in _NAME.findall(text):
        if len(name) > 1 and name not in MATH_NAMES:
            raise ValueError(f"answer names {name[:20]!r}, not a variable or function")
    return text


def guard_parse_expr(parse: Callable[..., Any]) -> Callable[..., Any]:
    """``parse`` that first checks its text with :func:`check_expression`."""
    if getattr(parse, "echo_guarded", False):
        return parse

    @functools.wraps(parse)
    def guarded(text: Any, *args: Any, **kwargs: Any) -> Any:
        return parse(check_expression(text), *args, **kwargs)

    guarded.echo_guarded = True  # type: ignore[attr-defined]
    return guarded


class _GuardedSympy(types.ModuleType):
    """The ``sympy`` module as one scorer module sees it: ``parse_expr`` guarded, the rest as is."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__)
        self._real = real
        self.parse_expr = guard_parse_expr(real.parse_expr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _module(dataset: str) -> types.ModuleType:
    from reasoning_gym.factory import DATASETS

    return sys.modules[DATASETS[dataset][0].__module__]


def install(dataset: str) -> None:
    """Put the guards in front of ``dataset``'s scorer in this process (idempotent)."""
    if dataset in EVAL_LITERAL:
        _module(dataset).eval = literal_only  # type: ignore[attr-defined]
    elif dataset in SYMPY_PARSE:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr

        mod = _module(dataset)
        for name, value in list(vars(mod).items()):
            if value is parse_expr or value is sympy.parse_expr:
                setattr(mod, name, guard_parse_expr(value))
            elif value is sympy:
                setattr(mod, name, _GuardedSympy(sympy))


@functools.cache
def scorer_hazards(dataset: str) -> tuple[str, ...]:
    """Interpreter calls in ``dataset``'s module that no guard covers (empty: none found).

    A reading of one module's source, not a proof: a scorer may call into other modules. The
    sandbox holds whatever gets past it.
    """
    if dataset in EVAL_LITERAL or dataset in SYMPY_PARSE or dataset in REVIEWED:
        return ()
    try:
        source = inspect.getsource(_module(dataset))
    except (OSError, TypeError):
        return ("source unavailable",)
    return tuple(sorted({m.group(0).rstrip("( ") for m in _HAZARD.finditer(source)}))
