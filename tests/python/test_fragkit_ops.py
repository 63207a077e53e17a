"""The frag ops: schemas, scriptability, single-process behaviour."""
import os
import tempfile
import unittest

import fragkit_testutil as U  # noqa: F401
import torch

import fragkit
from fragkit import ops
from fragkit.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce


class _UsesOps(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = tensor_model_parallel_all_reduce(x)
        b = tensor_model_parallel_all_gather(x, 0)
        c = torch.ops.frag.all_reduce(x, "ep")
        return a + b + c


class OpsTest(unittest.TestCase):
    def test_schemas(self):
        self.assertEqual(ops.OP_SCHEMAS, [
            "frag::all_reduce(Tensor x, str group) -> Tensor",
            "frag::all_gather(Tensor x, int dim, str group) -> Tensor",
            "frag::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
            "frag::rotary_embedding(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, "
            "int head_size, int rotary_dim, bool is_neox) -> (Tensor, Tensor)",
            "frag::silu_and_mul(Tensor x) -> Tensor",
        ])
        self.assertEqual(fragkit.OP_SCHEMAS, ops.OP_SCHEMAS)
        self.assertEqual(ops.registered_schemas(), ops.OP_SCHEMAS)

    def test_single_process_clone(self):
        self.assertFalse(torch.distributed.is_initialized())
        x = torch.randn(2, 3)
        y = torch.ops.frag.all_reduce(x, "tp")
        z = torch.ops.frag.all_gather(x, -1, "tp")
        self.assertTrue(torch.equal(y, x))
        self.assertTrue(torch.equal(z, x))
        self.assertNotEqual(y.data_ptr(), x.data_ptr())
        self.assertNotEqual(z.data_ptr(), x.data_ptr())
        with self.assertRaises(RuntimeError):
            torch.ops.frag.all_reduce(x, "dp")

    def test_scripted_graph_calls_ops(self):
        m = torch.jit.script(_UsesOps())
        kinds = [n.kind() for n in m.inlined_graph.nodes()]
        self.assertIn("frag::all_reduce", kinds)
        self.assertIn("frag::all_gather", kinds)
        gather = [n for n in m.inlined_graph.nodes() if n.kind() == "frag::all_gather"][0]
        self.assertEqual(gather.inputsAt(1).toIValue(), 0)
        self.assertEqual(gather.inputsAt(2).toIValue(), "tp")
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "m.pt")
            m.save(path)
            loaded = torch.jit.load(path)
            x = torch.ones(2)
            self.assertTrue(torch.equal(loaded(x), 3 * x))


if __name__ == "__main__":
    unittest.main()
