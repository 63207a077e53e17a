"""A client of ranks that are already running (`python -m fragments.ranks`, fragments.session.host):
`LanguageModel.attach(...)`.

The ranks' host (fragments.ranks) holds the rank processes and one listening socket on this machine
(127.0.0.1 only), authenticated with a random authkey (multiprocessing.connection's HMAC challenge) that
it writes, with the address, to a connection file readable by its user only. A client sends each request
pickled as the ranks take it; the host passes it to every rank and sends back their replies. One client
at a time: another is told the ranks are busy. A client that goes away (closed, killed) leaves the ranks
running for the next one.

Messages, client to host: ("request", bytes for the ranks) | ("detach", None) | ("shutdown", None);
host to client: ("hello", {path, tp, info, pids}) | ("busy", text) | ("ok", replies) | ("error", text).
"""
import json
import os
import pickle
from multiprocessing.connection import AuthenticationError, Client

from ..core.errors import FragmentsError

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_address(address):
    """("host", port) of "host:port"; only this machine's loopback addresses."""
    host, _, port = str(address).rpartition(":")
    host = host.strip("[]")
    if host not in LOCAL_HOSTS or not port.isdigit():
        raise FragmentsError(f"{address}: expected 127.0.0.1:PORT (ranks listen on this machine only)")
    return host, int(port)


def _key(authkey):
    if authkey is None:
        authkey = os.environ.get("FRAGMENTS_AUTHKEY")
    if authkey is None:
        raise FragmentsError("attach: no authkey: give the ranks' connection file (fragments.ranks prints its "
                             "path), or authkey= (or $FRAGMENTS_AUTHKEY)")
    if isinstance(authkey, str):
        try:
            return bytes.fromhex(authkey)
        except ValueError:
            raise FragmentsError("attach: authkey must be bytes or hex text") from None
    return bytes(authkey)


def connect(address, authkey=None, timeout=120.0):
    """(Remote, hello) for ranks at `address` (a connection file, or "127.0.0.1:PORT")."""
    where = str(address)
    if os.path.isfile(where):
        with open(where) as f:
            info = json.load(f)
        where, authkey = info["address"], authkey if authkey is not None else info["authkey"]
    elif where.endswith(".json") or os.sep in where:
        raise FragmentsError(f"{where}: no connection file there (fragments.ranks writes it when the ranks are "
                             "ready, and removes it when they end)")
    host, port = parse_address(where)
    try:
        conn = Client((host, port), authkey=_key(authkey))
    except ConnectionRefusedError:
        raise FragmentsError(f"nothing listens at {where}: start the ranks first, e.g. `python -m fragments.ranks "
                             f"DIR --tp N --listen {where}`") from None
    except AuthenticationError:
        raise FragmentsError(f"{where}: the authkey was refused (take it from the ranks' connection file)") from None
    if not conn.poll(timeout):
        conn.close()
        raise FragmentsError(f"{where}: the ranks did not answer within {timeout:.0f} s")
    kind, hello = pickle.loads(conn.recv_bytes())
    if kind != "hello":
        conn.close()
        raise FragmentsError(f"{where}: {hello}")
    return Remote(conn, where), hello


class Remote:
    """The client's end: one request at a time; a request interrupted here (Ctrl-C) has its reply dropped
    before the next."""

    def __init__(self, conn, address):
        self._conn, self._address, self._pending = conn, address, False

    def _receive(self):
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise FragmentsError(f"the ranks at {self._address} went away (their `python -m fragments.ranks` "
                                 "ended)") from None

    def request(self, data):
        if self._pending:
            self._pending = False
            self._receive()
        try:
            self._conn.send_bytes(pickle.dumps(("request", data)))
        except OSError:
            raise FragmentsError(f"the ranks at {self._address} cannot be reached") from None
        try:
            kind, payload = self._receive()
        except KeyboardInterrupt:
            self._pending = True
            raise
        if kind == "ok":
            return payload
        raise FragmentsError(payload)

    def detach(self):
        try:
            self._conn.send_bytes(pickle.dumps(("detach", None)))
        except OSError:
            pass
        self._conn.close()

    def shutdown(self):
        try:
            self._conn.send_bytes(pickle.dumps(("shutdown", None)))
            self._conn.poll(30) and self._conn.recv_bytes()
        except (OSError, EOFError):
            pass
        self._conn.close()
