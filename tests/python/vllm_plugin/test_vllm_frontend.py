"""fragments.vllm.VLLM behaves as fragments.load and LanguageModel do (issue 41, item 5; their side:
tests/python/frontend/backends_test.py, whose functions run here unchanged):

  - the module tree in `repr` (the same lines for the same Llama modules) and in `dir()`;
  - `locations()` with the fields of `frag inspect --json` (fragments.inspect/1), the rank-local location
    among them;
  - generation with fragments.load's options (max_new_tokens, temperature, top_p, seed, eos_token_id) and its
    scopes (`gen.decode()`): seeded sampling repeats, greedy `max_new_tokens` is vLLM's `max_tokens`;
  - the same mistake reads the same text as on fragments.load's model, at the user's file:line.

One engine: vLLM's CPU build at tp 2 on families.py's tiny Llama (~1-3 min on 2 shared cores), after
fragments.load's ranks over tests/models/llama_tp2 give the reference. Skipped, loudly, without vLLM or _C.
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("FRAG_TEST_ROOT", os.getcwd())
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python", "frontend"))


from test_vllm_plugin import _missing  # noqa: E402  (the one check of what the vLLM tests need)


def _engine(work):
    """VLLM at tp 2 over the tiny Llama, with the plugin's entry points on the path (as trace_check.py)."""
    from vllm_check import plugin_dist
    site = plugin_dist(os.path.join(work, "site"))
    sys.path.insert(0, site)
    os.environ["PYTHONPATH"] = site + os.pathsep + os.environ.get("PYTHONPATH", "")
    import engine_env
    engine_env.setup(2)
    import families
    from fragments.vllm import VLLM
    folder = os.path.join(work, "model")
    families.write_checkpoint("llama", folder)
    return VLLM(folder, tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                enable_prefix_caching=False, max_num_seqs=8, seed=0)


@unittest.skipIf(_missing(), _missing() or "")
class VllmFrontendTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import fragments
        import backends_test
        cls.bt = backends_test
        cls.local = fragments.launch(backends_test.local_rank, world=2,
                                     args=(os.path.join(backends_test.TP2, "rank{rank}.pt"),))[0]
        from vllm_check import remove_work, work_folder
        work = work_folder("frag-vllm-frontend-")
        cls.addClassCleanup(remove_work, work)  # after tearDownClass (the engine closed), or a failed setUpClass
        cls.model = _engine(work)
        prompt = backends_test.IDS[0]
        cls.mistakes = backends_test.mistakes(cls.model, lambda: cls.model.trace(prompt))

    @classmethod
    def tearDownClass(cls):
        cls.model.close()

    def test_the_module_tree_in_repr_and_dir(self):
        tree = [line.strip() for line in repr(self.model).splitlines()]
        local = [line.strip() for line in self.local["repr"].splitlines()]
        for line in ("(qkv_proj) QKVParallelLinear  [.input, .output]",
                     "(down_proj) RowParallelLinear  [.input, .output]",
                     "(embed_tokens) VocabParallelEmbedding  [.input, .output]"):
            self.assertIn(line, local)
            self.assertIn(line, tree)
        # vLLM shares one rotary module among the layers and names it under layer 0 only, so its layers are
        # not written once as fragments.load's are: each is there, in order
        self.assertIn("(0-1: 2 x) LlamaDecoderLayer  [.input, .output]", local)
        layers = [line for line in tree if line.endswith(") LlamaDecoderLayer  [.input, .output]")]
        self.assertEqual(layers, ["(0) LlamaDecoderLayer  [.input, .output]",
                                  "(1) LlamaDecoderLayer  [.input, .output]"])
        self.assertTrue(tree[0].startswith("<fragments.vllm.VLLM tp=2"), tree[0])
        names = dir(self.model.model.layers[0])
        for name in ("self_attn", "mlp", "input", "output", "inputs"):
            self.assertIn(name, names)
        self.assertIn("heads", dir(self.model.model.layers[0].self_attn.o_proj.input))

    def test_locations_have_inspects_fields(self):
        here, local = self.model.locations(), self.local["locations"]
        self.assertEqual(here["format"], local["format"])
        self.assertEqual(set(here) | {"files"}, set(local))
        self.assertEqual(here["tp_size"], 2)
        self.assertIn(self.bt.RANK_LOCAL, [r["location"] for r in here["rank_local"]])
        self.assertIn("model.layers.1.output", here["whole"])
        self.assertIn("model.layers.0.self_attn.qkv_proj.output",
                      [f["location"] for f in here["fragmented"]])

    def _generate(self, max_new_tokens, **options):
        """fragments.load's call: its option names and a decode-only edit scope; the tokens and a save."""
        import torch
        L = self.model.model.layers
        with self.model.generate(self.bt.IDS[0], max_new_tokens=max_new_tokens, **options) as gen:
            with gen.decode():
                L[0].mlp.down_proj.output[...] += 0.25
            saved = L[1].mlp.down_proj.input.save()
        self.assertIsInstance(saved.value, torch.Tensor)
        return list(gen.output.outputs[0].token_ids), saved.value

    def test_fragments_load_generation_options(self):
        import torch
        sampled = dict(temperature=0.9, top_p=0.8, seed=3, eos_token_id=999)  # 999: past the vocab, never met
        tokens, saved = self._generate(4, **sampled)
        again, saved_again = self._generate(4, **sampled)
        self.assertEqual(len(tokens), 4)
        self.assertEqual(tokens, again, "seeded sampling repeats")
        self.assertTrue(torch.equal(saved, saved_again))
        greedy, _ = self._generate(3)
        with self.model.generate(self.bt.IDS[0], max_tokens=3) as gen:  # vLLM's own name for the same
            pass
        self.assertEqual(greedy, list(gen.output.outputs[0].token_ids))
        stopped, _ = self._generate(3, eos_token_id=greedy[1])  # stops after it, the token kept (as fragments.load)
        self.assertEqual(stopped, greedy[:greedy.index(greedy[1]) + 1])

    def test_the_same_mistake_reads_the_same(self):
        for name, (text, line) in self.local["mistakes"].items():
            text_v, line_v = self.mistakes[name]
            self.assertEqual(text_v, text, name)
            if name != "unknown_module":  # (an attribute error has no step, so no line)
                self.assertTrue(line_v and line_v.rsplit(":", 1)[0].endswith("backends_test.py"), f"{name}: {line_v}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
