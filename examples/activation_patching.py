"""Activation patching between two prompts: each layer's output at the one position where the prompts
differ is taken from the clean run and patched into the corrupted run; how much of the clean answer's
logit comes back says where the model carries that token's information.

    PYTHONPATH=python $PY examples/activation_patching.py bazel-bin/tests/models/llama_tp2 --world 2
    PYTHONPATH=python $PY examples/activation_patching.py bazel-bin/tests/models/smollm2_tp3 --world 3 \\
        --clean "The capital of France is" --corrupt "The capital of Italy is"

(after the setup in examples/common.py).
"""
import sys

import fragments

import common


def patch_every_layer(rank, folder, clean, corrupt, position):
    model = fragments.load(f"{folder}/rank{{rank}}.pt")
    layers = model.model.layers
    with model.trace(clean):  # every layer's output from one clean forward
        sources = [layer.output.save() for layer in layers]
        clean_logits = model.output.save()
    with model.trace(corrupt):
        corrupt_logits = model.output.save()
    patched = []
    for layer, source in zip(layers, sources):
        with model.trace(corrupt):
            layer.output[:, position] = source.value[:, position]
            logits = model.output.save()
        patched.append(logits.value[0, -1])
    return (clean_logits.value[0, -1], corrupt_logits.value[0, -1], patched) if rank == 0 else None


def main():
    p = common.parser(__doc__)
    p.add_argument("--clean", help="the clean prompt (default: France, or ids 11 22 33 44 55 66)")
    p.add_argument("--corrupt", help="the corrupted prompt: the same length, one token different")
    a = p.parse_args()
    tokens = common.Tokens(a.folder)
    clean = tokens.ids(a.clean or tokens.pick("The capital of France is", "11 22 33 44 55 66"))
    corrupt = tokens.ids(a.corrupt or tokens.pick("The capital of Italy is", "11 22 99 44 55 66"))
    position = common.differing_position(clean, corrupt)
    clean_last, corrupt_last, patched = fragments.launch(
        patch_every_layer, world=a.world, args=(a.folder, clean, corrupt, position))[0]

    # The clean answer's logit minus the corrupted answer's (the clean answer's alone when they agree);
    # recovered is 1 where the patched run scores like the clean one, 0 where like the corrupted one.
    good, bad = int(clean_last.argmax()), int(corrupt_last.argmax())
    diff = lambda logits: float(logits[good] - (logits[bad] if bad != good else 0.0))  # noqa: E731
    span = diff(clean_last) - diff(corrupt_last)
    recovered = [(diff(x) - diff(corrupt_last)) / span if span else None for x in patched]
    print(f"clean answer {tokens.text(good)!r}, corrupted answer {tokens.text(bad)!r}; "
          f"patching position {position} ({tokens.text(clean[0, position])!r} into "
          f"{tokens.text(corrupt[0, position])!r})")
    print("layer  logit diff  recovered")
    for i, x in enumerate(patched):
        print(f"{i:5d}  {diff(x):+10.3f}  " + (f"{recovered[i]:9.3f}" if recovered[i] is not None else "      n/a"))
    common.write_json(a.json, {"position": position, "clean_answer": good, "corrupted_answer": bad,
                               "clean_diff": diff(clean_last), "corrupted_diff": diff(corrupt_last),
                               "patched_diff": [diff(x) for x in patched], "recovered": recovered})
    return 0


if __name__ == "__main__":
    sys.exit(main())
