"""A rank of a session (`python -m fragments._worker`): loads its rank file once, then runs what the driver
(fragments._session) sends, until the driver says close or goes away.

Started with a command line of its own, so the driver's `__main__` (a REPL, a notebook, a script without a
main guard) is never imported here. It ends when the driver does: the kernel's parent-death signal
(prctl PR_SET_PDEATHSIG, Linux) while it computes, and the end of its connection while it waits.
Messages are (kind, payload) pickled with cloudpickle where installed (functions defined in a notebook
travel by value), else pickle (functions travel by reference: only importable ones).
"""
import argparse
import ctypes
import os
import signal
import sys
import traceback
from multiprocessing.connection import Client


def _die_with_parent(parent):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the closed connection still ends the loop
    if os.getppid() != parent:  # the driver ended before prctl took effect
        os._exit(1)


def _shard_of(module, attr):
    """This rank's piece of a parameter: (tensor, the module's class name)."""
    value = getattr(module, attr, None)
    if not isinstance(value, __import__("torch").Tensor):
        names = [n for n, _ in module.named_parameters(recurse=False)]
        raise AttributeError(f"has no parameter {attr!r} (its parameters: {', '.join(names) or 'none'})")
    return value.detach().cpu().clone()


def _to(value, device):
    """Tensors in a message (a program's constants, a trace's results) moved to `device`: the ranks compute
    on their device, the driver gets CPU tensors."""
    import torch
    from fragments import _proxy
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, _proxy.Const):
        return _proxy.Const(_to(value.value, device))
    if isinstance(value, _proxy.Op):
        node = _proxy.Op(value.fn, _to(value.args, device), _to(value.kwargs, device))
        node.where = value.where
        return node
    if isinstance(value, _proxy.Call):
        node = _proxy.Call(value.modules, _to(value.arg, device))
        node.where = value.where
        return node
    if isinstance(value, dict):
        return {k: (_to(v, device) if k != "ids" else v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        items = [_to(v, device) for v in value]
        return type(value)(items) if type(value) is not tuple and not hasattr(value, "_fields") else (
            type(value)(*items) if hasattr(value, "_fields") else tuple(items))
    return value


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
    try:
        import cloudpickle as pickler
    except ImportError:
        import pickle as pickler

    rank = int(os.environ["RANK"])

    def send(kind, payload):
        conn.send_bytes(pickler.dumps((kind, payload)))

    send("hello", rank)

    try:
        import torch
        torch.set_grad_enabled(False)
        import fragments
        from fragments import _model, _program
        _model._STEP_LINES = False  # the driver keeps the user's lines
        model = fragments.load(a.path, device=a.device or None)
        device = torch.device(a.device or "cpu")
        info = {"classes": dict(model._classes), "children": {k: list(v) for k, v in model._children.items()},
                "locations": dict(model._location_kinds), "dtype": model.dtype, "world": model.world_size,
                "pid": os.getpid()}
        send("ready", info if rank == 0 else {"pid": os.getpid()})
    except BaseException as e:  # noqa: B902 - the driver says it in words
        send("error", f"rank {rank} could not load {a.path}: {type(e).__name__}: {e}")
        return 1
    return _serve(conn.recv_bytes, send, model, device, rank)


def _serve(recv, send, model, device, rank):
    """Answers the driver's requests until it closes or goes away; returns the exit status."""
    import pickle

    import torch
    import fragments
    from fragments import _program

    weights, scripted = {}, None
    while True:
        try:
            kind, payload = pickle.loads(recv())
        except (EOFError, OSError):
            return 0  # the driver went away
        if kind == "close":
            send("closed", None)
            return 0
        try:
            if kind == "run":
                values, digests = _program.run(model, _to(payload, device), weights)
                send("ok", (_to(values, "cpu") if rank == 0 else None, digests))
            elif kind == "shard":  # (module path, attribute): this rank's piece of a parameter
                if scripted is None:
                    scripted = torch.jit.load(model.path, map_location="cpu")
                path, attr = payload
                module = scripted
                for part in filter(None, path.split(".")):
                    module = getattr(module, part)
                send("ok", _shard_of(module, attr))
            elif kind == "weight":  # the whole parameter, cached here for expressions
                (path, attr), value = payload
                weights[(path, attr)] = value.to(device)
                send("ok", None)
            elif kind == "probe":  # the shapes and dtypes of every location in a small forward
                shapes = _program.probe(model, payload)
                send("ok", shapes if rank == 0 else None)
            elif kind == "head_layout":
                send("ok", model._head_layout(payload))
            elif kind == "call":  # a module ad hoc on a whole tensor (outside a trace)
                paths, x = payload
                out = model._c.call(paths, x)
                send("ok", out.cpu() if rank == 0 else None)
            elif kind == "exec":  # a callable on every rank (the session's `run_on_ranks`)
                fn = payload
                out = fn(model)
                send("ok", out if rank == 0 else None)
            else:
                send("error", f"unknown request {kind!r}")
        except _program.StepError as e:
            send("error", str(e))
        except fragments.FragError as e:
            send("error", str(e))
        except BaseException:  # noqa: B902 - sent to the driver with its traceback
            send("error", traceback.format_exc())


if __name__ == "__main__":
    sys.exit(main())
