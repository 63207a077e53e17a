"""python3 -m fragkit.checkpoint on Hugging Face folders and GGUF files of the Llama, Qwen2, Qwen2-MoE and
Mixtral families, against transformers' own forward of the same weights (float32, ≤ 1e-4 relative).

The checkpoints are tiny transformers models with seeded random weights (the real trained model is checked in
real_model_test.py); tp=1 runs in this process, tp=2 through `frag run --world 2`.
"""
import json
import os
import subprocess
import sys
import unittest

import torch
import torch.multiprocessing as mp

import fragkit_testutil  # noqa: F401  (puts the repository root, which holds fragkit, on the path)
import fragkit  # noqa: F401  (registers frag::all_reduce/all_gather for the tp=1 forward in this process)
import fragkit_tp_worker
from checkpoint_testutil import WorkDirCase, hf_model, logits_of, relative, save_gguf, save_hf
from fragkit.checkpoint import CheckpointError, export_checkpoint
from fragkit_testutil import frag_binary, free_port
from slow_tier import slow_tier

TOL = 1e-4
IDS = torch.tensor([[1, 17, 300, 999, 42, 5, 64, 700], [3, 3, 900, 12, 512, 6, 1, 0]])


def run_frag(folder: str, world: int, ids: torch.Tensor, work: str) -> torch.Tensor:
    from safetensors.torch import load_file

    frag = frag_binary()
    ids_file, out = os.path.join(work, "ids.txt"), os.path.join(work, "out.safetensors")
    with open(ids_file, "w") as f:
        f.write("\n".join(" ".join(map(str, r)) for r in ids.tolist()) + "\n")
    done = subprocess.run([frag, "run", "--world", str(world), os.path.join(folder, "rank{rank}.pt"), "--input",
                           ids_file, "--out", out, "--timeout", "120"], capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError("frag run failed: %s" % done.stderr)
    return load_file(out)["logits"]


class ImportCase(WorkDirCase):
    def assert_matches(self, source: str, reference_logits: torch.Tensor, tps=(1, 2), ep=False, dtype="float32",
                       tol=TOL):
        for tp in tps:
            out = self.path("tp%d%s" % (tp, "ep" if ep else ""))
            paths = export_checkpoint(source, tp, out, dtype=dtype, enable_expert_parallel=ep)
            self.assertEqual(paths, [os.path.join(out, "rank%d.pt" % r) for r in range(tp)])
            with open(os.path.join(out, "fragkit-model.json")) as f:
                info = json.load(f)
            self.assertEqual(info["tp_size"], tp)
            if tp == 1:
                with torch.no_grad():
                    ours = torch.jit.load(paths[0])(IDS)
            else:
                if frag_binary() is None:
                    self.skipTest("SKIPPED LOUDLY: no frag binary (set FRAG_BIN, or run under Bazel/CMake)")
                ours = run_frag(out, tp, IDS, self.work)
            worst = relative(ours.float(), reference_logits)
            self.assertLessEqual(worst, tol, "%s at tp=%d%s: %.2e" % (source, tp, " (ep)" if ep else "", worst))


class HuggingFaceFolders(ImportCase):
    def test_llama_gqa_tied_with_biases_and_llama3_rope_sharded_index(self):
        model, _ = hf_model("llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16})
        folder = save_hf(model, self.path("hf"))
        self.assertTrue(os.path.isfile(os.path.join(folder, "model.safetensors.index.json")), "expected shards")
        self.assert_matches(folder, logits_of(model, IDS))

    def test_llama_mqa_untied_linear_rope_replicates_kv_at_tp2(self):
        model, _ = hf_model("llama", num_key_value_heads=1, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0})
        self.assert_matches(save_hf(model, self.path("hf")), logits_of(model, IDS))

    def test_qwen2_with_qkv_biases(self):
        model, _ = hf_model("qwen2")
        self.assertIsNotNone(model.model.layers[0].self_attn.q_proj.bias)
        self.assert_matches(save_hf(model, self.path("hf")), logits_of(model, IDS))

    def test_qwen2_moe_shared_experts_and_a_dense_layer_tp_and_ep(self):
        model, _ = hf_model("qwen2_moe")
        folder = save_hf(model, self.path("hf"))
        self.assert_matches(folder, logits_of(model, IDS))
        self.assert_matches(folder, logits_of(model, IDS), tps=(2,), ep=True)

    def test_mixtral_tp_and_ep(self):
        model, _ = hf_model("mixtral")
        folder = save_hf(model, self.path("hf"))
        self.assert_matches(folder, logits_of(model, IDS))
        self.assert_matches(folder, logits_of(model, IDS), tps=(2,), ep=True)

    def test_bfloat16_import_is_the_float32_model_rounded(self):
        model, _ = hf_model("llama")
        # bf16 weights and activations: within a few bf16 roundings of the float32 reference.
        self.assert_matches(save_hf(model, self.path("hf")), logits_of(model, IDS), tps=(1,), dtype="bfloat16",
                            tol=0.05)

    def test_tokenizer_files_are_copied(self):
        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write('{"version": "1.0"}')
        export_checkpoint(folder, 1, self.path("out"))
        self.assertTrue(os.path.isfile(self.path("out", "tokenizer", "tokenizer.json")))
        with open(self.path("out", "fragkit-model.json")) as f:
            self.assertEqual(json.load(f)["tokenizer"], "tokenizer")


class TorchExportArchives(ImportCase):
    """--format export: the same import as torch.export archives (rank{r}.pt2); tp=2 runs its two ranks as
    processes over gloo with the kit's collectives."""

    @slow_tier("the same import (streaming, --format export, Llama with biases at tp 1 and 2, logits within "
               "1e-5 of transformers) stays in the default tier in checkpoint_pt2_stream_test.py's "
               "test_llama_tied_with_biases_fp32_byte_for_byte_at_tp_1_2_4")
    def test_llama_gqa_with_biases_as_pt2_at_tp1_and_tp2_equals_transformers(self):
        model, _ = hf_model("llama", attention_bias=True, mlp_bias=True)
        folder = save_hf(model, self.path("hf"))
        reference = logits_of(model, IDS)
        for tp in (1, 2):
            out = self.path("pt2_tp%d" % tp)
            paths = export_checkpoint(folder, tp, out, format="export")
            self.assertEqual(paths, [os.path.join(out, "rank%d.pt2" % r) for r in range(tp)])
            self.assertFalse(any(name.endswith(".pt") for name in os.listdir(out)), os.listdir(out))
            with open(os.path.join(out, "fragkit-model.json")) as f:
                self.assertEqual(json.load(f)["rank_format"], "export")
        with torch.no_grad():
            ours = torch.export.load(self.path("pt2_tp1", "rank0.pt2")).module()(IDS)
        self.assertLessEqual(relative(ours, reference), TOL, "tp=1 .pt2")
        inputs, results = self.path("inputs.pt"), self.path("results")
        os.makedirs(results)
        torch.save([IDS], inputs)
        case = {"name": "llama", "dir": self.path("pt2_tp2"), "inputs": inputs, "format": "export"}
        mp.spawn(fragkit_tp_worker.run_rank, nprocs=2, join=True,
                 args=(2, free_port(), [case], results, fragkit_testutil.KIT_ROOT))
        for r in range(2):
            ours = torch.load(os.path.join(results, "llama.rank%d.pt" % r))
            self.assertLessEqual(relative(ours, reference), TOL, "tp=2 .pt2, rank %d" % r)

    def test_an_unknown_format_is_refused_before_any_file_is_written(self):
        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        with self.assertRaisesRegex(CheckpointError, "format 'onnx' is not supported"):
            export_checkpoint(folder, 1, self.path("out"), format="onnx")
        self.assertFalse(os.path.exists(self.path("out")))


class GGUFFiles(ImportCase):
    """GGUF files written as llama.cpp lays them out. The reference is the transformers model the file was
    written from; where transformers' own GGUF loader reads the file completely (llama, qwen2) it must agree
    too, which checks the writer's layout independently of the importer. (transformers 5.24 ignores
    qwen2moe's expert sizes and reads no llama-architecture experts.)"""

    def transformers_from_gguf(self, path):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()

    def check(self, family, **overrides):
        model, config = hf_model(family, **overrides)
        path = save_gguf(model, config, self.path("m.gguf"))
        expected = logits_of(model, IDS)
        if family in ("llama", "qwen2"):
            self.assertLessEqual(relative(logits_of(self.transformers_from_gguf(path), IDS), expected), TOL,
                                 "the test's GGUF writer and transformers disagree")
        self.assert_matches(path, expected)

    def test_llama_untied_permuted_qk(self):
        self.check("llama", tie_word_embeddings=False)

    def test_llama_tied(self):
        self.check("llama", tie_word_embeddings=True)

    def test_qwen2(self):
        self.check("qwen2")

    def test_qwen2_moe(self):
        self.check("qwen2_moe", mlp_only_layers=[])  # llama.cpp's qwen2moe has no dense layers

    def test_mixtral(self):
        self.check("mixtral")


class Refusals(ImportCase):
    def refused(self, source, tp=1, **kw):
        with self.assertRaises(CheckpointError) as ctx:
            export_checkpoint(source, tp, self.path("out"), **kw)
        self.assertFalse(any(f.endswith(".pt") for f in os.listdir(self.path("out"))) if os.path.isdir(
            self.path("out")) else False, "no rank file may be left behind")
        return str(ctx.exception)

    def folder(self, family="llama", edit_config=None, **overrides):
        model, _ = hf_model(family, **overrides)
        folder = save_hf(model, self.path("hf"))
        if edit_config:
            with open(os.path.join(folder, "config.json")) as f:
                cfg = json.load(f)
            edit_config(cfg)
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(cfg, f)
        return folder

    def test_a_tp_that_does_not_divide_the_heads_names_the_layer_and_numbers(self):
        msg = self.refused(self.folder(), tp=3)
        self.assertIn("tp 3 does not divide the 4 attention heads", msg)
        self.assertIn("qkv_proj (QKVParallelLinear)", msg)

    def test_a_tp_that_does_not_divide_the_intermediate_size(self):
        msg = self.refused(self.folder(intermediate_size=100, num_attention_heads=8, num_key_value_heads=8,
                                       head_dim=8), tp=8)
        self.assertIn("tp 8 does not divide the intermediate size 100 of model.layers.*.mlp.gate_up_proj", msg)

    def test_kv_heads_neither_divisor_nor_multiple(self):
        msg = self.refused(self.folder(num_attention_heads=12, num_key_value_heads=3, head_dim=8, hidden_size=96),
                           tp=4)
        self.assertIn("neither a divisor nor a multiple of the 3 kv heads", msg)

    def test_padded_vocab(self):
        msg = self.refused(self.folder(num_attention_heads=5, num_key_value_heads=5, head_dim=8, hidden_size=40),
                           tp=5)
        self.assertIn("padded vocabulary 1024 (1000 padded to a multiple of 64)", msg)

    def test_unknown_config_field_is_refused_by_name_and_can_be_waived(self):
        folder = self.folder(edit_config=lambda c: c.update(my_new_scaling=3.0))
        self.assertIn("my_new_scaling", self.refused(folder))
        export_checkpoint(folder, 1, self.path("ok"), ignore_config_fields=["my_new_scaling"])

    def test_fields_that_change_the_math_are_refused(self):
        cases = {
            "hidden_act": (lambda c: c.update(hidden_act="gelu"), "hidden_act = 'gelu' is not supported"),
            "sliding": (lambda c: c.update(sliding_window=16), "sliding_window = 16"),
            "yarn": (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
                     "rope scaling of type 'yarn' is not supported"),
            "partial": (lambda c: c.update(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
            "type": (lambda c: c.update(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        }
        for name, (edit, expected) in cases.items():
            with self.subTest(name):
                self.tmp.cleanup()
                os.makedirs(self.work)
                self.assertIn(expected, self.refused(self.folder(edit_config=edit)))

    def test_missing_and_extra_tensors(self):
        from safetensors.torch import load_file, save_file

        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"), shard_size="100GB")
        file = os.path.join(folder, "model.safetensors")
        state = load_file(file)
        missing = dict(state)
        del missing["model.layers.1.mlp.up_proj.weight"]
        save_file(missing, file, metadata={"format": "pt"})
        self.assertIn("tensor model.layers.1.mlp.up_proj.weight is missing", self.refused(folder))
        extra = dict(state, **{"model.layers.0.self_attn.q_norm.weight": torch.ones(16)})
        save_file(extra, file, metadata={"format": "pt"})
        self.assertIn("model.layers.0.self_attn.q_norm.weight", self.refused(folder))

    def test_wrong_shape(self):
        from safetensors.torch import load_file, save_file

        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"), shard_size="100GB")
        file = os.path.join(folder, "model.safetensors")
        state = load_file(file)
        state["model.norm.weight"] = torch.ones(65)
        save_file(state, file, metadata={"format": "pt"})
        self.assertIn("gives model.norm.weight a shape (65,), the model expects (64,)", self.refused(folder))

    def test_not_a_checkpoint(self):
        os.makedirs(self.path("empty"))
        self.assertIn("no config.json", self.refused(self.path("empty")))
        with open(self.path("x.bin"), "wb") as f:
            f.write(b"PK\x03\x04 not gguf")
        self.assertIn("neither a Hugging Face model folder nor a GGUF file", self.refused(self.path("x.bin")))
        folder = self.folder()
        for f in os.listdir(folder):
            if f.endswith(".safetensors"):
                os.rename(os.path.join(folder, f), os.path.join(folder, f.replace(".safetensors", ".bin")))
        os.remove(os.path.join(folder, "model.safetensors.index.json"))
        self.assertIn("PyTorch pickles are not read", self.refused(folder))

    def test_command_line_error_is_one_line_and_exit_2(self):
        kit_root = os.path.dirname(os.path.dirname(fragkit.__file__))
        done = subprocess.run([sys.executable, "-m", "fragkit.checkpoint", "--from", self.path("nothing"), "--tp", "2",
                               "--out", self.path("out")], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=kit_root))
        self.assertEqual(done.returncode, 2)
        self.assertEqual(done.stderr.strip().count("\n"), 0, done.stderr)
        self.assertIn("fragkit.checkpoint: error: %s: no such file or folder" % self.path("nothing"), done.stderr)


if __name__ == "__main__":
    unittest.main()
