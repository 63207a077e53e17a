"""Ranks that stay up for other processes: `python -m fragments.ranks DIR --tp N [--listen 127.0.0.1:PORT]`.

Starts N rank processes once (as `fragments.LanguageModel(DIR, tp=N)` does), listens on this machine
only, and writes a connection file (address and a random authkey; mode 0600) that clients attach with:

    model = fragments.LanguageModel.attach("/tmp/fragments-ranks-1000-41234.json")

Clients come one after another (another while one is attached is told the ranks are busy); a client that
detaches, ends or dies leaves the ranks running. SIGINT/SIGTERM, or a client's `shutdown_ranks()`, end
them and remove the connection file. The authkey is $FRAGMENTS_AUTHKEY (hex) when set, else random.
"""
import argparse
import json
import os
import pickle
import queue
import secrets
import signal
import sys
import tempfile
import threading
from multiprocessing.connection import AuthenticationError, Listener

from ..core.errors import FragmentsError
from .attach import parse_address
from .language_model import LanguageModel

try:
    import cloudpickle as _pickler
except ImportError:
    _pickler = pickle


def _serve_client(session, conn):
    """Answers one client until it detaches or goes away (False) or asks to end the ranks (True)."""
    while True:
        try:
            kind, data = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return False
        if kind == "detach":
            return False
        if kind == "shutdown":
            conn.send_bytes(pickle.dumps(("ok", None)))
            return True
        try:
            reply = ("ok", session._link.request(data))
        except FragmentsError as e:
            reply = ("error", str(e))
        try:
            conn.send_bytes(_pickler.dumps(reply))
        except OSError:
            return False
        if session._dead:  # the ranks are gone: nothing is left to serve
            return True


def _accept(listener, waiting, busy):
    """Accepts clients into `waiting`; one that comes while another is attached is told so."""
    while True:
        try:
            conn = listener.accept()
        except (AuthenticationError, EOFError, ConnectionError):
            continue  # a wrong authkey, or a client that went away while connecting
        except OSError:
            return  # the listener was closed
        if busy.is_set():
            try:
                conn.send_bytes(pickle.dumps(("busy", "the ranks are busy: another client is attached")))
            finally:
                conn.close()
            continue
        busy.set()
        waiting.put(conn)


def _connection_file(path, address, key, session):
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "authkey": key.hex(), "path": session.path, "tp": session.tp,
                   "pid": os.getpid()}, f)


def serve(session, host, port, connection_file=None):
    """Serves clients of `session` at host:port until a client ends the ranks or a signal comes."""
    key = bytes.fromhex(os.environ["FRAGMENTS_AUTHKEY"]) if os.environ.get("FRAGMENTS_AUTHKEY") else secrets.token_bytes(32)
    listener = Listener((host, port), authkey=key)
    address = "%s:%d" % listener.address[:2]
    connection_file = connection_file or os.path.join(tempfile.gettempdir(),
                                                      f"fragments-ranks-{os.getuid()}-{listener.address[1]}.json")
    hello = {"path": os.path.abspath(session.path), "tp": session.tp, "info": session._info, "pids": session.pids}
    waiting, busy = queue.Queue(), threading.Event()
    threading.Thread(target=_accept, args=(listener, waiting, busy), daemon=True).start()
    _connection_file(connection_file, address, key, session)
    print(f"fragments.ranks: {session.tp} rank(s) of {session.path} listening on {address}; attach with "
          f"fragments.LanguageModel.attach({connection_file!r})", flush=True)
    try:
        while True:
            try:
                conn = waiting.get(timeout=1.0)
            except queue.Empty:
                session._link.check_alive()
                continue
            try:
                conn.send_bytes(pickle.dumps(("hello", hello)))
                stop = _serve_client(session, conn)
            except OSError:
                stop = False
            finally:
                conn.close()
                busy.clear()
            if stop:
                return
    finally:
        listener.close()
        if os.path.exists(connection_file):
            os.remove(connection_file)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fragments.ranks", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="an export folder (rank0.pt ...) or dir/rank{rank}.pt")
    p.add_argument("--tp", type=int, required=True, help="the number of ranks")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--listen", default="127.0.0.1:0", help="127.0.0.1:PORT (this machine only; 0: any free port)")
    p.add_argument("--connection-file", help="where to write the address and authkey (default: in the temp folder)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for loading and collectives")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        host, port = parse_address(a.listen)
        session = LanguageModel(a.path, tp=a.tp, backend=a.backend, timeout=a.timeout)
    except FragmentsError as e:
        print(f"fragments.ranks: {e}", file=sys.stderr)
        return 2
    try:
        serve(session, host, port, a.connection_file)
    except FragmentsError as e:  # a rank died
        print(f"fragments.ranks: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
