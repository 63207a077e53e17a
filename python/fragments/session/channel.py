"""The driver's end of a session's ranks: `python -m fragments.session.rank` processes started once, each
request sent to every rank, their replies gathered in rank order (a rank's error raised in its words).

How things travel: requests are pickled with cloudpickle (pinned in tools/requirements.txt) where it is
installed: functions and lambdas defined in a notebook or a REPL travel by value, with what they refer to;
without it, pickle sends functions by reference (only ones importable on the ranks). What cannot travel either
way: open files, sockets, locks, generators, CUDA streams, and objects of C extensions without pickling support;
the message names the object.
"""
import os
import pickle
import secrets
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener, wait

from ..core.errors import FragmentsError

try:
    import cloudpickle as pickler
except ImportError:  # functions then travel by reference only
    pickler = pickle

_PYTHON_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dumps(kind, payload):
    """A request as bytes; what cannot travel is said in words."""
    try:
        return pickler.dumps((kind, payload))
    except Exception as e:  # noqa: B902 - what cannot travel, in words
        raise FragmentsError(f"this cannot be sent to the ranks: {type(e).__name__}: {e} (functions travel "
                             f"{'by value (cloudpickle)' if pickler.__name__ == 'cloudpickle' else 'by reference: only importable ones'}; "
                             "open files, sockets, locks and generators do not travel)") from None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """`tp` rank processes of `path`, connected to this process; `dead` says why they ended, if they did."""

    def __init__(self, path, tp, backend, timeout):
        self.path, self.tp, self.dead = path, tp, None
        self._interrupted, self._waiting = False, set()
        self._procs, self._conns = [], [None] * tp
        try:
            self.info = self._start(backend, timeout)
        except BaseException:  # a rank that could not load, or an interrupt: no rank is left behind
            self.kill()
            raise
        self.pids = [p.pid for p in self._procs]

    def _start(self, backend, timeout):
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        address = "%s:%d" % listener.address
        pythonpath = os.pathsep.join(filter(None, [_PYTHON_ROOT, os.environ.get("PYTHONPATH", "")]))
        port = _free_port()
        for r in range(self.tp):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(self.tp), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FRAGMENTS_BACKEND=backend,
                       FRAGMENTS_TIMEOUT=str(timeout), FRAGMENTS_SESSION_KEY=key.hex(), PYTHONPATH=pythonpath)
            device = f"cuda:{r}" if backend == "nccl" else "cpu"
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "fragments.session.rank", "--address", address, "--path", self.path,
                 "--device", device, "--parent", str(os.getpid())], env=env, stdin=subprocess.DEVNULL))
        accepted = []

        def accept():
            try:
                for _ in range(self.tp):
                    accepted.append(listener.accept())
            except OSError:
                pass
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(0.1)
            self.check_alive()
            if time.monotonic() > deadline:
                self.kill()
                raise FragmentsError(f"LanguageModel: the {self.tp} ranks did not connect within {timeout:.0f} s")
        listener.close()
        for conn in accepted:
            kind, rank = pickle.loads(conn.recv_bytes())
            self._conns[rank] = conn
        return self.gather(deadline=time.monotonic() + timeout)[0]

    def check_alive(self):
        for r, p in enumerate(self._procs):
            code = p.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                self.dead = f"rank {r} (pid {p.pid}) died ({how})"
                self.kill()
                raise FragmentsError(f"{self.dead}; this session has ended: create a new LanguageModel")

    def kill(self):
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def gather(self, deadline=None, ranks=None):
        """Each rank's reply (kind "ok" payloads in rank order); a rank's error raises, in its words."""
        replies, errors = [None] * self.tp, {}
        waiting = set(range(self.tp) if ranks is None else ranks)
        self._waiting = waiting  # what an interrupt leaves unread
        while waiting:
            ready = wait([self._conns[r] for r in waiting], timeout=0.2)
            for conn in ready:
                r = self._conns.index(conn)
                try:
                    kind, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    time.sleep(0.2)
                    self.check_alive()
                    raise FragmentsError(f"rank {r} closed its connection")
                waiting.discard(r)
                if kind == "error":
                    errors[r] = payload
                else:
                    replies[r] = payload
            if not ready:
                self._late(errors, waiting, deadline)
            if errors and waiting:  # the others fail alike at once (the same step), or wait in a collective
                deadline = min(deadline or float("inf"), time.monotonic() + 5)
        if errors:
            r = min(errors)
            text = errors[r].rstrip() or "failed without a message"
            located = text.startswith("rank ") or ":" in text.split()[0]  # "file:line: ..." or "rank N ..."
            raise FragmentsError(text if located else f"rank {r}: {text}")
        return replies

    def _late(self, errors, waiting, deadline):
        """No reply came for a while: a dead rank, or ranks past their deadline, end the session."""
        self.check_alive()
        if deadline is None or time.monotonic() <= deadline:
            return
        self.kill()
        if errors:  # the others wait in a collective for the failed rank: the ranks are out of step
            r = min(errors)
            self.dead = f"rank {r} failed while ranks {sorted(waiting)} waited for it"
            raise FragmentsError(f"{errors[r].rstrip()}\n({self.dead}; this session has ended)")
        self.dead = "the ranks did not answer in time"
        raise FragmentsError(f"{self.dead}; this session has ended")

    def request(self, data):
        """Sends one pickled request to every rank; their replies in rank order."""
        self.check_alive()
        if self._interrupted:  # the replies of a request interrupted in the caller (Ctrl-C, a kernel
            self._interrupted = False  # interrupt): the ranks finish it; drop them
            try:
                self.gather(ranks=set(self._waiting))
            except FragmentsError:
                pass
        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self.check_alive()
                raise FragmentsError(f"rank {r} cannot be reached") from None
        try:
            return self.gather()
        except KeyboardInterrupt:
            self._interrupted = True
            raise

    def close(self):
        """Tells the ranks to end (unless they are dead) and waits for them."""
        if not self.dead:
            for conn in self._conns:
                try:
                    conn.send_bytes(pickle.dumps(("close", None)))
                except (OSError, AttributeError):
                    pass
        deadline = time.monotonic() + 10
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for conn in self._conns:
            if conn is not None:
                conn.close()
