"""Errors in the user's words, at the user's line.

Every backend raises FragmentsError for a misuse and names the line that recorded the step (`user_line`, the
first frame outside this package): recorded steps carry it as `where`, and an error the C++ engine raises
during a forward is put at the line of the first step whose location it names (`at_line`).
"""
import difflib
import os
import sys

from .. import _C

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = {}  # co_filename -> whether it is this package's (or importlib's): asked once per file


class FragmentsError(_C.FragError):
    """Misuse of the Python API, said in the user's words (a subclass of the runtime's FragError)."""


class StepError(FragmentsError):
    """A failure of one recorded step, reported at the user's line (`where`)."""


def at(where, message):
    """A StepError `where: message`."""
    return StepError(f"{where}: {message}")


def did_you_mean(name, candidates):
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


def _ours(filename):
    verdict = _OURS.get(filename)
    if verdict is None:
        path = os.path.abspath(filename)
        verdict = _OURS[filename] = path.startswith(_PACKAGE + os.sep) or "importlib" in path
    return verdict


def user_line():
    """"file:line" of the first frame outside this package (where the user wrote the step). Every step of
    every trace asks, so it walks frames with sys._getframe and judges each file once."""
    frame = sys._getframe(1)
    try:
        while frame is not None:
            filename = frame.f_code.co_filename
            ours = _OURS.get(filename)
            if not (_ours(filename) if ours is None else ours):
                return f"{filename}:{frame.f_lineno}"
            frame = frame.f_back
        return "?"
    finally:
        del frame


def at_line(error, steps):
    """`error` prefixed with the line of the first step whose location it names (else as it is); `steps`: any
    records with `at` and `where` (plan steps, Python steps)."""
    message = str(error)
    if _located(message):
        return error
    where = next((getattr(s, "where", None) for s in steps if getattr(s, "at", None) and s.at in message), None)
    return type(error)(f"{where}: {message}") if where and where != "?" else error


def _located(message):
    """Whether a message starts with a "file:line: " already."""
    first = message.split(" ", 1)[0]
    return first.endswith(":") and first[:-1].rpartition(":")[2].isdigit()
