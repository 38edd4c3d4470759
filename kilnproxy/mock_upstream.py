"""A fake OpenAI-compatible model server that behaves like vLLM (SPEC section 6).

It streams one chunk per generated word and can imitate llama.cpp's and
Ollama's quirks, so the gateway's stream handling is tested against the shapes
real servers send (``../shared/reference/upstream-behaviour.md``).

Per request, a ``mock`` object in the body steers it (the gateway forwards
unknown fields untouched)::

    "mock": {
        "flavor": "vllm" | "vllm_old" | "llamacpp" | "ollama",
        "fail": "500" | "503" | "401" | "429" | "hang" | "reset" | "garbage"      # before headers
              | "drop" | "error_event" | "stall" | "eof",                       # mid-stream, after `after` chunks
        "after": 2,              # chunks sent before a mid-stream failure
        "delay": 0.0,            # seconds between chunks
        "silence": 0.0,          # seconds before the first chunk
        "cached_tokens": 0,      # reported as usage.prompt_tokens_details.cached_tokens
        "pad_bytes": 0,          # one chunk carries a field this large (a multi-MB line)
        "crlf": false,           # end lines with CRLF
        "split": false,          # write every frame in two pieces, cut mid-line
        "continuous_usage": false, # running usage on every chunk (vLLM's continuous_usage_stats)
        "fields": false,         # also send event:/id:/retry: lines, which a gateway must drop
        "id": null, "created": null  # fixed chunk id and timestamp, for byte-exact comparisons
    }

With the ``llamacpp`` flavor, ``n`` > 1 (at most 8) gives ``n`` choices as
llama.cpp does: choice ``i`` has ``max_tokens - i`` words (at least one), their
chunks interleave, and each choice reports its own usage (in its last chunk on
/v1/completions, in a ``choices: []`` chunk of its own on chat); a non-streamed
answer reports the usage of choice 0 only, as llama.cpp does.

Test helpers: ``GET /mock/requests`` lists the bodies and headers received,
``GET /mock/stats`` counts requests, open streams and streams the client
hung up on, ``GET /mock/wait?hangups=N`` returns once that many hang-ups were seen.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson
from aiohttp import web

VOCAB = ("Paris", "is", "the", "capital", "of", "France", "and", "a", "city", "on", "the", "Seine.")
STATS = web.AppKey("stats", dict)
LOG = web.AppKey("log", list)
OPTIONS = web.AppKey("options", dict)
CHANGED = web.AppKey("changed", asyncio.Condition)


def create_mock_app(*, delay: float = 0.0, context_window: int = 4096, flavor: str = "vllm",
                    prompt_tokens_details: bool = False) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[OPTIONS] = {"delay": delay, "context_window": context_window, "flavor": flavor,
                    "prompt_tokens_details": prompt_tokens_details}
    app[STATS] = {"requests": 0, "open": 0, "hangups": 0, "completed": 0}
    app[LOG] = []
    app.on_startup.append(make_condition)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/mock/requests", requests_seen)
    app.router.add_get("/mock/stats", stats)
    app.router.add_get("/mock/wait", wait)
    return app


async def make_condition(app: web.Application) -> None:
    app[CHANGED] = asyncio.Condition()


async def bump(app: web.Application, name: str, by: int = 1) -> None:
    """Count ``name`` in ``/mock/stats`` and wake ``/mock/wait`` (the replaying upstream counts with it too)."""
    app[STATS][name] += by
    async with app[CHANGED]:
        app[CHANGED].notify_all()


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [{"id": "mock", "object": "model", "owned_by": "mock"}]})


async def requests_seen(request: web.Request) -> web.Response:
    return _json(request.app[LOG])


async def stats(request: web.Request) -> web.Response:
    return _json(request.app[STATS])


async def wait(request: web.Request) -> web.Response:
    """Long-poll until a counter reaches a value (at most 30 s): ``?hangups=1``."""
    name, target = next(iter(request.query.items()))
    target = int(target)
    cond = request.app[CHANGED]
    async with cond:
        try:
            await asyncio.wait_for(cond.wait_for(lambda: request.app[STATS][name] >= target), 30)
        except asyncio.TimeoutError:
            pass
    return _json(request.app[STATS])


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(flavor: str, status: int, message: str, kind: str, **extra: Any) -> web.Response:
    if flavor == "llamacpp":
        return _json({"error": {"code": status, "message": message, "type": kind, **extra}}, status)
    if flavor == "vllm_old":
        return _json({"object": "error", "message": message, "type": "BadRequestError", "param": None,
                      "code": status}, status)
    return _json({"error": {"message": message, "type": "BadRequestError" if status == 400 else kind,
                            "param": None, "code": status}}, status)


def count_tokens(body: dict) -> int:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return sum(len(p) if isinstance(p, list) else (1 if isinstance(p, int) else len(str(p).split()))
                   for p in prompt)
    if "messages" in body:
        total = 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            total += 4 + (len(content.split()) if isinstance(content, str) else 0)
        return total
    return len(str(prompt).split())


async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    raw = await request.read()
    app[STATS]["requests"] += 1
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _error("vllm", 400, "Invalid JSON body", "BadRequestError")
    headers = {str(k): v for k, v in request.headers.items()}  # istr keys are not JSON keys for orjson
    app[LOG].append({"path": request.path, "body": body, "headers": headers})
    del app[LOG][:-200]
    mock = body.get("mock") if isinstance(body.get("mock"), dict) else {}
    opts = {**app[OPTIONS], **mock}
    flavor = opts["flavor"]
    chat = request.path.endswith("/chat/completions")
    fail = str(opts.get("fail", ""))

    if fail in ("500", "503", "401", "429", "404"):
        return _error(flavor, int(fail), f"mock failure {fail}", "server_error")
    if fail == "hang":
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await bump(app, "hangups")
            raise
    if fail == "reset":
        request.transport.abort()
        raise web.HTTPInternalServerError()
    if fail == "garbage":
        return web.Response(text="<html>upstream proxy error</html>", content_type="text/html")

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        return _error(flavor, 400, "stream must be a boolean", "invalid_request_error")
    if body.get("stream_options") is not None and not stream and flavor.startswith("vllm"):
        return _error(flavor, 400, "Stream options can only be defined when `stream=True`.", "BadRequestError")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= 2:
        return _error(flavor, 400, f"temperature must be in [0, 2], got {temperature}.", "BadRequestError")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
    if not isinstance(max_tokens, int) or max_tokens < 1:
        return _error(flavor, 400, "max_tokens must be at least 1", "BadRequestError")
    try:
        prompt_tokens = count_tokens(body)
    except (TypeError, AttributeError) as exc:  # e.g. "messages": 1; vLLM's validation answers 400
        return _error(flavor, 400, f"Invalid prompt or messages: {exc}", "BadRequestError")
    window = opts["context_window"]
    if prompt_tokens + max_tokens > window:
        if flavor == "llamacpp":
            return _error(flavor, 400, f"request ({prompt_tokens} tokens) exceeds the available context size "
                          f"({window} tokens), try increasing it", "exceed_context_size_error",
                          n_prompt_tokens=prompt_tokens, n_ctx=window)
        return _error(flavor, 400, f"This model's maximum context length is {window} tokens. However, you "
                      f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                      f"{max_tokens} in the completion). Please reduce the length of the messages or "
                      "completion.", "BadRequestError")

    n = body.get("n", 1) if flavor == "llamacpp" else 1
    if type(n) is not int or not 1 <= n <= 8:
        return _error(flavor, 400, f"Field 'n': Value must be between 1 <= value <= 8, but got {n}",
                      "invalid_request_error")
    gen = _Generation(body, opts, chat, prompt_tokens, max_tokens, n)
    if not stream:
        await bump(app, "completed")
        return _json(gen.whole())
    return await _stream(request, gen, opts, fail)


class _Generation:
    """The words of one completion and the JSON shapes they travel in."""

    def __init__(self, body: dict, opts: dict, chat: bool, prompt_tokens: int, max_tokens: int, n: int = 1):
        self.body = body
        self.n = n
        self.opts = opts
        self.chat = chat
        self.flavor = opts["flavor"]
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.id = opts.get("id") or ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = opts.get("created") or int(time.time())
        self.model = body.get("model", "mock")
        self.words = [VOCAB[i % len(VOCAB)] for i in range(max_tokens)]
        options = body.get("stream_options") or {}
        self.include_usage = bool(options.get("include_usage"))

    def usage(self, completion_tokens: int) -> dict:
        usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion_tokens,
                 "completion_tokens": completion_tokens}
        cached = self.opts.get("cached_tokens")
        if cached is not None or self.opts.get("prompt_tokens_details"):
            usage["prompt_tokens_details"] = {"cached_tokens": int(cached or 0)}
        return usage

    def finish_reason(self) -> str:
        return "length"

    def words_of(self, index: int) -> list[str]:
        """The words of choice ``index``: one fewer for each later choice, so that their counts differ."""
        return self.words[:max(1, len(self.words) - index)]

    def whole(self) -> dict:
        choices = []
        for index in range(self.n):
            text = " " + " ".join(self.words_of(index))
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text.strip()},
                                "logprobs": None, "finish_reason": self.finish_reason(), "stop_reason": None})
            else:
                choices.append({"index": index, "text": text, "logprobs": None,
                                "finish_reason": self.finish_reason(), "stop_reason": None})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage(len(self.words))}

    def chunk(self, choices: list, **extra: Any) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.flavor == "vllm_old":
            out["usage"] = None
        if self.flavor == "ollama" and not self.chat:
            out["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        out.update(extra)
        return out

    def choice(self, text: str | None, finish: str | None, first: bool = False, index: int = 0) -> dict:
        if self.chat:
            delta = {"content": text} if text is not None else {}
            if first:
                delta = {"role": "assistant", "content": None if self.flavor == "llamacpp" else ""}
            return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}

    def frames(self) -> list[dict]:
        """Every chunk of the stream but [DONE], in order."""
        if self.n > 1:
            return self.llama_choice_frames()
        out = []
        if self.chat:
            out.append(self.chunk([self.choice(None, None, first=True)]))
        n = len(self.words)
        for i, word in enumerate(self.words):
            text = " " + word
            if i == 0 and self.opts.get("echo") and not self.chat:
                text = str(self.body.get("prompt", "")) + text
            last = i == n - 1
            extra = {}
            if self.opts.get("continuous_usage"):
                extra["usage"] = self.usage(i + 1)
            if i == 0 and self.opts.get("pad_bytes"):
                extra["padding"] = "x" * int(self.opts["pad_bytes"])
            finish = None
            if last and self.flavor in ("llamacpp", "ollama") or (last and self.chat):
                finish = self.finish_reason()
            if last and self.flavor == "llamacpp" and not self.chat:
                extra["usage"] = self.usage(n)
                extra["timings"] = {"prompt_n": self.prompt_tokens, "predicted_n": n}
            out.append(self.chunk([self.choice(text, finish)], **extra))
        if self.flavor not in ("llamacpp", "ollama") and not self.chat:
            out.append(self.chunk([self.choice("", self.finish_reason())]))
        if self.include_usage and not (self.flavor == "llamacpp" and not self.chat):
            out.append(self.chunk([], usage=self.usage(n)))
        return out


    def llama_choice_frames(self) -> list[dict]:
        """llama.cpp with ``n`` > 1: the choices' chunks interleaved, each choice ending with its own usage."""
        per_choice = []
        for index in range(self.n):
            words = self.words_of(index)
            frames = [self.chunk([self.choice(None, None, first=True, index=index)])] if self.chat else []
            frames += [self.chunk([self.choice(" " + word, None, index=index)]) for word in words]
            last = self.chunk([self.choice(None if self.chat else "", self.finish_reason(), index=index)])
            if not self.chat:
                last["usage"] = self.usage(len(words))
            frames.append(last)
            if self.chat and self.include_usage:
                frames.append(self.chunk([], usage=self.usage(len(words))))
            per_choice.append(frames)
        out = []
        for step in range(max(map(len, per_choice))):
            out += [frames[step] for frames in per_choice if step < len(frames)]
        return out


async def _stream(request: web.Request, gen: _Generation, opts: dict, fail: str) -> web.StreamResponse:
    app = request.app
    eol = b"\r\n" if opts.get("crlf") else b"\n"
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await bump(app, "open")
    delay = float(opts.get("delay") or 0)
    after = int(opts.get("after", 2))
    finished = False

    async def send(payload: bytes) -> None:
        frame = b"data: " + payload + eol + eol
        if opts.get("fields"):
            frame = b"event: message" + eol + b"id: 7" + eol + b"retry: 100" + eol + frame
        if opts.get("split") and len(frame) > 4:
            cut = len(frame) // 2
            await resp.write(frame[:cut])
            await asyncio.sleep(0.002)
            frame = frame[cut:]
        await resp.write(frame)

    try:
        silence = float(opts.get("silence") or 0)
        if silence:
            if gen.flavor == "llamacpp":
                await asyncio.sleep(silence / 2)
                await resp.write(b":" + eol + eol)
                await asyncio.sleep(silence / 2)
            else:
                await asyncio.sleep(silence)
        for i, event in enumerate(gen.frames()):
            if fail and i == after:
                await _fail_mid_stream(request, resp, gen, fail, send)
                return resp
            await send(orjson.dumps(event))
            if delay:
                await asyncio.sleep(delay)
        await send(b"[DONE]")
        await resp.write_eof()
        finished = True
        await bump(app, "completed")
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        await bump(app, "hangups")
        raise
    finally:
        app[STATS]["open"] -= 1
        if not finished:
            async with app[CHANGED]:
                app[CHANGED].notify_all()


async def _fail_mid_stream(request, resp, gen: _Generation, fail: str, send) -> None:
    if fail == "drop":
        request.transport.close()
        return
    if fail == "stall":
        await asyncio.sleep(3600)
    if fail == "eof":  # Ollama: an empty chunk, then the body just ends
        if gen.flavor == "ollama":
            await send(b"{}")
        await resp.write_eof()
        return
    if fail == "error_event":
        if gen.flavor == "llamacpp":
            await send(orjson.dumps({"error": {"code": 500, "message": "mock failure mid-stream",
                                               "type": "server_error"}}))
            await resp.write_eof()
            return
        await send(orjson.dumps({"error": {"message": "mock failure mid-stream", "type": "InternalServerError",
                                           "param": None, "code": 500}}))
        await send(b"[DONE]")
        await resp.write_eof()
