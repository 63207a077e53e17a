"""A model that stays loaded: `fragments.LanguageModel("DIR", tp=3)` in any Python process.

    model = fragments.LanguageModel("exports/smollm2_tp3", tp=3)      # starts 3 ranks once
    with model.trace("The capital of France is"):
        h = model.model.layers[5].output
        top = model.lm_head(model.model.norm(h))[:, -1].softmax(-1).topk(5).save()
    model.close()                                                      # or `with`, or the process's end

Prompts of different lengths run as one right-padded batch (`tracer.lengths`, `tracer.unpad(v)`); within
`tracer.invoke(...)` a value is that invoke's rows and tokens. `LanguageModel.attach(...)` drives ranks that
another process keeps up (`python -m fragments.ranks`, fragments._attach).

The driver (this process) records a trace as steps and expressions (fragments._proxy), sends the recording
to every rank once, and gets the saved values back once, from rank 0; each rank replays it on its own
`fragments.Model` (fragments._program) in the same order, so the ranks' collectives meet. The ranks are
`python -m fragments._worker` processes: they never import this process's `__main__`.

How things travel: messages are pickled with cloudpickle (pinned in tools/requirements.txt) where it is
installed: functions and lambdas defined in a notebook or a REPL travel by value, with what they refer to;
without it, pickle sends functions by reference (only ones importable on the ranks). What cannot travel
either way: open files, sockets, locks, generators, CUDA streams, and objects of C extensions without
pickling support; the message names the object.
"""
import atexit
import numbers
import operator
import os
import secrets
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Listener, wait

import torch

from . import _proxy
from ._model import FragmentsError, SavedValue, _did_you_mean

try:
    import cloudpickle as _pickler
except ImportError:  # functions then travel by reference only
    import pickle as _pickler
import pickle

_SESSIONS = weakref.WeakSet()


@atexit.register
def _close_all():
    for session in list(_SESSIONS):
        session.close()


def _rank_path(path):
    if "{rank}" in path:
        return path
    if os.path.isdir(path):
        for ext in ("pt", "pt2"):
            if os.path.exists(os.path.join(path, f"rank0.{ext}")):
                return os.path.join(path, f"rank{{rank}}.{ext}")
        raise FragmentsError(f"{path}: no rank0.pt or rank0.pt2 in this folder (an export of `frag rewrite` or "
                             "`python -m fragkit.checkpoint`)")
    raise FragmentsError(f"{path}: not a folder of rank files, nor a path with {{rank}}")


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LanguageModel:
    """A sharded model loaded once on `tp` rank processes; traces and generations run there.

    `path`: an export folder (rank0.pt ...; its `tokenizer/` makes text prompts work) or "dir/rank{rank}.pt".
    `backend`: "gloo" (CPU) or "nccl" (rank r on cuda:r). `timeout`: seconds for loading and collectives."""

    def __init__(self, path, tp=1, backend="gloo", timeout=120.0, tokenizer=None):
        if not isinstance(tp, numbers.Integral) or tp < 1:
            raise FragmentsError(f"LanguageModel: tp must be a positive number of ranks, got {tp!r}")
        if backend not in ("gloo", "nccl"):
            raise FragmentsError(f"LanguageModel: backend must be 'gloo' or 'nccl', got {backend!r}")
        self._setup(_rank_path(path), tp, tokenizer)
        try:
            self._start(backend, float(timeout))
        except BaseException:  # a rank that could not load, or an interrupt: no rank is left behind
            self._closed = True
            self._kill()
            raise
        _SESSIONS.add(self)

    def _setup(self, path, tp, tokenizer):
        self.path, self.tp, self._dead, self._closed = path, int(tp), None, False
        self._folder = os.path.dirname(self.path)
        self._tokenizer = tokenizer
        self._weights, self._layouts, self._shapes = {}, {}, None
        self._trace = None
        self._interrupted = False
        self._lock = threading.Lock()
        self._procs, self._conns = [], []
        self._remote = None  # an attached client's connection (fragments._attach)

    def _adopt(self, info):
        """Rank 0's description of the model (module tree, locations, dtype)."""
        self._info = info
        self.dtype = info["dtype"]
        self._classes, self._children = info["classes"], info["children"]
        self._location_kinds = info["locations"]

    # -- the ranks -----------------------------------------------------------------------------------------
    def _start(self, backend, timeout):
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        address = "%s:%d" % self._listener.address
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH", "")]))
        port = _free_port()
        self._procs = []
        for r in range(self.tp):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(self.tp), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), FRAGMENTS_BACKEND=backend,
                       FRAGMENTS_TIMEOUT=str(timeout), FRAGMENTS_SESSION_KEY=key.hex(), PYTHONPATH=pythonpath)
            device = f"cuda:{r}" if backend == "nccl" else "cpu"
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "fragments._worker", "--address", address, "--path", self.path,
                 "--device", device, "--parent", str(os.getpid())], env=env, stdin=subprocess.DEVNULL))
        self._conns = [None] * self.tp
        accepted = []

        def accept():
            try:
                for _ in range(self.tp):
                    accepted.append(self._listener.accept())
            except OSError:
                pass
        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(0.1)
            self._check_alive()
            if time.monotonic() > deadline:
                self._kill()
                raise FragmentsError(f"LanguageModel: the {self.tp} ranks did not connect within {timeout:.0f} s")
        self._listener.close()
        for conn in accepted:
            kind, rank = pickle.loads(conn.recv_bytes())
            self._conns[rank] = conn
        replies = self._gather(deadline=time.monotonic() + timeout)
        self._adopt(replies[0])
        self.pids = [p.pid for p in self._procs]

    def _check_alive(self):
        for r, p in enumerate(self._procs):
            code = p.poll()
            if code is not None:
                how = f"signal {-code}" if code < 0 else f"exit code {code}"
                self._dead = f"rank {r} (pid {p.pid}) died ({how})"
                self._kill()
                raise FragmentsError(f"{self._dead}; this session has ended: create a new LanguageModel")

    def _kill(self):
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def _gather(self, deadline=None, ranks=None):
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
                    self._check_alive()
                    raise FragmentsError(f"rank {r} closed its connection")
                waiting.discard(r)
                if kind == "error":
                    errors[r] = payload
                else:
                    replies[r] = payload
            if not ready:
                self._check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    self._kill()
                    if errors:  # the others wait in a collective for the failed rank: the ranks are out of step
                        r = min(errors)
                        self._dead = f"rank {r} failed while ranks {sorted(waiting)} waited for it"
                        raise FragmentsError(f"{errors[r].rstrip()}\n({self._dead}; this session has ended)")
                    self._dead = "the ranks did not answer in time"
                    raise FragmentsError(f"{self._dead}; this session has ended")
            if errors and waiting:  # the others fail alike at once (the same step), or wait in a collective
                deadline = min(deadline or float("inf"), time.monotonic() + 5)
        if errors:
            r = min(errors)
            text = errors[r].rstrip() or "failed without a message"
            located = text.startswith("rank ") or ":" in text.split()[0]  # "file:line: ..." or "rank N ..."
            raise FragmentsError(text if located else f"rank {r}: {text}")
        return replies

    def _request(self, kind, payload=None):
        if self._closed:
            raise FragmentsError("this LanguageModel was closed: create a new one")
        if self._dead:
            raise FragmentsError(f"{self._dead}; this session has ended: create a new LanguageModel")
        try:
            data = _pickler.dumps((kind, payload))
        except Exception as e:  # noqa: B902 - what cannot travel, in words
            raise FragmentsError(f"this cannot be sent to the ranks: {type(e).__name__}: {e} (functions travel "
                                 f"{'by value (cloudpickle)' if _pickler.__name__ == 'cloudpickle' else 'by reference: only importable ones'}; "
                                 "open files, sockets, locks and generators do not travel)") from None
        with self._lock:
            if self._remote is not None:
                return self._remote.request(data)
            return self._broadcast(data)

    def _broadcast(self, data):
        """Sends one pickled request to every rank; their replies in rank order."""
        self._check_alive()
        if self._interrupted:  # the replies of a request interrupted in the caller (Ctrl-C, a kernel
            self._interrupted = False  # interrupt): the ranks finish it; drop them
            try:
                self._gather(ranks=set(self._waiting))
            except FragmentsError:
                pass
        for r, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._check_alive()
                raise FragmentsError(f"rank {r} cannot be reached") from None
        try:
            return self._gather()
        except KeyboardInterrupt:
            self._interrupted = True
            raise

    @classmethod
    def attach(cls, address, authkey=None, timeout=120.0):
        """A LanguageModel on ranks already running (`python -m fragments.ranks DIR --tp N`): `address` is
        their connection file (it holds the address and the authkey) or "127.0.0.1:PORT" with `authkey`
        (bytes, hex text, or $FRAGMENTS_AUTHKEY). One client at a time; `close()` detaches and leaves the
        ranks running (`shutdown_ranks()` ends them)."""
        from ._attach import connect
        remote, hello = connect(address, authkey, timeout)
        self = cls.__new__(cls)
        self._setup(hello["path"], hello["tp"], None)
        self._remote = remote
        self._adopt(hello["info"])
        self.pids = hello["pids"]
        _SESSIONS.add(self)
        return self

    def shutdown_ranks(self):
        """Ends the ranks this attached client talks to (their `python -m fragments.ranks` too)."""
        if self._remote is None:
            return self.close()
        if not self._closed:
            self._closed = True
            self._remote.shutdown()

    def close(self):
        """Ends the ranks (also at `with`'s end and when this process exits)."""
        if self._closed:
            return
        self._closed = True
        if self._remote is not None:  # attached: the ranks stay for the next client
            self._remote.detach()
            return
        if not self._dead:
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: B902 - interpreter shutdown
            pass

    # -- the model -------------------------------------------------------------------------------------------
    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(Envoy(self, ""), name)

    @property
    def output(self):
        return self._active_trace("model.output")._location("output", None)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            folder = os.path.join(self._folder, "tokenizer")
            if not os.path.isdir(folder):
                raise FragmentsError(f"{self._folder} has no tokenizer/ folder: give token ids, or "
                                     "LanguageModel(..., tokenizer=a transformers tokenizer)")
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
        return self._tokenizer

    def _rows(self, prompt):
        """A prompt as token-id rows (lists of ints): text (the checkpoint's tokenizer), texts, ids [B, T] or
        [T], or lists of ids of different lengths (a ragged batch: right-padded when it runs)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return [list(self.tokenizer(p)["input_ids"]) for p in prompt]
        from ._model import _token_rows
        return _token_rows(prompt)

    def trace(self, prompt=None):
        """`with model.trace(prompt):` records; the block's end runs one forward on the ranks. `prompt`: a
        text, texts, or token ids; none when the block uses `tracer.invoke(prompt)` (several prompts)."""
        return SessionTrace(self, prompt, 0)

    def generate(self, prompt=None, max_new_tokens=1):
        """Greedy generation; the block's edits apply at every step; `model.output.save()` is the tokens."""
        if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise FragmentsError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        return SessionTrace(self, prompt, int(max_new_tokens))

    def run_on_ranks(self, fn):
        """`fn(model)` on every rank's `fragments.Model` (the same call on each); rank 0's result."""
        return self._request("exec", fn)[0]

    def _weight(self, module, attr):
        key = (module, attr)
        if key not in self._weights:
            shards = self._request("shard", key)
            cls = self._classes.get(module, "")
            layout = self._head_layout(f"{module}.output") if cls == "QKVParallelLinear" else {}
            whole = _join_shards(shards, cls, f"{module}.{attr}", layout)
            self._request("weight", (key, whole))
            self._weights[key] = whole
        return self._weights[key]

    def _probe(self):
        """{location: (shape, dtype)} of one forward of [2, 3] pad tokens (asked once): what `.shape` and
        `.dtype` inside a trace scale to the trace's batch."""
        if self._shapes is None:
            self._shapes = self._request("probe", _PROBE_SHAPE)[0]
        return self._shapes

    def _head_layout(self, name):
        if name not in self._layouts:
            self._layouts[name] = self._request("head_layout", name)[0]
        return self._layouts[name]

    def _active_trace(self, what):
        if self._trace is None:
            raise FragmentsError(f"{what}: use it inside `with model.trace(...)`")
        return self._trace

    def __repr__(self):
        state = "closed" if self._closed else (self._dead or f"ranks {self.pids}")
        state += " (attached)" if self._remote is not None else ""
        return f"<fragments.LanguageModel {self.path} tp={self.tp}: {state}>"


def _join_shards(shards, cls, what, layout=None):
    """A parameter's whole from the ranks' pieces, by its layer's split (vLLM's parallel layers, as the kit
    exports them): rows of a column-parallel layer, columns of a row-parallel one; a merged gate/up layer
    holds [gate_r; up_r] on rank r, a QKV layer [q_r; k_r; v_r] (a kv head replicated where kv heads < tp)."""
    tp = len(shards)
    if tp == 1 or all(torch.equal(s, shards[0]) for s in shards[1:]):
        return shards[0]
    if cls in ("RowParallelLinear",):
        return torch.cat(shards, dim=-1)
    if cls in ("ColumnParallelLinear", "VocabParallelEmbedding", "ParallelLMHead"):
        return torch.cat(shards, dim=0)
    if cls == "MergedColumnParallelLinear" and shards[0].shape[0] % 2 == 0:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if cls == "QKVParallelLinear" and layout and all(k in layout for k in "qkv"):
        q_rows = (layout["q"][1] - layout["q"][0]) // tp
        kv_heads = (layout["k"][1] - layout["k"][0]) // layout["k"][2]
        kv_rows = (shards[0].shape[0] - q_rows) // 2
        holders = range(tp) if kv_heads >= tp else range(0, tp, tp // kv_heads)  # one copy of each kv head
        q = [s[:q_rows] for s in shards]
        k = [shards[r][q_rows:q_rows + kv_rows] for r in holders]
        v = [shards[r][q_rows + kv_rows:] for r in holders]
        return torch.cat(q + k + v, dim=0)
    raise FragmentsError(f"{what}: a {cls}'s parameter has a layout across ranks not known here: reading it "
                         "whole is not supported")


class Envoy:
    """A module of the model: submodules as attributes, `.input`/`.output`, parameters (whole tensors)."""

    def __init__(self, session, path):
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_path", path)

    def _child(self, name):
        return f"{self._path}.{name}" if self._path else name

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        s = self._session
        if name in s._children.get(self._path, []):
            return Envoy(s, self._child(name))
        if name in ("input", "output"):
            return self._location(name)
        if name == "inputs":
            return self._inputs()
        if self._path in s._classes and name in ("weight", "bias") or name.endswith("weight"):
            if s._trace is not None:
                return s._trace._leaf_proxy(_proxy.Weight(self._path, name))
            try:
                return s._weight(self._path, name)
            except FragmentsError as e:
                raise AttributeError(f"{self._path or 'the model'}: {e}") from None
        options = list(s._children.get(self._path, [])) + ["input", "output", "weight"]
        raise AttributeError(f"{self._path or 'the model'} ({s._classes.get(self._path, '?')}) has no attribute "
                             f"{name!r}{_did_you_mean(name, options)}")

    def _inputs(self):
        """nnsight's `(args, kwargs)` of this module's inputs where the rank file has them: a decoder layer's
        hidden states (its first input in transformers) and, by name, the kit's `positions`; elsewhere the
        first input. `.inputs["name"]` reads one by name."""
        s = self._session
        raw = self._child("input")
        if raw not in s._location_kinds:
            raise AttributeError(f"{self._path or 'the model'} has no inputs in this rank file "
                                 f"(it has {', '.join(k for k in ('output',) if self._child(k) in s._location_kinds) or 'no location'})")
        trace = s._active_trace(f"{self._path}.inputs")
        alias = _hidden_state_alias(s, self._path)
        if alias is None:
            return Inputs(self._path, (trace._location(raw, None),), {})
        return Inputs(self._path, (trace._location(alias, None),), {"positions": trace._location(raw, None)},
                      names=("hidden_states",))

    def _location(self, kind):
        s = self._session
        name = self._child(kind)
        if name not in s._location_kinds:
            alias = _hidden_state_alias(s, self._path) if kind == "input" else None
            if alias is None:
                here = [n for n in s._location_kinds if n.startswith(self._path + ".")][:6]
                raise AttributeError(f"{name} is not a location of this rank file (locations under {self._path}: "
                                     f"{', '.join(here) or 'none'})")
            name = alias
        elif kind == "input":
            alias = _hidden_state_alias(s, self._path)
            if alias is not None:
                name = alias
        return s._active_trace(name)._location(name, None)

    def __setattr__(self, name, value):
        if name not in ("input", "output"):
            raise AttributeError(f"{self._path}: only .input and .output can be assigned in a trace, not {name!r}")
        loc = self._location(name)
        loc._assign(None, value)

    def __getitem__(self, i):
        numbered = [c for c in self._session._children.get(self._path, []) if c.isdigit()]
        if not numbered:
            raise TypeError(f"{self._path or 'the model'} is not a ModuleList: it cannot be indexed")
        if not isinstance(i, numbers.Integral) or not -len(numbered) <= i < len(numbered):
            raise IndexError(f"{self._path}[{i!r}]: it has {len(numbered)} modules (0 to {len(numbered) - 1})")
        return Envoy(self._session, self._child(str(i % len(numbered))))

    def __len__(self):
        return len([c for c in self._session._children.get(self._path, []) if c.isdigit()])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __call__(self, x, *rest):
        s = self._session
        if rest:
            raise FragmentsError(f"{self._path}(...) takes one whole tensor here")
        if isinstance(x, _proxy.Proxy):
            node = _proxy.Call([self._path], _proxy.as_node(x))
            if isinstance(node.arg, _proxy.Call):  # a chain: norm then lm_head, one call of the engine
                node = _proxy.Call(node.arg.modules + [self._path], node.arg.arg)
            node.where = _proxy.user_line()
            return _proxy.Proxy(x._trace, node)
        if isinstance(x, SavedValue):
            x = x.value
        if not isinstance(x, torch.Tensor):
            raise FragmentsError(f"{self._path}(...) takes a whole tensor or a value in a trace, got {type(x).__name__}")
        return s._request("call", ([self._path], x))[0]

    def __repr__(self):
        return f"<module {self._path or '(root)'} ({self._session._classes.get(self._path, '?')})>"


class Inputs(tuple):
    """`module.inputs`: `(args, kwargs)` as nnsight gives them; `inputs["name"]` is one input by name."""

    _TRANSFORMERS = ("attention_mask", "position_ids", "position_embeddings", "past_key_value",
                     "past_key_values", "cache_position", "use_cache", "output_attentions")

    def __new__(cls, path, args, kwargs, names=()):
        self = super().__new__(cls, (tuple(args), dict(kwargs)))
        self._path, self._names = path, dict(zip(names, args))
        self._names.update(kwargs)
        return self

    def __getitem__(self, key):
        if not isinstance(key, str):
            return super().__getitem__(key)
        if key in self._names:
            return self._names[key]
        there = ", ".join(self._names) or "its first input only (`.input`)"
        why = (" (a transformers input: the kit's layer takes `positions` and builds its own mask and rotary "
               "embedding, so it has no such input)" if key in self._TRANSFORMERS else "")
        raise KeyError(f"{self._path}.inputs has no {key!r}{why}; it has: {there}{_did_you_mean(key, self._names)}")


def _hidden_state_alias(session, path):
    """A decoder layer's hidden states where the rank file's first input is something else (a vLLM decoder
    layer's is `positions`): the previous layer's output, or the embedding's for layer 0."""
    parent, _, index = path.rpartition(".")
    if not index.isdigit() or not parent.endswith("layers"):
        return None
    if int(index) > 0:
        alias = f"{parent}.{int(index) - 1}.output"
    else:
        root = parent.rpartition(".")[0]
        alias = next((f"{c}.output" for c in (f"{root}.embed_tokens" if root else "embed_tokens",)
                      if f"{c}.output" in session._location_kinds), None)
    return alias if alias in session._location_kinds else None


class _Pending(_proxy.Proxy):
    """`loc[idx] += v`: Python reads `loc[idx]`, adds, and assigns back; this is the middle value."""

    def __init__(self, trace, node, base, do, operand):
        super().__init__(trace, node)
        object.__setattr__(self, "_edit", (base, do, operand))


def _inplace(do, fn):
    def method(self, other):
        node = _proxy.Op(fn, (_proxy.as_node(self), _proxy.as_node(other)))
        node.where = _proxy.user_line()
        return _Pending(self._trace, node, _proxy.as_node(self), do, other)
    return method


_proxy.Proxy.__iadd__ = _inplace("add", operator.add)
_proxy.Proxy.__isub__ = _inplace("sub", operator.sub)
_proxy.Proxy.__imul__ = _inplace("scale", operator.mul)
_proxy.Proxy.__itruediv__ = _inplace("div", operator.truediv)


class LocationProxy(_proxy.Proxy):
    """A location in a trace (within an invoke: its rows of the batch). A value, and a place to edit."""

    def __init__(self, trace, name, visit, rows):
        node = _proxy.Loc(name, visit)
        if rows is not None:  # an invoke's rows, and its own tokens where the batch is padded past them
            node = _proxy.Op(operator.getitem, (node, rows.index()))
        super().__init__(trace, node)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_visit", visit)
        object.__setattr__(self, "_rows", rows)

    def visit(self, k):
        if not isinstance(k, numbers.Integral) or k < 0:
            raise FragmentsError(f"{self._name}: visit takes a non-negative integer, got {k!r}")
        return LocationProxy(self._trace, self._name, int(k), self._rows)

    def __getattr__(self, name):
        if name in ("heads", "q", "k", "v") and self._name != "output":
            regions = self._trace._session._head_layout(self._name)  # ir::head_layout, asked of rank 0 once
            if name == "heads" and "heads" in regions:  # o_proj.input: the heads are the whole width
                return _Heads(self, *regions["heads"], self._name)
            if name in regions:
                return _Region(self, *regions[name], f"{self._name}.{name}")
            raise AttributeError(f"{self._name} has no {name!r} (its segments: {', '.join(regions) or 'none'})")
        return super().__getattr__(name)

    def apply(self, fn):
        """`fn(whole)` on the ranks at every visit; it returns the replacement or None (see Location.apply)."""
        if not callable(fn):
            raise FragmentsError(f"{self._name}.apply takes a callable, got {type(fn).__name__}")
        if self._rows is not None:  # the callable sees this invoke's rows and tokens only
            fn = _proxy.RowsApply(fn, self._rows.rows, self._rows.length)
        self._trace._record(("apply", self._name, self._visit, fn, _proxy.user_line()))

    def __setitem__(self, index, value):
        self._assign(index, value)

    def _assign(self, index, value):
        where = _proxy.user_line()
        if self._name == "output" and self._trace._session is not None:
            raise FragmentsError(f"{where}: model.output (the logits) cannot be edited: edit lm_head's input or output")
        full = _compose(self._rows, index)
        do, operand = "set", value
        if isinstance(value, _Pending):
            base, kind, operand = value._edit
            expected = _proxy.as_node(self if index is None else self[index])
            if not _same_read(base, expected):
                raise FragmentsError(f"{where}: {self._name}: an in-place edit must assign back to where it read")
            if kind == "sub":
                kind, operand = "add", (-operand if not isinstance(operand, _proxy.Proxy) else -operand)
            elif kind == "div":
                kind, operand = "scale", (1.0 / operand if _proxy.is_number(operand) else 1.0 / operand)
            do = kind
            if do == "scale" and not _proxy.is_number(operand):  # a tensor factor: set the product
                do, operand = "set", value
        node = _proxy.as_node(operand)
        if isinstance(node, torch.Tensor) and node.is_floating_point() and node.dtype != self._trace._session.dtype:
            node = node.to(self._trace._session.dtype)
        if isinstance(node, _proxy.Const):
            node = node.value
        self._trace._record(("edit", self._name, self._visit, full, do, node, where))


class _Region(_proxy.Proxy):
    """A q/k/v segment of a location's last dim (whole coordinates): a value, with `.heads`."""

    def __init__(self, location, start, stop, head_dim, what):
        view = location[..., start:stop]
        super().__init__(location._trace, _proxy.as_node(view))
        object.__setattr__(self, "_parts", (location, start, stop, head_dim, what))

    @property
    def heads(self):
        return _Heads(*self._parts)


class _Heads:
    """`.heads[i]`: head i (head_dim wide) of a segment or of o_proj's input; read, assign, `*=`."""

    def __init__(self, location, start, stop, head_dim, what):
        self._location, self._start, self._head_dim, self._what = location, start, head_dim, what
        self._count = (stop - start) // head_dim

    def __len__(self):
        return self._count

    def _index(self, i):
        if not isinstance(i, numbers.Integral) or not -self._count <= i < self._count:
            raise IndexError(f"{self._what}.heads[{i!r}]: it has {self._count} heads (0 to {self._count - 1})")
        a = self._start + (i % self._count) * self._head_dim
        return (Ellipsis, slice(a, a + self._head_dim))

    def __getitem__(self, i):
        return self._location[self._index(i)]

    def __setitem__(self, i, value):
        self._location._assign(self._index(i), value)


def _same_read(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, _proxy.Loc):
        return a.key() == b.key()
    if isinstance(a, _proxy.Op):
        return a.fn == b.fn and len(a.args) == len(b.args) and all(
            _same_read(x, y) if isinstance(x, _proxy.Node) else _eq(x, y) for x, y in zip(a.args, b.args))
    return a is b


def _eq(x, y):
    try:
        return bool(x == y)
    except Exception:  # noqa: B902 - tensors
        return x is y


class _Part:
    """An invoke's part of the batch: its rows, and its tokens (`length`: the longest of its prompts; the
    batch is right-padded past it when another invoke's prompts are longer). `length` None: every token
    (generation, where a decode step has one)."""

    def __init__(self, rows, length):
        self.rows, self.length = rows, length

    def index(self):
        return (self.rows,) if self.length is None else (self.rows, slice(0, self.length))


def _compose(part, index):
    """An index within an invoke's rows and tokens as an index of the whole batch."""
    if part is None:
        return index
    rows = part.rows
    items = () if index is None else (index if isinstance(index, tuple) else (index,))
    if not items:
        return part.index()
    first, rest = items[0], items[1:]
    if first is Ellipsis:
        return part.index() + (Ellipsis,) + rest
    if isinstance(first, numbers.Integral):
        n = rows.stop - rows.start
        if not -n <= first < n:
            raise FragmentsError(f"row {first} of an invoke of {n} prompt(s)")
        row = rows.start + first % n
    elif isinstance(first, slice) and first.step in (None, 1):
        start, stop, _ = first.indices(rows.stop - rows.start)
        row = slice(rows.start + start, rows.start + stop)
    else:
        raise FragmentsError(f"index {index!r} of an invoke's rows: use integers or slices")
    if part.length is None:
        return (row,) + rest
    return (row,) + _tokens(rest, part.length, index)


def _tokens(rest, length, index):
    """The token part of an invoke's index, counted within its own `length` tokens (`-1`: its last)."""
    if not rest:
        return (slice(0, length),)
    second, after = rest[0], rest[1:]
    if second is Ellipsis:
        return (slice(0, length), Ellipsis) + after
    if isinstance(second, numbers.Integral):
        if not -length <= second < length:
            raise FragmentsError(f"token {second} of an invoke's prompts of {length} tokens")
        return (second % length,) + after
    if isinstance(second, slice):
        return (slice(*second.indices(length)),) + after
    raise FragmentsError(f"index {index!r} of an invoke's tokens: use integers, slices or ...")


class SessionTrace:
    """The recording of one `with model.trace(...)` block of a LanguageModel."""

    def __init__(self, session, prompt, generate):
        self._session = session
        self._generate = generate
        self._steps, self._saves = [], []
        self._given = None if prompt is None else session._rows(prompt)
        self._invokes = []  # token-id rows per invoke
        self._rows = None   # the open invoke's _Part
        self._opened_at = _proxy.user_line()
        self.lengths = None if self._given is None else [len(r) for r in self._given]

    def __enter__(self):
        if self._session._trace is not None:
            raise FragmentsError("a trace of this model is already open: traces do not nest")
        self._session._trace = self
        return self

    def __exit__(self, kind, value, tb):
        self._session._trace = None
        if kind is None:
            self._run()
        return False

    def invoke(self, prompt):
        """`with tracer.invoke(prompt):` one or more prompts as rows of this trace's batch; locations read
        and edited in the block are those rows' (and their own tokens, where another invoke's prompts are
        longer: `[:, -1]` is this invoke's last token). A value of one invoke can be used in a later one."""
        if self._given is not None and not self._invokes:
            raise FragmentsError("invoke: this trace was given its prompt already; use model.trace() with invokes")
        return _Invoke(self, self._session._rows(prompt))

    def unpad(self, value):
        """Each row of a value of this trace's whole batch trimmed to its prompt's tokens (a list)."""
        from ._model import unpad
        return unpad(value, self.lengths)

    def _all_rows(self):
        rows = [r for inv in self._invokes for r in inv] if self._invokes else self._given
        if rows is None:
            raise FragmentsError(f"{_proxy.user_line()}: the trace has no prompt yet: give one to model.trace(...) "
                                 "or use tracer.invoke(...) first")
        return rows

    def _location(self, name, visit):
        if name == "output":
            return LocationProxy(self, "output", None, self._rows)
        return LocationProxy(self, name, visit, self._rows)

    def _leaf_proxy(self, node):
        node.where = _proxy.user_line()
        if isinstance(node, _proxy.Weight):
            self._session._weight(node.module, node.attr)  # gathered once; the ranks keep it
        return _proxy.Proxy(self, node)

    def _meta(self, node):
        """`node` on meta tensors: the shapes of the batch so far (rows and longest prompt), the rest of each
        location's shape from one probe forward of the ranks (once per session)."""
        rows = self._all_rows()
        batch, tokens = len(rows), max(len(r) for r in rows)
        s = self._session
        probe = s._probe()

        def leaf(x, arg):
            if isinstance(x, _proxy.Weight):
                return _proxy.as_meta(s._weight(x.module, x.attr))
            if isinstance(x, _proxy.Call):
                shape, dtype = probe[f"{x.modules[-1]}.output"]
                return torch.empty(tuple(arg.shape[:-1]) + tuple(shape[-1:]), dtype=dtype, device="meta")
            name = "output" if isinstance(x, _proxy.Output) else x.name
            if name == "output" and self._generate:
                return torch.empty((batch, tokens + self._generate), dtype=torch.long, device="meta")
            if name not in probe:
                raise FragmentsError(f"{x.where}: {name} was not reached by a forward: it has no shape")
            return torch.empty(_scaled(probe[name][0], batch, tokens), dtype=probe[name][1], device="meta")
        return _proxy.meta(node, leaf)

    def _record(self, step):
        self._steps.append(step)

    def _save_node(self, node, where):
        if not isinstance(node, _proxy.Node):
            raise FragmentsError(f"{where}: save() of {type(node).__name__}: save a value of the trace")
        saved = SavedValue(repr(node))
        key = f"s{len(self._saves)}"
        self._saves.append((key, saved, where))
        self._steps.append(("save", node, key, where))
        return saved

    def _run(self):
        s = self._session
        rows = self._all_rows()
        self.lengths = [len(r) for r in rows]
        if self._generate and self._invokes and len({len(r) for r in rows}) > 1:
            raise FragmentsError(
                f"{self._opened_at}: generation with invokes of prompts of different numbers of tokens "
                f"({sorted({len(r) for r in rows})}): give them as one list, `model.generate([...])`")
        from ._model import _padded
        ids = rows if self._generate else _padded(rows)  # generation pads (and tracks positions) itself
        program = {"ids": ids, "generate": self._generate, "steps": self._steps}
        values, digests = _run_program(s, program)
        for key, saved, where in self._saves:
            saved._set(values[key])
        self.output = None


_PROBE_SHAPE = (2, 3)  # the probe forward's [rows, tokens]


def _scaled(shape, batch, tokens):
    """A location's shape in the probe forward, for a batch of `batch` rows of `tokens` tokens: [B, T, ...]
    values, and [T, ...] ones (a decoder layer's positions)."""
    shape = tuple(shape)
    if shape[:2] == _PROBE_SHAPE:
        return (batch, tokens) + shape[2:]
    if shape[:1] == _PROBE_SHAPE[1:]:
        return (tokens,) + shape[1:]
    return shape


def _run_program(session, program):
    replies = session._request("run", program)
    values, digests = replies[0]
    for r in range(1, len(replies)):
        for key, d in replies[r][1].items():
            if digests.get(key) != d:
                raise FragmentsError(f"a value computed in the trace differs across ranks (save {key}: rank 0 "
                                     f"{digests.get(key)}, rank {r} {d}): the computation must be deterministic")
    return values, digests


class _Invoke:
    def __init__(self, trace, rows):
        self._trace, self._ids = trace, rows

    def __enter__(self):
        t = self._trace
        start = sum(len(i) for i in t._invokes)
        t._invokes.append(self._ids)
        length = None if t._generate else max(len(r) for r in self._ids)
        t._rows = _Part(slice(start, start + len(self._ids)), length)
        return t

    def __exit__(self, *exc):
        self._trace._rows = None
        return False
