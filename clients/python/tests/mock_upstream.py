"""A mock LLM provider on 127.0.0.1 for the integration tests and the SDK examples: OpenAI's
``/v1/chat/completions`` and Anthropic's ``/v1/messages`` (each streamed as server-sent events or
not), and an OAuth token endpoint (``/token``).

It counts, per credential (the API key or bearer token a request presents), the requests it is
serving at once: a request counts from its arrival until its answer's last byte is written or its
client goes away (aiohttp cancels the handler then). ``peak[key]`` is the most it ever served at
once, which is what a provider's concurrency limit is about.

``received[path]`` counts every request that reached it, by path, whatever it answered (404 to
a path it does not serve).

What a key is answered is scripted per key: ``rate_limit(key, retry_after)`` (429 with
``Retry-After``), ``reject(key)`` (401), ``cut(key)`` (a stream whose connection drops after two
chunks). Each answer reports token usage (10 prompt tokens, and
one completion token per chunk of its text).

Run it alone (the examples do, through scripts/run-examples)::

    python clients/python/tests/mock_upstream.py

prints ``mock upstream listening on http://127.0.0.1:PORT`` and serves until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple

from aiohttp import web
from aiohttp.typedefs import Handler

from harness import ServedInThread

#: What every answer says, one chunk (and one completion token) per word.
WORDS = ["Hello", " from", " the", " mock", " upstream", "."]
PROMPT_TOKENS = 10


class MockUpstream(ServedInThread):
    """The mock provider, served by aiohttp in a thread of its own (so that sync and async tests,
    and other processes, can call it). Use it as a context manager; ``base_url`` is
    ``http://127.0.0.1:PORT`` once entered.

    ``delay`` is the seconds an unstreamed answer takes; ``chunk_delay`` the seconds between two
    chunks of a streamed one."""

    def __init__(self, delay: float = 0.05, chunk_delay: float = 0.02) -> None:
        super().__init__("mock upstream")
        self.delay = delay
        self.chunk_delay = chunk_delay
        self._lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        #: Streams whose client went away before the last event.
        self.abandoned: Counter[str] = Counter()
        #: Every request that reached it, by path (refused, unknown and failed ones too).
        self.received: Counter[str] = Counter()
        self._rate_limited: Dict[str, str] = {}
        self._rejected: Set[str] = set()
        self._cut: Set[str] = set()
        self.tokens_issued = 0

    # -- scripting and reading -----------------------------------------------------------

    def rate_limit(self, key: str, retry_after: str = "30") -> None:
        """From now on, answer ``key`` with 429 and ``Retry-After: retry_after``."""
        with self._lock:
            self._rate_limited[key] = retry_after

    def reject(self, key: str) -> None:
        """From now on, answer ``key`` with 401."""
        with self._lock:
            self._rejected.add(key)

    def cut(self, key: str) -> None:
        """From now on, drop the connection of ``key``'s streams after their second chunk."""
        with self._lock:
            self._cut.add(key)

    def serving(self) -> Dict[str, int]:
        """Requests being served now, per key (keys with none left out)."""
        with self._lock:
            return {key: n for key, n in self.in_flight.items() if n}

    # -- running ---------------------------------------------------------------------------

    async def _listen(self) -> Tuple[int, Callable[[], Awaitable[None]]]:
        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            with self._lock:
                self.received[request.path] += 1
            return await handler(request)

        app = web.Application(middlewares=[count])
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        app.router.add_post("/token", self._token)
        # Cancelled handlers are how a client that goes away mid-stream is seen.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner.addresses[0][1], runner.cleanup

    # -- bookkeeping ------------------------------------------------------------------------

    def _enter(self, key: str) -> None:
        with self._lock:
            self.in_flight[key] += 1
            self.peak[key] = max(self.peak[key], self.in_flight[key])

    def _leave(self, key: str, finished: bool) -> None:
        with self._lock:
            self.in_flight[key] -= 1
            self.served[key] += 1
            if not finished:
                self.abandoned[key] += 1

    def _is_cut(self, key: str) -> bool:
        with self._lock:
            return key in self._cut

    def _refusal(self, key: str, anthropic: bool) -> Optional[web.Response]:
        with self._lock:
            retry_after = self._rate_limited.get(key)
            rejected = key in self._rejected
        if retry_after is not None:
            kind = "rate_limit_error" if anthropic else "rate_limit_exceeded"
            return _error(429, kind, "Rate limit reached", anthropic, {"retry-after": retry_after})
        if rejected:
            kind = "authentication_error" if anthropic else "invalid_api_key"
            return _error(401, kind, "Invalid credentials", anthropic)
        return None

    async def _call(self, request: web.Request, key: str, anthropic: bool) -> web.StreamResponse:
        """One call of either API presenting ``key``: refused if scripted so, else counted while
        it is served: its answer as JSON after ``delay``, or, when the body asks for a stream,
        its events (False from the stream: it was cut)."""
        body = await request.json()
        refused = self._refusal(key, anthropic)
        if refused is not None:
            return refused
        self._enter(key)
        finished = False
        try:
            model = str(body.get("model", "claude-sonnet-4" if anthropic else "gpt-4o"))
            if not body.get("stream"):
                await asyncio.sleep(self.delay)
                finished = True
                return web.json_response(_message(model) if anthropic else _chat_completion(model))
            response = await _open_sse(request)
            if anthropic:
                finished = await self._messages_stream(response, model)
            else:
                finished = await self._chat_stream(request, response, key, model, body)
            return response
        finally:
            self._leave(key, finished)

    # -- OpenAI ------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, _bearer(request), anthropic=False)

    async def _chat_stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        key: str,
        model: str,
        body: Dict[str, Any],
    ) -> bool:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for n, word in enumerate(WORDS):
            await asyncio.sleep(self.chunk_delay)
            if n == 2 and self._is_cut(key):
                # the connection drops mid-stream, as a provider's or a network's failure
                assert request.transport is not None
                request.transport.close()
                return False
            delta: Dict[str, Any] = {"content": word}
            if n == 0:
                delta["role"] = "assistant"
            await _send(response, _chunk(model, delta, None))
        await _send(response, _chunk(model, {}, "stop"))
        if include_usage:
            await _send(response, {**_chunk(model, None, None), "usage": _usage()})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return True

    # -- Anthropic ---------------------------------------------------------------------------

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get("x-api-key") or _bearer(request)
        return await self._call(request, key, anthropic=True)

    async def _messages_stream(self, response: web.StreamResponse, model: str) -> bool:
        start = _message(model)
        start.update(content=[], stop_reason=None)
        start["usage"] = {"input_tokens": PROMPT_TOKENS, "output_tokens": 1}
        await _event(response, "message_start", {"type": "message_start", "message": start})
        block = {"type": "text", "text": ""}
        await _event(
            response,
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": block},
        )
        for word in WORDS:
            await asyncio.sleep(self.chunk_delay)
            delta = {"type": "text_delta", "text": word}
            await _event(
                response,
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": delta},
            )
        await _event(response, "content_block_stop", {"type": "content_block_stop", "index": 0})
        await _event(
            response,
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": len(WORDS)},
            },
        )
        await _event(response, "message_stop", {"type": "message_stop"})
        await response.write_eof()
        return True

    # -- OAuth -------------------------------------------------------------------------------

    async def _token(self, request: web.Request) -> web.Response:
        """A token endpoint that grants every refresh: access token ``at-N``, refresh token
        ``rt-N``, valid for an hour."""
        form = await request.post()
        if form.get("grant_type") != "refresh_token":
            return web.json_response({"error": "unsupported_grant_type"}, status=400)
        with self._lock:
            self.tokens_issued += 1
            n = self.tokens_issued
        return web.json_response(
            {
                "access_token": f"at-{n}",
                "refresh_token": f"rt-{n}",
                "token_type": "Bearer",
                "expires_in": 3600,
            }
        )


def _bearer(request: web.Request) -> str:
    header = request.headers.get("authorization", "")
    return header[len("bearer ") :] if header.lower().startswith("bearer ") else header


def _usage() -> Dict[str, int]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": len(WORDS),
        "total_tokens": PROMPT_TOKENS + len(WORDS),
    }


def _chat_completion(model: str) -> Dict[str, Any]:
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(WORDS)},
                "finish_reason": "stop",
            }
        ],
        "usage": _usage(),
    }


def _chunk(model: str, delta: Optional[Dict[str, Any]], finish: Optional[str]) -> Dict[str, Any]:
    choices: List[Dict[str, Any]] = []
    if delta is not None:
        choices.append({"index": 0, "delta": delta, "finish_reason": finish})
    return {
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def _message(model: str) -> Dict[str, Any]:
    return {
        "id": "msg_mock",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": "".join(WORDS)}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": len(WORDS)},
    }


def _error(
    status: int,
    kind: str,
    message: str,
    anthropic: bool,
    headers: Optional[Dict[str, str]] = None,
) -> web.Response:
    if anthropic:
        body: Dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "code": kind, "param": None}}
    return web.json_response(body, status=status, headers=headers)


async def _open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, data: Dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")


async def _event(response: web.StreamResponse, name: str, data: Dict[str, Any]) -> None:
    await response.write(
        b"event: " + name.encode() + b"\ndata: " + json.dumps(data).encode() + b"\n\n"
    )


def main(argv: Tuple[str, ...]) -> None:
    """Serves until killed, printing the base URL once listening."""
    del argv
    with MockUpstream() as upstream:
        print(f"mock upstream listening on {upstream.base_url}", flush=True)
        threading.Event().wait()


if __name__ == "__main__":
    main(tuple(sys.argv[1:]))
