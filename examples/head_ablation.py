"""Head ablation: each attention head of one layer zeroed in turn (its slice of o_proj's input, in whole
coordinates, wherever its rank holds it); how much the prompt's top next token loses says which heads it
needs.

    PYTHONPATH=python $PY examples/head_ablation.py bazel-bin/tests/models/llama_tp2 --world 2
    PYTHONPATH=python $PY examples/head_ablation.py bazel-bin/tests/models/smollm2_tp3 --world 3 \\
        --prompt "The capital of France is" --layer 5

(after the setup in examples/common.py).
"""
import sys

import fragments

import common


def ablate_each_head(rank, folder, ids, layer):
    model = fragments.load(f"{folder}/rank{{rank}}.pt")
    heads = model.model.layers[layer].self_attn.o_proj.input.heads
    with model.trace(ids):
        clean = model.output.save()
    ablated = []
    for h in range(len(heads)):
        with model.trace(ids):
            heads[h] = 0
            logits = model.output.save()
        ablated.append(logits.value[0, -1])
    return (clean.value[0, -1], ablated) if rank == 0 else None


def main():
    p = common.parser(__doc__)
    p.add_argument("--prompt", help="the prompt (text with a tokenizer, else ids)")
    p.add_argument("--layer", type=int, default=0)
    a = p.parse_args()
    tokens = common.Tokens(a.folder)
    ids = tokens.ids(a.prompt or tokens.pick("The capital of France is", "11 22 33 44 55 66"))
    clean, ablated = fragments.launch(ablate_each_head, world=a.world, args=(a.folder, ids, a.layer))[0]
    target = int(clean.argmax())
    p_clean = float(clean.softmax(-1)[target])
    print(f"layer {a.layer}: the top next token {tokens.text(target)!r} has probability {p_clean:.3f}")
    print("head  its probability  logit change  top token then")
    drops = []
    for h, logits in enumerate(ablated):
        prob, change = float(logits.softmax(-1)[target]), float(logits[target] - clean[target])
        drops.append(change)
        print(f"{h:4d}  {prob:15.3f}  {change:+12.3f}  {tokens.text(logits.argmax())!r}")
    common.write_json(a.json, {"layer": a.layer, "target": target, "logit_change": drops,
                               "top_after": [int(x.argmax()) for x in ablated]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
