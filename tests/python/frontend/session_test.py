"""fragments.LanguageModel (python/fragments/session/): a model kept loaded on rank processes, driven from
code on standard input (`python -`, no main guard) and from an interactive REPL (`python -i`), on the
reference Llama export at tp 2 over Gloo against tp 1 of the same weights computed here with the plain
`fragments.load` API and torch (fp32, <= 1e-5 relative).

Also: a rank killed between traces is reported in words at the next call; the driver killed with SIGKILL
leaves no rank behind (parent-death signal); a bad step is reported at the user's file and line; invokes
of prompts of different lengths each get their own tokens (their values: ragged_trace_test.py).

FRAG_SESSION_BACKEND=nccl runs the stdin and REPL sessions on GPUs 0 and 1 (not in CI: no GPU here).

Needs tests/models/{llama_tp1, llama_tp2, llama_kv2_tp1, llama_kv2_tp4} and `fragments` importable (python/ with _C built); run from the
runfiles root (Bazel) or with FRAG_TEST_ROOT pointing at a tree that has them.
"""
import json
import os
import signal
import subprocess
import sys
import time
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from process_watch import alive, wait_gone  # noqa: E402
MODELS = os.path.join(ROOT, "tests", "models")
TP2 = os.path.join(MODELS, "llama_tp2")
TOLERANCE = 1e-5
IDS = [[5, 17, 300, 42, 9, 77], [8, 1, 250, 42, 600, 3]]

# The session's traces, as a user types them. Prints one JSON line of results (lists of floats).
SESSION_CODE = r'''
import json, os, torch, fragments
model = fragments.LanguageModel(os.environ["EXPORT"], tp=2, backend=os.environ.get("FRAG_SESSION_BACKEND", "gloo"))
ids = torch.tensor(%(ids)s)
W = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
with model.trace(ids):
    h = model.model.layers[1].output
    norm = (h * 2).norm(dim=-1).save()
    proj = (h[:, -1] @ W).save()
    top = model.lm_head(model.model.norm(h))[:, -1].softmax(-1).topk(5).save()
    last = h[:, -1].save()
    layer_in = model.model.layers[1].input.save()
    down_w = (model.model.layers[0].mlp.down_proj.weight * 1).save()
    logits = model.output.save()
with model.trace(ids):  # one prompt's value into the other within one forward; a callable from this code
    model.model.layers[0].output[1, 2] = model.model.layers[0].output[0, 2]
    model.model.layers[1].output.apply(lambda t: t * 0.5)
    patched = model.output.save()
with model.trace() as tracer:  # the same through invokes
    with tracer.invoke(ids[0]):
        source = model.model.layers[0].output[:, 2]
    with tracer.invoke(ids[1]):
        model.model.layers[0].output[:, 2] = source
        invoked = model.output.save()
with model.trace(ids):  # heads by number, in whole coordinates
    model.model.layers[0].self_attn.o_proj.input.heads[1] = 0
    model.model.layers[1].self_attn.o_proj.input.heads[0] *= 0.5
    k1 = model.model.layers[1].self_attn.qkv_proj.output.k.heads[1].save()
    headless = model.output.save()
down = model.model.layers[0].mlp.down_proj.weight
qkv_w = model.model.layers[1].self_attn.qkv_proj.weight
gate_up_w = model.model.layers[1].mlp.gate_up_proj.weight
out = {"qkv_w": qkv_w.tolist(), "gate_up_w": gate_up_w.tolist(), "headless": headless.tolist(), "k1": k1.tolist(), "norm": norm.tolist(), "proj": proj.tolist(), "top_values": top.values.tolist(),
       "top_indices": top.indices.tolist(), "last": last.tolist(), "layer_in": layer_in.tolist(),
       "logits": logits.tolist(), "patched": patched.tolist(), "invoked": invoked.tolist(),
       "down": down.tolist(), "down_in_trace": down_w.tolist(), "pids": model.pids}
print("RESULT " + json.dumps(out))
''' % {"ids": IDS}


def relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def expected():
    """tp=1 of the same weights, in this process with the plain API and torch on saved wholes."""
    model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
    ids = torch.tensor(IDS)
    W = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    with model.trace(ids):
        h = model.model.layers[1].output.save()
        h0 = model.model.layers[0].output.save()
        lens = model.lm_head(model.model.norm(model.model.layers[1].output)).save()
        logits = model.output.save()
    h, h0, lens = h.value, h0.value, lens.value
    top = lens[:, -1].softmax(-1).topk(5)
    with model.trace(ids):
        model.model.layers[0].output[1, 2] = h0[0, 2]
        model.model.layers[1].output *= 0.5
        patched = model.output.save()
    with model.trace(ids):
        model.model.layers[0].output[1, 2] = h0[0, 2]
        invoked = model.output.save()
    with model.trace(ids):
        model.model.layers[0].self_attn.o_proj.input.heads[1] = 0
        model.model.layers[1].self_attn.o_proj.input.heads[0] *= 0.5
        k1 = model.model.layers[1].self_attn.qkv_proj.output.k.heads[1].save()
        headless = model.output.save()

    layers = torch.jit.load(os.path.join(MODELS, "llama_tp1", "rank0.pt")).model.layers._modules
    down = layers["0"].mlp.down_proj.weight
    return {"norm": (h * 2).norm(dim=-1), "proj": h[:, -1] @ W, "top_values": top.values,
            "top_indices": top.indices, "last": h[:, -1], "layer_in": h0, "logits": logits.value,
            "patched": patched.value, "invoked": invoked.value[1:], "down": down.detach(),
            "down_in_trace": down.detach(), "headless": headless.value, "k1": k1.value,
            "qkv_w": layers["1"].self_attn.qkv_proj.weight.detach(),
            "gate_up_w": layers["1"].mlp.gate_up_proj.weight.detach()}


def env():
    return dict(os.environ, EXPORT=TP2, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "python"), ROOT, os.environ.get("PYTHONPATH", "")]))


class SessionTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.expected = expected()

    def check(self, out):
        for key, want in self.expected.items():
            got = torch.tensor(out[key])
            if key == "top_indices":
                self.assertEqual(got.tolist(), want.tolist())
            else:
                self.assertLess(relative(got, want), TOLERANCE, key)
        self.assertEqual(wait_gone(out["pids"]), [], "ranks left after the process ended")

    def result(self, stdout):
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        self.assertEqual(len(lines), 1, stdout)
        return json.loads(lines[0][len("RESULT "):])

    def test_code_on_stdin(self):
        """`python -` (code from standard input, no main guard): the file the issue found failing."""
        done = subprocess.run([sys.executable, "-"], input=SESSION_CODE, capture_output=True, text=True,
                              env=env(), timeout=600)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.check(self.result(done.stdout))

    def test_interactive_repl(self):
        """`python -i`: each statement typed at the prompt (blocks entered whole through exec)."""
        import ast
        lines = []
        for node in ast.parse(SESSION_CODE).body:  # a statement per prompt; a `with` block through exec
            source = ast.get_source_segment(SESSION_CODE, node)
            lines.append(f"exec({source!r})" if isinstance(node, ast.With) else source)
        script = "\n".join(lines) + "\n"
        done = subprocess.run([sys.executable, "-i", "-q"], input=script, capture_output=True, text=True,
                              env=env(), timeout=600)
        self.assertIn(">>>", done.stderr, "not an interactive session")
        self.assertNotIn("Traceback", done.stderr, done.stderr)
        self.check(self.result(done.stdout))

    def test_mistakes_and_dead_rank(self):
        code = r'''
import os, signal, time, torch, fragments
model = fragments.LanguageModel(os.environ["EXPORT"], tp=2)
print("PIDS", model.pids)
try:
    with model.trace([[1, 2, 3]]):
        model.model.layers[0].output[:, 0] = torch.zeros(7)   # LINE-SHAPE
except fragments.FragmentsError as e:
    print("SHAPE", e)
try:
    with model.trace([[1, 2, 3]]):
        x = (model.model.layers[0].output @ torch.zeros(5, 5)).save()   # LINE-MATMUL
except fragments.FragmentsError as e:
    print("MATMUL", e)
with model.trace() as tracer:   # prompts of different lengths: each invoke's own tokens
    with tracer.invoke([[1, 2, 3]]):
        a = model.output.save()
    with tracer.invoke([[4, 5]]):
        b = model.output.save()
print("LENGTHS", tuple(a.shape), tuple(b.shape), tracer.lengths)
try:
    fragments.LanguageModel(os.path.join(os.environ["EXPORT"], "..", "llama_tp1"), tp=2)   # a tp 1 export
except fragments.FragmentsError as e:
    print("LOAD", " ".join(e.args[0].split()))
try:
    model.model.layers[0].mlp.dwn_proj
except AttributeError as e:
    print("NAME", e)
def interrupt(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, interrupt)
signal.setitimer(signal.ITIMER_REAL, 0.3)   # Ctrl-C while the ranks work: their late replies are dropped
try:
    model.run_on_ranks(lambda m: (time.sleep(1.5), "late")[1])
except KeyboardInterrupt:
    print("INTERRUPTED", model.run_on_ranks(lambda m: "fresh"))
log = open(os.devnull, "w")
try:
    model.run_on_ranks(lambda m: log.write("x"))   # an open file cannot travel
except fragments.FragmentsError as e:
    print("TRAVEL", e)
model.run_on_ranks(lambda m: torch.manual_seed(m.rank))   # each rank its own random numbers
try:
    with model.trace([[1, 2, 3]]):
        noise = model.model.layers[0].output.sigmoid().bernoulli().save()
except fragments.FragmentsError as e:
    print("DIFFER", e)
with model.trace([[1, 2, 3]]):
    ok = model.output.save()
print("OK", tuple(ok.shape))
os.kill(model.pids[1], signal.SIGKILL)
time.sleep(0.5)
try:
    with model.trace([[1, 2, 3]]):
        model.output.save()
except fragments.FragmentsError as e:
    print("DEAD", e)
'''
        done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, env=env(),
                              timeout=600)
        self.assertEqual(done.returncode, 0, done.stderr)
        out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in done.stdout.splitlines() if " " in line}
        line_of = {tag: i + 1 for i, line in enumerate(code.split("\n")) for tag in ("LINE-SHAPE", "LINE-MATMUL")
                   if tag in line}
        self.assertIn(f"<stdin>:{line_of['LINE-SHAPE']}", out["SHAPE"])
        self.assertIn(f"<stdin>:{line_of['LINE-MATMUL']}", out["MATMUL"])
        self.assertEqual(out["LENGTHS"], "(1, 3, 1000) (1, 2, 1000) [3, 2]")  # refused before issue 29's last stop
        self.assertIn("did you mean down_proj", out["NAME"])
        self.assertRegex(out["LOAD"], r"could not load .*exported for tp_size 1 but the world size is 2")
        self.assertIn("differs across ranks", out["DIFFER"])
        self.assertEqual(out["INTERRUPTED"], "fresh")
        self.assertIn("cannot be sent to the ranks", out["TRAVEL"])
        self.assertEqual(out["OK"], "(1, 3, 1000)")
        pids = json.loads(out["PIDS"])
        self.assertRegex(out["DEAD"], rf"rank 1 \(pid {pids[1]}\) died \(signal 9\)")
        self.assertEqual(wait_gone(pids), [])

    def test_weight_of_replicated_kv_heads(self):
        """qkv_proj's whole weight where 2 kv heads are replicated over 4 ranks, against tp 1's."""
        with fragments.LanguageModel(os.path.join(MODELS, "llama_kv2_tp4"), tp=4) as model:
            whole = model.model.layers[1].self_attn.qkv_proj.weight
            pids = model.pids
        self.assertEqual(wait_gone(pids), [])
        tp1 = torch.jit.load(os.path.join(MODELS, "llama_kv2_tp1", "rank0.pt")).model.layers._modules["1"]
        self.assertTrue(torch.equal(whole, tp1.self_attn.qkv_proj.weight.detach()))

    def test_plain_api_error_at_line(self):
        """fragments.load's traces (launch, torchrun) also report a step refused in the forward at its line."""
        import inspect
        model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        with self.assertRaises(fragments.FragError) as caught:
            with model.trace([[1, 2, 3]]):
                line = inspect.currentframe().f_lineno + 1
                model.model.layers[0].output[:, -1] += torch.ones(7)
        self.assertIn(f"session_test.py:{line}: ", str(caught.exception))
        self.assertIn("does not fit the selected whole", str(caught.exception))

    def test_driver_killed(self):
        """SIGKILL to the driver (no atexit): the ranks end by themselves (parent-death signal)."""
        code = ('import os, sys, time, fragments\nmodel = fragments.LanguageModel(os.environ["EXPORT"], tp=2)\n'
                'print("PIDS", model.pids, flush=True)\ntime.sleep(600)\n')
        proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env())
        proc.stdin.write(code)
        proc.stdin.close()
        line = proc.stdout.readline()
        pids = json.loads(line.split(" ", 1)[1])
        self.assertTrue(all(alive(p) for p in pids))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        self.assertEqual(wait_gone(pids), [], "ranks outlived their driver")


if __name__ == "__main__":
    unittest.main(verbosity=2)
