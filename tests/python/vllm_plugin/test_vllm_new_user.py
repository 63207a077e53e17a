"""The README's quick start as a new user runs it on vLLM's CPU build: `LLM(model_dir, tensor_parallel_size=2,
enforce_eager=True)` with neither VLLM_CPU_OMP_THREADS_BIND nor VLLM_CPU_KVCACHE_SPACE set (this machine: one
NUMA node, 2 cores). vLLM alone stops at engine start there (one node cannot bind two workers; its reservation,
0.92 of the memory in vLLM 0.24, is not free on a busy machine); the plugin sets what lets it start and says so
in one line. CpuDefaultsTest: when the plugin sets the KV cache, without an engine.

    python tests/python/vllm_plugin/test_vllm_new_user.py

Asserts: the plugin's one line is printed once (the first process only), the engine starts, and a save of
layer 0's q|k|v comes back whole. (With FRAGMENTS_VLLM_CPU_DEFAULTS=0 the same script stops at engine start.)
"""
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child():
    import families
    from fragments import vllm as fv
    from vllm import LLM
    folder = os.path.join(os.environ["FRAG_WORK"], "model")
    families.write_checkpoint("llama", folder)
    llm = LLM(folder, tensor_parallel_size=2, enforce_eager=True, skip_tokenizer_init=True, max_model_len=64)
    out = fv.generate(llm, [{"prompt_token_ids": [5, 17, 200]}],
                      [[{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv", "step": 0}]],
                      max_tokens=2, temperature=0)[0]
    print(f"SAVED {tuple(out.fragments['qkv'].shape)} {out.fragments_error}", flush=True)
    llm.llm_engine.engine_core.shutdown()  # its processes end here: they would outlive os._exit
    fv.remove_state_dir()  # the plugin's state folder (model.json): os._exit skips the hook that removes it


class NewUserTest(unittest.TestCase):
    def test_quick_start_on_the_cpu_build(self):
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            print("SKIPPED new-user quick start: vllm is not installed (tools/install_deps.sh)", file=sys.stderr)
            self.skipTest("vllm is not installed")
        import engine_env
        if engine_env.GPU:
            self.skipTest("the CPU build's settings: this vLLM is the CUDA build")
        from vllm_check import plugin_dist, remove_work, work_folder
        work = work_folder("frag-vllm-new-user-")
        self.addCleanup(remove_work, work)  # the children (engines shut down) have ended by then
        site = plugin_dist(os.path.join(work, "site"))
        env = {k: v for k, v in os.environ.items()
               if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_SIM_MULTI_NUMA",
                            "FRAGMENTS_VLLM_DIR", "FRAGMENTS_VLLM_CPU_DEFAULTS")}
        env.update(FRAG_WORK=work, PYTHONPATH=os.pathsep.join([site, env.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True,
                              text=True, timeout=600)
        lines = [l for l in proc.stderr.splitlines() if l.startswith("fragments: vLLM CPU build:")]
        saved = next((l for l in proc.stdout.splitlines() if l.startswith("SAVED ")), None)
        print("\n".join(lines + [str(saved)]))
        self.assertEqual(len(lines), 1, "the plugin says what it set, in one line, once")
        self.assertEqual(saved, "SAVED (3, 512) None", proc.stderr[-3000:])
        from fragments.vllm import _numa_nodes
        if _numa_nodes() > 1:
            return  # vLLM's own binding can serve tp 2 here: nothing to contrast
        # the same without the plugin's settings: vLLM stops at engine start, as a new user saw it
        env["FRAGMENTS_VLLM_CPU_DEFAULTS"] = "0"
        off = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env, capture_output=True,
                             text=True, timeout=600)
        self.assertIsNone(next((l for l in off.stdout.splitlines() if l.startswith("SAVED ")), None))
        self.assertIn("Not enough allowed NUMA nodes", off.stderr, off.stderr[-2000:])


class CpuDefaultsTest(unittest.TestCase):
    """The KV cache is set wherever free memory is under vLLM's reservation plus the margin its workers' own start
    takes (2026-12-07: 20.93 of 23.54 GiB free, 0.889, passed the plugin's 0.9 and stopped vLLM at 0.92)."""

    def decide(self, total, available):
        from unittest import mock
        import fragments.vllm as fv
        env = {k: v for k, v in os.environ.items()
               if k not in ("VLLM_CPU_KVCACHE_SPACE", "FRAGMENTS_VLLM_CPU_DEFAULTS")}
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"  # the NUMA branch out of the way
        with mock.patch.dict(os.environ, env, clear=True), \
                mock.patch.object(fv, "_memory_gib", return_value=(total, available)), \
                mock.patch.object(fv, "_default_reservation", return_value=0.92), \
                mock.patch("vllm.platforms.current_platform") as platform:
            platform.is_cpu.return_value = True
            fv._cpu_defaults()
            return os.environ.get("VLLM_CPU_KVCACHE_SPACE")

    def test_the_kv_cache_is_set_below_the_reservation_and_its_margin(self):
        import importlib.util
        if importlib.util.find_spec("vllm") is None:
            print("SKIPPED CpuDefaultsTest: vllm is not installed (tools/install_deps.sh)", file=sys.stderr)
            self.skipTest("vllm is not installed")
        self.assertEqual(self.decide(23.54, 20.93), "5")  # the day it failed: a quarter of the free memory
        self.assertEqual(self.decide(100.0, 96.0), "24")  # 0.96 free: under 0.92 + 0.05
        self.assertIsNone(self.decide(100.0, 98.0))  # enough: vLLM's own default stays


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
        sys.stdout.flush()
        os._exit(0)
    unittest.main(verbosity=2)
