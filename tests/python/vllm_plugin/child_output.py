"""What a failed check process printed, cut for a test log: its first traceback and its tail.

A vLLM engine that fails to start prints its root cause (a worker's traceback) first and then a few thousand
characters of the engine core's and the caller's tracebacks, which say only that startup failed; a tail alone
loses the cause (CI, stop 46: "WorkerProc initialization failed", no reason left in the log).
"""
import re

# an exception line, after vLLM's "(Worker_TP0 pid=123)" prefix where there is one
_RAISED = re.compile(r"^(\([^)]*pid=\d+\)\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(:|$)")


def first_traceback(text: str, most: int = 80) -> str:
    """The first `Traceback ...` block of `text` up to its exception line (at most `most` lines); '' if none."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if "Traceback (most recent call last)" in l), None)
    if start is None:
        return ""
    block = lines[start:start + most]
    end = next((j for j, l in enumerate(block) if j > 0 and _RAISED.match(l.strip())), None)
    return "\n".join(block if end is None else block[:end + 1])


def excerpt(text: str, tail: int = 6000) -> str:
    """`text`'s last `tail` characters, preceded by its first traceback where that lies before them."""
    last = text[-tail:]
    first = first_traceback(text)
    if not first or first in last:
        return last
    return f"first traceback:\n{first}\n...\nlast {tail} characters:\n{last}"
