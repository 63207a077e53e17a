"""Steering during generation: a direction in the residual stream (one layer's output at the last position
for a positive prompt minus that for a negative prompt) is added to that layer's output at every position
of every generation step; greedy generation with and without it.

    PYTHONPATH=python $PY examples/steering.py bazel-bin/tests/models/llama_tp2 --world 2
    PYTHONPATH=python $PY examples/steering.py bazel-bin/tests/models/smollm2_tp3 --world 3 \\
        --prompt "I think that dogs are" --positive "Love" --negative "Hate" --scale 8

(after the setup in examples/common.py).
"""
import json
import os
import sys

import fragments

import common


def steer(rank, folder, prompt, positive, negative, layer, scale, new_tokens):
    model = fragments.load(f"{folder}/rank{{rank}}.pt")
    at = model.model.layers[layer]
    with model.trace(positive):
        plus = at.output.save()
    with model.trace(negative):
        minus = at.output.save()
    direction = scale * (plus.value[0, -1] - minus.value[0, -1])
    with model.generate(prompt, max_new_tokens=new_tokens):
        plain = model.output.save()
    with model.generate(prompt, max_new_tokens=new_tokens):
        at.output[:] += direction  # every position, at every step
        steered = model.output.save()
    if rank != 0:
        return None
    start = prompt.shape[1]
    return plain.value[0, start:].tolist(), steered.value[0, start:].tolist(), direction


def main():
    p = common.parser(__doc__)
    p.add_argument("--prompt", help="the prompt to continue")
    p.add_argument("--positive", help="the prompt whose direction is added")
    p.add_argument("--negative", help="the prompt whose direction is taken away")
    p.add_argument("--layer", type=int, default=None, help="the layer steered (default: a third of the way in)")
    p.add_argument("--scale", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=10, help="tokens to generate")
    a = p.parse_args()
    tokens = common.Tokens(a.folder)
    prompt = tokens.ids(a.prompt or tokens.pick("I think that dogs are", "11 22 33 44"))
    positive = tokens.ids(a.positive or tokens.pick("Love", "7"))
    negative = tokens.ids(a.negative or tokens.pick("Hate", "8"))
    layer = a.layer
    if layer is None:
        info = os.path.join(a.folder, "fragkit-model.json")  # an imported checkpoint says its depth
        if os.path.isfile(info):
            with open(info) as f:
                layer = json.load(f)["config"]["num_hidden_layers"] // 3
        else:
            layer = 0
    plain, steered, direction = fragments.launch(
        steer, world=a.world, args=(a.folder, prompt, positive, negative, layer, a.scale, a.tokens))[0]
    join = (lambda ids: tokens.tokenizer.decode(ids)) if tokens.tokenizer else (lambda ids: " ".join(map(str, ids)))
    print(f"steering layer {layer} by {a.scale} x (positive - negative), |direction| = {float(direction.norm()):.2f}")
    print(f"plain:   {join(plain)!r}")
    print(f"steered: {join(steered)!r}")
    common.write_json(a.json, {"layer": layer, "plain": plain, "steered": steered})
    return 0


if __name__ == "__main__":
    sys.exit(main())
