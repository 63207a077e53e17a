"""Ranks that stay up (`python -m fragments.ranks`) and clients that attach to them
(`fragments.LanguageModel.attach`, issue 29), on the reference Llama export at tp 2 over Gloo:

- before anything listens, attach says so in words;
- the ranks start once; their connection file is readable by this user only;
- client 1 (code on stdin) attaches, traces, and ends without closing; a client attaching while another
  is attached is told the ranks are busy; client 2 is killed with SIGKILL in the middle of its session;
  client 3 attaches to the same rank processes, gets the same values, and ends the ranks;
- every client's values equal tp 1's computed here with the plain API (fp32, <= 1e-5 relative);
- a wrong authkey is refused in words; after shutdown_ranks no rank process and no connection file is left.

Needs tests/models/{llama_tp1, llama_tp2} and `fragments` importable (python/ with _C built).
"""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import unittest

import torch

import fragments

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from process_watch import wait_gone  # noqa: E402
MODELS = os.path.join(ROOT, "tests", "models")
IDS = [[5, 17, 300, 42, 9, 77], [8, 1, 250]]

CLIENT = r'''
import json, os, sys, torch, fragments
model = fragments.LanguageModel.attach(os.environ["CONNECTION"])
with model.trace(%(ids)s) as tracer:
    h = model.model.layers[1].output
    top = model.lm_head(model.model.norm(h))[:, 2].softmax(-1).topk(5).save()
    logits = model.output.save()
print("RESULT " + json.dumps({"pids": model.pids, "top": top.values.tolist(), "top_i": top.indices.tolist(),
                              "logits": [t.tolist() for t in tracer.unpad(logits)]}), flush=True)
%(then)s
''' % {"ids": IDS, "then": "%(then)s"}


def relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def env(**extra):
    return dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "python"), ROOT,
                                                        os.environ.get("PYTHONPATH", "")]), **extra)


class AttachTest(unittest.TestCase):
    def expected(self):
        model = fragments.load(os.path.join(MODELS, "llama_tp1", "rank0.pt"))
        logits = []
        for ids in IDS:
            with model.trace([ids]):
                out = model.output.save()
            logits.append(out.value[0])
        lens = torch.stack([logits[0][2], logits[1][2]]).softmax(-1).topk(5)
        return logits, lens

    def client(self, connection):
        # stderr to a file: a pipe nobody reads while the process runs could fill and block it
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, env=env(CONNECTION=connection))
        proc.log = log
        return proc

    @staticmethod
    def log(proc):
        proc.log.seek(0)
        return proc.log.read()

    def result(self, proc, code):
        proc.stdin.write(code)
        proc.stdin.close()
        line = proc.stdout.readline()
        self.assertTrue(line.startswith("RESULT "), line + self.log(proc))
        return json.loads(line[len("RESULT "):])

    def check(self, out, logits, lens):
        for got, want in zip(out["logits"], logits):
            self.assertLess(relative(got, want), 1e-5)
        self.assertLess(relative(out["top"], lens.values), 1e-5)
        self.assertEqual(out["top_i"], lens.indices.tolist())

    def test_attach(self):
        logits, lens = self.expected()
        folder = tempfile.mkdtemp(prefix="attach_test.")
        self.addCleanup(shutil.rmtree, folder, True)  # the assertions before the try fail too
        connection = os.path.join(folder, "ranks.json")
        with self.assertRaises(fragments.FragmentsError) as nothing:
            fragments.LanguageModel.attach("127.0.0.1:9", authkey="00")
        self.assertIn("nothing listens at 127.0.0.1:9", str(nothing.exception))
        with self.assertRaises(fragments.FragmentsError) as no_file:
            fragments.LanguageModel.attach(connection)
        self.assertIn("no connection file there", str(no_file.exception))

        host_log = open(os.path.join(folder, "host.log"), "w+")
        host = subprocess.Popen([sys.executable, "-m", "fragments.ranks", os.path.join(MODELS, "llama_tp2"),
                                 "--tp", "2", "--connection-file", connection], stdout=subprocess.PIPE,
                                stderr=host_log, text=True, env=env())
        try:
            banner = host.stdout.readline()
            self.assertIn("listening on 127.0.0.1:", banner, banner)
            self.assertEqual(stat.S_IMODE(os.stat(connection).st_mode), 0o600)

            go = os.path.join(folder, "go")
            first = self.client(connection)  # holds the ranks until `go` exists
            out1 = self.result(first, CLIENT % {"then": f"import time\nwhile not os.path.exists({go!r}): "
                                                        "time.sleep(0.1)"})
            self.check(out1, logits, lens)
            with self.assertRaises(fragments.FragmentsError) as busy:
                fragments.LanguageModel.attach(connection)
            self.assertIn("busy", str(busy.exception))
            open(go, "w").close()  # the first client ends without close(): the ranks stay
            self.assertEqual(first.wait(60), 0, self.log(first))

            second = self.client(connection)
            out2 = self.result(second, CLIENT % {"then": "import time; time.sleep(600)"})
            os.kill(second.pid, signal.SIGKILL)  # killed while attached
            second.wait()
            self.assertEqual(out2["pids"], out1["pids"])
            self.check(out2, logits, lens)

            with open(connection) as f:
                address = json.load(f)["address"]
            with self.assertRaises(fragments.FragmentsError) as wrong:
                fragments.LanguageModel.attach(address, authkey="ab" * 32)
            self.assertIn("authkey was refused", str(wrong.exception))

            third = self.client(connection)
            out3 = self.result(third, CLIENT % {"then": "model.shutdown_ranks()"})
            self.assertEqual(third.wait(60), 0, self.log(third))
            self.assertEqual(out3["pids"], out1["pids"])
            self.check(out3, logits, lens)
            code = host.wait(60)
            host_log.seek(0)
            self.assertEqual(code, 0, host_log.read())
            self.assertEqual(wait_gone(out1["pids"]), [])
            self.assertFalse(os.path.exists(connection))
        finally:
            if host.poll() is None:
                host.kill()
                host.wait()
            host.stdout.close()
            host_log.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
