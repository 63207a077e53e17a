"""Generation as a trace of fragments.load's model: `with model.generate(prompts, max_new_tokens=...) as gen:`.

Inside the block, reads and edits are recorded as in `model.trace`; when it ends, generation runs from
the rank file's KV cache (program/decoder.h): one prefill of every prompt (prompts of different lengths
are right-padded; each row's tokens are those of its own unbatched run), then one decode step per new
token. Every recorded step acts at every generation step (step 0 is the prefill, step k the k-th decode
step) unless a scope narrows it:

    with model.generate(["The cat", "A much longer prompt"], max_new_tokens=20, tokenizer=tok) as gen:
        h = model.model.layers[6].output.save()          # a list: [B, T, W] at step 0, [B, 1, W] after
        with gen.iter[1:]:                                # decode steps only (gen.prefill(), gen.decode())
            model.model.layers[6].output[...] += steer
        with gen.rows([1]):                               # batch row 1 only
            model.model.layers[3].output *= 0.5
    gen.output                                            # tokens: [B, T + n], or one row each if ragged
    gen.new_tokens                                        # each row's new tokens (to EOS / a stop string)

`gen.all()` is the default scope (every step), as in nnsight. Sampling: temperature > 0 samples (with
top_p nucleus filtering) from a generator seeded with `seed`, the same on every rank (the logits are
whole and equal everywhere); temperature 0 is greedy. A row stops at `eos_token_id` or when its decoded
text ends in one of `stop` (needs `tokenizer`, anything with `.decode(list_of_ids)`); generation ends when
every row has stopped. `on_token(step, tokens)` is called after every step with each row's new token
(None for a stopped row); `model.stream(...)` yields the same as an iterator.
"""
import numbers

import torch

from .. import _C
from ..core.errors import FragmentsError
from ..core.tokens import nonempty, token_ids
from . import run
from .trace import Trace


class Generation(Trace):
    """The trace of one `with model.generate(...)` block (see the module's docstring)."""

    def __init__(self, model, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0, eos_token_id=None,
                 stop=None, tokenizer=None, on_token=None, max_len=None, batch_size=None, batch_buckets=None):
        if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise FragmentsError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if temperature < 0 or not 0 < top_p <= 1:
            raise FragmentsError(f"generate: temperature must be >= 0 and top_p in (0, 1], got {temperature}, "
                                 f"{top_p}")
        if stop and tokenizer is None:
            raise FragmentsError("generate: stop strings need a tokenizer (anything with .decode(ids))")
        super().__init__(model, None, generate=int(max_new_tokens))
        self._plan = False  # no ids: the prompts are given here, and it runs at its block's end
        self._prompts = prompt_rows(prompts, tokenizer)
        self._ragged = len({len(p) for p in self._prompts}) > 1
        self._n = int(max_new_tokens)
        self._temperature, self._top_p, self._seed = float(temperature), float(top_p), int(seed)
        self._eos = set([eos_token_id] if isinstance(eos_token_id, numbers.Integral) else (eos_token_id or []))
        self._stop = [stop] if isinstance(stop, str) else list(stop or [])
        self._tokenizer, self._on_token = tokenizer, on_token
        self._max_len = max_len
        # The cache's rows (default: the prompts) and the batch sizes decode steps are padded to
        # (program/decoder.h; None: the Decoder's default, [] none).
        self._batch_size, self._buckets = batch_size, batch_buckets
        self.lengths = [len(p) for p in self._prompts]
        self.new_tokens = None
        self.logits = None
        self.cache = None  # the Decoder's description of its KV cache, once it ran

    def _finish(self):
        for _ in self._steps_run():
            pass

    def run(self, ids):
        raise FragmentsError("a generation runs once, at its block's end: run(ids) is a trace's (model.trace, "
                             "model.plan)")

    def _meta(self, node):
        self._ids = torch.zeros((len(self._prompts), max(self.lengths)), dtype=torch.long)
        return super()._meta(node)

    # ---- running
    def _pick(self, logits, generator):
        logits = logits.float()
        if self._temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits / self._temperature, dim=-1)
        if self._top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
            sorted_probs = sorted_probs.masked_fill(before >= self._top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)

    def _stopped(self, row_tokens):
        if row_tokens and row_tokens[-1] in self._eos:
            return True
        if self._stop:
            text = self._tokenizer.decode(row_tokens)
            return any(s in text for s in self._stop)
        return False

    def _steps_run(self):
        """Runs the generation, yielding (step, [token or None per row]) after each step."""
        c = self._model._c
        if not c.has_kv_cache:
            if self._ragged or self._temperature > 0 or self._eos or self._stop or self._on_token:
                raise FragmentsError(f"{self._model.path}: this rank file's forward takes no KV cache (exported "
                                     "before cached generation): only greedy generation of equal-length "
                                     "prompts runs here; export it again with the kit")
            self._ids = torch.tensor(self._prompts)
            self._run()  # the engine's own greedy loop (program::generate)
            self.new_tokens = [row[len(p):] for row, p in zip(self.output.tolist(), self._prompts)]
            return
        prepared = self._prepare()
        c.prepare(prepared.steps, prepared.callables)
        new, logits_per_step = [[] for _ in self._prompts], []
        try:
            yield from self._decode(c, new, logits_per_step)
        finally:
            saved, unreached = c.finish(bool(prepared.callables))
        run.warn_unreached(unreached)
        self.new_tokens = new
        self.logits = logits_per_step
        if self._ragged:
            self.output = [torch.tensor(p + n, dtype=torch.long) for p, n in zip(self._prompts, new)]
        else:
            width = max(len(n) for n in new)
            padded = [n + [n[-1]] * (width - len(n)) for n in new]  # a stopped row repeats its last token
            self.output = torch.cat([torch.tensor(self._prompts), torch.tensor(padded)], 1)
        self._results = prepared.results(self.output, saved, self._n, self._model._call)
        self._deliver(*self._results)

    def _decode(self, c, new, logits_per_step):
        """The prefill, then one decode step per new token, until every row stopped or the last token."""
        batch = len(self._prompts)
        max_len = self._max_len or max(len(p) for p in self._prompts) + self._n
        generator = torch.Generator().manual_seed(self._seed)
        done = [False] * batch
        decoder = _C.Decoder(c, max(batch, self._batch_size or 0), max_len)
        if self._buckets is not None:
            decoder.set_batch_buckets([int(b) for b in self._buckets])
        self.cache = decoder.describe()
        logits = decoder.prefill(self._prompts)
        for step in range(self._n):
            logits_per_step.append(logits)
            tokens = self._pick(logits, generator)
            emitted = []
            for r, t in enumerate(tokens.tolist()):
                if done[r]:
                    emitted.append(None)
                    continue
                new[r].append(t)
                emitted.append(t)
                done[r] = self._stopped(new[r])
            if self._on_token is not None:
                self._on_token(step, emitted)
            yield step, emitted
            if all(done) or step == self._n - 1:
                break
            logits = decoder.decode(tokens.to(torch.long))


def prompt_rows(prompts, tokenizer):
    """Prompts as lists of ids: a LongTensor [B, T] or [T], lists of ints, or strings (with a tokenizer)."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], str)):
        if tokenizer is None:
            raise FragmentsError("generate: text prompts need a tokenizer (anything with .encode(text))")
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        rows = [list(tokenizer.encode(t)) for t in texts]
    elif isinstance(prompts, torch.Tensor):
        rows = token_ids(prompts).tolist()
    elif isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], numbers.Integral):
        rows = [[int(t) for t in prompts]]
    elif isinstance(prompts, (list, tuple)) and prompts:
        rows = [[int(t) for t in p] for p in prompts]
    else:
        raise FragmentsError(f"generate: prompts must be token ids or text, got {type(prompts).__name__}")
    return nonempty(rows, "generate")
