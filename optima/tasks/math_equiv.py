"""Equivalence of MATH answers: a fast string/number path, then `math-verify` in worker processes.

The symbolic check runs in a process pool (a `signal.alarm` timeout only works in a main thread, docs/method.md
D7); a check that times out twice scores "not equivalent" and is counted (`MathVerifier.timeouts`), since the
score then depends on the machine's load. Without `math-verify` installed, only the fast path decides.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import logging
import multiprocessing
import re
import threading
from collections.abc import Callable
from fractions import Fraction

from optima.tasks.answers import drop_thousands_commas, normalize_final_answer, without_percent

logger = logging.getLogger(__name__)

# LaTeX that changes only the spelling of an answer, removed or rewritten before comparing strings.
_CANONICAL_REWRITES = (
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\:", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
)
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_FRACTION = re.compile(r"([-+]?)\\frac\{([-+]?\d+(?:\.\d*)?)\}\{([-+]?\d+(?:\.\d*)?)\}")
_SLASH_FRACTION = re.compile(r"([-+]?\d+(?:\.\d*)?)/([-+]?\d+(?:\.\d*)?)")
# Longer strings are not numbers worth parsing (and int() refuses more than 4300 digits anyway).
_MAX_NUMBER_CHARS = 64
TIMEOUT_RETRIES = 1  # a symbolic check that timed out is run once more before it is counted and scored 0


def canonical_answer(answer: str) -> str:
    """The Minerva-normalised answer without the LaTeX spellings that never change its value."""
    text = normalize_final_answer(answer)
    for before, after in _CANONICAL_REWRITES:
        text = text.replace(before, after)
    return "".join(without_percent(text).split())


def numeric_value(text: str) -> Fraction | None:
    """An integer, a decimal, `a/b` or `\\frac{a}{b}` as a Fraction (thousands commas ignored; any other comma,
    as in the list `-1, 2`, makes it no number), else None."""
    text = drop_thousands_commas("".join(text.split()))
    if not text or "," in text or len(text) > _MAX_NUMBER_CHARS:
        return None
    try:
        if _NUMBER.fullmatch(text):
            return Fraction(text)
        match = _FRACTION.fullmatch(text) or _SLASH_FRACTION.fullmatch(text)
        if match is None:
            return None
        groups = match.groups()
        sign = -1 if len(groups) == 3 and groups[0] == "-" else 1
        numerator, denominator = Fraction(groups[-2]), Fraction(groups[-1])
        return None if denominator == 0 else sign * numerator / denominator
    except (ValueError, ZeroDivisionError):
        return None


def fast_equivalence(prediction: str, gold: str) -> bool | None:
    """Equal strings or numbers without sympy: True, False, or None (undecided: try the symbolic check)."""
    pred_text, gold_text = canonical_answer(prediction), canonical_answer(gold)
    if pred_text == gold_text:
        return True
    pred_value, gold_value = numeric_value(pred_text), numeric_value(gold_text)
    if pred_value is not None and gold_value is not None:
        return pred_value == gold_value
    return None


class _TimeoutLog(logging.Handler):
    """Notes math-verify's "Timeout during ..." warnings: it logs a timeout and answers "not equivalent"."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = self.seen or str(record.msg).startswith("Timeout during")


def symbolic_check(prediction: str, gold: str, timeout_s: int) -> bool | None:
    """math-verify's verdict on two LaTeX answers, in a worker's main thread (its signal-based `timeout_s` works
    there); None when it timed out before finding them equal."""
    from math_verify import parse, verify  # lazy: only worker processes import sympy/math-verify

    watch, log = _TimeoutLog(), logging.getLogger("math_verify")
    log.addHandler(watch)
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s)
        pred_parsed = parse(f"${prediction}$", parsing_timeout=timeout_s)
        equal = bool(gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    finally:
        log.removeHandler(watch)
    return None if watch.seen and not equal else equal


def symbolic_backend_available() -> bool:
    """Whether `math-verify` is installed (checked without importing it)."""
    return importlib.util.find_spec("math_verify") is not None


class MathVerifier:
    """Thread-safe symbolic checker over a process pool; a context manager.

    Args:
        max_workers: worker processes.
        timeout_s: math-verify's limit per item.
        check: what the workers run, `(prediction, gold, timeout_s) -> bool | None` (None: timed out).
        hard_timeout_s: deadline on a worker's answer (default `3 * timeout_s + 5`: parse twice, verify once),
            past which the pool is recycled.
    """

    def __init__(
        self,
        max_workers: int = 2,
        timeout_s: int = 10,
        check: Callable[[str, str, int], bool] = symbolic_check,
        hard_timeout_s: float | None = None,
    ):
        self.max_workers = max_workers
        self.timeout_s = timeout_s
        self.check = check
        self.hard_timeout_s = 3 * timeout_s + 5 if hard_timeout_s is None else hard_timeout_s
        self.available = check is not symbolic_check or symbolic_backend_available()
        if not self.available:
            logger.warning("math-verify is not installed: MATH answers are compared as strings and numbers only")
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None
        self._timeouts = 0

    @property
    def timeouts(self) -> int:
        """Symbolic checks that timed out on every try (each scored "not equivalent")."""
        with self._lock:
            return self._timeouts

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                # spawn: forking a multi-threaded parent (HTTP threads, torch) is unsafe.
                context = multiprocessing.get_context("spawn")
                self._executor = concurrent.futures.ProcessPoolExecutor(self.max_workers, mp_context=context)
            return self._executor

    def _recycle(self, executor: concurrent.futures.ProcessPoolExecutor) -> None:
        """Replace a pool whose worker is stuck past the hard deadline (terminating its processes)."""
        with self._lock:
            if self._executor is executor:
                self._executor = None
        # ProcessPoolExecutor cannot cancel a running task; ending its processes is the only way to free them.
        for process in list((executor._processes or {}).values()):
            process.terminate()
        executor.shutdown(wait=False, cancel_futures=True)

    def symbolic_equal(self, prediction: str, gold: str) -> bool:
        """The symbolic check in a worker, run again after a timeout; False on failure or timeouts only."""
        if not self.available:
            return False
        for _ in range(TIMEOUT_RETRIES + 1):
            verdict = self._check_once(prediction, gold)
            if verdict is not None:
                return verdict
        with self._lock:
            self._timeouts += 1
        logger.warning(
            "math equivalence timed out %d times (limit %ss, deadline %ss); scored as not equivalent and counted",
            TIMEOUT_RETRIES + 1, self.timeout_s, self.hard_timeout_s,
        )  # fmt: skip
        return False

    def _check_once(self, prediction: str, gold: str) -> bool | None:
        """One check in a worker: True or False, None when it timed out (its own limit or the hard deadline)."""
        executor = self._pool()
        future = executor.submit(self.check, prediction, gold, self.timeout_s)
        try:
            verdict = future.result(timeout=self.hard_timeout_s)
            return None if verdict is None else bool(verdict)
        except concurrent.futures.TimeoutError:
            logger.debug("math equivalence passed the %ss deadline; recycling the pool", self.hard_timeout_s)
            self._recycle(executor)
            return None
        except concurrent.futures.process.BrokenProcessPool:
            logger.warning("math verifier pool broke; recreating it")
            self._recycle(executor)
        except (ValueError, TypeError, ArithmeticError, RecursionError) as error:
            logger.debug("math equivalence check failed: %r", error)
        return False

    def is_equivalent(self, prediction: str | None, gold: str) -> bool:
        """Whether two final answers are equal (fast path first, then symbolic; None or "" never is)."""
        if not prediction or not gold:
            return False
        decided = fast_equivalence(prediction, gold)
        if decided is not None:
            return decided
        return self.symbolic_equal(prediction, gold)

    def close(self) -> None:
        """Shut the worker pool down."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
