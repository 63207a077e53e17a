"""A logit lens at every layer: lm_head(norm(layer output)) at every position, in one forward (ad-hoc
calls on whole tensors). Prints the top token per layer and position, and writes a PNG heat map (rows:
layers, columns: positions; colour: the top token's probability; text: the top token) and, beside it,
the same table as JSON (`<png>.json`).

    PYTHONPATH=python $PY examples/logit_lens.py bazel-bin/tests/models/llama_tp2 --world 2
    PYTHONPATH=python $PY examples/logit_lens.py bazel-bin/tests/models/smollm2_tp3 --world 3 \\
        --prompt "The capital of France is" --png docs/logit_lens_smollm2.png

(after the setup in examples/common.py).
"""
import os
import sys

import torch

import fragments

import common

CELL = (72, 20)                 # a cell's width and height in pixels
MARGIN = (70, 46, 12, 30)       # left (layer labels), top (title, prompt tokens), right, bottom (axis label)


def lens(rank, folder, ids):
    model = fragments.load(f"{folder}/rank{{rank}}.pt")
    m = model.model
    with model.trace(ids):
        lenses = [model.lm_head(m.norm(layer.output)).save() for layer in m.layers]
    if rank != 0:
        return None
    probs = torch.stack([x.value[0] for x in lenses]).float().softmax(-1)  # [layers, positions, vocab]
    top, token = probs.max(-1)
    return top, token


def colour(p):
    """White (probability 0) to dark blue (1)."""
    return (round(255 - 225 * p), round(255 - 185 * p), round(255 - 75 * p))


def fit(draw, text, font, width):
    """The text, cut with an ellipsis to fit `width` pixels."""
    text = repr(text) if not text.strip() else text.replace("\n", "\\n")  # a blank token shows as ' '
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def heat_map(path, top, texts, inputs, title):
    """Writes the PNG atomically (temp file, then rename); returns its size."""
    from PIL import Image, ImageDraw, ImageFont

    layers, positions = top.shape
    left, upper, right, bottom = MARGIN
    size = (left + positions * CELL[0] + right, upper + layers * CELL[1] + bottom)
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=11)
    draw.text((6, 4), title, fill="black", font=ImageFont.load_default(size=13))
    for j in range(positions):  # the prompt's tokens head the columns
        draw.text((left + j * CELL[0] + CELL[0] / 2, upper - 4), fit(draw, inputs[j], font, CELL[0] - 4),
                  fill="black", font=font, anchor="md")
    for i in range(layers):
        y = upper + i * CELL[1]
        draw.text((left - 6, y + CELL[1] / 2), f"layer {i}", fill="black", font=font, anchor="rm")
        for j in range(positions):
            x, p = left + j * CELL[0], float(top[i, j])
            draw.rectangle([x, y, x + CELL[0] - 1, y + CELL[1] - 1], fill=colour(p))
            draw.text((x + CELL[0] / 2, y + CELL[1] / 2), fit(draw, texts[i][j], font, CELL[0] - 6),
                      fill="white" if p > 0.5 else "black", font=font, anchor="mm")
    draw.text((left + positions * CELL[0] / 2, size[1] - 6), "position (input token above); colour: top token's "
              "probability", fill="black", font=font, anchor="md")
    tmp = f"{path}.tmp{os.getpid()}.png"
    image.save(tmp)
    os.replace(tmp, path)
    return size


def main():
    p = common.parser(__doc__)
    p.add_argument("--prompt", help="the prompt (text with a tokenizer, else ids)")
    p.add_argument("--png", default="logit_lens.png", help="the heat map (its table goes to <png>.json)")
    a = p.parse_args()
    tokens = common.Tokens(a.folder)
    ids = tokens.ids(a.prompt or tokens.pick("The capital of France is", "11 22 33 44 55 66"))
    top, token = fragments.launch(lens, world=a.world, args=(a.folder, ids))[0]
    texts = [tokens.texts(row) for row in token.tolist()]
    inputs = tokens.texts(ids[0].tolist())
    for i, row in enumerate(texts):
        print(f"layer {i:2d}: " + "  ".join(f"{t!r} {float(q):.2f}" for t, q in zip(row, top[i])))
    title = f"logit lens: {os.path.basename(os.path.normpath(a.folder))}, top token per layer and position"
    size = heat_map(a.png, top, texts, inputs, title)
    common.write_json(a.png + ".json", {"top_token": token.tolist(), "top_probability": top.tolist(),
                                        "input": ids[0].tolist(), "cell": list(CELL), "margin": list(MARGIN),
                                        "size": list(size)})
    print(f"wrote {a.png} ({size[0]}x{size[1]}) and {a.png}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
