"""fragments._C.gather_rows (runtime/row_gather.h): outs[i] = srcs[i][indices[i]] for several tensors at once, the
vLLM worker's per-step gather of a steady batch's saving rows (_drain.py). Every case is compared with
torch.index_select: dtypes of 1, 2, 4 and 8 bytes, rows of odd byte counts (the kernel's narrow words), sources with
strided rows (a column range of a wider buffer), more tensors than one launch takes (32), empty indices; and bad
arguments refused with one FragError naming the tensor. On a GPU (a CMake build with nvcc: gather_rows_fused()) the
same cases run the fused kernel; without one they are skipped, loudly.

    PYTHONPATH=python python tests/python/vllm_plugin/test_row_gather.py
"""
import unittest

import torch

from fragments import _C

CUDA = torch.cuda.is_available()


def cases(device):
    """(srcs, indices): every kind of source the kernel's word choice and launches meet."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        if dtype in (torch.int8, torch.uint8, torch.int64):
            return torch.randint(0, 100, shape, generator=g).to(dtype).to(device)
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def index(rows, n):
        return torch.randint(0, rows, (n,), generator=g).to(device)

    wide = rand(40, 4096 + 96, dtype=torch.bfloat16)
    srcs = [
        rand(40, 4096, dtype=torch.bfloat16),  # a hidden state: 16-byte words
        rand(40, 8, 3, dtype=torch.float32),  # 3-d rows (heads x dim)
        rand(40, 7, dtype=torch.float16),  # 14-byte rows: 2-byte words
        rand(40, 13, dtype=torch.uint8),  # 13-byte rows: bytes
        rand(40, 5, dtype=torch.int64),  # 8-byte words
        wide[:, 32:32 + 4096],  # rows strided: a column range of a wider buffer (64-byte offset)
        wide[:, 3:3 + 5],  # strided and unaligned: 2-byte words
        rand(40, dtype=torch.float32),  # 1-d: a row is one value
    ]
    indices = [index(40, n) for n in (16, 1, 40, 7, 3, 16, 9, 5)]
    indices[0][0], indices[0][-1] = 0, 39  # the first and last rows
    return srcs, indices


class GatherRowsTest(unittest.TestCase):
    def check(self, device):
        srcs, indices = cases(device)
        outs = [torch.full((ix.shape[0],) + tuple(s.shape[1:]), 7, dtype=s.dtype, device=device)
                for s, ix in zip(srcs, indices)]
        _C.gather_rows(srcs, indices, outs)
        for i, (s, ix, out) in enumerate(zip(srcs, indices, outs)):
            self.assertTrue(torch.equal(out, torch.index_select(s, 0, ix)), i)

    def check_many(self, device):
        """More tensors than one launch carries (32), some with no rows."""
        srcs = [torch.arange(10 * 6, dtype=torch.float32, device=device).view(10, 6) + 1000 * i for i in range(70)]
        indices = [torch.tensor([i % 10, (3 * i) % 10], device=device) if i % 9 else
                   torch.empty(0, dtype=torch.long, device=device) for i in range(70)]
        outs = [torch.zeros(ix.shape[0], 6, device=device) for ix in indices]
        _C.gather_rows(srcs, indices, outs)
        for i in range(70):
            self.assertTrue(torch.equal(outs[i], srcs[i][indices[i]]), i)

    def test_cpu(self):
        self.check("cpu")
        self.check_many("cpu")

    @unittest.skipUnless(CUDA, "SKIPPED LOUDLY: no CUDA device here; the fused kernel runs on the GPU machine "
                               "(tools/device/README.md)")
    def test_cuda_one_launch(self):
        self.assertTrue(_C.gather_rows_fused(), "a CUDA machine's build should have the fused kernel (nvcc)")
        self.check("cuda")
        self.check_many("cuda")

    @unittest.skipUnless(CUDA, "SKIPPED LOUDLY: no CUDA device here")
    def test_cuda_one_kernel_a_call(self):
        """Eight tensors' rows are one kernel in the profiler, where index_select would be eight."""
        srcs, indices = cases("cuda")
        outs = [torch.empty((ix.shape[0],) + tuple(s.shape[1:]), dtype=s.dtype, device="cuda")
                for s, ix in zip(srcs, indices)]
        _C.gather_rows(srcs, indices, outs)  # warm
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _C.gather_rows(srcs, indices, outs)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        self.assertEqual(len(kernels), 1, [e.name for e in kernels])
        self.assertIn("gather_rows", kernels[0].name)

    def test_bad_arguments_are_one_error_naming_the_tensor(self):
        src, ix = torch.zeros(4, 3), torch.tensor([0, 1])
        bad = {
            "one of each": ([src], [ix, ix], [torch.zeros(2, 3)]),
            "tensor 0: expected a source of at least one dimension and a 1-d int64 index":
                ([src], [ix.int()], [torch.zeros(2, 3)]),
            "tensor 1: expected an output of 2 rows of 3 Float": ([src, src], [ix, ix], [torch.zeros(2, 3),
                                                                                       torch.zeros(3, 3)]),
            "tensor 0: expected an output of 2 rows of 3 Float, found 2x3 Double":
                ([src], [ix], [torch.zeros(2, 3, dtype=torch.float64)]),
            "tensor 0: expected a dense output": ([src], [ix], [torch.zeros(3, 2).t()]),
            "tensor 0: expected a dense output and dense source rows":  # rows of [3, 2] stored as [2, 3]
                ([torch.zeros(4, 2, 3).transpose(1, 2)], [ix], [torch.zeros(2, 3, 2)]),
        }
        for message, args in bad.items():
            with self.assertRaises(_C.FragError) as caught:
                _C.gather_rows(*args)
            self.assertIn(message, str(caught.exception))
            self.assertNotIn("\n", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
