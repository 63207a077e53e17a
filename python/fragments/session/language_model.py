"""A model that stays loaded: `fragments.LanguageModel("DIR", tp=3)` in any Python process.

    model = fragments.LanguageModel("exports/smollm2_tp3", tp=3)      # starts 3 ranks once
    with model.trace("The capital of France is"):
        h = model.model.layers[5].output
        top = model.lm_head(model.model.norm(h))[:, -1].softmax(-1).topk(5).save()
    model.close()                                                      # or `with`, or the process's end

The driver (this process) records a trace with the recorder every backend shares (fragments.tracing), sends
the recording to every rank once (fragments.session.channel), and gets the saved values back once, from rank 0;
each rank runs it on its own `fragments.Model` (fragments.local.run) in the same order, so the ranks'
collectives meet. The ranks are `python -m fragments.session.rank` processes: they never import this process's
`__main__`. `LanguageModel.attach(...)` drives ranks that another process keeps up (`python -m fragments.ranks`,
fragments.session.attach).
"""
import atexit
import numbers
import os
import threading
import weakref

import torch

from ..core.errors import FragmentsError
from ..core.saved import SavedValue
from ..core.tokens import token_rows
from ..tracing.envoy import TracedModel
from . import channel
from .attach import connect
from .trace import SessionTrace

_SESSIONS = weakref.WeakSet()
PROBE_SHAPE = (2, 3)  # the probe forward's [rows, tokens] (fragments.local.trace.PROBE_SHAPE)


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


class LanguageModel(TracedModel):
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
            self._link = channel.Ranks(self.path, self.tp, backend, float(timeout))
        except BaseException:
            self._closed = True
            raise
        self._adopt(self._link.info, self._link.pids)
        _SESSIONS.add(self)

    def _setup(self, path, tp, tokenizer):
        self.path, self.tp, self._closed = path, int(tp), False
        self._folder = os.path.dirname(self.path)
        self._tokenizer = tokenizer
        self._weights, self._shapes = {}, None
        self._lock = threading.Lock()
        self._link = None
        self._remote = None  # an attached client's connection (fragments.session.attach)

    def _adopt(self, info, pids):
        """Rank 0's description of the model (module tree, locations, dtype) and the ranks' pids."""
        self._info = info
        self._tree = info["tree"]
        self._tree.hidden_state_inputs = True  # a decoder layer's .input: its hidden states, as nnsight's
        self.dtype = self._tree.dtype
        self.pids = pids

    @property
    def _dead(self):
        return getattr(self._link, "dead", None)

    def _request(self, kind, payload=None):
        if self._closed:
            raise FragmentsError("this LanguageModel was closed: create a new one")
        if self._dead:
            raise FragmentsError(f"{self._dead}; this session has ended: create a new LanguageModel")
        data = channel.dumps(kind, payload)
        with self._lock:
            return self._link.request(data)

    @classmethod
    def attach(cls, address, authkey=None, timeout=120.0):
        """A LanguageModel on ranks already running (`python -m fragments.ranks DIR --tp N`): `address` is
        their connection file (it holds the address and the authkey) or "127.0.0.1:PORT" with `authkey`
        (bytes, hex text, or $FRAGMENTS_AUTHKEY). One client at a time; `close()` detaches and leaves the
        ranks running (`shutdown_ranks()` ends them)."""
        remote, hello = connect(address, authkey, timeout)
        self = cls.__new__(cls)
        self._setup(hello["path"], hello["tp"], None)
        self._link = self._remote = remote
        self._adopt(hello["info"], hello["pids"])
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
        elif self._link is not None:
            self._link.close()

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
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            folder = os.path.join(self._folder, "tokenizer")
            if not os.path.isdir(folder):
                raise FragmentsError(f"{self._folder} has no tokenizer/ folder: give token ids, or "
                                     "LanguageModel(..., tokenizer=a transformers tokenizer)")
            from transformers import AutoTokenizer  # (only sessions given text need transformers)
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
        return self._tokenizer

    def _rows(self, prompt):
        """A prompt as token-id rows (lists of ints): text (the checkpoint's tokenizer), texts, ids [B, T] or
        [T], or lists of ids of different lengths (a ragged batch: right-padded when it runs)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(p, str) for p in prompt):
            return [list(self.tokenizer(p)["input_ids"]) for p in prompt]
        return token_rows(prompt)

    def trace(self, prompt=None):
        """`with model.trace(prompt):` records; the block's end runs one forward on the ranks. `prompt`: a
        text, texts, or token ids; none when the block uses `tracer.invoke(prompt)` (several prompts)."""
        return SessionTrace(self, prompt, 0)

    def generate(self, prompt=None, max_new_tokens=1, **options):
        """Generation, as fragments.load's `model.generate`: the block's edits act at every step (narrow them with
        `gen.iter[a:b]`, `gen.prefill()`, `gen.decode()`, `gen.rows(...)`); `model.output.save()` is the tokens.
        Options as there: temperature, top_p, seed, eos_token_id, stop (with the session's tokenizer), max_len,
        batch_size, batch_buckets; greedy by default. (`on_token` runs in the caller's process: use
        fragments.load's `model.stream` for it.)"""
        if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise FragmentsError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if "on_token" in options or "tokenizer" in options:
            raise FragmentsError("generate: on_token and tokenizer are fragments.load's; a session's generation "
                                 "runs on the ranks with the session's tokenizer")
        if options.get("stop"):
            options["tokenizer"] = self.tokenizer
        return SessionTrace(self, prompt, int(max_new_tokens), options)

    def run_on_ranks(self, fn):
        """`fn(model)` on every rank's `fragments.Model` (the same call on each); rank 0's result."""
        return self._request("exec", fn)[0]

    def locations(self):
        """What `frag inspect --json` lists for the rank files (format fragments.inspect/1), from rank 0."""
        return self._request("locations")[0]

    def _weight_value(self, module, attr):
        """A parameter's whole tensor (gathered from the ranks' pieces once; the ranks keep it for expressions)."""
        key = (module, attr)
        if key not in self._weights:
            shards = self._request("shard", key)
            cls = self._tree.classes.get(module, "")
            layout = self._tree.head_layout(f"{module}.output") if cls == "QKVParallelLinear" else {}
            whole = join_shards(shards, cls, f"{module}.{attr}", layout)
            self._request("weight", (key, whole))
            self._weights[key] = whole
        return self._weights[key]

    def _probe(self):
        """{location: (shape, dtype)} of one forward of [2, 3] pad tokens (asked once): what `.shape` and
        `.dtype` inside a trace scale to the trace's batch."""
        if self._shapes is None:
            self._shapes = self._request("probe", PROBE_SHAPE)[0]
        return self._shapes

    def _callable(self, path):
        return None if path in self._tree.classes else f"{path} is not a module of this model"

    def _call(self, modules, x):
        if isinstance(x, SavedValue):
            x = x.value
        return self._request("call", (list(modules), x))[0]

    def _title(self):
        state = "closed" if self._closed else (self._dead or f"ranks {self.pids}")
        state += " (attached)" if self._remote is not None else ""
        return f"<fragments.LanguageModel {self.path} tp={self.tp}: {state}>"


def join_shards(shards, cls, what, layout=None):
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

