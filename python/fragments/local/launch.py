"""Ranks: `launch(fn, world=N)` starts N processes, or runs this one rank under torchrun.

Each rank meets the others through the runtime's own rendezvous (program::RankContext over a TCP store,
torchrun's variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); `fragments.load` connects
on first use, once per process.
"""
import multiprocessing
import os
import pickle
import queue as queue_module
import socket
import time
import traceback

import torch

from .. import _C

_CONTEXT = None


class RankFailed(RuntimeError):
    """A rank of `launch` raised (or died): `rank`, and its traceback in the message."""

    def __init__(self, rank, message):
        super().__init__(message)
        self.rank = rank


def rank_context():
    """This process's rank context: from torchrun's variables when WORLD_SIZE > 1, else a single rank.

    Where torch.distributed is set up in this process (``init_process_group`` before the first
    ``fragments.load``), the context joins it instead: collectives run on its default process group (its
    Gloo or NCCL), the ranks' agreement goes through its store, and no second rendezvous is made.

    It is also the process's context for the model's own collectives (``frag::all_reduce`` /
    ``all_gather``): a rank file loaded with plain ``torch.jit.load`` or ``torch.export.load`` (original or
    rewritten) runs them over it once this was called."""
    global _CONTEXT
    if _CONTEXT is None:
        world = os.environ.get("WORLD_SIZE", "1")
        distributed = torch.distributed
        if distributed.is_available() and distributed.is_initialized():
            timeout = float(os.environ.get("FRAGMENTS_TIMEOUT", "60"))
            _CONTEXT = _C.join_process_group(distributed.distributed_c10d._get_default_store(),
                                             distributed.group.WORLD.group_name, timeout)
        elif world.strip() not in ("", "1"):
            timeout = float(os.environ.get("FRAGMENTS_TIMEOUT", "60"))
            backend = os.environ.get("FRAGMENTS_BACKEND", "gloo")
            _CONTEXT = _C.connect_from_env(timeout, backend)
        else:
            _CONTEXT = _C.single_rank()
        _C.set_process_rank_context(_CONTEXT)
    return _CONTEXT


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, backend, timeout, args, queue):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "FRAGMENTS_BACKEND": backend, "FRAGMENTS_TIMEOUT": str(timeout)})
    try:
        result = fn(rank, *args)
    except BaseException:  # noqa: B902 - every failure is reported to the launcher, then this rank ends
        queue.put((rank, "error", traceback.format_exc(), time.monotonic()))
        queue.close()
        queue.join_thread()
        os._exit(1)
    # Pickled here with the plain pickler: multiprocessing's would pass tensors as shared memory that
    # vanishes when this process exits before the launcher reads it.
    queue.put((rank, "ok", pickle.dumps(result), time.monotonic()))


def launch(fn, world=None, backend="gloo", args=(), timeout=60.0):
    """Runs `fn(rank, *args)` on `world` ranks and returns their results in rank order.

    Under torchrun (RANK and WORLD_SIZE set) it runs this process's rank only and returns [its result]
    at index 0. Otherwise it starts `world` processes (spawned: `fn` must be importable, e.g. defined at
    a module's top level; guard a script with `if __name__ == "__main__"`). If one rank raises, the others
    get `timeout` seconds (the collective timeout makes them fail too) and are then killed; RankFailed
    shows the first failure once, with its rank and traceback.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: backend must be 'gloo' or 'nccl', got {backend!r}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        given = int(os.environ["WORLD_SIZE"])
        if world is not None and world != given:
            raise ValueError(f"launch(world={world}) under a launcher with WORLD_SIZE={given}")
        os.environ.setdefault("FRAGMENTS_BACKEND", backend)
        os.environ.setdefault("FRAGMENTS_TIMEOUT", str(timeout))
        return [fn(int(os.environ["RANK"]), *args)]
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"launch: world must be a positive number of ranks, got {world!r}")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(fn, r, world, port, backend, timeout, args, queue),
                                 daemon=True) for r in range(world)]
    for p in processes:
        p.start()
    results, failure, deadline = {}, None, None
    reported, dead_since = set(), {}
    while len(reported) < world:
        try:
            rank, status, payload, when = queue.get(timeout=0.1)
            reported.add(rank)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            elif failure is None:  # the first failure is the cause; later ones are its consequences
                failure = (rank, payload)
                deadline = time.monotonic() + timeout
        except queue_module.Empty:  # check for ranks that died without a word
            for r, p in enumerate(processes):
                if r in reported or p.is_alive():
                    continue
                # Its last message may still be in the pipe: a rank counts as dead after a grace period.
                if time.monotonic() - dead_since.setdefault(r, time.monotonic()) > 2.0:
                    reported.add(r)
                    if failure is None:
                        failure = (r, f"rank {r} died (exit code {p.exitcode})\n")
                        deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() > deadline:
            break
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()
    if failure is not None:
        rank, text = failure
        raise RankFailed(rank, f"rank {rank} of {world} failed:\n{text.rstrip()}")
    return [results[r] for r in range(world)]
