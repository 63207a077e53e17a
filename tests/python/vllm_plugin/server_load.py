"""A load run against fragments' OpenAI server (issue 40; results in bench/README.md).

    python server_load.py TP [--clients 64] [--minutes 5] [--ttl 60] [--no-plans] [--out FILE.json]

Starts `vllm serve` (server_check.Served: the tiny Llama, `--api-key`, --max-num-seqs = CLIENTS) and runs
CLIENTS clients at once for MINUTES, each an asyncio task with the official client (openai.AsyncOpenAI;
httpx for GET /v1/fragments/saves/KEY), each request a fresh random prompt (4-12 token ids), 8-24 greedy
tokens (ignore_eos). A quarter of the clients send plans; every plan saves the embedding's output at the
prefill (the rows of its own prompt's ids: which prompt it ran on) and the logits at every step (their
argmax is the answer's tokens: which generation it saw) and adds "@steer" at layer 1's down projection
input every step. Each client draws its next request:
  plain clients  complete 55%, stream 25%, stream left after its first chunk 10%, cancelled 10%
  plan clients   complete 40%, stream then fetch its saves 20%, stream never fetched 10% (they expire:
                 FRAGMENTS_VLLM_SAVES_TTL=TTL), stream left after its first chunk 10%, cancelled 10%, a step
                 that fails at run time 10% (200, its fragments.error)
(cancelled: the client gives up after 0.05-0.5 s and closes the connection). Checks, printing one line each:
zero lost answers (every request not given up answered 200 or 4xx; none 5xx, none over 120 s), zero saves in
the wrong answer (each plan's embedding rows are its own prompt's, exactly; its logits' argmax its tokens),
the memory of the API server, the engine and the workers (RSS every 15 s) flat after warm-up (minute 5 within
64 MB + 10% of minute 1), and, once the run ends and the unfetched saves expire, no plan, hook or saves left
in the workers (/metrics). Reports latency p50/p99 of completions with plans against those without in the
same run; --no-plans makes every client plain (the run without plans at all: its latency and memory).
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

PLAIN_MIX = [("complete", 55), ("stream", 25), ("leave", 10), ("cancel", 10)]
PLAN_MIX = [("complete", 40), ("stream-fetch", 20), ("stream-abandon", 10), ("leave", 10), ("cancel", 10),
            ("fail", 10)]


def plan_for(fail=False):
    plan = [{"at": "model.embed_tokens.output", "do": "save", "as": "emb", "step": 0},
            {"at": "logits_processor.output", "do": "save", "as": "final_logits"},
            {"at": "model.layers.1.mlp.down_proj.input", "do": "add", "value": "@steer"}]
    if fail:  # row 50 of a prompt of at most 12 tokens: fails in the workers, this request alone
        plan[2]["index"] = "50,..."
    return plan


class Run:
    def __init__(self, served, clients, minutes, embedding, plan_every=4):
        import openai
        self.served, self.clients, self.deadline = served, clients, time.time() + 60 * minutes
        self.client = served.client()
        self.api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=self.client.api_key,
                                      max_retries=0, timeout=120)
        self.embedding = embedding
        self.plan_every = plan_every  # every plan_every-th client sends plans; 0: none does
        self.records = []  # per request: kind, plan, outcome, seconds, tokens, verified or a problem

    def verify(self, prompt, tokens, frag):
        """None when the saves are this request's own, else what is wrong."""
        import torch
        from safetensors.torch import load
        import base64
        if not frag or not frag.get("safetensors"):
            return f"no saves: {frag and frag.get('error')}"
        saves = load(base64.b64decode(frag["safetensors"]))
        if not torch.equal(saves["emb"], self.embedding[prompt]):
            return "embedding rows are not this prompt's"
        if saves["final_logits"].shape[0] != len(tokens) or saves["final_logits"].argmax(-1).tolist() != list(tokens):
            return f"logits' argmax {saves['logits'].argmax(-1).tolist()} is not the tokens {list(tokens)}"
        return None

    async def one(self, rng, kind, with_plan):
        prompt = [rng.randrange(3, self.served.vocab) for _ in range(rng.randint(4, 12))]
        body = {"return_token_ids": True, "ignore_eos": True}
        if with_plan:
            body["vllm_xargs"] = {"fragments": json.dumps(plan_for(kind == "fail"))}
        args = dict(model=self.client.model, prompt=prompt, max_tokens=rng.randint(8, 24), temperature=0.0,
                    extra_body=body)
        t0 = time.time()
        record = {"kind": kind, "plan": with_plan, "max_tokens": args["max_tokens"]}
        try:
            if kind in ("complete", "fail"):
                await self.complete(record, prompt, args)
            elif kind == "cancel":
                try:
                    await asyncio.wait_for(self.api.completions.create(**args), rng.uniform(0.05, 0.5))
                    record["outcome"] = "200 (before the cancel)"
                except asyncio.TimeoutError:
                    record["outcome"] = "cancelled"
            else:
                await self.stream(record, prompt, args, kind, with_plan)
        except Exception as e:  # an error status or a broken connection: a lost answer, none is expected here
            status = getattr(e, "status_code", None)
            record["outcome"] = str(status) if status else f"lost: {type(e).__name__}"
            record["problem"] = str(e)[:300]
        record["seconds"] = time.time() - t0
        self.records.append(record)

    async def complete(self, record, prompt, args):
        r = await self.api.completions.with_raw_response.create(**args)
        answer = r.parse()
        record["outcome"] = str(r.status_code)
        tokens = list(answer.choices[0].token_ids)
        frag = (answer.model_extra or {}).get("fragments")
        if record["kind"] == "fail":
            record["problem"] = None if frag and "(add)" in (frag.get("error") or "") else f"no step error: {frag}"
        elif record["plan"]:
            record["problem"] = self.verify(prompt, tokens, frag)
        elif frag is not None:
            record["problem"] = "a plain request's answer has a fragments field"

    async def stream(self, record, prompt, args, kind, with_plan):
        import httpx
        r = await self.api.completions.with_raw_response.create(stream=True, **args)
        key = r.headers.get("x-fragments-key")
        tokens, stream = [], r.parse()
        async for chunk in stream:
            tokens += list((chunk.choices[0].model_extra or {}).get("token_ids") or []) if chunk.choices else []
            if kind == "leave":
                await stream.close()  # the connection closes mid-stream
                record["outcome"] = "left"
                return
        record["outcome"] = str(r.status_code)
        if kind == "stream-fetch":
            async with httpx.AsyncClient(timeout=120) as http:
                got = await http.get(f"http://127.0.0.1:{self.served.port}/v1/fragments/saves/{key}",
                                     headers={"Authorization": f"Bearer {self.client.api_key}"})
            record["problem"] = self.verify(prompt, tokens, got.json()) if got.status_code == 200 else \
                f"GET saves {got.status_code}"

    async def client_loop(self, index):
        rng = random.Random(index)
        with_plan = bool(self.plan_every) and index % self.plan_every == 0
        mix = PLAN_MIX if with_plan else PLAIN_MIX
        while time.time() < self.deadline:
            kind = rng.choices([k for k, _ in mix], [w for _, w in mix])[0]
            await self.one(rng, kind, with_plan)

    async def sample_memory(self, samples):
        import psutil
        server = psutil.Process(self.served.proc.pid)
        t0 = time.time()
        while time.time() < self.deadline:
            row = {"t": round(time.time() - t0), "api": server.memory_info().rss}
            for child in server.children(recursive=True):
                try:
                    row[f"{child.name()}:{child.pid}"] = child.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            samples.append(row)
            await asyncio.sleep(15)

    async def main(self, samples):
        await asyncio.gather(self.sample_memory(samples), *[self.client_loop(i) for i in range(self.clients)])


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else None


def summarize(records, samples, minutes, memory=True):
    """The run's numbers (JSON-able) and its checks."""
    summary = {"requests": len(records), "outcomes": {}}
    for r in records:
        key = f"{r['kind']}{' +plan' if r['plan'] else ''}: {r['outcome']}"
        summary["outcomes"][key] = summary["outcomes"].get(key, 0) + 1
    # every request is valid: anything but 200 (or the client's own leaving) is a lost answer
    lost = [r for r in records if not (r["outcome"].startswith("200") or r["outcome"] in ("cancelled", "left"))]
    wrong = [r for r in records if r.get("problem") and r["outcome"] == "200"]
    verified = sum(1 for r in records if r["plan"] and r["kind"] in ("complete", "stream-fetch")
                   and r["outcome"] == "200" and not r.get("problem"))
    summary["verified_plan_answers"] = verified
    check(f"load: zero lost answers ({len(records)} requests)", not lost, str(lost[:3])[:600])
    check(f"load: zero saves in the wrong answer ({verified} plans' saves checked against their own prompt and "
          "tokens)", not wrong and (verified > 0 or not any(r["plan"] for r in records)), str(wrong[:3])[:600])
    for name, plan in (("without plans", False), ("with plans", True)):
        done = [r for r in records if r["kind"] == "complete" and r["plan"] == plan and r["outcome"] == "200"]
        summary[name] = {"completions": len(done),
                         "p50_s": round(percentile([r["seconds"] for r in done], 0.5) or 0, 3),
                         "p99_s": round(percentile([r["seconds"] for r in done], 0.99) or 0, 3),
                         "p50_s_per_token": round(percentile([r["seconds"] / r["max_tokens"] for r in done], 0.5) or 0, 4),
                         "p99_s_per_token": round(percentile([r["seconds"] / r["max_tokens"] for r in done], 0.99) or 0, 4)}
    at = {}
    for minute in (1, minutes):
        row = min(samples, key=lambda s: abs(s["t"] - 60 * minute)) if samples else {}
        at[minute] = {k: round(v / 2 ** 20) for k, v in row.items() if k != "t"}
        at[minute]["t"] = row.get("t")
    summary["rss_mb"] = at
    summary["rss_series_mb"] = [{k: (v if k == "t" else round(v / 2 ** 20)) for k, v in row.items()} for row in samples]
    grown = {k: at[minutes][k] - at[1][k] for k in at[1] if k != "t" and k in at[minutes]}
    if memory:
        check(f"load: memory flat from minute 1 to minute {minutes} (MB: {grown})",
              bool(grown) and all(g <= 64 + 0.1 * at[1][k] for k, g in grown.items()), json.dumps(at))
    return summary


def load(served, clients, minutes, ttl, plan_every=4):
    """The load run on a running server (its saves' TTL `ttl` s); returns the summary. A run under a minute
    (server_check.py's smoke run) skips the memory check."""
    from safetensors.torch import load_file
    import server_limits
    embedding = load_file(os.path.join(served.folder, "model.safetensors"))["model.embed_tokens.weight"]
    run = Run(served, clients, minutes, embedding, plan_every)
    samples = []
    asyncio.run(run.main(samples))
    summary = summarize(run.records, samples, max(1, round(minutes)), memory=minutes >= 2)
    values, held = server_limits.settled(run.client, timeout=ttl + 60)
    check("load: after the run and the saves' expiry, no plan, hook or saves left in the workers", not any(held),
          f"plans, hooks, held requests, held bytes: {held}")
    summary["saves_dropped"] = {dict(l).get("reason"): v for (n, l), v in values.items()
                                if n == "fragments:saves_dropped_total"}
    # A stream the client leaves while it runs has its saves dropped at once; one whose every message the
    # server had already sent (a short one) looks finished to it, and its saves expire like a never-fetched one.
    left, abandoned = (sum(1 for r in run.records if r["plan"] and r["kind"] == kind and r["outcome"] in outcomes)
                       for kind, outcomes in (("leave", ("left",)), ("stream-abandon", ("200",))))
    dropped = summary["saves_dropped"]
    if plan_every:
        check(f"load: the saves of every plan stream left ({left}) or never fetched ({abandoned}) are gone: dropped "
              "when its client left, else expired", dropped.get("disconnected", 0) >= 1 and
              dropped.get("disconnected", 0) + dropped.get("expired", 0) >= left + abandoned, str(dropped))
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=5)
    ap.add_argument("--ttl", type=int, default=60)
    ap.add_argument("--no-plans", action="store_true", help="every client plain: the baseline")
    ap.add_argument("--out")
    args = ap.parse_args()
    from server_check import Served
    served = Served(args.tp, "load", env={"FRAGMENTS_VLLM_SAVES_TTL": str(args.ttl)},
                    args=["--max-num-seqs", str(args.clients)])
    summary = {}
    try:
        summary = load(served, args.clients, args.minutes, args.ttl, 0 if args.no_plans else 4)
        summary.update(tp=args.tp, clients=args.clients, minutes=args.minutes, plans=not args.no_plans,
                       engine_start_s=round(served.start_s, 1), failed=FAILED)
    finally:
        served.done(FAILED)
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
