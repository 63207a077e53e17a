"""A fuzz run of generated hostile bodies against fragments' OpenAI server (issue 40; docs/vllm.md).

    python server_fuzz.py TP [--bodies 10000] [--seed 0] [--concurrency 8] [--out FILE.json]

Starts `vllm serve` (server_check.Served: the tiny Llama, its vectors, `--api-key`) and sends BODIES POST
/v1/completions bodies with httpx (a real client, keep-alive connections), CONCURRENCY at a time, each built
from a seed and mutated with a seeded random.Random:
  seed    server_limits.hostile_bodies (the named hostile cases: 10^5 steps, 3000-deep nesting, NaN, ...)
  plan    a random valid plan (this model's locations, every action, steps, indices, heads, "@steer"), then
          0-3 mutations of its tree: a node replaced by a random value (any JSON type, NaN/inf, 2^70, a 10^5-
          character string, a deep list), a field dropped or added, a list repeated, the plan sent as text
          or as an object
  body    the body's own fields mutated: prompts of every type (a batch, nested lists, negative ids), n,
          stream, max_tokens, ignore_eos, beam search, vllm_xargs of the wrong type
and afterwards, each on its own connection, bad values of fields vLLM itself mishandles (VLLM_FIELDS:
logprobs, min_tokens, stop, stop_token_ids) with a plan and without: the same status both ways.
  bytes   a body's JSON text cut short or with random bytes written into it
Every answer must come within 120 s and be below 500 (a valid plan's 200 carries its "fragments" object; a
stream is read to its end); afterwards the engine must serve a plain request as before, /health must be
200, and once the streams' unfetched saves expire (FRAGMENTS_VLLM_SAVES_TTL=20 here) no plan, hook or
saves may be left in the workers (server_limits.settled). Prints one line per check and a JSON summary
(statuses by kind, latency, API server memory); exits non-zero on any failure.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vllm_check import check, FAILED  # noqa: E402

ACTIONS = ("save", "add", "set", "scale", "zero", "call", "nope", "")


def random_value(rng, depth=0):
    """Any JSON-ish value, hostile ones included (NaN and inf are written by json.dumps as NaN/Infinity)."""
    kind = rng.randrange(14)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.randint(-5, 300)
    if kind == 2:
        return rng.choice([2 ** 70, -2 ** 63, 10 ** 30, 0])
    if kind == 3:
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 1e-300, 3.5])
    if kind == 4:
        return "x" * rng.choice([0, 1, 1025, 100_000])
    if kind == 5:
        return rng.choice(["@steer", "@short", "@", "@nope", "/etc/passwd:x", "../x.safetensors:v", "a:b:c",
                           "\u0000", "\ud800", "…,0:8", "...,0:8", "0,...", "...,-1", "::", "prefill", "decode"])
    if kind == 6 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7 and depth < 3:
        return {rng.choice(["at", "do", "as", "by", "step", "heads", "x", ""]): random_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if kind == 8:
        nested = 0
        for _ in range(rng.choice([5, 50, 500])):
            nested = [nested]
        return nested
    if kind == 9:
        return [rng.randint(0, 8)] * rng.choice([1, 100, 5000])
    return rng.choice(["all", "prefill", "decode", 0, 1, [0, 1], "model.norm.output", "v", "q", [1], [-1]])


def random_step(rng, locations):
    at = rng.choice(locations)
    step = {"at": at, "do": rng.choice(ACTIONS[:5])}
    if step["do"] == "save":
        step["as"] = f"s{rng.randrange(1000)}"
    elif step["do"] in ("add", "set"):
        step["value"] = rng.choice(["@steer", "@steer", "@short"])
    elif step["do"] == "scale":
        step["by"] = rng.choice([0.5, 2.0, -1.0, 0.0, 1e3])
    if rng.random() < 0.3:
        step["step"] = rng.choice(["all", "prefill", "decode", 0, 1, [0, 2], [1, 3, 5]])
    if rng.random() < 0.2:
        step["index"] = rng.choice(["...,0:8", "0,...", "...,-1", "50,...", "...,0:100000", "1:3,..."])
    if ".qkv_proj.output" in at and rng.random() < 0.3:
        step["segment"], step["heads"] = rng.choice(["q", "k", "v"]), rng.choice([[0], [1], [0, 1], [3]])
    return step


def mutate(rng, tree):
    """One random change somewhere in a JSON tree (in place where possible); returns the tree."""
    path, node = [], tree
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append((node, key))
        node = node[key]
    op = rng.randrange(5)
    if not path or op == 0:
        new = random_value(rng)
        if not path:
            return new
        parent, key = path[-1]
        parent[key] = new
    elif op == 1 and isinstance(node, dict) and node:
        del node[rng.choice(list(node))]
    elif op == 2 and isinstance(node, dict):
        node[rng.choice(["bogus", "key", "base", "program", "format", "visit", "modules", "rows"])] = \
            random_value(rng)
    elif op == 3 and isinstance(node, list) and node:
        node.extend(node * (rng.choice([1, 10, 200]) if len(node) < 1000 else 1))  # shared items: JSON copies them
    else:
        parent, key = path[-1]
        parent[key] = [parent[key]]
    return tree


def body_of(rng, model, vocab, locations, seeds):
    """(kind, body bytes) of one generated body (module docstring)."""
    kind = rng.choice(["seed", "plan", "plan", "plan", "body", "bytes"])
    if kind == "seed":
        return kind, rng.choice(seeds)[1]
    plan = [random_step(rng, locations) for _ in range(rng.randint(1, 4))]
    if kind == "plan":
        for _ in range(rng.randrange(4)):
            plan = mutate(rng, plan)
    body = {"model": model, "prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 8))],
            "max_tokens": rng.randint(1, 3), "temperature": 0.0,
            "vllm_xargs": {"fragments": json.dumps(plan) if rng.random() < 0.7 else plan}}
    if rng.random() < 0.2:
        body["stream"] = True
    if kind == "body":
        # not VLLM_FIELDS: vLLM itself answers some values there from its generic exception handler and then
        # drops the connection, plan or not; vllm_fields() shows the plan changes nothing there
        field = rng.choice(["prompt", "n", "stream", "max_tokens", "vllm_xargs", "use_beam_search", "ignore_eos"])
        body[field] = rng.choice([random_value(rng), [[1, 2], [3]], [-1, 5], "text prompt", 2, 0, {"fragments": 5}])
    text = json.dumps(body).encode()
    if kind == "bytes" and text:
        at = rng.randrange(len(text))
        text = text[:at] if rng.random() < 0.5 else text[:at] + bytes(rng.randrange(256) for _ in range(4)) + text[at + 4:]
    return kind, text


# Fields whose bad values vLLM 0.24 answers from its generic exception handler (a plain ValueError or TypeError
# in its sampling-parameter checks), after which uvicorn closes the kept-alive connection: a client's next
# request on it breaks, with or without a plan (docs/vllm.md, Limits).
VLLM_FIELDS = {"logprobs": [[1], {"a": 1}, "2"], "min_tokens": [5, -2 ** 63], "stop": ["", [""], [[1]], 5],
               "stop_token_ids": [["x"], 7]}


def vllm_fields(port, key, model):
    """Each bad value of VLLM_FIELDS with a plan and without, each on a fresh connection: {field=value:
    (status with a plan, status without)}. fragments' checks must not change vLLM's answer."""
    import httpx
    plan = json.dumps([{"at": "model.norm.output", "do": "save", "as": "n"}])
    out = {}
    for field, values in VLLM_FIELDS.items():
        for value in values:
            statuses = []
            for with_plan in (True, False):
                body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2, field: value}
                if with_plan:
                    body["vllm_xargs"] = {"fragments": plan}
                try:
                    statuses.append(httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120,
                                               headers={"Authorization": f"Bearer {key}"}).status_code)
                except httpx.HTTPError as e:
                    statuses.append(type(e).__name__)
            out[f"{field}={json.dumps(value)}"] = statuses
    return out


async def send_all(port, key, bodies, concurrency, timeout=120.0):
    """Sends every (kind, body); returns [(kind, status or an exception's name, seconds, problem or None)]."""
    import httpx
    url = f"http://127.0.0.1:{port}/v1/completions"
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    out, queue = [], list(enumerate(bodies))

    async def one(http, kind, body):
        t0 = time.time()
        problem = None
        try:
            async with http.stream("POST", url, content=body, headers=headers, timeout=timeout) as r:
                data = await r.aread()  # a stream is read to its end
                status = r.status_code
                if status == 200 and r.headers.get("x-fragments-key") and b'"fragments"' not in data and \
                        b"data:" not in data[:10]:
                    problem = "200 with a plan but no fragments object"
        except Exception as e:  # a timeout or a broken connection: the server failed this body
            status, problem = type(e).__name__, str(e)[:200]
        if isinstance(status, int) and (status >= 500 or b"internal error while checking" in data):
            problem = data[:300].decode(errors="replace")
        out.append((kind, status, time.time() - t0, problem, body[:2000]))

    async def worker(http):
        while queue:
            _, (kind, body) = queue.pop()
            await one(http, kind, body)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as http:
        await asyncio.gather(*[worker(http) for _ in range(concurrency)])
    return out


def run(client, served_pid, n, seed, concurrency, vocab, quiet=False):
    """The fuzz run on a running server; returns its summary (checks printed as they pass or fail)."""
    import psutil
    import server_limits
    record = client.get("/v1/fragments/model")
    locations = [f"{m}.{side}" for m in record["modules"] for side in ("input", "output")]
    locations += ["model.layers.9.mlp.down_proj.input", "model.norm.outptu", "logits_processor.input", ""]
    seeds = [s for s in server_limits.hostile_bodies(client.model) if len(s[1]) < (1 << 20)]
    rng = random.Random(seed)
    bodies = [body_of(rng, client.model, vocab, locations, seeds) for _ in range(n)]
    before = client.complete([5, 6, 7])
    rss0 = psutil.Process(served_pid).memory_info().rss
    t0 = time.time()
    results = asyncio.run(send_all(client.port, client.api_key, bodies, concurrency))
    took = time.time() - t0
    statuses, bad = {}, [r for r in results if r[3] is not None]
    for kind, status, _, _, _ in results:
        statuses.setdefault(kind, {}).setdefault(str(status), 0)
        statuses[kind][str(status)] += 1
    times = sorted(r[2] for r in results)
    summary = {"bodies": len(results), "seconds": round(took, 1), "statuses": statuses,
               "p50_s": round(times[len(times) // 2], 4), "p99_s": round(times[int(len(times) * 0.99)], 4),
               "max_s": round(times[-1], 3), "api_server_rss_mb": [round(rss0 / 2 ** 20), round(
                   psutil.Process(served_pid).memory_info().rss / 2 ** 20)],
               "problems": [(k, s, p, b.decode(errors="replace")[:300]) for k, s, _, p, b in bad[:10]]}
    check(f"fuzz: {len(results)} bodies answered, none 5xx, none lost or over 120 s ({took:.0f} s)",
          len(results) == n and not bad, json.dumps(summary["problems"])[:1500])
    fields = vllm_fields(client.port, client.api_key, client.model)
    summary["vllm_fields"] = fields
    check("fuzz: vLLM's own fields with bad values: the same answer with a plan as without, none 5xx",
          all(a == b and isinstance(a, int) and a < 500 for a, b in fields.values()), json.dumps(fields))
    after = client.complete([5, 6, 7])
    check("fuzz: the engine serves a plain request afterwards, as before", after["tokens"] == before["tokens"],
          f"{after['tokens']} vs {before['tokens']}")
    check("fuzz: /health 200 afterwards", client.status("/health")[0] == 200)
    _, held = server_limits.settled(client, timeout=90)
    check("fuzz: afterwards no plan, hook or saves left in the workers (unfetched streams' saves expired)",
          not any(held), f"plans, hooks, held requests, held bytes: {held}")
    summary["held_after"] = held
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("--bodies", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    from server_check import Served
    served = Served(args.tp, "fuzz", env={"FRAGMENTS_VLLM_SAVES_TTL": "20"})
    try:
        summary = run(served.client(), served.proc.pid, args.bodies, args.seed, args.concurrency, served.vocab)
        summary.update(tp=args.tp, seed=args.seed, concurrency=args.concurrency, engine_start_s=round(served.start_s, 1),
                       failed=FAILED)
    finally:
        served.done(FAILED)
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
