"""Steering during generation: a direction in the residual stream (one layer's output at the last position
for a positive prompt minus that for a negative prompt) is added to that layer's output at every position
of every generation step; greedy generation with and without it.

    PYTHONPATH=python $PY examples/steering.py bazel-bin/tests/models/llama_tp2 --world 2
    PYTHONPATH=python $PY examples/steering.py bazel-bin/tests/models/smollm2_tp3 --world 3 \\
        --prompt "I think that dogs are" --positive "I love" --negative "I hate" --strength 0.5

How much is added: by default the direction is rescaled so that its norm is --strength (0.5) times the
typical norm of the steered layer's output (the mean over the prompt's positions), because a difference
of two hidden states has no fixed size: on SmolLM2-135M-Instruct at layer 10 the states' norms are ~150,
"I love" - "I hate" is ~59 and "Love" - "Hate" ~192, so a fixed multiple of the difference either does
nothing or swamps the stream (4 x "Love" - "Hate", norm 769, made it generate "----------"). Measured
there (layer 10, greedy, "I think that dogs are"): strength 0.25 and 0.5 change the continuation and stay
fluent (0.5: " a wonderful choice for your family, and I'm happy to discuss how we can" instead of " just as
capable of being creative as humans."), 1.0 starts to break ("a Good Investment for Our Community?\n\nP.01001"),
1.5 is noise. --scale S instead adds exactly S x (positive - negative).
The default prompts have two tokens: the direction is read at the last position, not at position 0, whose
state a trained model treats apart (with one-token prompts "Love"/"Hate" even strength 0.25 broke SmolLM2).

(after the setup in examples/common.py).
"""
import json
import os
import sys

import fragments

import common


def steer(rank, folder, prompt, positive, negative, layer, scale, strength, new_tokens):
    model = fragments.load(f"{folder}/rank{{rank}}.pt")
    at = model.model.layers[layer]
    with model.trace(positive):
        plus = at.output.save()
    with model.trace(negative):
        minus = at.output.save()
    difference = plus.value[0, -1] - minus.value[0, -1]
    if scale is None and float(difference.norm()) == 0:
        raise ValueError(f"the positive and negative prompts give the same layer-{layer} output: no direction")
    if scale is None:  # relative to the stream: |direction| = strength x the prompt's typical |hidden state|
        with model.trace(prompt):
            hidden = at.output.save()
        scale = strength * float(hidden.value[0].norm(dim=-1).mean()) / float(difference.norm())
    direction = scale * difference
    with model.generate(prompt, max_new_tokens=new_tokens):
        plain = model.output.save()
    with model.generate(prompt, max_new_tokens=new_tokens):
        at.output[:] += direction  # every position, at every step
        steered = model.output.save()
    if rank != 0:
        return None
    start = prompt.shape[1]
    return plain.value[0, start:].tolist(), steered.value[0, start:].tolist(), direction, scale


def main():
    p = common.parser(__doc__)
    p.add_argument("--prompt", help="the prompt to continue")
    p.add_argument("--positive", help="the prompt whose direction is added")
    p.add_argument("--negative", help="the prompt whose direction is taken away")
    p.add_argument("--layer", type=int, default=None, help="the layer steered (default: a third of the way in)")
    p.add_argument("--strength", type=float, default=0.5,
                   help="the added vector's norm as a fraction of the layer's typical hidden-state norm")
    p.add_argument("--scale", type=float, default=None,
                   help="add exactly SCALE x (positive - negative) instead of --strength")
    p.add_argument("--tokens", type=int, default=10, help="tokens to generate")
    a = p.parse_args()
    tokens = common.Tokens(a.folder)
    prompt = tokens.ids(a.prompt or tokens.pick("I think that dogs are", "11 22 33 44"))
    positive = tokens.ids(a.positive or tokens.pick("I love", "7"))
    negative = tokens.ids(a.negative or tokens.pick("I hate", "8"))
    layer = a.layer
    if layer is None:
        info = os.path.join(a.folder, "fragkit-model.json")  # an imported checkpoint says its depth
        if os.path.isfile(info):
            with open(info) as f:
                layer = json.load(f)["config"]["num_hidden_layers"] // 3
        else:
            layer = 0
    plain, steered, direction, scale = fragments.launch(
        steer, world=a.world,
        args=(a.folder, prompt, positive, negative, layer, a.scale, a.strength, a.tokens))[0]
    join = (lambda ids: tokens.tokenizer.decode(ids)) if tokens.tokenizer else (lambda ids: " ".join(map(str, ids)))
    how = "" if a.scale is not None else f" (strength {a.strength} of the hidden state's norm)"
    print(f"steering layer {layer} by {scale:.3g} x (positive - negative){how}, "
          f"|direction| = {float(direction.norm()):.2f}")
    print(f"plain:   {join(plain)!r}")
    print(f"steered: {join(steered)!r}")
    common.write_json(a.json, {"layer": layer, "scale": scale, "plain": plain, "steered": steered})
    return 0


if __name__ == "__main__":
    sys.exit(main())
