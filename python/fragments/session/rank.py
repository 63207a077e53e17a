"""A rank of a session (`python -m fragments.session.rank`): loads its rank file once, then runs what the driver
(fragments.session.language_model) sends, until the driver says close or goes away.

Started with a command line of its own, so the driver's `__main__` (a REPL, a notebook, a script without a
main guard) is never imported here. It ends when the driver does: the kernel's parent-death signal
(prctl PR_SET_PDEATHSIG, Linux) while it computes, and the end of its connection while it waits.
Messages are (kind, payload) pickled with cloudpickle where installed (functions defined in a notebook
travel by value), else pickle (functions travel by reference: only importable ones).

A trace arrives as its recording (fragments.tracing.tracer.Recording) and runs here exactly as a trace of
fragments.load does (fragments.local.run): the same Steps into C++, the same Hooks for Python steps.
"""
import argparse
import ctypes
import dataclasses
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Client

import torch

from .. import _C
from ..core import executor, graph
from ..local.model import load
from ..local.run import Prepared
from ..local.trace import probe

try:
    import cloudpickle as pickler
except ImportError:
    pickler = pickle


def _die_with_parent(parent):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the closed connection still ends the loop
    if os.getppid() != parent:  # the driver ended before prctl took effect
        os._exit(1)


def _shard_of(module, attr):
    """This rank's piece of a parameter."""
    value = getattr(module, attr, None)
    if not isinstance(value, torch.Tensor):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        raise AttributeError(f"has no parameter {attr!r} (its parameters: {', '.join(names) or 'none'})")
    return value.detach().cpu().clone()


def _on_device(recording, device):
    """The recording with its Python steps' and expressions' tensors on this rank's device (plan steps' values
    stay where C++ takes them)."""
    python = [dataclasses.replace(s, value=graph.to_device(s.value, device)) for s in recording.python]
    expressions = [(graph.to_device(node, device), where) for node, where in recording.expressions]
    return dataclasses.replace(recording, python=python, expressions=expressions)


class Rank:
    """This rank's model and what the driver's requests read and keep (whole weights)."""

    def __init__(self, model, device, rank):
        self.model, self.device, self.rank = model, device, rank
        self.weights, self._scripted = {}, None

    def run(self, payload):
        """A trace: (values on rank 0, computed values on rank 0, digests of the computed ones)."""
        recording, ids, generate, options = payload
        model = self.model
        trace = model.generate(ids, generate, **options) if generate else model.trace(ids)
        trace._prepared = Prepared(_on_device(recording, self.device), self.weights, generate)
        trace._finish()
        values, computed = trace._results
        digests = [executor.digest(v) for v in computed]
        if self.rank != 0:
            return None, None, digests
        return graph.to_device(values, "cpu"), graph.to_device(computed, "cpu"), digests

    def shard(self, payload):  # (module path, attribute): this rank's piece of a parameter
        if self._scripted is None:
            self._scripted = torch.jit.load(self.model.path, map_location="cpu")
        path, attr = payload
        module = self._scripted
        for part in filter(None, path.split(".")):
            module = getattr(module, part)
        return _shard_of(module, attr)

    def weight(self, payload):  # the whole parameter, kept here for expressions
        (path, attr), value = payload
        self.weights[(path, attr)] = value.to(self.device)

    def probe(self, payload):  # the shapes and dtypes of every location in a small forward
        shapes = probe(self.model, payload)
        return shapes if self.rank == 0 else None

    def call(self, payload):  # a module ad hoc on a whole tensor (outside a trace)
        paths, x = payload
        out = self.model._c.call(paths, x)
        return out.cpu() if self.rank == 0 else None

    def exec(self, fn):  # a callable on every rank (the session's `run_on_ranks`)
        out = fn(self.model)
        return out if self.rank == 0 else None

    def locations(self, payload):
        return self.model.locations() if self.rank == 0 else None


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--path", required=True)
    p.add_argument("--device", default="")
    p.add_argument("--parent", type=int, required=True)
    a = p.parse_args(argv)
    _die_with_parent(a.parent)
    host, port = a.address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("FRAGMENTS_SESSION_KEY")))
    rank = int(os.environ["RANK"])

    def send(kind, payload):
        conn.send_bytes(pickler.dumps((kind, payload)))

    send("hello", rank)
    try:
        torch.set_grad_enabled(False)
        model = load(a.path, device=a.device or None)
        info = {"tree": model._tree.resolved(), "world": model.world_size, "pid": os.getpid()}
        send("ready", info if rank == 0 else {"pid": os.getpid()})
    except BaseException as e:  # noqa: B902 - the driver says it in words
        send("error", f"rank {rank} could not load {a.path}: {type(e).__name__}: {e}")
        return 1
    return _serve(conn.recv_bytes, send, Rank(model, torch.device(a.device or "cpu"), rank))


_REQUESTS = ("run", "shard", "weight", "probe", "call", "exec", "locations")


def _serve(recv, send, rank):
    """Answers the driver's requests until it closes or goes away; returns the exit status."""
    while True:
        try:
            kind, payload = pickle.loads(recv())
        except (EOFError, OSError):
            return 0  # the driver went away
        if kind == "close":
            send("closed", None)
            return 0
        if kind not in _REQUESTS:
            send("error", f"unknown request {kind!r}")
            continue
        try:
            send("ok", getattr(rank, kind)(payload))
        except _C.FragError as e:  # the runtime's and the API's errors (at the user's line): their words only
            send("error", str(e))
        except BaseException:  # noqa: B902 - sent to the driver with its traceback
            send("error", traceback.format_exc())


if __name__ == "__main__":
    sys.exit(main())
