"""fragments in vLLM's OpenAI server (`vllm serve`): plans in the request body, saves in the response.

The general plugin (fragments.vllm:register) runs in the API server process before vLLM builds its app and
wraps `build_app` so that the app's innermost middleware (after vLLM's CORS and API-key checks: every
/v1/fragments/* route and every answer carrying saves is behind `--api-key` as vLLM's own routes are) is
FragmentsServer. Per request (POST /v1/completions, /v1/chat/completions):

  body.vllm_xargs.fragments = a plan (object, list or its JSON text; docs/vllm.md)
    → bounded first (size, depth, count, finite numbers: _plan.load_untrusted), then checked against the
      model's locations and widths (the C++ plan parser, _plan.RequestPlan): a bad plan is HTTP 400 in one
      line before vLLM sees the request; values come from registered vectors ("@name") only
      (FRAGMENTS_VLLM_ALLOW_FILES=1 also allows files on the server's disk); one prompt, n = 1; a plan whose
      saves must pass FRAGMENTS_VLLM_MAX_SAVE_BYTES is refused up front
    → given a fresh unguessable key (128 random bits) and passed on as JSON text (vLLM's vllm_xargs holds
      scalars), which vLLM copies into SamplingParams.extra_args["fragments"]: the workers run it
      (_worker.py); the plugin's check in vLLM's input processor (validate_request) refuses any plan this middleware did not issue
      (a body over FRAGMENTS_VLLM_MAX_BODY_BYTES, another route), so nothing reaches the engine unchecked
    → after vLLM's answer: the saves taken from the workers (collective_rpc "fragments_take_saves") and
      added to the JSON answer as "fragments": {"key", "error", "bytes", "safetensors": base64 or null}.
  A streamed request (stream: true) gets its key in the "x-fragments-key" header and fetches its saves
  once after the stream with GET /v1/fragments/saves/{key} (the same object; 409 while it streams, 410 once
  taken or dropped, 404 for a key the workers never saw); a stream its client leaves before the end has its
  saves dropped. GET /v1/fragments/model is fragments.vllm.inspect's record; GET /v1/fragments/vectors lists
  the registered vectors. The workers bound what waits (_saves.py); counters on /metrics (_metrics.py).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import re
import secrets
import sys
import time
from collections import OrderedDict
from typing import Optional, Tuple

from .. import _C
from . import _delivery, _plan, _saves
from ._metrics import metrics
from ._plan import EXTRA_KEY, RequestPlan, registered_vectors

log = logging.getLogger("fragments.vllm")

PLAN_PATHS = ("/v1/completions", "/v1/chat/completions")
SAVES_PATH = re.compile(r"^/v1/fragments/saves/([A-Za-z0-9_.-]{1,128})$")
DEFAULT_MAX_BODY_BYTES = 32 << 20
RPC_TIMEOUT_S = 60.0  # a fetch of saves waits for the engine's current step; a dead engine answers at once

_issued: set = set()  # keys of plans this process checked and sent on, while their request runs
_serving = False  # True in `vllm serve`'s API server process, once its app is built


def install_into_api_server() -> None:
    """Wraps vllm.entrypoints.openai.api_server.build_app when that module is loaded (the API server
    process); other processes are left alone. Idempotent."""
    from ._vllm_api import BUILD_APP_MODULES as names  # where this vLLM's API server calls build_app
    main = sys.modules.get("__main__")  # `python -m vllm.entrypoints.openai.api_server` runs it as __main__
    for module in {id(m): m for m in [sys.modules.get(n) for n in names] + [main] if m is not None and
                   (m.__name__ in names or getattr(getattr(m, "__spec__", None), "name", None) in names)}.values():
        _wrap_build_app(module)


def _wrap_build_app(module) -> None:
    if getattr(module.build_app, "_fragments", False):
        return
    original = module.build_app

    def build_app(*args, **kwargs):
        global _serving
        app = original(*args, **kwargs)
        from starlette.middleware import Middleware
        registered_vectors()  # a bad FRAGMENTS_VLLM_VECTORS stops the server at start, with its message
        for name in _saves.SETTINGS:  # so does a bad limit
            _saves.setting(name)
        for name in _plan.UNTRUSTED_SETTINGS:
            _plan.untrusted_setting(name)
        max_body_bytes()
        metrics()
        app.user_middleware.append(Middleware(FragmentsServer))  # innermost: after CORS and API keys
        app.middleware_stack = None  # vLLM's app has built its stack already; Starlette rebuilds it on use
        _serving = True
        return app
    build_app._fragments = True
    module.build_app = build_app


def max_body_bytes() -> int:
    text = os.environ.get("FRAGMENTS_VLLM_MAX_BODY_BYTES") or str(DEFAULT_MAX_BODY_BYTES)
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"FRAGMENTS_VLLM_MAX_BODY_BYTES={text!r}: expected a positive whole number (bytes of a "
                         f"request body the server reads for a plan; default {DEFAULT_MAX_BODY_BYTES})")
    return int(text)


def check_issued(spec) -> None:
    """vLLM's validator, in the API server process: a plan must have passed FragmentsServer (raises
    ValueError otherwise, which vLLM answers 400). In-process LLMs are not served: nothing to check."""
    if not _serving:
        return
    try:
        key = (json.loads(spec) if isinstance(spec, str) else spec).get("key")
    except (ValueError, AttributeError, RecursionError):
        key = None
    if key not in _issued:
        raise ValueError("fragments: this plan did not pass the server's checks; send plans in "
                         "vllm_xargs.fragments of POST /v1/completions or /v1/chat/completions, in a body of at "
                         f"most {max_body_bytes()} bytes (FRAGMENTS_VLLM_MAX_BODY_BYTES)")


def model_record() -> Optional[dict]:
    from . import _model_record
    return _model_record()


class BadPlan(ValueError):
    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason  # the label of fragments:plans_refused_total


def prepare(spec) -> Tuple[str, str, RequestPlan]:
    """A request's plan as the body carries it -> (its key, the JSON text vLLM passes to the workers, the
    parsed plan). Raises BadPlan with the message the client gets."""
    try:
        spec = dict(_plan.load_untrusted(spec))
    except ValueError as e:
        raise BadPlan(f"vllm_xargs.{EXTRA_KEY}: {e}", "bounds") from None
    if "python_steps" in spec:  # Python steps run only for an in-process LLM's traces (fragments/vllm/_python.py)
        raise BadPlan('fragments plan: "python_steps" (Python steps of fragments.vllm.VLLM\'s traces) are refused '
                      'over HTTP', "python_steps")
    if os.environ.get("FRAGMENTS_VLLM_ALLOW_FILES") != "1":
        if "base" in spec:
            raise BadPlan('fragments plan: "base" (a folder on the server) is refused; refer to registered '
                          'vectors as "@name" (FRAGMENTS_VLLM_ALLOW_FILES=1 allows files)', "file")
        for i, item in enumerate(spec.get("interventions") or []):
            value = item.get("value") if isinstance(item, dict) else None
            if value is not None and not (isinstance(value, str) and value.startswith("@")):
                raise BadPlan(f'fragments plan: intervention {i}: "value" {json.dumps(value)[:80]} is not a '
                              'registered vector; refer to one as "@name" (files on the server: '
                              "FRAGMENTS_VLLM_ALLOW_FILES=1)", "file")
    spec["key"] = "frag-" + secrets.token_hex(16)
    record = model_record()
    if record is None:
        raise BadPlan("fragments: the plugin is not active in vLLM's workers (no model record); is the "
                      "engine started with VLLM_PLUGINS unset or naming 'fragments'?", "inactive")
    plan = RequestPlan.parse(spec, spec["key"], record)
    if plan.error:
        raise BadPlan(plan.error, "width" if "does not fit" in plan.error else "invalid")
    return spec["key"], json.dumps(spec), plan


def check_body(payload: dict, path: str) -> None:
    """What a request with a plan must be besides its plan: one prompt, one sequence."""
    if payload.get("n") not in (None, 1):
        raise BadPlan("fragments: a request with a plan must have n = 1 (one sequence per plan)", "body")
    if payload.get("use_beam_search"):
        raise BadPlan("fragments: a request with a plan cannot use beam search (one sequence per plan)", "body")
    prompt = payload.get("prompt")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise BadPlan("fragments: a request with a plan takes one prompt (a string or a list of token ids), "
                      "not a batch: its saves are one request's; send one request per prompt", "body")


def check_saves_floor(plan: RequestPlan, payload: dict, record: dict, config) -> None:
    """Refuses up front a plan that must save more than FRAGMENTS_VLLM_MAX_SAVE_BYTES: the least it saves is
    knowable from the prompt's token ids (text: one row), the decode steps that must run (max_tokens with
    ignore_eos and no stop, else min_tokens) and the saved locations' widths. Otherwise the workers truncate."""
    import torch
    cap = _saves.setting("FRAGMENTS_VLLM_MAX_SAVE_BYTES")
    widths = record.get("widths") or {}
    prompt = payload.get("prompt")
    caching = bool(getattr(getattr(config, "cache_config", None), "enable_prefix_caching", False))
    rows0 = len(prompt) if isinstance(prompt, list) and prompt and not caching else 1
    most = payload.get("max_completion_tokens") or payload.get("max_tokens")
    least = payload.get("min_tokens")
    runs_to_end = payload.get("ignore_eos") is True and isinstance(most, int) and not payload.get("stop") \
        and not payload.get("stop_token_ids")
    decode = (most if runs_to_end else least if isinstance(least, int) else 0) - 1  # vLLM checks the types
    itemsize = torch.empty((), dtype=getattr(config.model_config, "dtype", torch.float32)).element_size()
    floor = 0
    for s in plan.steps:
        width = widths.get(s.at)
        if s.do != "save" or width is None or (s.index and not s.index.lstrip().startswith("...")):
            continue
        if s.index:
            try:
                width = _C.index_view(s.index, torch.empty((1, width), device="meta"), s.at).shape[1:].numel()
            except (RuntimeError, ValueError):  # the index fails when it runs, with its message
                continue
        rows = (1 if s.logits else rows0) if s.runs_at(0) else 0
        if isinstance(s.steps, frozenset):  # one row per decode step it saves at
            rows += sum(1 <= k <= decode for k in s.steps)
        elif s.steps in ("all", "decode"):
            rows += max(decode, 0)
        floor += rows * width * itemsize
    if floor > cap:
        raise BadPlan(f"fragments plan: it saves at least {floor} bytes (its locations' widths times the rows "
                      f"this request must run), over the server's cap of {cap} (FRAGMENTS_VLLM_MAX_SAVE_BYTES); "
                      "save fewer locations or steps, or ask fewer tokens", "saves_cap")


async def take(app, key: str) -> dict:
    """The saves of one request from the workers (rank 0's answer, _saves.SavesStore.take), or why not:
    {"status", "error", "data", "bytes"}; "status" is "error" when the engine did not answer."""
    try:
        steps = {key: _saves.finished_tokens.pop(key)}  # rows of steps past the request's tokens left out
        answers = await asyncio.wait_for(app.state.engine_client.collective_rpc(
            "fragments_take_saves", args=(steps, _delivery.route())), RPC_TIMEOUT_S)
    except Exception as e:  # the engine is dead or hung: the client hears it, the server does not crash
        return {"status": "error", "error": f"fragments: the saves could not be fetched from the engine: "
                f"{type(e).__name__}: {e}"[:500], "data": None, "bytes": 0}
    from ._stages import merge_takes
    first = merge_takes(answers, [key])  # at pp > 1 each stage answers with its own saves
    return first.get(key) or {"status": "unknown", "error": None, "data": None, "bytes": 0}


def fragments_object(key: str, entry: dict) -> dict:
    """The "fragments" object of an answer: the key, the saves as base64 safetensors (or null), their size
    and the error (a failed step, a truncation, or why the saves are gone)."""
    data = _delivery.payload(entry)  # bytes in the answer, or a file in shared memory (read and removed)
    if data:
        metrics().returned.inc(len(data))
    error = entry.get("error")
    if entry["status"] == "unknown":
        error = f"fragments: no saves under {key}: the workers never ran its plan"
    return {"key": key, "error": error, "bytes": len(data),
            "safetensors": base64.b64encode(data).decode("ascii") if data else None}


def error_body(message: str, status: int = 400) -> bytes:
    """vLLM's ErrorResponse shape (what the openai client raises as BadRequestError, NotFoundError, ...)."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError", 410: "GoneError",
            413: "RequestTooLargeError"}.get(status, "InternalServerError")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class Streams:
    """Keys of streamed requests this process relays: "running" until the stream's last message, then
    "done" until fetched. Bounded by the saves' expiry and a count."""

    def __init__(self):
        self._keys: "OrderedDict[str, tuple]" = OrderedDict()

    def set(self, key: str, state: Optional[str]) -> None:
        self._keys.pop(key, None)
        if state is not None:
            self._keys[key] = (state, time.monotonic())
        ttl, most = _saves.setting("FRAGMENTS_VLLM_SAVES_TTL"), 4 * _saves.setting("FRAGMENTS_VLLM_SAVES_MAX_REQUESTS")
        while self._keys and (len(self._keys) > most or next(iter(self._keys.values()))[1] < time.monotonic() - ttl):
            self._keys.popitem(last=False)

    def state(self, key: str) -> Optional[str]:
        return self._keys.get(key, (None,))[0]


class FragmentsServer:
    """ASGI middleware: plans in, saves out (module docstring)."""

    def __init__(self, app):
        self.app = app
        self.streams = Streams()
        self._background: set = set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"].removeprefix(scope.get("root_path", "")), scope["method"]
        if method == "GET" and path.startswith("/v1/fragments/"):
            return await self._get(scope, path, send)
        if method == "GET" and path == "/metrics":
            await self._refresh_metrics(scope["app"])
        if method != "POST" or path not in PLAN_PATHS:
            return await self.app(scope, receive, send)
        return await self._post(scope, path, receive, send)

    async def _post(self, scope, path: str, receive, send):
        messages, whole = await _read_body(receive, max_body_bytes())
        body = b"".join(m.get("body", b"") for m in messages)
        if not whole or b"fragments" not in body:  # not ours to read (vLLM's validator still refuses a plan)
            return await self.app(scope, _replay(messages, receive), send)
        try:
            payload = json.loads(body)
        except RecursionError:
            metrics().refused_for("bounds")
            return await _respond(send, 400, error_body("fragments: the request body is nested too deep to read"))
        except ValueError:  # not JSON: vLLM answers it as it would without us
            return await self.app(scope, _replay(messages, receive), send)
        xargs = payload.get("vllm_xargs") if isinstance(payload, dict) else None
        if not isinstance(xargs, dict) or xargs.get(EXTRA_KEY) is None:
            return await self.app(scope, _replay(messages, receive), send)
        try:
            check_body(payload, path)
            key, text, plan = prepare(xargs[EXTRA_KEY])
            check_saves_floor(plan, payload, model_record(), scope["app"].state.engine_client.vllm_config)
        except BadPlan as e:
            metrics().refused_for(e.reason)
            return await _respond(send, 400, error_body(str(e)))
        except Exception as e:  # a check that should have said what is wrong did not: the client still hears
            log.exception("fragments: checking a plan failed")  # it in one line, the log keeps the trace
            metrics().refused_for("internal")
            return await _respond(send, 400, error_body(f"fragments: internal error while checking the plan "
                                                        f"({type(e).__name__}: {str(e)[:200]}); please report it"))
        xargs[EXTRA_KEY] = text
        body = json.dumps(payload).encode()
        metrics().plans.labels(route=path).inc()
        _issued.add(key)
        try:
            if payload.get("stream"):
                return await self._stream(scope, body, receive, send, key)
            return await self._answer(scope, body, receive, send, key)
        finally:
            _issued.discard(key)

    async def _answer(self, scope, body: bytes, receive, send, key: str):
        start, parts = None, []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
        await self.app(scope, _replay([_message(body)], receive), capture)
        entry = await take(scope["app"], key)  # taken on every path: nothing stays in the workers
        out = b"".join(parts)
        if start is not None and start["status"] == 200:
            try:
                answer = json.loads(out)
            except ValueError:
                answer = None
            if isinstance(answer, dict):  # vLLM answers null to a client that left: nothing to add
                answer[EXTRA_KEY] = fragments_object(key, entry)
                out = json.dumps(answer).encode()
        _delivery.discard(entry)  # saves no answer carries (vLLM refused, the client left): their file goes
        headers = [(k, v) for k, v in (start or {}).get("headers", []) if k.lower() != b"content-length"]
        headers += [(b"content-length", str(len(out)).encode()), (b"x-fragments-key", key.encode())]
        await send({"type": "http.response.start", "status": (start or {}).get("status", 500), "headers": headers})
        await send({"type": "http.response.body", "body": out})

    async def _stream(self, scope, body: bytes, receive, send, key: str):
        """Relays vLLM's stream with the key in a header; a stream that ends before its last message (the
        client left) has its saves dropped in the workers, also those of steps still under way."""
        status, ended = None, False

        async def relay(message):
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [(b"x-fragments-key", key.encode())]
            last = message["type"] == "http.response.body" and not message.get("more_body", False)
            if last:  # the client may ask for the saves as soon as it has this message
                self.streams.set(key, "done" if status == 200 else None)
            await send(message)
            ended |= last
        self.streams.set(key, "running")
        try:
            await self.app(scope, _replay([_message(body)], receive), relay)
        finally:
            if not ended:
                self.streams.set(key, None)
                task = asyncio.ensure_future(self._drop(scope["app"], key))  # not awaited: we may be cancelled
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _drop(self, app, key: str):
        try:
            await asyncio.wait_for(app.state.engine_client.collective_rpc(
                "fragments_saves", args=("drop", [key], _saves.DISCONNECTED,
                                         f"the saves of {key} were dropped: its client left before the stream "
                                         "ended")), RPC_TIMEOUT_S)
        except Exception:  # a dead engine holds no saves
            pass

    async def _get(self, scope, path: str, send):
        match = SAVES_PATH.match(path)
        if match:
            key = match.group(1)
            if self.streams.state(key) == "running":
                return await _respond(send, 409, error_body(f"fragments: {key} is still streaming; fetch its saves "
                                                            "after the stream ends", 409))
            entry = await take(scope["app"], key)
            self.streams.set(key, None)
            status = {"ok": 200, "taken": 410, "dropped": 410, "unknown": 404}.get(entry["status"], 503)
            if status == 200:
                return await _respond(send, 200, json.dumps(fragments_object(key, entry)).encode())
            why = entry["error"] or (f"fragments: no saves under {key}: no request with this key ran here (keys "
                                     "come in the x-fragments-key header of a request with a plan)")
            return await _respond(send, status, error_body(why, status))
        if path == "/v1/fragments/model":
            record = model_record()
            if record is None:
                return await _respond(send, 404, error_body("fragments: no model record yet", 404))
            return await _respond(send, 200, json.dumps(record).encode())
        if path == "/v1/fragments/vectors":
            return await _respond(send, 200, json.dumps(_vector_shapes()).encode())
        return await _respond(send, 404, error_body(f"fragments: no route {path[:200]}", 404))

    async def _refresh_metrics(self, app):
        if not metrics().due():
            return
        try:
            answers = await asyncio.wait_for(app.state.engine_client.collective_rpc("fragments_saves",
                                                                                    args=("stats",)), 5.0)
        except Exception:  # a dead or busy engine: vLLM's own series say so; ours keep their last values
            return
        metrics().update_from_workers(answers)


def _vector_shapes() -> dict:
    from safetensors import safe_open
    out = {}
    for name, where in registered_vectors().items():
        path, _, tensor = where.rpartition(":")
        with safe_open(path, framework="pt") as f:
            out[name] = list(f.get_slice(tensor).get_shape())
    return out


def _message(body: bytes) -> dict:
    return {"type": "http.request", "body": body, "more_body": False}


async def _read_body(receive, limit: int) -> Tuple[list, bool]:
    """The body's messages up to `limit` bytes, and whether that is the whole body."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, False  # the client left
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, True
        if size > limit:
            return messages, False


def _replay(messages: list, receive):
    """The messages read so far, then the client's own receive (the rest of the body; vLLM listens there for
    a disconnect to abort on)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()
    return replay


async def _respond(send, status: int, body: bytes):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
