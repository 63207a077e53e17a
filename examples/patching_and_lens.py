"""Activation patching, a logit lens at every layer, head ablation and steered generation, in Python,
on a reference export (any tp):

    PY=$(bash tools/python_env.sh)
    PYTHONPATH=tools $PY tools/export_model.py --model llama --tp 2 --out exports/llama_tp2
    PYTHONPATH=bazel-bin/python:python $PY examples/patching_and_lens.py exports/llama_tp2 --world 2

(after `bazel build //python/fragments:_C.so`, or with the package installed by `pip install .`).
"""
import argparse

import torch

import fragments


def main(rank, folder):
    model = fragments.load(f"{folder}/rank{{rank}}.pt")
    m = model.model
    clean = torch.tensor([[11, 22, 33, 44, 55, 66]])
    corrupt = torch.tensor([[11, 22, 99, 44, 55, 66]])
    layers = len(m.layers)

    # A logit lens at every layer: norm then lm_head on each layer's whole output, in one forward.
    with model.trace(clean):
        lenses = [model.lm_head(m.norm(m.layers[i].output)).save() for i in range(layers)]
        logits = model.output.save()
    top = [int(lens.value[0, -1].argmax()) for lens in lenses]

    # Activation patching: each layer's clean output patched into the corrupted run.
    with model.trace(corrupt):
        corrupted = model.output.save()
    target = int(logits.value[0, -1].argmax())
    recovered = []
    for i in range(layers):
        with model.trace(clean):
            h = m.layers[i].output.save()
        with model.trace(corrupt):
            m.layers[i].output[:, 2] = h.value[:, 2]   # only the corrupted position
            patched = model.output.save()
        recovered.append(float(patched.value[0, -1, target] - corrupted.value[0, -1, target]))

    # Head ablation: zero one attention head's output (o_proj's input, whole coordinates).
    with model.trace(clean):
        m.layers[0].self_attn.o_proj.input.heads[0] = 0
        ablated = model.output.save()

    # Steering during generation: the edit applies at every step.
    hidden = h.value.shape[-1]
    steer = torch.randn(hidden, generator=torch.Generator().manual_seed(0))  # the same on every rank
    with model.generate(clean, max_new_tokens=5):
        m.layers[0].output[:, -1] += 4 * steer
        steered = model.output.save()
    if rank == 0:
        print("logit lens, top token at the last position per layer:", top)
        print("patching each layer's output at position 2, logit change of the clean top token:",
              [f"{r:+.3f}" for r in recovered])
        print("ablating head 0 of layer 0 moves the logits by",
              f"{float((ablated.value - logits.value).abs().max()):.3f}")
        print("steered generation:", steered.value[0].tolist())


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--world", type=int, default=1)
    a = p.parse_args()
    fragments.launch(main, world=a.world, args=(a.folder,))
