"""The streaming ``--format export`` import (fragkit.checkpoint.pt2 + stream.write_ranks) writes the materializing
import's .pt2 rank files.

Each rank's program is traced from fake weights and saved as a skeleton whose empty weight records the
writer fills from the checkpoint, tensor by tensor. Against the materializing import (the whole tp=1 model
in memory, each rank filled and exported by fragkit.export.export_ranks) of the same checkpoint:

- with CRC-32s (``crc32=True``, as torch.export.save writes them) the files are the same byte for byte but
  for the export id in extra/fragkit.json (a digest of the weights there, of the checkpoint's identity
  here; same length) and the CRCs that cover it: the same records in the same order at the same offsets,
  every record's bytes equal;
- by default (no CRC-32) every tensor is equal, and the ranks compute the same logits through the Python
  API (torch.export.load; at tp > 1 in gloo processes running the kit's collectives), which at tp 1 and 2
  also equal Hugging Face transformers' (fp32).

FRAG_SLOW=1 adds tp 4 (and tp 1 for the byte comparison) and three cases the default tier skips (slow_tier.py, for
CI time): bf16 (the streaming import's dtypes), GGUF with --jobs and Qwen2-MoE (tp and ep), each of which
checkpoint_stream_test.py runs through the same writer path with TorchScript ranks; the .pt2 writer keeps the
Llama case (byte for byte, logits against transformers) in the default tier.
"""
import contextlib
import json
import os
import tempfile
import unittest
from unittest import mock
import zipfile

import torch
import torch.multiprocessing as mp

import fragkit_testutil as U
import fragkit_tp_worker
from checkpoint_testutil import WorkDirCase, hf_model, logits_of, relative, save_gguf, save_hf
from fragkit.checkpoint import CheckpointError, export_checkpoint
from slow_tier import slow_tier

SLOW = os.environ.get("FRAG_SLOW") == "1"
EXTRA = "extra/fragkit.json"
SERIALIZATION_ID = ".data/serialization_id"  # the writer's digest of the records' CRCs


def records(path):
    reader = torch._C.PyTorchFileReader(path)
    return {name: bytes(reader.get_record(name)) for name in reader.get_all_records()}


def zip_entries(path):
    with zipfile.ZipFile(path) as z:
        return [(i.filename, i.header_offset, i.file_size, i.compress_type, i.CRC) for i in z.infolist()]


def pt2_tensors(path):
    program = torch.export.load(path)
    out = {"state:" + k: v for k, v in program.state_dict.items()}
    out.update({"constant:" + k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)})
    return out


class StreamedPt2(WorkDirCase):
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 999, 0], [4, 4, 500, 1, 2, 3, 6, 8]])

    def export(self, source, tp, name, **kw):
        out = self.path(name)
        paths = export_checkpoint(source, tp, out, format="export", **kw)
        self.assertEqual([os.path.basename(p) for p in paths], ["rank%d.pt2" % r for r in range(tp)])
        left = [f for f in os.listdir(out) if f.endswith(".tmp")]
        self.assertEqual(left, [], "no temporary or skeleton file left behind")
        return paths

    def assert_bytes_equal_but_the_export_id(self, streamed, materialized):
        rs, rm = records(streamed), records(materialized)
        self.assertEqual(list(rs), list(rm), "the same records in the same order")
        for name in rm:
            if name == EXTRA:
                a, b = json.loads(rs[name]), json.loads(rm[name])
                self.assertEqual(len(a.pop("export_id")), len(b.pop("export_id")))
                self.assertEqual(a, b, "fragkit.json but for the export id")
            elif name != SERIALIZATION_ID:
                self.assertEqual(rs[name], rm[name], "record %s of %s" % (name, streamed))
        zs, zm = zip_entries(streamed), zip_entries(materialized)
        for (es, em) in zip(zs, zm):
            if es[0].endswith((EXTRA, SERIALIZATION_ID)):
                es, em = es[:-1], em[:-1]  # their CRCs cover the export id
            self.assertEqual(es, em, "zip entry (name, offset, size, method, CRC)")
        self.assertEqual(len(zs), len(zm))
        self.assertEqual(os.path.getsize(streamed), os.path.getsize(materialized))
        weights = [n for n in rm if n.startswith("data/weights/weight_")]
        self.assertTrue(weights and all(len(rs[n]) > 0 for n in weights), "the weight records are filled")

    def assert_tensors_equal(self, streamed, materialized, dtype=None):
        ts, tm = pt2_tensors(streamed), pt2_tensors(materialized)
        self.assertEqual(sorted(ts), sorted(tm))
        for name in tm:
            self.assertEqual((ts[name].dtype, ts[name].shape), (tm[name].dtype, tm[name].shape), name)
            self.assertTrue(torch.equal(ts[name], tm[name]), "%s differs in %s" % (name, streamed))
            if dtype is not None and name.startswith("state:"):
                self.assertEqual(ts[name].dtype, dtype, name)

    def logits(self, dirs, tp):
        """{dir: logits} of each folder's ranks on ``ids`` (rank 0's; every rank returns the whole logits)."""
        if tp == 1:
            with torch.no_grad():
                return {d: torch.export.load(os.path.join(d, "rank0.pt2")).module()(self.ids) for d in dirs}
        out_dir = tempfile.mkdtemp(prefix="logits_tp%d_" % tp, dir=self.work)
        inputs = os.path.join(out_dir, "inputs.pt")
        torch.save([self.ids], inputs)
        cases = [{"name": "case%d" % i, "dir": d, "inputs": inputs, "format": "export"} for i, d in enumerate(dirs)]
        mp.spawn(fragkit_tp_worker.run_rank, nprocs=tp, join=True, args=(tp, U.free_port(), cases, out_dir, U.KIT_ROOT))
        result = {}
        for i, d in enumerate(dirs):
            per_rank = [torch.load(os.path.join(out_dir, "case%d.rank%d.pt" % (i, r))) for r in range(tp)]
            for r in range(1, tp):
                self.assertTrue(torch.equal(per_rank[r], per_rank[0]), "rank %d's logits differ from rank 0's" % r)
            result[d] = per_rank[0]
        return result

    def check(self, source, tps, dtype=None, ep=False, hf=None, expect_dtype=None):
        for tp in tps:
            with self.subTest(source=os.path.basename(source), tp=tp, dtype=dtype, ep=ep):
                kw = dict(dtype=dtype, enable_expert_parallel=ep)
                streamed = self.export(source, tp, "streamed_%s_%d_%s" % (dtype, tp, ep), **kw)
                materialized = self.export(source, tp, "materialized_%s_%d_%s" % (dtype, tp, ep), _materialize=True,
                                           **kw)
                with open(os.path.join(os.path.dirname(streamed[0]), "fragkit-model.json")) as f:
                    info = json.load(f)
                self.assertEqual((info["import"], info["rank_format"]), ("streaming", "export"))
                ids = set()
                for r, (a, b) in enumerate(zip(streamed, materialized)):
                    self.assert_tensors_equal(a, b, expect_dtype)
                    extra = json.loads(records(a)[EXTRA])
                    self.assertEqual((extra["tp_size"], extra["tp_rank"]), (tp, r))
                    ids.add(extra["export_id"])
                self.assertEqual(len(ids), 1, "one export id for every rank of one export")
                self.pending.append((tp, os.path.dirname(streamed[0]), os.path.dirname(materialized[0]), hf))

    def setUp(self):
        super().setUp()
        self.pending = []  # (tp, streamed folder, materialized folder, transformers model or None)

    def run_pending(self):
        """The logits of every checked folder: one group of rank processes per tp."""
        for tp in sorted({p[0] for p in self.pending}):
            cases = [p for p in self.pending if p[0] == tp]
            logits = self.logits([d for p in cases for d in p[1:3]], tp)
            for _, streamed, materialized, hf in cases:
                with self.subTest(logits=os.path.basename(streamed)):
                    self.assertTrue(torch.equal(logits[streamed], logits[materialized]),
                                    "%s: the streamed files' logits differ from the materialized files'" % streamed)
                    if hf is not None:
                        rel = relative(logits[streamed], logits_of(hf, self.ids))
                        self.assertLess(rel, 1e-5, "%s vs transformers: %.3g" % (streamed, rel))
        self.pending.clear()

    def test_llama_tied_with_biases_fp32_byte_for_byte_at_tp_1_2_4(self):
        model, _ = hf_model("llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
        folder = save_hf(model, self.path("hf"))
        for tp in (1, 2, 4) if SLOW else (2,):
            with self.subTest(tp=tp):
                streamed = self.export(folder, tp, "crc_%d" % tp, crc32=True)
                materialized = self.export(folder, tp, "mat_%d" % tp, _materialize=True)
                for a, b in zip(streamed, materialized):
                    self.assert_bytes_equal_but_the_export_id(a, b)
                    state = torch.export.load(a).state_dict  # the tied head is the embedding's record
                    self.assertEqual(state["lm_head.weight"].data_ptr(), state["model.embed_tokens.weight"].data_ptr())
        self.check(folder, (1, 2), hf=model, expect_dtype=torch.float32)
        self.run_pending()

    @slow_tier("the streaming import's dtypes stay in the default tier in checkpoint_stream_test.py (bf16 kept, "
               "fp32 as bf16), the .pt2 writer in this file's Llama and Qwen2-MoE cases")
    def test_bf16_checkpoint_stays_bf16_and_fp32_imported_as_bf16(self):
        model, _ = hf_model("qwen2")
        self.check(save_hf(model.to(torch.bfloat16), self.path("hf_bf16")), (1, 2, 4) if SLOW else (2,),
                   expect_dtype=torch.bfloat16)
        model, _ = hf_model("llama", num_key_value_heads=1)
        self.check(save_hf(model, self.path("hf_fp32")), (2,), dtype="bfloat16", expect_dtype=torch.bfloat16)
        self.run_pending()

    @slow_tier("Qwen2-MoE through the streaming import (tp and ep) stays in the default tier in "
               "checkpoint_stream_test.py (test_qwen2_moe_tp_and_ep, test_mixtral_tp_and_ep_bf16), the .pt2 writer "
               "in this file's Llama case")
    def test_moe_tp_and_ep(self):
        model, _ = hf_model("qwen2_moe")
        folder = save_hf(model, self.path("hf"))
        self.check(folder, (2, 4) if SLOW else (2,), hf=model)
        self.check(folder, (2,), ep=True)
        self.run_pending()

    @slow_tier("GGUF and --jobs through the streaming import stay in the default tier in checkpoint_stream_test.py "
               "(test_gguf_llama_permuted_qk, test_jobs_write_the_same_files...), the .pt2 writer in this file's "
               "Llama and Qwen2-MoE cases")
    def test_gguf_and_jobs(self):
        model, config = hf_model("llama", tie_word_embeddings=False)
        gguf = save_gguf(model, config, self.path("m.gguf"))
        self.check(gguf, (2,))
        self.run_pending()
        tp = 4 if SLOW else 2
        one = self.export(gguf, tp, "jobs1")
        two = self.export(gguf, tp, "jobs2", jobs=2)
        for a, b in zip(one, two):
            self.assertEqual(records(a), records(b), "--jobs 2 writes the same files")


class ChangedTorch(WorkDirCase):
    """The private seam (pt2.py) guarded: a torch whose pt2 writer changed is refused in one line, before
    any rank file exists, rather than writing archives whose weights are in the wrong records."""

    def refused(self, folder):
        out = self.path("out")
        with self.assertRaises(CheckpointError) as ctx:
            export_checkpoint(folder, 2, out, format="export")
        self.assertFalse(os.path.exists(out), "nothing is left behind")
        message = str(ctx.exception)
        self.assertNotIn("\n", message)
        self.assertIn("relies on torch 2.11's pt2 archive writer, and torch %s differs" % torch.__version__, message)
        return message

    def test_group_weights_gone_or_fake_weights_in_one_record(self):
        from torch.export.pt2_archive import _package

        from fragkit.checkpoint import pt2

        model, _ = hf_model("llama")
        folder = save_hf(model, self.path("hf"))
        with mock.patch.object(_package, "group_weights", None):
            self.assertIn("group_weights is gone", self.refused(folder))
        # torch's own grouping: every fake weight of a dtype in one record
        with mock.patch.object(pt2, "fake_weights_grouped_by_identity", contextlib.nullcontext):
            self.assertRegex(self.refused(folder), r"the parameters \S+ and \S+ share the record data/weights/weight_0")


if __name__ == "__main__":
    unittest.main()
