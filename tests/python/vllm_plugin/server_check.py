"""fragments through vLLM's OpenAI server (`vllm serve`), with the official openai client and curl.

    python server_check.py TP [--pp PP]

Writes a tiny Llama with transformers' save_pretrained (and a word-level tokenizer: [w0] … [w299]), a
safetensors file of steering vectors registered by name (FRAGMENTS_VLLM_VECTORS: "steer" fits layer 1's
down-projection input, "short" fits nothing), starts vLLM's own command `vllm serve DIR
--tensor-parallel-size TP` (on the CPU build it needs tools/vllm_dist_name.py's `vllm` dist-info) on
127.0.0.1 with the plugin loaded through its real entry points (a dist-info on PYTHONPATH), fp32, eager,
no prefix caching, FRAGMENTS_VLLM_MAX_SAVE_BYTES=65536, and checks, one line per check, exiting non-zero
on any failure:
  A  16 requests (8 plain, 8 with 8 different plans: saves of fragmented and whole locations at chosen
     steps, logits, a steering vector "@steer" added at every step, a v head scaled) served one at a
     time: the plans' saves come back in the response as base64 safetensors of the expected shapes;
     a plain request's answer has no "fragments" field
  B  the same 16 at once (16 threads, openai client), together with, over curl, a bad plan (an unknown
     location: HTTP 400 with the location in the message), a plan naming a file on the server (400), one
     naming a Python program (400: only an in-process LLM's traces run Python steps) and
     a request with n = 2 (400); and a "@short" vector that passes the front end's check but does not fit
     its location (200, its "fragments.error" names the location): each of the 16 equals its answer from A
     (tokens exactly; logprobs and saves within 1e-5 relative: vLLM's CPU kernels round differently in a
     batch of 16 than alone, plain requests included)
  C  "@steer": the saved down-projection input at prefill minus the unsteered one is the registered vector
  D  a plan whose saves pass the cap: 200, "safetensors" null, "error" names the cap
  F  /v1/chat/completions with the official client (client.chat.completions.create, extra_body={"vllm_xargs":
     {"fragments": plan}}; the tiny tokenizer gets a chat template that joins the messages' words): four of
     A's plans each equal A's completion served alone (same prompt ids, tokens exactly, logprobs and saves
     within 1e-5), a plain chat has no "fragments" field, a bad plan is a BadRequestError (400)
  E  stream: true over curl: the key in the x-fragments-key header, saves from GET /v1/fragments/saves/KEY
     equal to the same request's in A; GET /v1/fragments/model lists the locations; /vectors the shapes
"""
import argparse
import base64
import re
import concurrent.futures as futures
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vllm_check import check, FAILED, plugin_dist, rel, remove_work, TOL, work_folder  # noqa: E402

MAX_TOKENS = 5
CAP = 65536
TTL = 20  # seconds unfetched saves wait (FRAGMENTS_VLLM_SAVES_TTL): the short load run leaves some


def write_model(folder, vocab):
    import families
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    families.write_checkpoint("llama", folder)
    # words "[w0]" … : no word is inside another, so the special tokens (matched anywhere in a text, before
    # the split at spaces) cannot cut a word in two ("w2" would cut "w234")
    tok = Tokenizer(models.WordLevel({f"[w{i}]": i for i in range(vocab)}, unk_token="[w0]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[w0]", bos_token="[w1]",
                                                eos_token="[w2]")
    # A chat template for /v1/chat/completions: the messages' contents joined by spaces, nothing added, so a
    # chat whose one message is "[w5] [w17] [w200]" is the prompt [5, 17, 200] (the test's tokenizer has none).
    if not getattr(fast, "chat_template", None):
        fast.chat_template = "{% for m in messages %}{% if not loop.first %} {% endif %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(folder)


def vllm_command():
    """vLLM's `vllm` console script of this Python (the venv's bin/, beside sys.executable)."""
    return os.path.join(os.path.dirname(sys.executable), "vllm")


def start_server(folder, tp, port, env, log, args=()):
    """`vllm serve` with the checks' settings (flags in `args` come last: later ones win)."""
    cmd = [vllm_command(), "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp), "--enforce-eager", "--dtype", "float32",
           "--max-model-len", "128", "--no-enable-prefix-caching", "--max-num-seqs", "32", "--seed", "0",
           "--api-key", API_KEY, *args]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    t0 = time.time()
    while time.time() - t0 < 900:
        if proc.poll() is not None:  # the log's cause in the message: its folder goes at exit
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; {log_excerpt(log.name)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, time.time() - t0
        except OSError:
            time.sleep(2)
    proc.kill()
    raise RuntimeError(f"vllm serve did not come up in 900 s; {log_excerpt(log.name)}")


def log_excerpt(path):
    """The server log's root cause and tail (child_output.excerpt), for a failure's message."""
    import child_output
    try:
        with open(path, errors="replace") as f:
            return f"its log {path}:\n{child_output.excerpt(f.read())}"
    except OSError as e:
        return f"no log: {e}"


def plans(vocab):
    L = "model.layers"
    q0, q1 = f"{L}.0.self_attn.qkv_proj.output", f"{L}.1.self_attn.qkv_proj.output"
    return [
        [{"at": q0, "do": "save", "as": "qkv0", "step": 0}, {"at": "logits_processor.output", "do": "save",
                                                              "as": "final_logits"}],
        [{"at": f"{L}.1.mlp.down_proj.input", "do": "add", "value": "@steer"},
         {"at": f"{L}.1.mlp.down_proj.input", "do": "save", "as": "down1", "step": "all"}],
        [{"at": q0, "do": "scale", "by": 0.5, "segment": "v", "heads": [1]},
         {"at": f"{L}.1.self_attn.o_proj.input", "do": "save", "as": "attn1", "step": "decode"}],
        [{"at": f"{L}.0.output", "do": "save", "as": "h0", "step": [0, 2]},
         {"at": "model.norm.output", "do": "save", "as": "final", "step": "all"}],
        [{"at": f"{L}.0.mlp.gate_up_proj.output", "do": "save", "as": "gate_up0", "step": "prefill"}],
        [{"at": q1, "do": "scale", "by": 2.0, "step": 1, "index": "...,0:64"},
         {"at": q1, "do": "save", "as": "qkv1", "step": 1}],
        [{"at": f"{L}.0.mlp.down_proj.input", "do": "zero", "step": 3, "index": "...,0:8"},
         {"at": "logits_processor.output", "do": "save", "as": "final_logits", "step": [3, 4]}],
        [{"at": "model.embed_tokens.output", "do": "save", "as": "emb", "step": 0},
         {"at": f"{L}.1.mlp.down_proj.output", "do": "save", "as": "mlp1", "step": "decode"}],
    ]


API_KEY = "sk-fragments-test-" + "0123456789abcdef"  # the server's --api-key


class Client:
    def __init__(self, port, model, api_key=API_KEY):
        import openai
        self.port, self.model, self.api_key = port, model, api_key
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0)

    def complete(self, prompt, plan=None, **extra):
        body = {"return_token_ids": True, "ignore_eos": True}
        if plan is not None:
            body["vllm_xargs"] = {"fragments": json.dumps(plan)}
        body.update(extra)
        r = self.api.completions.create(model=self.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                        logprobs=1, extra_body=body)
        c = r.choices[0]
        frag = (r.model_extra or {}).get("fragments")
        return {"tokens": list(c.token_ids), "logprobs": list(c.logprobs.token_logprobs), "text": c.text,
                "fragments": frag, "saves": decode(frag)}

    def chat(self, prompt, plan=None):
        """The same request through /v1/chat/completions (the official client's chat API): one user message
        whose text is the prompt's words, so the chat template gives the same token ids."""
        body = {"return_token_ids": True, "ignore_eos": True}
        if plan is not None:
            body["vllm_xargs"] = {"fragments": json.dumps(plan)}
        r = self.api.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": " ".join(f"[w{t}]" for t in prompt)}],
            max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True, extra_body=body)
        c = r.choices[0]
        frag = (r.model_extra or {}).get("fragments")
        return {"tokens": list((c.model_extra or {}).get("token_ids") or []),
                "prompt_tokens": list((r.model_extra or {}).get("prompt_token_ids") or []),
                "logprobs": [x.logprob for x in c.logprobs.content], "text": c.message.content,
                "fragments": frag, "saves": decode(frag)}

    def curl(self, body, *extra):
        out = subprocess.run(["curl", "-s", "-o", "-", "-w", "\n%{http_code}", *extra,
                              f"http://127.0.0.1:{self.port}/v1/completions", "-H", "Content-Type: application/json",
                              "-H", f"Authorization: Bearer {self.api_key}",
                              "-d", json.dumps(dict(model=self.model, max_tokens=MAX_TOKENS, temperature=0.0, **body))],
                             capture_output=True, text=True, timeout=300).stdout
        text, _, code = out.rpartition("\n")
        return int(code), text

    def get(self, path):
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                         headers={"Authorization": f"Bearer {self.api_key}"})
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())

    def status(self, path, key=None):
        """(HTTP status, JSON body) of GET `path` with `key` as the bearer token (None: no header)."""
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                                               headers=headers), timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()


def decode(frag):
    from safetensors.torch import load
    if not frag or not frag.get("safetensors"):
        return None
    return load(base64.b64decode(frag["safetensors"]))


def same(a, b):
    """Tokens exactly; logprobs and saves within TOL relative: vLLM's CPU kernels round differently for
    different batch sizes (plain requests move too, see the report), so bits are not asked across batches."""
    if a["tokens"] != b["tokens"]:
        return False, f"tokens {a['tokens']} vs {b['tokens']}"
    import torch
    worst = rel(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]))
    if (a["saves"] is None) != (b["saves"] is None):
        return False, "saves present in one only"
    for name in (a["saves"] or {}):
        x, y = a["saves"][name], b["saves"].get(name)
        worst = max(worst, rel(x, y) if y is not None else float("inf"))
    return worst <= TOL, f"worst rel {worst:.1e}"


def run_checks(client, prompts, vocab, work):
    import torch
    from safetensors.torch import load_file
    P = plans(vocab)
    jobs = [(prompts[i], P[i // 2] if i % 2 else None) for i in range(16)]
    alone = [client.complete(p, plan) for p, plan in jobs]
    for i, (r, (_, plan)) in enumerate(zip(alone, jobs)):
        if plan is None:
            check(f"A plain request {i}: no fragments field", r["fragments"] is None, str(r["fragments"])[:80])
        else:
            names = {s["as"] for s in plan if s["do"] == "save"}
            got = set(r["saves"] or {})
            check(f"A plan {i // 2}: saves {sorted(names)} returned", got == names and r["fragments"]["error"] is None,
                  f"{sorted(got)} {r['fragments'] and r['fragments']['error']}")
    tokens = len(prompts[1])
    s0 = alone[1]["saves"]
    check("A qkv0 at prefill: [prompt tokens, (4+2+2)*64]", s0 and tuple(s0["qkv0"].shape) == (tokens, 512),
          str(s0 and tuple(s0["qkv0"].shape)))
    check("A logits every step: [max_tokens, vocab]", s0 and tuple(s0["final_logits"].shape) == (MAX_TOKENS, vocab),
          str(s0 and tuple(s0["final_logits"].shape)))

    bad_plan = [{"at": "model.layers.9.mlp.down_proj.input", "do": "save", "as": "x"}]
    with futures.ThreadPoolExecutor(20) as pool:
        together = [pool.submit(client.complete, p, plan) for p, plan in jobs]
        bad = pool.submit(client.curl, {"prompt": prompts[0], "vllm_xargs": {"fragments": json.dumps(bad_plan)}})
        file_plan = [{"at": "model.layers.1.mlp.down_proj.input", "do": "add", "value": "/etc/x.safetensors:v"}]
        bad_file = pool.submit(client.curl, {"prompt": prompts[0], "vllm_xargs": {"fragments": json.dumps(file_plan)}})
        with_program = dict(interventions=[], program=["trace-0", 0])  # not a plan of the schema: refused
        bad_program = pool.submit(client.curl, {"prompt": prompts[0], "vllm_xargs": {"fragments": json.dumps(
            with_program)}})
        bad_n = pool.submit(client.curl, {"prompt": prompts[0], "n": 2, "vllm_xargs": {"fragments": json.dumps(P[0])}})
        short = pool.submit(client.curl, {"prompt": prompts[2], "vllm_xargs": {"fragments": json.dumps(
            [{"at": "model.layers.1.mlp.down_proj.input", "do": "add", "value": "@short"}])}})
        late = pool.submit(client.complete, prompts[2],  # row 50 of a short prompt: fails when it runs
                           [{"at": "model.layers.1.mlp.down_proj.input", "do": "add", "value": "@steer",
                             "index": "50,..."}])
        together = [f.result() for f in together]
    code, text = bad.result()
    check("B bad plan: HTTP 400 naming the location", code == 400 and "model.layers.9.mlp.down_proj.input" in text,
          f"{code} {text[:160]}")
    code, text = bad_file.result()
    check("B a file on the server refused: 400", code == 400 and "@name" in text, f"{code} {text[:120]}")
    code, text = bad_program.result()
    check("B a plan naming a Python program refused: 400", code == 400 and "program" in text, f"{code} {text[:120]}")
    code, text = bad_n.result()
    check("B n = 2 with a plan: 400", code == 400 and "n = 1" in text, f"{code} {text[:120]}")
    code, text = short.result()
    check("B a vector that does not fit its location: 400 at submission, naming both",
          code == 400 and "model.layers.1.mlp.down_proj.input" in text and "@short" in text and "does not fit" in text,
          f"{code} {text[:200]}")
    lr = late.result()
    check("B a step that fails when it runs fails its request alone (200, error named)",
          lr["fragments"] and "model.layers.1.mlp.down_proj.input (add)" in (lr["fragments"]["error"] or ""),
          str(lr["fragments"] and lr["fragments"]["error"])[:160])
    for i, (a, b) in enumerate(zip(alone, together)):
        ok, why = same(a, b)
        check(f"B request {i} ({'plan ' + str(i // 2) if i % 2 else 'plain'}) at once == alone", ok, why)

    plain = client.complete(prompts[3], [{"at": "model.layers.1.mlp.down_proj.input", "do": "save", "as": "down1",
                                          "step": 0}])
    steer = load_file(os.path.join(work, "vectors.safetensors"))["steer"]
    diff = alone[3]["saves"]["down1"][:len(prompts[3])] - plain["saves"]["down1"]
    check("C @steer adds the registered vector", rel(diff, steer.expand_as(diff)) < 1e-5,
          f"rel {rel(diff, steer.expand_as(diff)):.2e}")

    # 6 KiB a row a layer (q|k|v 512, gate|up 512, o_proj and down_proj inputs 256 each, float32): prompt 0's
    # 4 tokens and 4 decode steps are 96 KiB, over the cap of 64
    big = [{"at": f"model.layers.{l}.{m}", "do": "save", "as": f"{l}{m}"} for l in (0, 1)
           for m in ("self_attn.qkv_proj.output", "mlp.gate_up_proj.output", "self_attn.o_proj.input",
                     "mlp.down_proj.input")]
    code, text = client.curl({"prompt": prompts[0], "ignore_eos": True, "vllm_xargs": {"fragments": json.dumps(big)}})
    check("D saves that must pass the cap (token ids, ignore_eos): 400 up front naming the cap", code == 400 and
          "FRAGMENTS_VLLM_MAX_SAVE_BYTES" in text, f"{code} {text[:200]}")
    r = client.complete(prompts[0], big, stop=["no-such-word"])  # a stop string: may stop early, so it runs
    kept = r["saves"] or {}
    check("D saves that pass the cap when run: truncated, the reason given", r["fragments"]["safetensors"] and
          "FRAGMENTS_VLLM_MAX_SAVE_BYTES" in (r["fragments"]["error"] or "") and 0 < r["fragments"]["bytes"] <= CAP + 4096
          and sum(t.numel() * 4 for t in kept.values()) <= CAP, f"{r['fragments']['bytes']} bytes; "
          f"{ {k: tuple(v.shape) for k, v in kept.items()} }; {str(r['fragments']['error'])[:160]}")

    code, text = client.curl({"prompt": jobs[1][0], "stream": True, "logprobs": 1, "ignore_eos": True,
                              "vllm_xargs": {"fragments": json.dumps(jobs[1][1])}}, "-D", os.path.join(work, "h.txt"))
    headers = open(os.path.join(work, "h.txt")).read().lower()
    key = next((l.split(":", 1)[1].strip() for l in headers.splitlines() if l.startswith("x-fragments-key")), None)
    streamed = client.get(f"/v1/fragments/saves/{key}") if key else {}
    saves = decode(streamed)
    check("E stream: key in the header, saves by id equal the unstreamed request's", code == 200 and saves is not None
          and all(bool((saves[n] == alone[1]["saves"][n]).all()) for n in alone[1]["saves"]), f"{code} key {key}")
    again, text = client.status(f"/v1/fragments/saves/{key}", client.api_key)
    check("E a second fetch of the same key: 410, saying they were taken", again == 410 and b"already fetched" in text,
          f"{again} {text[:160]}")
    unknown, text = client.status("/v1/fragments/saves/frag-" + "0" * 32, client.api_key)
    check("E an unknown key: 404", unknown == 404 and b"no saves under" in text, f"{unknown} {text[:160]}")
    check("E keys are unguessable: frag- and 32 hex digits (128 random bits), all different",
          key and re.fullmatch(r"frag-[0-9a-f]{32}", key) and len({r["fragments"]["key"] for r in alone if r["fragments"]})
          == 8, str(key))
    # F  chat completions: each plan of A through client.chat.completions.create(extra_body={"vllm_xargs":
    # ...}) on the same prompt equals that completion served alone; a bad plan is a 400 there too.
    for i in (1, 3, 5, 7):
        chat = client.chat(jobs[i][0], jobs[i][1])
        ok, why = same(chat, alone[i])
        check(f"F chat completion with plan {i // 2} == the completion alone", ok and
              chat["prompt_tokens"] == list(jobs[i][0]) and chat["fragments"]["error"] is None,
              f"{why}; prompt ids {chat['prompt_tokens'][:6]} vs {list(jobs[i][0])[:6]}")
    plain_chat = client.chat(jobs[0][0])
    check("F plain chat completion: no fragments field, tokens of the completion", plain_chat["fragments"] is None
          and plain_chat["tokens"] == alone[0]["tokens"], f"{plain_chat['tokens']} vs {alone[0]['tokens']}")
    import openai
    try:
        client.chat(prompts[0], bad_plan)
        check("F chat with a bad plan: 400", False, "no error")
    except openai.BadRequestError as e:
        check("F chat with a bad plan: 400 naming the location", "model.layers.9.mlp.down_proj.input" in str(e),
              str(e)[:160])

    record = client.get("/v1/fragments/model")
    check("E GET /v1/fragments/model lists locations", "model.layers.0.mlp.down_proj" in record["modules"])
    check("E GET /v1/fragments/vectors", client.get("/v1/fragments/vectors") == {"steer": [256], "short": [7]})
    return alone, jobs


def misuse_checks(served, client, alone, jobs):
    """G-J (server_limits.py): auth, hostile bodies, clients that leave, /metrics; then K, the short versions
    of the fuzz run (server_fuzz.py: 300 bodies) and the load run (server_load.py: 16 clients, 20 s)."""
    import server_fuzz
    import server_limits
    import server_load
    server_limits.check_auth(client)
    server_limits.check_hostile(client, served.proc.pid)
    after = client.complete(jobs[0][0])
    check("H a plain request after the hostile bodies equals its answer before", same(after, alone[0])[0],
          same(after, alone[0])[1])
    server_limits.check_leaving(client, jobs[1][0])
    server_limits.check_metrics(client)
    print("K", json.dumps(server_fuzz.run(client, served.proc.pid, 300, 1, 8, served.vocab))[:400], flush=True)
    print("K", json.dumps(server_load.load(served, 16, 1 / 3, TTL))[:400], flush=True)


class Served:
    """A tiny Llama (write_model), its steering vectors ("steer" fits layer 1's down-projection input,
    "short" fits nothing) and `vllm serve` on it at tensor_parallel_size `tp`, on a free 127.0.0.1 port, in a
    fresh folder: `env` adds settings, `args` flags. server_fuzz.py, server_load.py and server_faults.py start
    theirs the same way."""

    def __init__(self, tp, name="serve", env=None, args=(), port=None, pp=1):
        import torch
        from safetensors.torch import save_file
        import families
        self.tp = tp
        self.work = work_folder(f"frag-vllm-{name}-tp{tp}-")
        self.folder = os.path.join(self.work, "model")
        self.vocab = families.config("llama").vocab_size
        write_model(self.folder, self.vocab)
        g = torch.Generator().manual_seed(3)
        self.vectors = os.path.join(self.work, "vectors.safetensors")
        save_file({"steer": torch.randn(256, generator=g) * 0.5, "short": torch.ones(7)}, self.vectors)
        # token ids (the completions API takes them): the checks do not depend on how the tokenizer splits text
        self.prompts = [torch.randint(3, self.vocab, (4 + i % 6,), generator=g).tolist() for i in range(16)]
        site = plugin_dist(os.path.join(self.work, "site"))
        self.env = dict(os.environ)
        # the package this process runs first: the GPU machine's has its _C beside it (vllm_run.sh), and the
        # second environment (next_env.py) puts its own build, against its torch, first on the path
        import fragments
        self.env["PYTHONPATH"] = os.pathsep.join([site, os.path.dirname(os.path.dirname(fragments.__file__)),
                                                  self.env.get("PYTHONPATH", "")])
        cores = os.cpu_count() or 1
        workers = tp * pp
        self.env.update(VLLM_CPU_KVCACHE_SPACE="1", FRAGMENTS_VLLM_VECTORS=self.vectors, HF_HUB_OFFLINE="1",
                        VLLM_CPU_OMP_THREADS_BIND="|".join(str(r % cores) for r in range(workers)) if workers > 1
                        else f"0-{cores - 1}", **(env or {}))
        self.args = (["--pipeline-parallel-size", str(pp)] if pp > 1 else []) + list(args)
        import engine_env
        if engine_env.GPU:  # a share of the GPU (checks run side by side), float32 kept float32 (engine_env)
            self.env.setdefault("TRITON_F32_DEFAULT", "ieee")
            kw = engine_env.engine_kwargs()
            self.args[:0] = ["--gpu-memory-utilization", str(kw["gpu_memory_utilization"]),
                             "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"])]
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.proc = None
        self.start()

    def start(self):
        """(Re)starts the server; returns the seconds until /health answered."""
        self.log = open(os.path.join(self.work, "serve.log"), "a")
        import psutil
        self.proc, self.start_s = start_server(self.folder, self.tp, self.port, self.env, self.log, self.args)
        self.tree = psutil.Process(self.proc.pid).children(recursive=True)  # the engine and workers it started
        print(f"engine start {self.start_s:.1f} s (log {self.log.name})", flush=True)
        return self.start_s

    def client(self):
        return Client(self.port, self.folder)

    def stop(self):
        """Ends the server and every process it started (vLLM's engine and workers)."""
        import psutil
        if self.proc is None:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        children += [p for p in self.tree if p.pid not in {c.pid for c in children}]  # orphans of a dead server
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for child in psutil.wait_procs(children, timeout=30)[1]:  # still alive after the server went
            child.kill()
        self.proc = None

    def done(self, failed):
        """Stops the server and removes its folder (FRAG_KEEP_WORK=1 keeps it); on a failure the server's log is
        printed first."""
        self.stop()
        if failed:
            print(f"vllm serve, {log_excerpt(self.log.name)}", file=sys.stderr, flush=True)
        remove_work(self.work)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size (layer 0 on stage 0, layer 1 on 1)")
    ap.add_argument("--core", action="store_true", help="checks A-F only (no hostile bodies, fuzz or load)")
    args = ap.parse_args()
    served = Served(args.tp, pp=args.pp, env=dict(FRAGMENTS_VLLM_MAX_SAVE_BYTES=str(CAP), FRAGMENTS_VLLM_SAVES_TTL=str(TTL),
                                      FRAGMENTS_VLLM_MAX_BODY_BYTES=str(8 << 20)))
    raised = True
    try:
        client = served.client()
        alone, jobs = run_checks(client, served.prompts, served.vocab, served.work)
        if not args.core:
            misuse_checks(served, client, alone, jobs)
        raised = False
    finally:
        served.done(FAILED or raised)  # the server's log printed when a check failed or raised
    print(json.dumps({"tp": args.tp, "pp": args.pp, "engine_start_s": round(served.start_s, 1), "failed": FAILED}))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
