"""fragments in vLLM's OpenAI server (`vllm serve`): plans in the request body, saves in the response.

The general plugin (fragments.vllm:register) runs in the API server process before vLLM builds its app and
wraps `build_app` so that the app's innermost middleware (after vLLM's CORS and API-key checks) is
FragmentsServer. Per request (POST /v1/completions, /v1/chat/completions):

  body.vllm_xargs.fragments = a plan (object, list or its JSON text; docs/vllm.md)
    → checked here against the model's locations (the C++ plan parser, _plan.RequestPlan): a bad plan is
      HTTP 400 before vLLM sees the request; values come from registered vectors ("@name") only
      (FRAGMENTS_VLLM_ALLOW_FILES=1 also allows files on the server's disk); n must be 1
    → given a fresh key and passed on as JSON text (vLLM's vllm_xargs holds scalars), which vLLM copies
      into SamplingParams.extra_args["fragments"]: the workers run it (_worker.py)
    → after vLLM's answer: the saves taken from the workers (collective_rpc "fragments_take_saves") and
      added to the JSON answer as "fragments": {"key", "error", "bytes", "safetensors": base64 or null}
      (null above FRAGMENTS_VLLM_MAX_SAVE_BYTES, default 16 MiB, with the reason in "error").
  A streamed request (stream: true) gets its key in the "x-fragments-key" header and fetches its saves
  after the stream with GET /v1/fragments/saves/{key} (the same object). GET /v1/fragments/model is
  fragments.vllm.inspect's record; GET /v1/fragments/vectors lists the registered vectors.
"""
from __future__ import annotations

import base64
import json
import os
import re
import sys
import uuid
from typing import Optional, Tuple

from ._plan import EXTRA_KEY, RequestPlan, registered_vectors

PLAN_PATHS = ("/v1/completions", "/v1/chat/completions")
SAVES_PATH = re.compile(r"^/v1/fragments/saves/([A-Za-z0-9_.-]+)$")
DEFAULT_MAX_SAVE_BYTES = 16 << 20


def install_into_api_server() -> None:
    """Wraps vllm.entrypoints.openai.api_server.build_app when that module is loaded (the API server
    process); other processes are left alone. Idempotent."""
    name = "vllm.entrypoints.openai.api_server"
    main = sys.modules.get("__main__")  # `python -m vllm.entrypoints.openai.api_server` runs it as __main__
    for module in {id(m): m for m in (sys.modules.get(name), main) if m is not None and
                   (m.__name__ == name or getattr(getattr(m, "__spec__", None), "name", None) == name)}.values():
        _wrap_build_app(module)


def _wrap_build_app(module) -> None:
    if getattr(module.build_app, "_fragments", False):
        return
    original = module.build_app

    def build_app(*args, **kwargs):
        app = original(*args, **kwargs)
        from starlette.middleware import Middleware
        registered_vectors()  # a bad FRAGMENTS_VLLM_VECTORS stops the server at start, with its message
        app.user_middleware.append(Middleware(FragmentsServer))  # innermost: after CORS and API keys
        app.middleware_stack = None  # vLLM's app has built its stack already; Starlette rebuilds it on use
        return app
    build_app._fragments = True
    module.build_app = build_app


def max_save_bytes() -> int:
    return int(os.environ.get("FRAGMENTS_VLLM_MAX_SAVE_BYTES", DEFAULT_MAX_SAVE_BYTES))


def model_record() -> Optional[dict]:
    from . import _model_record
    return _model_record()


class BadPlan(ValueError):
    pass


def prepare(spec) -> Tuple[str, str]:
    """A request's plan as the body carries it -> (its key, the JSON text vLLM passes to the workers).
    Raises BadPlan with the message the client gets."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise BadPlan(f"vllm_xargs.{EXTRA_KEY}: expected a plan (JSON object or list), found invalid JSON: "
                          f"{e}") from None
    if isinstance(spec, list):
        spec = {"interventions": spec}
    if not isinstance(spec, dict):
        raise BadPlan(f"vllm_xargs.{EXTRA_KEY}: expected a plan object or list, found {type(spec).__name__}")
    spec = dict(spec)
    if "program" in spec:  # Python steps run only for an in-process LLM's traces (fragments/vllm/_python.py)
        raise BadPlan('fragments plan: "program" (Python steps of fragments.vllm.VLLM\'s traces) is refused over '
                      'HTTP')
    if os.environ.get("FRAGMENTS_VLLM_ALLOW_FILES") != "1":
        if "base" in spec:
            raise BadPlan('fragments plan: "base" (a folder on the server) is refused; refer to registered '
                          'vectors as "@name" (FRAGMENTS_VLLM_ALLOW_FILES=1 allows files)')
        for i, item in enumerate(spec.get("interventions") or []):
            value = item.get("value") if isinstance(item, dict) else None
            if isinstance(value, str) and not value.startswith("@"):
                raise BadPlan(f'fragments plan: intervention {i}: "value" "{value}" names a file on the server; '
                              'refer to a registered vector as "@name" (FRAGMENTS_VLLM_ALLOW_FILES=1 allows '
                              'files)')
    spec["key"] = "frag-" + uuid.uuid4().hex
    record = model_record()
    if record is None:
        raise BadPlan("fragments: the plugin is not active in vLLM's workers (no model record); is the "
                      "engine started with VLLM_PLUGINS unset or naming 'fragments'?")
    plan = RequestPlan.parse(spec, spec["key"], record)
    if plan.error:
        raise BadPlan(plan.error)
    return spec["key"], json.dumps(spec)


async def take(app, key: str) -> dict:
    """The saves of one finished request from the workers: the response's "fragments" object."""
    answers = await app.state.engine_client.collective_rpc("fragments_take_saves", args=([key],))
    first = next((a for a in answers if a is not None), None) or {}
    entry = first.get(key) or {"error": None, "data": None}
    data = entry["data"] or b""
    out = {"key": key, "error": entry["error"], "bytes": len(data), "safetensors": None}
    cap = max_save_bytes()
    if len(data) > cap:
        out["error"] = (out["error"] or "") + (f"{'; ' if out['error'] else ''}saves are {len(data)} bytes, over "
                                               f"the server's cap of {cap} (FRAGMENTS_VLLM_MAX_SAVE_BYTES): dropped")
    elif data:
        out["safetensors"] = base64.b64encode(data).decode("ascii")
    return out


def error_body(message: str, status: int = 400) -> bytes:
    """vLLM's ErrorResponse shape (what the openai client raises as BadRequestError)."""
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()


class FragmentsServer:
    """ASGI middleware: plans in, saves out (module docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if method == "GET" and path.startswith("/v1/fragments/"):
            return await self._get(scope, path, send)
        if method != "POST" or path not in PLAN_PATHS:
            return await self.app(scope, receive, send)
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
            spec = payload["vllm_xargs"][EXTRA_KEY]
        except (ValueError, KeyError, TypeError):  # not ours: vLLM answers it as it would without us
            return await self.app(scope, _replay(body, receive), send)
        try:
            if payload.get("n", 1) != 1:
                raise BadPlan("fragments: a request with a plan must have n = 1 (one sequence per plan)")
            key, text = prepare(spec)
        except BadPlan as e:
            return await _respond(send, 400, error_body(str(e)))
        payload["vllm_xargs"][EXTRA_KEY] = text
        body = json.dumps(payload).encode()
        if payload.get("stream"):
            return await self.app(scope, _replay(body, receive), _with_key_header(send, key))
        await self._answer(scope, body, receive, send, key)

    async def _answer(self, scope, body: bytes, receive, send, key: str):
        start, parts = None, []

        async def capture(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                parts.append(message.get("body", b""))
        await self.app(scope, _replay(body, receive), capture)
        saves = await take(scope["app"], key)  # taken on every path: nothing stays in the workers
        out = b"".join(parts)
        if start is not None and start["status"] == 200:
            try:
                answer = json.loads(out)
                answer[EXTRA_KEY] = saves
                out = json.dumps(answer).encode()
            except ValueError:
                pass
        headers = [(k, v) for k, v in (start or {}).get("headers", []) if k.lower() != b"content-length"]
        headers += [(b"content-length", str(len(out)).encode()), (b"x-fragments-key", key.encode())]
        await send({"type": "http.response.start", "status": (start or {}).get("status", 500), "headers": headers})
        await send({"type": "http.response.body", "body": out})

    async def _get(self, scope, path: str, send):
        match = SAVES_PATH.match(path)
        if match:
            return await _respond(send, 200, json.dumps(await take(scope["app"], match.group(1))).encode())
        if path == "/v1/fragments/model":
            record = model_record()
            if record is None:
                return await _respond(send, 404, error_body("fragments: no model record yet", 404))
            return await _respond(send, 200, json.dumps(record).encode())
        if path == "/v1/fragments/vectors":
            return await _respond(send, 200, json.dumps(_vector_shapes()).encode())
        return await _respond(send, 404, error_body(f"fragments: no route {path}", 404))


def _vector_shapes() -> dict:
    from safetensors import safe_open
    out = {}
    for name, where in registered_vectors().items():
        path, _, tensor = where.rpartition(":")
        with safe_open(path, framework="pt") as f:
            out[name] = list(f.get_slice(tensor).get_shape())
    return out


async def _read_body(receive) -> bytes:
    parts, more = [], True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


def _replay(body: bytes, receive):
    """The body once, then the client's own receive (vLLM listens there for a disconnect to abort on)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _with_key_header(send, key: str):
    async def wrapped(message):
        if message["type"] == "http.response.start":
            message = dict(message)
            message["headers"] = list(message.get("headers", [])) + [(b"x-fragments-key", key.encode())]
        await send(message)
    return wrapped


async def _respond(send, status: int, body: bytes):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
