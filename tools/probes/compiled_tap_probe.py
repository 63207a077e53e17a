"""Can a module hook reach a compiled vLLM model? A minimal reproduction for issue 27's compiled mode.

vLLM's CPU platform compiles the model with torch.compile (Inductor, fullgraph). fragments' vLLM plugin acts
in module hooks that read per-step Python state (which request rows, which plan steps). Traced by Dynamo,
that reading would become guards or graph breaks. This probe puts the hook's work behind a functional custom
op, ``fragprobe::tap(Tensor x, int location) -> Tensor`` (a fake kernel for tracing; the eager body returns a
copy, or an edited value), called from a forward hook on a toy two-layer model, compiles with
``torch.compile(fullgraph=True)`` and checks:

1. the compiled forward equals the eager one, and the op's body ran (once per forward);
2. changing the Python state after compiling (an edit: scale by 0.5) changes the next compiled forward
   without recompiling: the body runs at run time, where it sees the live state;
3. the value the body saw equals the first layer's output (a save).

Measured 2026-12-03 (torch 2.11, CPU): all three hold, one graph, no recompile. docs/vllm.md ("What a minimal
compiled version would take") builds on it. ~30 s here:

    $(bash tools/python_env.sh) tools/probes/compiled_tap_probe.py
"""
import sys

import torch

STATE = {"scale": None, "calls": 0, "seen": []}


@torch.library.custom_op("fragprobe::tap", mutates_args=())
def tap(x: torch.Tensor, location: int) -> torch.Tensor:
    STATE["calls"] += 1
    STATE["seen"].append(x.detach().clone())
    return x * STATE["scale"] if STATE["scale"] is not None else x.clone()  # never an alias of x


@tap.register_fake
def _(x, location):
    return torch.empty_like(x)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def main() -> int:
    torch.manual_seed(0)
    m = Toy()
    m.a.register_forward_hook(lambda mod, args, out: torch.ops.fragprobe.tap(out, 0))
    x = torch.randn(3, 8)
    with torch.no_grad():  # vLLM runs inference; a custom op without an autograd formula needs it
        eager = m(x)
        STATE.update(calls=0, seen=[])
        compiled = torch.compile(m, fullgraph=True)
        y0 = compiled(x)
        calls0 = STATE["calls"]
        STATE["scale"] = 0.5
        y1 = compiled(x)
        a_out = torch.nn.functional.linear(x, m.a.weight, m.a.bias)
        edited = m.b(torch.relu(a_out * 0.5))
    checks = {
        "compiled forward equals eager, the op ran once": torch.allclose(y0, eager, atol=1e-6) and calls0 == 1,
        "an edit set after compiling acts, no recompile": torch.allclose(y1, edited, atol=1e-6)
        and STATE["calls"] == 2,
        "the op saw the first layer's output": torch.allclose(STATE["seen"][0], a_out, atol=1e-6),
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
