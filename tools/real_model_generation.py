#!/usr/bin/env python3
"""Cached generation on the real SmolLM2-135M-Instruct against Hugging Face transformers (float32).

Four prompts of different token lengths run as ONE batch through fragments' Python API (fragments.launch at
--tp ranks over Gloo, KV cache, right-padded prefill); transformers runs each prompt alone with
``generate(use_cache=True)`` (its DynamicCache). Greedy tokens must be equal token for token, and the logits
of every step within --tolerance (max |ours - theirs| / max |theirs|, per row and step). Then the same with a
steering vector added at --steer-layer's output at every step: through fragments' plan, and through a forward
hook on the transformers model (with its cache). Each row stops at EOS on both sides.

    python3 tools/real_model_generation.py --exports bazel-bin/tests/models --tp 3 --tokens 128

Prints one line per comparison; exits 1 if any fails. tests/python/real_model_generation_test.py runs it
(16 tokens by default, 128 with FRAG_SLOW=1). The fragments half runs in a child process (``--worker``):
fragments cannot be imported beside fragkit, which finds the GGUF.
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

PROMPTS = [
    "The capital of France is",
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote valley of",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Water boils at",
]
STEER_LAYER = 6


def generate_rank(rank, path, rows, tokens, eos, steer):
    """One rank: for the plain run and the steered one, the batch's new tokens and, on rank 0, each step's
    logits [steps, rows, vocab]; and the cache's description."""
    import fragments

    model = fragments.load(path)
    out = []
    for vector in (None, steer):
        with model.generate(rows, max_new_tokens=tokens, eos_token_id=eos) as gen:
            if vector is not None:
                model.model.layers[STEER_LAYER].output[...] += vector
        out.append((gen.new_tokens, torch.stack(gen.logits) if rank == 0 else None))
    return out, gen.cache


def worker(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--export", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--job", required=True, help="a JSON file: rows, tokens, eos, steer (a safetensors file)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import fragments
    from safetensors.torch import load_file, save_file

    with open(a.job) as f:
        job = json.load(f)
    steer = load_file(job["steer"])["v"]
    runs, cache = fragments.launch(generate_rank, world=a.tp, backend="gloo", timeout=600,
                                   args=(f"{a.export}/rank{{rank}}.pt", job["rows"], job["tokens"], job["eos"],
                                         steer))[0]
    tensors = {}
    for name, (new, logits) in zip(("plain", "steer"), runs):
        width = max(len(n) for n in new)
        tensors[name + ".tokens"] = torch.tensor([n + [-1] * (width - len(n)) for n in new], dtype=torch.long)
        tensors[name + ".logits"] = logits.contiguous()
    save_file(tensors, a.out, metadata={"cache": cache})
    return 0


def relative(a, reference):
    a, reference = a.double(), reference.double()
    return float((a - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


class GenerationCheck:
    def __init__(self, exports, tp, tokens, work=None):
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root holds fragkit/
        from fragkit.checkpoint import smollm2_gguf_path
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.export = os.path.join(exports, "smollm2_tp%d" % tp)
        self.tp, self.tokens = tp, tokens
        self.work = work or tempfile.mkdtemp(prefix="real_model_generation.")
        if not work:  # ours: removed when the process ends (the script, or real_model_generation_test's run)
            atexit.register(shutil.rmtree, self.work, True)
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(self.export, "tokenizer"))
        path = smollm2_gguf_path()
        self.hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                       dtype=torch.float32).eval()
        self.rows = [self.tokenizer(p).input_ids for p in PROMPTS]
        self.eos = self.tokenizer.eos_token_id
        self.lines, self.times = [], {}

    def steering_vector(self):
        return 4.0 * torch.randn(self.hf.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def ours(self, steer):
        """fragments' tokens and logits (both runs made by one launch, the first time either is asked for)."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        if not hasattr(self, "_ours"):
            job = {"rows": self.rows, "tokens": self.tokens, "eos": self.eos,
                   "steer": os.path.join(self.work, "steer.safetensors")}
            save_file({"v": self.steering_vector().contiguous()}, job["steer"])
            job_file, out = os.path.join(self.work, "job.json"), os.path.join(self.work, "ours.safetensors")
            with open(job_file, "w") as f:
                json.dump(job, f)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--export", self.export, "--tp",
                   str(self.tp), "--job", job_file, "--out", out]
            started = time.time()
            done = subprocess.run(cmd, capture_output=True, text=True)
            self.times["fragments tp=%d, plain and steered (one batch each)" % self.tp] = time.time() - started
            if done.returncode != 0:
                raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), done.returncode, done.stderr.strip()))
            with safe_open(out, "pt") as f:
                self.cache = f.metadata()["cache"]
                self._ours = {k: f.get_tensor(k) for k in f.keys()}
        name = "plain" if steer is None else "steer"
        tokens = self._ours[name + ".tokens"]
        return [[t for t in row if t >= 0] for row in tokens.tolist()], self._ours[name + ".logits"]

    def theirs(self, steer):
        handle = None
        if steer is not None:
            def hook(module, args, output):
                if isinstance(output, tuple):
                    return (output[0] + steer,) + tuple(output[1:])
                return output + steer
            handle = self.hf.model.layers[STEER_LAYER].register_forward_hook(hook)
        out = []
        started = time.time()
        try:
            for row in self.rows:
                ids = torch.tensor([row])
                with torch.no_grad():
                    g = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.tokens,
                                         do_sample=False, use_cache=True, output_logits=True,
                                         return_dict_in_generate=True, eos_token_id=self.eos, pad_token_id=self.eos)
                out.append((g.sequences[0, len(row):].tolist(), torch.stack([s[0] for s in g.logits])))
        finally:
            if handle is not None:
                handle.remove()
        self.times["transformers %s (one prompt at a time)" % ("steer" if steer is not None else "plain")] = \
            time.time() - started
        return out

    def check(self, steer=None):
        """{"tokens_equal": bool, "logits": worst relative difference, "tokens": ours}; `steer`: the
        steering_vector() (fragments always steers with that one)."""
        ours_tokens, ours_logits = self.ours(steer)
        reference = self.theirs(steer)
        equal, worst = True, 0.0
        label = "steered at layer %d" % STEER_LAYER if steer is not None else "plain"
        for b, (tokens, logits) in enumerate(reference):
            same = ours_tokens[b] == tokens
            equal &= same
            n = min(len(tokens), len(ours_tokens[b]))
            for k in range(n):
                worst = max(worst, relative(ours_logits[k, b], logits[k]))
            self.lines.append("%s row %d (%d prompt tokens): %d tokens, %s" % (
                label, b, len(self.rows[b]), len(tokens), "equal" if same else
                "DIFFER: ours %s, transformers %s" % (ours_tokens[b], tokens)))
        self.lines.append("%s: logits every step, worst relative difference %.2e" % (label, worst))
        if len({len(r) for r in self.rows}) != len(self.rows):
            raise AssertionError("the prompts must have different token lengths: %s" % [len(r) for r in self.rows])
        return {"tokens_equal": equal, "logits": worst, "tokens": ours_tokens}


def check_cli(check, frag, tokens):
    """`frag run --prompt ... --generate` on the ragged prompts (text in): its new tokens per row, to the
    first EOS, and what rank 0 printed about the cache."""
    from safetensors.torch import load_file

    out = os.path.join(check.work, "cli.safetensors")
    cmd = [frag, "run", "--world", str(check.tp), os.path.join(check.export, "rank{rank}.pt"), "--generate",
           str(tokens), "--out", out, "--timeout", "300"]
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    env = dict(os.environ, FRAG_PYTHON=os.environ.get("FRAG_PYTHON", sys.executable))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), done.returncode, done.stderr.strip()))
    rows = []
    for row in load_file(out)["new_tokens"].tolist():
        rows.append(row[:row.index(check.eos) + 1] if check.eos in row else row)
    return rows, [line for line in done.stderr.splitlines() if "KV cache" in line]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        return worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--exports", default="tests/models", help="folder with smollm2_tp<N>/")
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--frag", help="also run `frag run --prompt ... --generate` (the CLI) and compare")
    a = p.parse_args(argv)
    check = GenerationCheck(a.exports, a.tp, a.tokens)
    plain = check.check()
    steered = check.check(check.steering_vector())
    print("SmolLM2-135M-Instruct, tp=%d, float32, %d prompts of %s tokens in one batch, up to %d new tokens"
          % (a.tp, len(PROMPTS), [len(r) for r in check.rows], a.tokens))
    print(check.cache)
    print("\n".join(check.lines))
    for what, seconds in check.times.items():
        print("%-50s %.1f s" % (what, seconds))
    cli_ok = True
    if a.frag:
        rows, cache = check_cli(check, a.frag, a.tokens)
        cli_ok = rows == plain["tokens"]
        print("frag run --prompt x4 --generate %d: %s; %s" % (a.tokens, "equal" if cli_ok else "DIFFER", cache))
    ok = cli_ok and (plain["tokens_equal"] and steered["tokens_equal"] and plain["logits"] <= a.tolerance
          and steered["logits"] <= a.tolerance and plain["tokens"] != steered["tokens"])
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
