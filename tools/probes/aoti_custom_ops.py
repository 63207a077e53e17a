"""Can AOTInductor compile a graph holding fragments' kind of op? A minimal reproduction (issue 14, item 3c).

fragments' ops pass a value through untouched unless an intervention waits, so their schemas say the output
aliases the input (``frag::intervene(Tensor(a) value, str location, bool fragmented) -> Tensor(a)``, see
ir/op_schemas.h). This probe exports a two-layer toy model with one such op between the layers and compiles
it with ``torch._inductor.aoti_compile_and_package`` twice:

1. the op with the aliasing schema (as fragments declares it): refused by AOTInductor's functionalization
   ("Found a custom (non-ATen) operator whose output has alias annotations"); a rewritten .pt2 archive fails
   the same way, on its first ``frag.intervene`` node;
2. the same op with a functional schema (``-> Tensor``, the kernel returns a copy): compiles; the compiled
   package calls the kernel through the dispatcher once per forward, and the output equals the eager model's.

So an AOTInductor path needs functional variants of the three ops — each costing a copy where it stays in
the graph, which is why such a path would compile a program specialized to a plan (ops only where an
intervention waits), not the full rewrite. Runs on the CPU (a C++ compiler and PyTorch's headers; ~20-40 s a
compile on this 2-core machine):

    $(bash tools/python_env.sh) tools/probes/aoti_custom_ops.py [--device cuda]

On a GPU (--device cuda) the package is compiled for CUDA and loaded by the same C++ loader
(AOTIModelPackageLoader) that a C++ runner would use.
"""
import sys
import tempfile
import time
import warnings

import torch

warnings.filterwarnings("ignore")
CALLS = []


def define(namespace, schema_output):
    lib = torch.library.Library(namespace, "DEF")
    lib.define("intervene(Tensor%s value, str location, bool fragmented) -> Tensor%s" % (schema_output, schema_output))
    aliasing = schema_output == "(a)"

    def kernel(value, location, fragmented):
        CALLS.append(location)
        return value if aliasing else value.clone()

    lib.impl("intervene", kernel, "CompositeExplicitAutograd")
    return lib, getattr(torch.ops, namespace).intervene


class Toy(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.op(self.a(x), "a.output", False)))


def probe(name, op, folder, device):
    torch.manual_seed(0)
    model = Toy(op).eval().to(device)
    x = torch.randn(4, 16, device=device)
    with torch.no_grad():
        expected = model(x)
        program = torch.export.export(model, (x,))
    start = time.time()
    try:
        path = torch._inductor.aoti_compile_and_package(program, package_path="%s/%s.pt2" % (folder, name))
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        first = str(e).strip().splitlines()[0]
        print("%-10s refused after %.1f s: %s" % (name, time.time() - start, first))
        return False
    compiled = torch._inductor.aoti_load_package(path)
    CALLS.clear()
    with torch.no_grad():
        out = compiled(x)
    print("%-10s compiled in %.1f s; kernel calls in one forward: %d; equal to eager: %s"
          % (name, time.time() - start, len(CALLS), torch.equal(out, expected)))
    return len(CALLS) == 1 and torch.allclose(out, expected)


def main():
    device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    libs = []
    with tempfile.TemporaryDirectory() as folder:
        lib, aliasing = define("fragprobe_alias", "(a)")
        libs.append(lib)
        refused = not probe("aliasing", aliasing, folder, device)
        lib, functional = define("fragprobe_functional", "")
        libs.append(lib)
        works = probe("functional", functional, folder, device)
    print("torch %s on %s: aliasing schema refused: %s; functional schema compiles and runs: %s"
          % (torch.__version__, device, refused, works))
    return 0 if refused and works else 1


if __name__ == "__main__":
    sys.exit(main())
