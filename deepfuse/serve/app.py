"""The OpenAI-compatible HTTP app (Starlette) over an AsyncLLM.

    app = build_app(AsyncLLM("smollm2"), "smollm2", api_key=None)
    POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics

Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}: 400 for malformed
JSON or a value that cannot run, 401 for a missing or wrong API key (/v1 routes), 404 for
another model, 413 for a body over the size limit, 422 for a body that does not fit the
request's schema, 500 (without a traceback) for a bug. Streams are server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`; a client that leaves a stream aborts its
requests, which frees their KV blocks.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import DeepfuseError
from ..runtime.async_llm import AsyncLLM, EngineFailure
from ..runtime.outputs import RequestOutput
from ..runtime.request import SamplingParams
from .metrics import ServerMetrics
from .protocol import ChatRequest, CompletionRequest
from .responses import Deltas, chat_body, chat_chunks, completion_body, completion_chunks, new_id, usage_chunk


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def build_app(llm: AsyncLLM, model_name: str, api_key: str | None = None, max_body_bytes: int = 1 << 20) -> Starlette:
    """Serves llm as model_name. api_key: required as `Authorization: Bearer <key>` on /v1
    routes (None: no key). The app records llm's finished requests for /metrics."""
    metrics = ServerMetrics()
    llm.on_finish = metrics.on_finish
    created = int(time.time())

    def v1(handler: Callable) -> Callable:
        """The /v1 routes: API key checked, ApiError and DeepfuseError turned into error bodies."""
        async def route(request: Request) -> Response:
            try:
                if api_key is not None:
                    got = request.headers.get("authorization", "")
                    if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                        raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                       "authentication_error", code="invalid_api_key")
                return await handler(request)
            except ApiError as e:
                return e.response()
            except DeepfuseError as e:
                return ApiError(400, str(e), param=_field_named(str(e))).response()
            except EngineFailure as e:
                return ApiError(500, str(e), "internal_server_error").response()
            except Exception as e:  # a bug: the client gets its name, stderr the traceback
                traceback.print_exc(file=sys.stderr)
                return ApiError(500, f"internal error: {type(e).__name__}", "internal_server_error").response()
        return route

    async def read(request: Request, model: type[BaseModel]) -> BaseModel:
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > max_body_bytes:
            raise ApiError(413, f"request body of {size} bytes is over the limit of {max_body_bytes}",
                           code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_body_bytes:
                raise ApiError(413, f"request body is over the limit of {max_body_bytes} bytes", code="request_too_large")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise ApiError(422, f"{param or 'body'}: {first['msg']}" + (f" (and {e.error_count() - 1} more)"
                                                                         if e.error_count() > 1 else ""),
                           param=param) from None
        if req.model is not None and req.model != model_name:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        return req

    async def completions(request: Request) -> Response:
        req = await read(request, CompletionRequest)
        req.check()
        params = req.sampling_params(req.max_tokens, req.logprobs)
        rid = new_id("cmpl")
        outputs = await start(llm, [(p, params, f"{rid}-{i}") for i, p in enumerate(req.prompts())])
        if not req.stream:
            finals = await last_outputs(llm, outputs)
            return JSONResponse(completion_body(rid, model_name, finals, req.logprobs))
        sent, stamp = Deltas(), int(time.time())
        return sse(llm, outputs, lambda i, out: completion_chunks(rid, model_name, stamp, i, out, sent, req.logprobs),
                   lambda finals: usage_chunk(rid, model_name, stamp, "text_completion", finals) if req.include_usage
                   else None)

    async def chat(request: Request) -> Response:
        req = await read(request, ChatRequest)
        k = req.logprob_count()
        params = req.sampling_params(req.max_new_tokens(), k)
        prompt = llm.tokenizer.render_chat(req.conversation())
        rid = new_id("chatcmpl")
        outputs = await start(llm, [(prompt, params, rid)])
        if not req.stream:
            finals = await last_outputs(llm, outputs)
            return JSONResponse(chat_body(rid, model_name, finals[0], k))
        sent, stamp = Deltas(), int(time.time())
        return sse(llm, outputs, lambda _, out: chat_chunks(rid, model_name, stamp, out, sent, k),
                   lambda finals: usage_chunk(rid, model_name, stamp, "chat.completion.chunk", finals)
                   if req.include_usage else None)

    async def models(request: Request) -> Response:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "deepfuse",
                "max_model_len": llm.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.render(llm.stats()), media_type="text/plain; version=0.0.4")

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.method} {request.url.path}", code="not_found").response()

    async def wrong_method(request: Request, exc: Exception) -> Response:
        return ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed").response()

    routes = [Route("/v1/completions", v1(completions), methods=["POST"]),
              Route("/v1/chat/completions", v1(chat), methods=["POST"]),
              Route("/v1/models", v1(models), methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: wrong_method})


FIELDS = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)


def _field_named(message: str) -> str | None:
    """The request field a SamplingParams error names first ("temperature must be ..."), if any."""
    first = message.split(" ", 1)[0]
    return first if first in FIELDS else None


async def start(llm: AsyncLLM, requests: list[tuple[object, SamplingParams, str]]) -> list[AsyncIterator[RequestOutput]]:
    """Adds every request (all or none: if one cannot run, those added are aborted and its
    DeepfuseError raised); returns their output streams."""
    added = []
    try:
        for prompt, params, rid in requests:
            added.append((rid, await llm.add_request(prompt, params, rid)))
    except BaseException:
        for rid, stream in added:
            await stream.aclose()
            await llm.abort(rid)
        raise
    return [stream for _, stream in added]


async def merged(outputs: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream number, output) from all streams as they come; closing this aborts the unfinished."""
    got: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await got.put((i, out))
        except Exception as e:
            await got.put((i, e))
        await got.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(outputs)]
    try:
        left = len(tasks)
        while left:
            i, item = await got.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # a stream cancelled before its end aborts its request (AsyncLLM)
        await asyncio.gather(*tasks, return_exceptions=True)


async def last_outputs(llm: AsyncLLM, outputs: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(outputs)
    async for i, out in merged(outputs):
        finals[i] = out
    return finals


def sse(llm: AsyncLLM, outputs: list[AsyncIterator[RequestOutput]], chunks: Callable[[int, RequestOutput], list[dict]],
        closing: Callable[[list[RequestOutput]], dict | None]) -> StreamingResponse:
    """A server-sent event stream: the chunks each output adds, the closing chunk (usage) of the
    final outputs, `[DONE]`. An error mid-stream is sent as an error event."""
    async def events() -> AsyncIterator[str]:
        finals: list[RequestOutput | None] = [None] * len(outputs)
        try:
            async for i, out in merged(outputs):
                finals[i] = out
                for chunk in chunks(i, out):
                    yield f"data: {json.dumps(chunk)}\n\n"
            last = closing(finals)
            if last is not None:
                yield f"data: {json.dumps(last)}\n\n"
        except EngineFailure as e:
            body = {"error": {"message": str(e), "type": "internal_server_error", "param": None, "code": None}}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
