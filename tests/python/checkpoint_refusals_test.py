"""Refusals of the streaming import, each one line naming the file and the tensor, with nothing left behind;
--dry-run; fragkit.synthetic folders.

The disk-space cases mount a small tmpfs (root only): without the privilege they are skipped loudly.
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

import fragkit_testutil  # noqa: F401  (puts the repository root, which holds fragkit, on the path)
import fragkit  # noqa: F401
from checkpoint_testutil import hf_model, logits_of, relative, save_hf
from fragkit.checkpoint import CheckpointError, export_checkpoint
from fragkit.synthetic import like_config, tensor_shapes, write_synthetic

KIT_ROOT = os.path.dirname(os.path.dirname(fragkit.__file__))


class Case(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)  # cleanups run last-in first-out: after the tmpfs is unmounted
        self.work = self.tmp.name

    def path(self, *parts):
        return os.path.join(self.work, *parts)

    def refused(self, source, out=None, tp=2, **kw):
        out = out or self.path("out")
        with self.assertRaises(CheckpointError) as ctx:
            export_checkpoint(source, tp, out, **kw)
        message = str(ctx.exception)
        self.assertNotIn("\n", message)
        left = os.listdir(out) if os.path.isdir(out) else []
        self.assertEqual(left, [], "nothing may be left behind: %s" % left)
        return message


class Refusals(Case):
    def test_truncated_shard_names_the_file_and_the_first_tensor_cut_off(self):
        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
        victim = os.path.join(folder, shards[-1])
        size = os.path.getsize(victim)
        with open(victim, "r+b") as f:
            f.truncate(size - 1000)
        message = self.refused(folder)
        self.assertIn("%s: truncated: tensor " % victim, message)
        self.assertIn("1000 bytes missing", message)

    def test_index_naming_a_missing_shard(self):
        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        shard = weight_map["model.norm.weight"]
        os.remove(os.path.join(folder, shard))
        message = self.refused(folder)
        self.assertIn("model.safetensors.index.json maps tensor ", message)
        self.assertIn("to %s, which is not in the folder" % shard, message)

    def test_an_index_that_is_not_json_names_the_file(self):
        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        index = os.path.join(folder, "model.safetensors.index.json")
        for text in (b"{not json", b"\xff\xfe binary", b"[1, 2]"):
            with open(index, "wb") as f:
                f.write(text)
            message = self.refused(folder)
            self.assertIn(index, message)
            self.assertTrue("not JSON" in message or "weight_map" in message, message)

    def test_a_tensor_whose_dtype_disagrees_with_the_config(self):
        from safetensors.torch import load_file, save_file

        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"), shard_size="100GB")
        file = os.path.join(folder, "model.safetensors")
        state = load_file(file)
        state["model.layers.1.mlp.down_proj.weight"] = state["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16)
        save_file(state, file, metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        self.assertEqual(cfg.get("torch_dtype", cfg.get("dtype")), "float32")
        message = self.refused(folder)
        self.assertIn("%s: tensor model.layers.1.mlp.down_proj.weight is bfloat16, config.json says torch_dtype "
                      "float32" % file, message)

    def test_a_tensor_whose_shape_disagrees_with_the_config(self):
        from safetensors.torch import load_file, save_file

        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"), shard_size="100GB")
        file = os.path.join(folder, "model.safetensors")
        state = load_file(file)
        state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
        save_file(state, file, metadata={"format": "pt"})
        message = self.refused(folder)
        self.assertIn("model.layers.0.self_attn.k_proj.weight", message)
        self.assertIn("model.layers.0.self_attn.qkv_proj.weight a shape (144, 64), the model expects (128, 64)",
                      message)

    def test_an_existing_output_folder_keeps_its_files_and_gets_no_new_ones(self):
        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        os.remove(os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]))
        out = self.path("existing")
        os.makedirs(out)
        with open(os.path.join(out, "notes.txt"), "w") as f:
            f.write("mine")
        with self.assertRaises(CheckpointError):
            export_checkpoint(folder, 2, out)
        self.assertEqual(os.listdir(out), ["notes.txt"])


class SmallDisk(Case):
    """A 1 MB tmpfs: the tiny llama's tp 2 files need ~1.4 MB."""

    def setUp(self):
        super().setUp()
        self.disk = self.path("disk")
        os.makedirs(self.disk)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", self.disk], capture_output=True,
                              text=True)
        if done.returncode != 0:
            self.skipTest("SKIPPED LOUDLY: cannot mount a small tmpfs (%s): the full-disk cases need root"
                          % done.stderr.strip())
        self.addCleanup(subprocess.run, ["umount", self.disk])
        model, _ = hf_model("llama")
        self.folder = save_hf(model, self.path("hf"))

    def test_not_enough_free_space_is_refused_before_writing(self):
        for format in ("torchscript", "export"):
            with self.subTest(format=format):
                message = self.refused(self.folder, out=os.path.join(self.disk, "out"), format=format)
                self.assertRegex(message, r"writing 2 rank file\(s\) needs [0-9.]+ GB, the device of .* has [0-9.]+ "
                                          r"GB free")
                self.assertEqual(os.listdir(self.disk), [])

    def test_a_disk_that_fills_up_midway_leaves_nothing(self):
        # The space check skipped, as when another process fills the disk during the import. A .pt2 rank
        # (--format export, ~0.53 MB here) is written through a Python file object: a short or failed write
        # must surface too, not leave a truncated archive.
        for format, suffix in (("torchscript", "pt"), ("export", "pt2")):
            with self.subTest(format=format):
                message = self.refused(self.folder, out=os.path.join(self.disk, "out"), _check_space=False,
                                       format=format)
                # The file, and the tensor (or other record) being written when the disk was full.
                self.assertRegex(message, r"^%s/out/rank\d\.%s: writing \S+ failed \(.*\d+ bytes "
                                          r"free on the device\): nothing is left behind$" % (self.disk, suffix))
                self.assertEqual(os.listdir(self.disk), [])


class DryRunAndSynthetic(Case):
    def test_dry_run_of_a_405b_shaped_config_writes_nothing(self):
        out = self.path("out")
        done = subprocess.run([sys.executable, "-m", "fragkit.checkpoint", "--dry-run", "--like", "llama3-405b",
                               "--layers", "4", "--tp", "8", "--out", out], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=KIT_ROOT))
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertFalse(os.path.exists(out))
        self.assertIn("rank7.pt", done.stdout)
        self.assertIn("predicted peak memory of the import", done.stdout)

    def test_dry_run_bytes_are_the_written_bytes(self):
        from fragkit.checkpoint import plan

        model, _ = hf_model("qwen2_moe")
        folder = save_hf(model, self.path("hf"))
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        predicted = plan.dry_run(cfg, folder, 2)
        paths = export_checkpoint(folder, 2, self.path("out"))
        for r, p in enumerate(paths):
            size = os.path.getsize(p)
            # parameters and buffers exactly, plus the zip's headers, code and pickles (under 1 MB + 256 B a record)
            self.assertLessEqual(size, predicted["rank_bytes"][r])
            self.assertGreaterEqual(size, predicted["rank_bytes"][r] - (1 << 20) - 256 * 400)

    def test_synthetic_folder_matches_transformers_and_imports(self):
        import transformers
        from safetensors import safe_open

        cfg = like_config("qwen2-moe-a14b", layers=2, dtype="float32")
        cfg.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                   num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=1000, max_position_embeddings=128)
        folder = self.path("synth")
        shards = write_synthetic(cfg, folder, seed=3, dtype="float32", shard_gb=0.0005)
        self.assertGreater(len(shards), 1)
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            weight_map = json.load(f)["weight_map"]
        # What transformers' own save_pretrained writes for this config (hub names, per-expert tensors).
        config = transformers.AutoConfig.from_pretrained(folder)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(self.path("hf"))
        expected = {}
        for f in os.listdir(self.path("hf")):
            if f.endswith(".safetensors"):
                with safe_open(self.path("hf", f), framework="pt") as h:
                    expected.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
        got = {}
        for shard in shards:
            with safe_open(shard, framework="pt") as h:
                for k in h.keys():
                    got[k] = tuple(h.get_slice(k).get_shape())
                    self.assertEqual(weight_map[k], os.path.basename(shard))
        self.assertEqual(got, expected)
        self.assertEqual(dict(tensor_shapes(cfg)), got)
        again = write_synthetic(cfg, self.path("again"), seed=3, dtype="float32", shard_gb=0.0005)
        other = write_synthetic(cfg, self.path("other"), seed=4, dtype="float32", shard_gb=0.0005)
        with open(shards[0], "rb") as a, open(again[0], "rb") as b, open(other[0], "rb") as c:
            first = a.read()
            self.assertEqual(first, b.read(), "a seed writes the same bytes")
            self.assertNotEqual(first, c.read())
        reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        ids = torch.tensor([[1, 17, 300, 999, 42, 5]])
        paths = export_checkpoint(folder, 1, self.path("out"))
        with torch.no_grad():
            ours = torch.jit.load(paths[0])(ids)
        self.assertLessEqual(relative(ours, logits_of(reference, ids)), 1e-4)


if __name__ == "__main__":
    unittest.main()
