"""What the examples share: their arguments, prompts as text or as token ids, and token text.

An export folder with a tokenizer/ (a real checkpoint imported by `python3 -m fragkit.checkpoint`, e.g.
SmolLM2) takes prompts as text; a reference export (random weights, no tokenizer) takes them as token ids
written "11 22 33". Only the launching process tokenizes: the ranks get token ids.

Setup, once, from the repository root (or `pip install .` and no PYTHONPATH):

    PY=$(bash tools/python_env.sh)
    bazel build //python/fragments:_C.so //tests/models:llama_tp2 //tests/models:smollm2_tp3
    cp bazel-bin/python/fragments/_C.so python/fragments/   # the extension beside the package (git ignores it)
"""
import argparse
import json
import os

import torch


def parser(doc):
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="an export folder with rank0.pt ... (and tokenizer/ for text prompts)")
    p.add_argument("--world", type=int, default=1, help="ranks to launch: the export's tp")
    p.add_argument("--json", help="also write the results here (JSON)")
    return p


class Tokens:
    """Text <-> token ids through the export's tokenizer, or ids only when it has none."""

    def __init__(self, folder):
        path = os.path.join(folder, "tokenizer")
        self.tokenizer = None
        if os.path.isdir(path):
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(path)

    def ids(self, prompt):
        """[1, tokens] ids of a prompt: text with a tokenizer, else "11 22 33"."""
        if self.tokenizer is not None:
            return self.tokenizer(prompt, return_tensors="pt").input_ids
        try:
            return torch.tensor([[int(t) for t in prompt.split()]], dtype=torch.long)
        except ValueError:
            raise SystemExit(f"this export has no tokenizer/: give prompts as token ids (\"11 22 33\"), "
                             f"not {prompt!r}") from None

    def pick(self, text, ids):
        """The default prompt that fits the export: `text` with a tokenizer, else `ids`."""
        return text if self.tokenizer is not None else ids

    def text(self, token_id):
        """A token as readable text (its id in `#` form without a tokenizer)."""
        if self.tokenizer is None:
            return f"#{int(token_id)}"
        return self.tokenizer.decode([int(token_id)])

    def texts(self, ids):
        return [self.text(t) for t in ids]


def differing_position(a, b):
    """The one position where two prompts of the same length differ (what patching patches)."""
    if a.shape != b.shape:
        raise SystemExit(f"the two prompts must have as many tokens ({a.shape[1]} vs {b.shape[1]})")
    differ = (a[0] != b[0]).nonzero().flatten().tolist()
    if len(differ) != 1:
        raise SystemExit(f"the two prompts must differ in exactly one token, not at positions {differ}")
    return differ[0]


def write_json(path, data):
    """Writes atomically (a temp file then rename), so a reader never sees half a file."""
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
