"""Whether rank processes are gone: the session tests and the notebook test check that closing a model,
a kernel shutting down or a killed driver leaves no rank behind."""
import time


def alive(pid):
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids, seconds=15.0, poll=0.1):
    """Waits up to `seconds` for every pid to end; returns those still alive."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(poll)
    return [p for p in pids if alive(p)]
