"""The streaming import (fragkit.checkpoint.stream) writes the same rank files as the materializing one.

The materializing import (the whole tp=1 model in memory, sliced by the layers' load_full_weights) is kept
behind export_checkpoint(_materialize=True); here both import the same checkpoints and every rank file's
tensors (parameters and buffers) must be equal bit for bit, with the same names, shapes and dtypes, at
several tp sizes, from float32 and bfloat16 checkpoints, and from the real SmolLM2 GGUF.

FRAG_SLOW=1 adds SmolLM2 at tp 3 (about a minute more) and tp 4 for every family.
"""
import json
import os
import unittest
import zipfile

import torch

import fragkit_testutil  # noqa: F401  (puts the repository root, which holds fragkit, on the path)
import fragkit  # noqa: F401
from checkpoint_testutil import WorkDirCase, hf_model, save_gguf, save_hf
from fragkit.checkpoint import CheckpointError, export_checkpoint, smollm2_gguf_path

SLOW = os.environ.get("FRAG_SLOW") == "1"


def rank_tensors(path):
    module = torch.jit.load(path)
    out = {"param:" + k: v for k, v in module.named_parameters()}
    out.update({"buffer:" + k: v for k, v in module.named_buffers()})
    return out


class StreamedEqualsMaterialized(WorkDirCase):
    def assert_same(self, source, tps, dtype=None, ep=False, expect_dtype=None):
        for tp in tps:
            with self.subTest(source=os.path.basename(source), tp=tp, dtype=dtype, ep=ep):
                a = self.path("streamed_tp%d" % tp)
                b = self.path("materialized_tp%d" % tp)
                streamed = export_checkpoint(source, tp, a, dtype=dtype, enable_expert_parallel=ep)
                materialized = export_checkpoint(source, tp, b, dtype=dtype, enable_expert_parallel=ep,
                                                 _materialize=True)
                self.assertEqual([os.path.basename(p) for p in streamed], ["rank%d.pt" % r for r in range(tp)])
                self.assertEqual(sorted(os.listdir(a)), sorted(os.listdir(b)))
                with open(os.path.join(a, "fragkit-model.json")) as f:
                    info = json.load(f)
                self.assertEqual(info["import"], "streaming")
                if expect_dtype:
                    self.assertEqual(info["dtype"], expect_dtype)
                ids = set()
                for ps, pm in zip(streamed, materialized):
                    ts, tm = rank_tensors(ps), rank_tensors(pm)
                    self.assertEqual(sorted(ts), sorted(tm))
                    for name in ts:
                        self.assertEqual(ts[name].dtype, tm[name].dtype, name)
                        self.assertEqual(ts[name].shape, tm[name].shape, name)
                        self.assertTrue(torch.equal(ts[name], tm[name]), "%s differs at rank %s" % (name, ps))
                        if expect_dtype and name.startswith("param:"):
                            self.assertEqual(str(ts[name].dtype), "torch." + expect_dtype, name)
                    extra = {"fragkit.json": ""}
                    torch.jit.load(ps, _extra_files=extra)
                    meta = json.loads(extra["fragkit.json"])
                    self.assertEqual((meta["tp_size"], meta["tp_rank"]), (tp, streamed.index(ps)))
                    ids.add(meta["export_id"])
                self.assertEqual(len(ids), 1, "every rank file of one export carries one export id")
                self.assertFalse([f for f in os.listdir(a) if f.endswith(".tmp")])

    def test_llama_tied_with_biases_fp32_checkpoint_at_tp_1_2_4(self):
        model, _ = hf_model("llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
        self.assert_same(save_hf(model, self.path("hf")), (1, 2, 4), expect_dtype="float32")

    def test_llama_fp32_checkpoint_imported_as_bf16(self):
        model, _ = hf_model("llama", num_key_value_heads=1)
        self.assert_same(save_hf(model, self.path("hf")), (1, 2), dtype="bfloat16", expect_dtype="bfloat16")

    def test_bf16_checkpoint_stays_bf16_by_default(self):
        model, _ = hf_model("qwen2")
        model = model.to(torch.bfloat16)
        folder = save_hf(model, self.path("hf"))
        self.assert_same(folder, (1, 2), expect_dtype="bfloat16")
        # asked for float32: the bf16 values exactly, widened
        self.assert_same(folder, (2,), dtype="float32", expect_dtype="float32")

    def test_qwen2_moe_tp_and_ep(self):
        model, _ = hf_model("qwen2_moe")
        folder = save_hf(model, self.path("hf"))
        self.assert_same(folder, (1, 2, 4) if SLOW else (2,))
        self.assert_same(folder, (2,), ep=True)

    def test_mixtral_tp_and_ep_bf16(self):
        model, _ = hf_model("mixtral")
        folder = save_hf(model.to(torch.bfloat16), self.path("hf"))
        self.assert_same(folder, (1, 2, 4) if SLOW else (2,), expect_dtype="bfloat16")
        self.assert_same(folder, (2,), ep=True)

    def test_gguf_llama_permuted_qk(self):
        model, config = hf_model("llama", tie_word_embeddings=False)
        self.assert_same(save_gguf(model, config, self.path("m.gguf")), (1, 2))

    def test_jobs_write_the_same_files_and_a_memory_budget_is_enforced(self):
        model, _ = hf_model("mixtral")
        folder = save_hf(model, self.path("hf"))
        one = export_checkpoint(folder, 4, self.path("jobs1"))
        two = export_checkpoint(folder, 4, self.path("jobs2"), jobs=2)
        for a, b in zip(one, two):
            ta, tb = rank_tensors(a), rank_tensors(b)
            self.assertEqual(sorted(ta), sorted(tb))
            for name in ta:
                self.assertTrue(torch.equal(ta[name], tb[name]), name)
        with open(self.path("jobs2", "fragkit-model.json")) as f:
            info = json.load(f)
        self.assertEqual(info["jobs"], 2)
        self.assertFalse([f for f in os.listdir(self.path("jobs2")) if f.endswith(".tmp")])
        with self.assertRaisesRegex(CheckpointError, r"2 job\(s\) are predicted to need [0-9.]+ GB of memory, over "
                                                     r"the budget of 1.00 GB"):
            export_checkpoint(folder, 4, self.path("budget"), jobs=2, memory_budget_gb=1.0)
        self.assertFalse(os.path.exists(self.path("budget")))

    def test_smollm2(self):
        try:
            smollm2_gguf_path()
        except CheckpointError as e:
            self.skipTest("SKIPPED LOUDLY: %s" % e)
        # Q4_1: quantized, so float32 by default
        self.assert_same("smollm2", (1, 3) if SLOW else (1,), expect_dtype="float32")


def data_records(path):
    """name -> bytes of each storage record (data/N) of a TorchScript file."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: i.file_size for i in z.infolist() if "/data/" in i.filename}


def data_records_pt2(path):
    with zipfile.ZipFile(path) as z:
        return sorted((i.filename.split("/", 1)[1], i.file_size) for i in z.infolist() if "/data/weights/" in i.filename)


def rotary_modules(module):
    return [m for name, m in module.named_modules() if name.endswith("rotary_emb")]


class StoredOnce(WorkDirCase):
    """Issue 30 item 4: a rank file holds each tensor once -- a tied head is the embedding's record, and the
    layers share one rotary table -- from either import; files written the earlier way still load alike."""

    def check_rank_file(self, path, tied):
        module = torch.jit.load(path)
        tables = {m.cos_sin_cache.data_ptr() for m in rotary_modules(module)}
        self.assertEqual(len(rotary_modules(module)), 3)
        self.assertEqual(len(tables), 1, "one rotary table for all layers")
        same = module.lm_head.weight.data_ptr() == module.model.embed_tokens.weight.data_ptr()
        self.assertEqual(same, tied)
        distinct = {t.data_ptr(): t.numel() * t.element_size() for t in
                    list(module.parameters()) + list(module.buffers())}
        records = data_records(path)
        self.assertEqual(len(records), len(distinct), "one record per distinct tensor")
        self.assertEqual(sum(records.values()), sum(distinct.values()))
        return module

    def test_tied_head_and_rotary_table_once_at_tp_1_2(self):
        for tied in (True, False):
            model, _ = hf_model("llama", tie_word_embeddings=tied, num_hidden_layers=3)
            hf = save_hf(model, self.path("hf_%s" % tied))
            for tp in (1, 2):
                for materialize in (False, True):
                    with self.subTest(tied=tied, tp=tp, materialize=materialize):
                        out = self.path("out_%s_%d_%s" % (tied, tp, materialize))
                        for p in export_checkpoint(hf, tp, out, _materialize=materialize):
                            self.check_rank_file(p, tied)

    def test_export_format_tied_head_once_and_no_whole_storage_of_a_view(self):
        model, _ = hf_model("llama", tie_word_embeddings=True)
        hf = save_hf(model, self.path("hf"))
        streamed = export_checkpoint(hf, 2, self.path("s"), format="export")
        materialized = export_checkpoint(hf, 2, self.path("m"), format="export", _materialize=True)
        for a, b in zip(streamed, materialized):
            weights = [data_records_pt2(p) for p in (a, b)]
            self.assertEqual(weights[0], weights[1], "the same weight records, of the same sizes")
            state = torch.export.load(a).state_dict
            self.assertEqual(state["lm_head.weight"].data_ptr(), state["model.embed_tokens.weight"].data_ptr())
            for name, t in torch.export.load(b).state_dict.items():
                self.assertTrue(torch.equal(state[name], t), name)

    def test_a_rank_file_written_the_earlier_way_loads_and_computes_alike(self):
        model, _ = hf_model("llama", tie_word_embeddings=True, num_hidden_layers=3)
        [path] = export_checkpoint(save_hf(model, self.path("hf")), 1, self.path("new"))
        new = self.check_rank_file(path, tied=True)
        old = torch.jit.load(path)  # made as before: the head its own copy, a table per layer
        old.lm_head.weight = old.model.embed_tokens.weight.clone()
        for rotary in rotary_modules(old):
            rotary.cos_sin_cache = rotary.cos_sin_cache.clone()
        old.save(self.path("old.pt"))
        old = torch.jit.load(self.path("old.pt"))
        self.assertEqual(len(data_records(self.path("old.pt"))), len(data_records(path)) + 1 + 2)
        self.assertGreater(os.path.getsize(self.path("old.pt")), os.path.getsize(path))
        ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
        self.assertTrue(torch.equal(old(ids), new(ids)))


if __name__ == "__main__":
    unittest.main()
