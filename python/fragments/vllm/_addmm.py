"""Compiled mode on a GPU: a tap at a biased linear layer's output leaves Inductor's float32 code as plain vLLM's.

Inductor on a GPU rewrites a float32 `addmm(bias, x, w)` into `bias + mm(x, w)` when every user of its output is
pointwise, so the bias add joins the next pointwise kernel (torch/_inductor/fx_passes/post_grad.py,
`unfuse_bias_add_to_pointwise`, `should_prefer_unfused_addmm`). A tap (`fragments::tap`, functionalized to
`auto_functionalized(_v2)` by then) is not a pointwise user, so in a tapped engine that addmm stayed cuBLAS's
addmm: another kernel, other roundings, 1 ulp in GPT-NeoX's logprobs against plain compiled vLLM (run33).

`unfuse_tapped_addmm` runs before Inductor's patterns (`post_grad_custom_pre_pass`) and makes the same rewrite
where Inductor's own check would have made it but for the taps: the users, followed through views, are
pointwise or taps, at least one is a tap, the bias is a float32 (or wider) tensor on a GPU, alpha and beta are 1.
The sum is written `mm - (-bias)`: Inductor's `addmm` pattern folds `mm + bias` back into an addmm when a
user is not pointwise (a tap), and a subtraction of the negated bias is the same IEEE sum (negation is exact,
a - (-b) rounds a + b) without matching it. The tap then reads the sum as a buffer and its users read that
buffer; in float32 that buffer holds the bits the fused kernel computes in registers (one rounding of the same
sum), so the engine computes what plain vLLM computes. bfloat16 and float16 addmm are never unfused by
Inductor, and are left alone here too.
"""
from __future__ import annotations

import logging
import operator
from typing import Tuple

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

log = logging.getLogger("fragments.vllm")

_GPU_TYPES = ("cuda", "xpu", "mps", "mtia")  # torch._inductor.utils.GPU_TYPES, spelled here: stable across releases


def _is_tap(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    tap = getattr(getattr(torch.ops, "fragments", None), "tap", None)
    if tap is None:
        return False
    if node.target is tap.default:
        return True
    hops = [getattr(torch.ops.higher_order, n, None) for n in ("auto_functionalized", "auto_functionalized_v2")]
    return node.target in [h for h in hops if h is not None] and bool(node.args) and node.args[0] is tap.default


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and any(a.alias_info is not None
                                                             for a in target._schema.arguments)


def _uses(node: torch.fx.Node) -> Tuple[bool, bool]:
    """(every use is pointwise or a tap, following views and the value a functionalized tap passes on, which
    plain vLLM's users would have read directly; some use is a tap)."""
    fine, tapped = True, False
    for use in node.users:
        if _is_tap(use):
            tapped = True
            for out in use.users:  # auto_functionalized's getitems: the (mutated) value the later users read
                f, _ = _uses(out)
                fine = fine and f
        elif use.op == "call_function" and _is_view(use):
            f, t = _uses(use)
            fine, tapped = fine and f, tapped or t
        elif not (use.op == "call_function" and isinstance(use.target, torch._ops.OpOverload)
                  and torch.Tag.pointwise in use.target.tags):
            fine = False
    return fine, tapped


def _unfusable(node: torch.fx.Node, gpu_only: bool) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.addmm.default or len(node.args) != 3:
        return False
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return False
    bias = node.args[0]
    value = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype in (torch.bfloat16, torch.float16):
        return False
    if gpu_only and value.device.type not in _GPU_TYPES:
        return False
    fine, tapped = _uses(node)
    return fine and tapped


def unfuse_tapped_addmm(graph: torch.fx.Graph, gpu_only: bool = True) -> int:
    """Rewrites each tapped addmm Inductor would unfuse but for its taps (module docstring) into `mm - (-bias)`.
    Returns how many."""
    done = 0
    for node in list(graph.nodes):
        if not _unfusable(node, gpu_only):
            continue
        bias, mat1, mat2 = node.args
        vals = [a.meta["val"] for a in (bias, mat1, mat2)]
        fake = torch._guards.detect_fake_mode(vals)
        with graph.inserting_before(node):
            mm = graph.call_function(torch.ops.aten.mm.default, (mat1, mat2))
            neg = graph.call_function(torch.ops.aten.neg.default, (bias,))
            total = graph.call_function(torch.ops.aten.sub.Tensor, (mm, neg))  # = bias + mm, not refolded
        if fake is not None:
            with fake:
                mm.meta["val"] = torch.ops.aten.mm.default(vals[1], vals[2])
                neg.meta["val"] = torch.ops.aten.neg.default(vals[0])
                total.meta["val"] = torch.ops.aten.sub.Tensor(mm.meta["val"], neg.meta["val"])
        node.replace_all_uses_with(total)
        graph.erase_node(node)
        done += 1
    return done


class UnfuseTappedAddmm(CustomGraphPass):
    """Inductor's `post_grad_custom_pre_pass`: unfuse_tapped_addmm, never failing a compile (a graph it cannot
    rewrite is left as it was, with one warning)."""

    def __init__(self, gpu_only: bool = True):
        self.gpu_only = gpu_only
        self.rewritten = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        try:
            self.rewritten += unfuse_tapped_addmm(graph, self.gpu_only)
        except Exception as e:  # noqa: B902 - a compile must go on; the engine then differs by Inductor's rounding
            log.warning("fragments: the tapped-addmm rewrite skipped a graph (%s: %s); a tap at a biased layer's "
                        "output may then differ from plain vLLM by Inductor's rounding", type(e).__name__, e)

    def uuid(self):
        return (get_hash_for_files((__file__,)), self.gpu_only)


def install() -> bool:
    """Sets Inductor's post_grad_custom_pre_pass in this process (vLLM sets only the post pass). Leaves one the
    user set, saying so once. Returns whether the rewrite is in place."""
    import torch._inductor.config as inductor_config
    current = inductor_config.post_grad_custom_pre_pass
    if isinstance(current, UnfuseTappedAddmm):
        return True
    if current is not None:
        log.warning("fragments: Inductor's post_grad_custom_pre_pass is already set (%r); taps at biased layers' "
                    "outputs may differ from plain compiled vLLM by 1 ulp in float32", current)
        return False
    inductor_config.post_grad_custom_pre_pass = UnfuseTappedAddmm()
    return True
