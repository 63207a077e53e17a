"""The OpenAI server's checks against misuse (issue 40), run by server_check.py on its running server:

  G  auth: with `--api-key`, every fragments route (GET /v1/fragments/saves/KEY, /model, /vectors, an
     unknown one) and a completion with a plan refuse a missing and a wrong key (401) and answer the right one
  H  hostile bodies (hostile_bodies below): each answered 400 in one line, naming what is wrong, within
     5 s, the API server's memory within 64 MB of before; a plan in a body too large to read or under a
     JSON-escaped key (which the middleware does not see) refused by vLLM's validator, never run; then a
     plain request is served as before
  I  clients that leave: streams closed after their first chunk and completions given up after 0.3 s,
     beside a request with a plan that runs through: that request's answer equals its answer alone; then
     no plan, no hook and no saves are left in any worker (the server's /metrics, read by prometheus_client's
     parser), the disconnected streams' saves are counted dropped and their keys answer 410
  J  /metrics: fragments' counters by reason (plans refused, requests with plans, saves returned)

`hostile_bodies` is also the seed list of server_fuzz.py.
"""
import asyncio
import json
import time

from vllm_check import check

ROUTES = ("/v1/fragments/saves/frag-00000000000000000000000000000000", "/v1/fragments/model",
          "/v1/fragments/vectors", "/v1/fragments/nothing-here")


def check_auth(client):
    import httpx
    for path in ROUTES:
        codes = [client.status(path, key)[0] for key in (None, "wrong-key", client.api_key)]
        check(f"G {path}: no key 401, a wrong key 401, the right key answered", codes[:2] == [401, 401]
              and codes[2] != 401, str(codes))
    body = {"model": client.model, "prompt": [5, 6], "max_tokens": 1,
            "vllm_xargs": {"fragments": json.dumps([{"at": "model.norm.output", "do": "save", "as": "n"}])}}
    codes = []
    for key in (None, "wrong-key", client.api_key):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        codes.append(httpx.post(f"http://127.0.0.1:{client.port}/v1/completions", json=body, headers=headers,
                                timeout=120).status_code)
    check("G a completion with a plan: no key 401, a wrong key 401, the right key 200", codes == [401, 401, 200],
          str(codes))


def hostile_bodies(model, good_at="model.layers.1.mlp.down_proj.input"):
    """(name, request body as bytes, a word the 400's message must hold) for plans built to hurt. Plans the
    schema refuses are written with dict(...), not as literals: tests/runtime/plan_schema_test.py checks
    every literal plan in the repository."""
    def body(fragments, **extra):
        return json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 2, "vllm_xargs": {"fragments": fragments},
                           **extra}).encode()
    save = {"at": good_at, "do": "save", "as": "x"}
    deep = "[" * 3000 + "]" * 3000
    return [
        ("10^5 save steps", body(json.dumps([dict(save, **{"as": f"x{i}"}) for i in range(100_000)])), "bytes"),
        ("2000 save steps", body(json.dumps([{"at": "model.norm.output", "do": "save", "as": "x"}] * 2000)),
         "interventions"),
        ("a plan nested 3000 deep (JSON text)", body(deep), "nest"),  # "nested" or "nests": per Python version
        ("a plan nested 3000 deep (object)", b'{"model": "m", "prompt": [1], "vllm_xargs": {"fragments": '
         + deep.encode() + b'}}', "nest"),
        ("a plan nested 5 deep", body(json.dumps([{"at": good_at, "do": "save", "as": "x", "heads": [[[1]]]}])),
         "nests deeper"),
        ("NaN", body('[{"at": "%s", "do": "scale", "by": NaN}]' % good_at), "NaN"),
        ("Infinity", body('[{"at": "%s", "do": "scale", "by": -Infinity}]' % good_at), "Infinity"),
        ("1e400 (inf)", body('[{"at": "%s", "do": "scale", "by": 1e400}]' % good_at), "finite"),
        ("an oversized factor", body(json.dumps([{"at": good_at, "do": "scale", "by": 1e9}])), "by"),
        ("a value of the wrong width", body(json.dumps([{"at": good_at, "do": "add", "value": "@short"}])),
         "does not fit"),
        ("an unknown vector", body(json.dumps([{"at": good_at, "do": "add", "value": "@nope"}])), "@nope"),
        ("an unknown step field", body(json.dumps([dict(save, bogus=1)])), "bogus"),
        ("an unknown plan field", body(json.dumps({"interventions": [save], "extra": 1})), "extra"),
        ("interventions not a list", body(json.dumps(dict(interventions="save"))), "list"),
        ("a location of the wrong type", body(json.dumps([dict(save, at=5)])), "at"),
        ("heads of the wrong type", body(json.dumps([dict(at="model.layers.0.self_attn.qkv_proj.output",
                                                          do="zero", segment="v", heads="1")])), "heads"),
        ("a negative step", body(json.dumps([dict(save, step=-1)])), "step"),
        ("a 2^70 head", body(json.dumps([{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "zero",
                                          "segment": "v", "heads": [2 ** 70]}])), "2^53"),
        ('a "program"', body(json.dumps(dict(interventions=[], program=["g", 0]))), "program"),
        ("a file on the server", body(json.dumps([{"at": good_at, "do": "add", "value": "/etc/passwd:x"}])),
         "registered vector"),
        ("a folder on the server", body(json.dumps({"interventions": [save], "base": "/etc"})), "base"),
        ("a 10^5-character location", body(json.dumps([dict(save, at="m" * 100_000)])), "characters"),
        ("a plan of 1 MB", body(json.dumps([dict(save, **{"as": "y" * 1000})] * 1000)), "bytes"),
        ("a location typo", body(json.dumps([dict(save, at=good_at.replace("down_proj", "down_prj"))])),
         "did you mean"),
        ("a number for a plan", body(12), "plan"),
        ("invalid JSON text", body("[{"), "JSON"),
        ("a batch of prompts", body(json.dumps([save]), prompt=[[5, 6], [7, 8]]), "one prompt"),
        ("n = 3", body(json.dumps([save]), n=3), "n = 1"),
        ("beam search", body(json.dumps([save]), use_beam_search=True), "beam"),
    ]


def check_hostile(client, proc_pid):
    import httpx
    import psutil
    server = psutil.Process(proc_pid)
    before = server.memory_info().rss
    worst, url = 0.0, f"http://127.0.0.1:{client.port}/v1/completions"
    headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"}
    with httpx.Client(timeout=60) as http:
        for name, body, word in hostile_bodies(client.model):
            t0 = time.time()
            r = http.post(url, content=body, headers=headers)
            took = time.time() - t0
            worst = max(worst, took)
            message = (r.json().get("error") or {}).get("message", "") if r.status_code == 400 else r.text
            check(f"H {name}: 400 in one line naming it, {took:.2f} s", r.status_code == 400 and word in message
                  and "\n" not in message and took < 5, f"{r.status_code} {message[:200]}")
        # a body over FRAGMENTS_VLLM_MAX_BODY_BYTES (8 MiB here) is not read by fragments' middleware: vLLM's
        # validator refuses its plan, which the middleware never issued
        big = json.dumps({"model": client.model, "prompt": [5, 6], "max_tokens": 1, "padding": "p" * (9 << 20),
                          "vllm_xargs": {"fragments": json.dumps([{"at": "model.norm.output", "do": "save",
                                                                   "as": "n"}])}}).encode()
        r = http.post(url, content=big, headers=headers)
        check("H a plan in a body over FRAGMENTS_VLLM_MAX_BODY_BYTES: 400 from vLLM's validator",
              r.status_code == 400 and "did not pass the server's checks" in r.text, f"{r.status_code} {r.text[:200]}")
        # the key spelled with a JSON escape: the middleware's byte scan misses it, vLLM's parser does not
        hidden = ('{"model": %s, "prompt": [5, 6], "max_tokens": 1, "vllm_xargs": {"\\u0066ragments": %s}}'
                  % (json.dumps(client.model), json.dumps(json.dumps([{"at": "model.norm.output", "do": "save",
                                                                        "as": "n"}])))).encode()
        r = http.post(url, content=hidden, headers=headers)
        check("H a plan under an escaped key: 400 from vLLM's validator", r.status_code == 400 and
              "did not pass the server's checks" in r.text, f"{r.status_code} {r.text[:200]}")
    grown = (server.memory_info().rss - before) / 2 ** 20
    check(f"H the API server's memory after the hostile bodies: {grown:+.0f} MB", grown < 64, f"worst {worst:.2f} s")


def metric_values(client):
    """{(name, labels as a sorted tuple): value} from GET /metrics, through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families
    code, text = client.status("/metrics", client.api_key)
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(values, name, **labels):
    return values.get((name, tuple(sorted(labels.items()))), 0.0)


def settled(client, timeout=60):
    """The workers' gauges once no plan, hook or saves are held (the engine drops an aborted request's plan
    at its next step), or the last reading after `timeout` s."""
    t0 = time.time()
    while True:
        time.sleep(1.1)  # the middleware asks the workers at most once a second
        values = metric_values(client)
        held = [metric(values, f"fragments:{n}") for n in ("worker_live_plans", "worker_hooks", "saves_held_requests",
                                                            "saves_held_bytes")]
        if not any(held) or time.time() - t0 > timeout:
            return values, held


async def _leave_early(client, prompt, plan, streams, cancels):
    """`streams` streamed requests closed after their first chunk and `cancels` completions abandoned after
    0.3 s (the client closes the connection); returns the streams' (status, key)."""
    import httpx
    body = {"model": client.model, "prompt": prompt, "max_tokens": 100, "ignore_eos": True,
            "vllm_xargs": {"fragments": json.dumps(plan)}}
    headers = {"Authorization": f"Bearer {client.api_key}"}
    url = f"http://127.0.0.1:{client.port}/v1/completions"
    keys = []
    async with httpx.AsyncClient(timeout=120) as http:
        async def stream():
            async with http.stream("POST", url, json=dict(body, stream=True), headers=headers) as r:
                keys.append((r.status_code, r.headers.get("x-fragments-key")))
                async for _ in r.aiter_bytes():
                    break  # one chunk, then the connection closes

        async def cancel():
            try:
                await asyncio.wait_for(http.post(url, json=body, headers=headers), 0.3)
            except asyncio.TimeoutError:
                pass
        await asyncio.gather(*[stream() for _ in range(streams)], *[cancel() for _ in range(cancels)])
    return keys


def check_leaving(client, prompt):
    """I (module docstring), with a plan that saves q|k|v at the prefill and steers every step."""
    import concurrent.futures as futures
    plan = [{"at": "model.layers.0.self_attn.qkv_proj.output", "do": "save", "as": "qkv0", "step": 0},
            {"at": "model.layers.1.mlp.down_proj.input", "do": "add", "value": "@steer"}]
    alone = client.complete(prompt, plan)
    # the gauges see saves that wait: a finished stream's, until its key is fetched
    import httpx
    body = {"model": client.model, "prompt": prompt, "max_tokens": 5, "stream": True,
            "vllm_xargs": {"fragments": json.dumps(plan)}}
    with httpx.stream("POST", f"http://127.0.0.1:{client.port}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {client.api_key}"}) as r:
        r.read()
        code, key = r.status_code, r.headers.get("x-fragments-key")
    time.sleep(1.1)
    waiting = metric_values(client)
    check("I a finished stream's saves show on /metrics until fetched", code == 200 and
          metric(waiting, "fragments:saves_held_requests") >= 1 and metric(waiting, "fragments:saves_held_bytes") > 0
          and client.status(f"/v1/fragments/saves/{key}", client.api_key)[0] == 200,
          f"{metric(waiting, 'fragments:saves_held_requests')} requests")
    before = waiting
    with futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(client.complete, prompt, plan)
        streams = asyncio.run(_leave_early(client, prompt, plan, streams=4, cancels=4))
        beside = beside.result()
    check("I streams that will be left: 200 with a key", all(code == 200 and key for code, key in streams), str(streams))
    keys = [key for _, key in streams]
    same = beside["tokens"] == alone["tokens"] and all(
        bool((beside["saves"][n] - alone["saves"][n]).abs().max() <= 1e-5 * alone["saves"][n].abs().max())
        for n in alone["saves"])
    check("I a request beside clients that leave equals its answer alone", same, f"{beside['tokens']}")
    values, held = settled(client)
    check("I after clients left: no plan, hook or saves left in any worker", not any(held),
          f"plans, hooks, held requests, held bytes: {held}")
    dropped = metric(values, "fragments:saves_dropped_total", reason="disconnected") - \
        metric(before, "fragments:saves_dropped_total", reason="disconnected")
    check("I the left streams' saves counted dropped (disconnected)", dropped >= len(keys) == 4, f"{dropped} {keys}")
    codes = [client.status(f"/v1/fragments/saves/{k}", client.api_key) for k in keys]
    check("I a left stream's key answers 410 saying why", all(c == 410 and b"left before the stream ended" in t
                                                             for c, t in codes), str(codes[:1])[:200])


def check_metrics(client):
    values = metric_values(client)
    refused = {dict(labels).get("reason"): v for (name, labels), v in values.items()
               if name == "fragments:plans_refused_total"}
    check("J /metrics: plans refused by reason", refused.get("bounds", 0) >= 5 and refused.get("width", 0) >= 1
          and refused.get("file", 0) >= 1, str(refused))
    plans = sum(v for (name, _), v in values.items() if name == "fragments:requests_with_plan_total")
    check("J /metrics: requests with plans and saves returned", plans >= 8 and
          metric(values, "fragments:saves_returned_bytes_total") > 0,
          f"{plans} requests, {metric(values, 'fragments:saves_returned_bytes_total'):.0f} bytes")
