"""A vLLM worker killed under fragments' OpenAI server, then the server started again (issue 40).

    python server_faults.py TP [--inflight 8] [--timeout 60] [--out FILE.json]

Starts `vllm serve` (server_check.Served), puts INFLIGHT long requests in flight with the official client
(half streamed, half not; half of each with a plan that saves and steers), and once every stream has its
first chunk, kills one of vLLM's worker processes (SIGKILL, the last `VLLM::Worker*` under the engine core).
Checks, one line each: every in-flight client gets an answer within TIMEOUT s (an HTTP error status, a
stream that ends or breaks; none hangs), the non-streamed ones a 5xx; a request sent after the kill is
answered within TIMEOUT s (an error status, or the connection refused once the server has shut down) and
/health stops answering 200; the server process exits by itself or is stopped; no process of the old server
is left; the same command started again on the same port serves a plain request and a request with a plan
(its saves back). Prints a JSON summary (each client's outcome and seconds); exits non-zero on any failure.
"""
import argparse
import asyncio
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vllm_check import check, FAILED  # noqa: E402

PLAN = [{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv0", "step": 0},
        {"at": "model.layers.1.mlp.down_proj.input", "do": "add", "value": "@steer"}]


def workers(server_pid):
    import psutil
    return [p for p in psutil.Process(server_pid).children(recursive=True) if p.name().startswith("VLLM::Worker")]


async def in_flight(served, n, timeout, started):
    """n requests (module docstring); `started` is set once every stream has its first chunk. Returns each
    client's (kind, outcome, seconds after the kill or None)."""
    import openai
    api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=served.client().api_key,
                             max_retries=0, timeout=timeout)
    first_chunks, out = asyncio.Semaphore(0), []
    kill_time = {}

    async def one(i):
        stream, plan = i % 2 == 0, i % 4 < 2
        body = {"ignore_eos": True, **({"vllm_xargs": {"fragments": json.dumps(PLAN)}} if plan else {})}
        kind = f"{'stream' if stream else 'complete'}{' +plan' if plan else ''}"
        try:
            r = await api.completions.create(model=served.folder, prompt=[5 + i, 6, 7, 8], max_tokens=110,
                                             temperature=0.0, stream=stream, extra_body=body)
            if stream:
                seen = False
                async for _ in r:
                    if not seen:
                        seen = True
                        first_chunks.release()
                outcome = "stream ended"
            else:
                outcome = "200"
        except openai.APIStatusError as e:
            outcome = str(e.status_code)
        except Exception as e:  # a broken stream or connection: an answer, not a hang
            outcome = f"{type(e).__name__}"
        out.append((kind, outcome, time.time() - kill_time["t"] if "t" in kill_time else None))

    async def wait_started():
        for _ in range((n + 1) // 2):
            await first_chunks.acquire()
        kill_time["t"] = time.time()
        started.set()
    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    await asyncio.wait_for(wait_started(), 300)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout + 30)
    return out


async def kill_during(served, n, timeout):
    started = asyncio.Event()
    flight = asyncio.ensure_future(in_flight(served, n, timeout, started))
    await started.wait()
    victim = workers(served.proc.pid)[-1]
    name = f"{victim.name()} pid {victim.pid}"
    victim.send_signal(signal.SIGKILL)
    return name, await flight


def after_kill(served, timeout):
    """A request and /health after the kill: (its outcome, seconds, /health's answer, seconds until the
    server process exited or None)."""
    import httpx
    client = served.client()
    t0 = time.time()
    try:
        code = httpx.post(f"http://127.0.0.1:{served.port}/v1/completions", timeout=timeout,
                          headers={"Authorization": f"Bearer {client.api_key}"},
                          json={"model": served.folder, "prompt": [5, 6], "max_tokens": 2}).status_code
    except httpx.HTTPError as e:
        code = type(e).__name__
    took = time.time() - t0
    try:
        health = httpx.get(f"http://127.0.0.1:{served.port}/health", timeout=timeout).status_code
    except httpx.HTTPError as e:
        health = type(e).__name__
    t1 = time.time()
    try:
        served.proc.wait(timeout)
        exited = time.time() - t1
    except Exception:  # still running: stopped below, and the summary says it did not exit
        exited = None
    return code, took, health, exited


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--out")
    args = ap.parse_args()
    import psutil
    from server_check import Served
    served = Served(args.tp, "faults")
    summary = {"tp": args.tp}
    try:
        old = [psutil.Process(served.proc.pid)] + psutil.Process(served.proc.pid).children(recursive=True)
        victim, outcomes = asyncio.run(kill_during(served, args.inflight, args.timeout))
        summary["killed"] = victim
        summary["inflight"] = [{"kind": k, "outcome": o, "s_after_kill": None if s is None else round(s, 2)}
                               for k, o, s in outcomes]
        answered = [s for _, _, s in outcomes if s is not None]
        check(f"kill: every in-flight client answered within {args.timeout:.0f} s of the kill "
              f"(slowest {max(answered, default=0):.1f} s)", len(outcomes) == args.inflight and
              all(s is not None and s <= args.timeout for _, _, s in outcomes), json.dumps(summary["inflight"]))
        check("kill: the non-streamed in-flight requests got a 5xx", all(o.startswith("5") for k, o, _ in outcomes
                                                                          if k.startswith("complete")),
              str([o for k, o, _ in outcomes if k.startswith("complete")]))
        code, took, health, exited = after_kill(served, args.timeout)
        summary.update(after_kill={"request": code, "s": round(took, 2), "health": health,
                                   "server_exited_s": None if exited is None else round(exited, 1)})
        check("kill: a request after it is refused within the timeout, /health not 200",
              (code == "ConnectError" or (isinstance(code, int) and code >= 500)) and took <= args.timeout
              and health != 200, json.dumps(summary["after_kill"]))
        t0 = time.time()
        _, alive = psutil.wait_procs(old, timeout=args.timeout)  # the survivors wind down by themselves
        summary["old_processes_gone_s"] = round(time.time() - t0, 1)
        check(f"kill: no process of the old server left {args.timeout:.0f} s after the kill "
              f"(the last went after {summary['old_processes_gone_s']} s)", not alive,
              str([f"{p.pid}" for p in alive]))
        served.stop()  # ends what is left
        summary["restart_s"] = round(served.start(), 1)
        client = served.client()
        plain, planned = client.complete([5, 6, 7]), client.complete([5, 6, 7], PLAN)
        check("restart: the server serves again, a plain request and one with a plan (saves back)",
              len(plain["tokens"]) == 5 and planned["saves"] is not None and "qkv0" in planned["saves"],
              f"{plain['tokens']} {planned['fragments'] and planned['fragments']['error']}")
        summary["failed"] = FAILED
    finally:
        served.done(FAILED)
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
