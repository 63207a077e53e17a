"""tests/python/notebooks/smollm2_session.ipynb run headless (nbclient, a fresh ipykernel), then the same
cells typed into a plain interactive Python (`python -i`, code on standard input; FRAG_SLOW=1 only, for CI time).

The notebook loads SmolLM2 at tp 3 once (fragments.LanguageModel) and its cells assert, each against nnsight
on transformers at tp 1 (the same GGUF weights), a saved layer, a logit lens keeping the top 5 tokens per
layer, a head ablation, patching across two prompts in one trace, and a steered generation. After the
kernel shuts down (and after the REPL's end) no rank process may be left.

Needs tests/models/smollm2_tp3 (Bazel: //tests/models:smollm2_tp3; else set SMOLLM2_TP3 to an export of
`python -m fragkit.checkpoint --from smollm2 --tp 3`), nbclient and ipykernel, `fragments` importable.
"""
import ast
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
NOTEBOOK = os.path.join(ROOT, "tests", "python", "notebooks", "smollm2_session.ipynb")
EXPORT = os.path.abspath(os.environ.get("SMOLLM2_TP3", os.path.join(ROOT, "tests", "models", "smollm2_tp3")))


sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from process_watch import alive, wait_gone  # noqa: E402
from slow_tier import slow_tier  # noqa: E402


# IPython's and Jupyter's folders in one of the test's own, removed at its exit: without a writable home (Bazel's
# tests) they fall back to temporary folders of their own and leave them in /tmp (three per run).
HOMES = tempfile.mkdtemp(prefix="frag-notebook-")
atexit.register(shutil.rmtree, HOMES, True)


def environment():
    path = [os.path.join(ROOT, "python"), ROOT, os.environ.get("PYTHONPATH", "")]
    homes = {name: os.path.join(HOMES, name.lower()) for name in
             ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "MPLCONFIGDIR")}
    return dict(os.environ, SMOLLM2_TP3=EXPORT, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(filter(None, path)),
                **homes)


def pids_in(text):
    match = re.search(r"PIDS (\[[\d, ]+\])", text)
    assert match, f"no PIDS line in:\n{text}"
    return json.loads(match.group(1))


class NotebookTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.isfile(os.path.join(EXPORT, "rank2.pt")):
            raise AssertionError(f"{EXPORT}: no SmolLM2 tp 3 export (build //tests/models:smollm2_tp3)")

    def test_notebook(self):
        import nbformat
        from nbclient import NotebookClient

        os.environ.update(environment())  # the kernel inherits it
        nb = nbformat.read(NOTEBOOK, as_version=4)
        started = time.monotonic()
        NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": ROOT}}).execute()
        text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
        print(f"notebook: {time.monotonic() - started:.0f} s\n{text}")
        pids = pids_in(text)
        self.assertEqual(wait_gone(pids, seconds=20), [], "rank processes left after the kernel shut down")

    # The REPL half is the slow tier's (CI time): the notebook runs the same cells against nnsight by default,
    # and frontend/session_test drives a loaded model from `python -i` (test_interactive_repl).
    @slow_tier("the same cells run in the default tier in test_notebook, and a session typed into `python -i` "
               "in tests/python/frontend:session_test (test_interactive_repl)")
    def test_repl(self):
        with open(NOTEBOOK) as f:
            nb = json.load(f)
        lines = []
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            for node in ast.parse(source).body:  # simple statements typed; blocks through exec
                segment = ast.get_source_segment(source, node)
                simple = "\n" not in segment and not isinstance(node, (ast.With, ast.For, ast.If, ast.Try))
                if simple:
                    lines.append(segment)
                else:  # nnsight (the reference) reads a block's source back: give the block a linecache entry
                    name = f"<block{len(lines)}>"
                    lines.append(f"import linecache; linecache.cache[{name!r}] = ({len(segment)}, None, "
                                 f"{segment.splitlines(True)!r}, {name!r}); exec(compile({segment!r}, {name!r}, 'exec'))")
        done = subprocess.run([sys.executable, "-i", "-q"], input="\n".join(lines) + "\n", capture_output=True,
                              text=True, env=environment(), timeout=900, cwd=ROOT)
        print(done.stdout[-3000:])
        self.assertIn(">>>", done.stderr, "not an interactive session")
        self.assertNotIn("Traceback", done.stderr, done.stderr[-5000:])
        self.assertEqual(wait_gone(pids_in(done.stdout), seconds=20), [], "rank processes left after the REPL ended")


if __name__ == "__main__":
    unittest.main(verbosity=2)
