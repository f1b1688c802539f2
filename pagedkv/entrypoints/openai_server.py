"""``pagedkv serve MODEL_DIR``: an OpenAI-compatible HTTP server (FastAPI on uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``.

Requests are translated to ``SamplingParams`` (names as OpenAI's and vLLM's: ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
``stop_token_ids``, ``n``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logprobs`` / ``top_logprobs``, ``echo``, ``ignore_eos``,
``min_tokens``) and run through one ``AsyncLLM`` (the engine in its own thread). ``n > 1`` runs
``n`` requests of the same prompt (their full prompt blocks are shared through the prefix
cache); with a ``seed``, sample ``i`` uses ``seed + i``.

Streaming (``"stream": true``): server-sent events, one chunk per detokenized delta (the
detokenizer never emits a broken UTF-8 sequence), ``data: [DONE]`` at the end; with
``stream_options.include_usage`` a last chunk carries ``usage``. A client that disconnects
aborts its requests at once (their blocks are free before the next step).

Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for an
invalid field or a prompt longer than the context, 401 for a missing or wrong key with
``--api-key``, 404 for an unknown model, 503 while overloaded (``--max-waiting``) or shutting
down. A bad request never reaches the engine; the engine keeps serving the others.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the routes' annotations here

from pagedkv.entrypoints.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from pagedkv.entrypoints.metrics import ServingMetrics
from pagedkv.errors import ChatTemplateError, InvalidRequestError, PagedKVError
from pagedkv.sampling.params import SamplingParams

MAX_N = 16


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def _get(body: dict, key: str, types, default=None):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in (
            types if isinstance(types, tuple) else (types,))):
        raise _bad(f"'{key}' has the wrong type: {type(v).__name__}", key)
    return v


def sampling_params_from(body: dict, *, chat: bool) -> tuple[SamplingParams, int, int | None]:
    """``(SamplingParams, n, logprobs)`` of an OpenAI request body; 400 on a bad field."""
    num = (int, float)
    max_tokens = _get(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None if chat else 16)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise _bad(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    if chat:
        logprobs = None
        if _get(body, "logprobs", bool, False):
            logprobs = _get(body, "top_logprobs", int, 0)
        elif body.get("top_logprobs") is not None:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    else:
        logprobs = _get(body, "logprobs", int)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise _bad("'stop' must be a string or a list of strings", "stop")
    kw: dict[str, Any] = dict(
        temperature=_get(body, "temperature", num, 1.0),
        top_p=_get(body, "top_p", num, 1.0),
        top_k=_get(body, "top_k", int, 0),
        min_p=_get(body, "min_p", num, 0.0),
        seed=_get(body, "seed", int),
        max_tokens=max_tokens,
        min_tokens=_get(body, "min_tokens", int, 0),
        stop=stop,
        stop_token_ids=_get(body, "stop_token_ids", list),
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        presence_penalty=_get(body, "presence_penalty", num, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", num, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", num, 1.0),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
    )
    try:
        return SamplingParams(**kw), n, logprobs
    except InvalidRequestError as e:
        raise _bad(str(e)) from None


def _sample_params(params: SamplingParams, i: int) -> SamplingParams:
    """Sample ``i`` of ``n``: the same parameters, seed + i when seeded."""
    if i == 0 or params.seed is None:
        return params
    import dataclasses

    return dataclasses.replace(params, seed=params.seed + i)


class OpenAIServing:
    """The request handling behind the HTTP routes (kept apart from FastAPI for clarity)."""

    def __init__(self, async_llm: AsyncLLM, model_name: str, tokenizer, chat_template=None,
                 metrics: ServingMetrics | None = None) -> None:
        self.llm = async_llm
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.metrics = metrics
        self.max_model_len = async_llm.engine.max_model_len

    # ----- helpers -------------------------------------------------------------------------
    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", "NotFoundError", "model", "model_not_found")

    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False) if self.tokenizer else str(tid)

    def _prompts(self, body: dict) -> list:
        p = body.get("prompt")
        if p is None:
            raise _bad("'prompt' is required", "prompt")
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return list(p)
        if isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [{"prompt_token_ids": p}]
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": x} for x in p]
        raise _bad("'prompt' must be a string, a list of strings, a list of token ids or a list "
                   "of such lists", "prompt")

    def render_chat(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("'messages' must be a non-empty list", "messages")
        if self.chat_template is None:
            raise _bad("this model has no chat template; use /v1/completions", "messages")
        kwargs = _get(body, "chat_template_kwargs", dict, {})
        try:
            text = self.chat_template.render(
                messages, add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
                continue_final_message=_get(body, "continue_final_message", bool, False),
                tools=body.get("tools"), **kwargs)
        except ChatTemplateError as e:
            raise _bad(str(e), "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, prompt, params: SamplingParams, n: int, rid: str):
        """Submit the ``n`` requests of one prompt; their output streams. Validation errors
        raise here (a 400 even for streamed requests); if a later sample fails to submit, the
        earlier ones are aborted."""
        streams = []
        try:
            for i in range(n):
                streams.append(self.llm.submit(prompt, _sample_params(params, i),
                                               request_id=f"{rid}-{i}"))
        except BaseException:
            for st in streams:
                st.close()
            raise
        return streams

    # ----- completions ----------------------------------------------------------------------
    async def completions(self, body: dict):
        self.check_model(body)
        params, n, logprobs = sampling_params_from(body, chat=False)
        prompts = self._prompts(body)
        echo = _get(body, "echo", bool, False)
        stream = _get(body, "stream", bool, False)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        streams = []
        try:
            for j, prompt in enumerate(prompts):
                streams.append(self._run(prompt, params, n, f"{rid}-{j}"))
        except BaseException:
            for group in streams:
                for st in group:
                    st.close()
            raise
        flat = [(j * n + i, it) for j, group in enumerate(streams) for i, it in enumerate(group)]
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._stream(flat, rid, created, "text_completion", echo, logprobs,
                                include_usage, n, chat=False)
        finals = await self._collect(flat)
        choices, usage = [], _usage()
        for index, out in finals:
            comp = out.outputs[0]
            text = comp.text
            lp = None
            if logprobs is not None:
                lp = self._completion_logprobs(comp, 0)
            if echo:
                text = self._prompt_text(out) + text
            choices.append({"index": index, "text": text, "logprobs": lp,
                            "finish_reason": _finish(comp.finish_reason),
                            "stop_reason": comp.stop_reason})
            _add_usage(usage, out, count_prompt=index % n == 0)
        return {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage}

    def _prompt_text(self, out) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer else ""

    def _completion_logprobs(self, comp, text_offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = text_offset
        for tid, entry in zip(comp.token_ids, comp.logprobs or ()):
            t = self._token_text(tid)
            tokens.append(t)
            token_lps.append(entry[tid].logprob if tid in entry else None)
            tops.append({self._token_text(k): v.logprob for k, v in entry.items()})
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    # ----- chat ----------------------------------------------------------------------------
    async def chat(self, body: dict):
        self.check_model(body)
        params, n, logprobs = sampling_params_from(body, chat=True)
        ids = self.render_chat(body)
        stream = _get(body, "stream", bool, False)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        flat = list(enumerate(self._run({"prompt_token_ids": ids}, params, n, rid)))
        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return self._stream(flat, rid, created, "chat.completion.chunk", False, logprobs,
                                include_usage, n, chat=True)
        finals = await self._collect(flat)
        choices, usage = [], _usage()
        for index, out in finals:
            comp = out.outputs[0]
            choices.append({
                "index": index,
                "message": {"role": "assistant", "content": comp.text},
                "logprobs": None if logprobs is None else {"content": self._chat_logprobs(comp, logprobs)},
                "finish_reason": _finish(comp.finish_reason),
                "stop_reason": comp.stop_reason,
            })
            _add_usage(usage, out, count_prompt=index == 0)
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": self.model_name, "choices": choices, "usage": usage}

    def _chat_logprobs(self, comp, top: int, start: int = 0) -> list[dict]:
        items = []
        for tid, entry in list(zip(comp.token_ids, comp.logprobs or ()))[start:]:
            t = self._token_text(tid)
            # the top `top` tokens by rank (the sampled one among them if it ranks that high)
            alts = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top]
            items.append({
                "token": t, "logprob": entry[tid].logprob if tid in entry else None,
                "bytes": list(t.encode("utf-8")),
                "top_logprobs": [{"token": self._token_text(k), "logprob": v.logprob,
                                  "bytes": list(self._token_text(k).encode("utf-8"))}
                                 for k, v in alts],
            })
        return items

    # ----- shared --------------------------------------------------------------------------
    async def _collect(self, flat):
        async def last(it):
            out = None
            async for out in it:
                pass
            return out

        try:
            outs = await asyncio.gather(*(last(it) for _, it in flat))
        finally:  # a failure or a disconnect: abort the others too
            for _, it in flat:
                it.close()
        return [(index, out) for (index, _), out in zip(flat, outs)]

    async def _stream(self, flat, rid, created, object_, echo, logprobs, include_usage, n, *,
                      chat):
        """Server-sent events of all ``flat`` streams, merged as their outputs arrive."""
        finals: dict[int, Any] = {}
        sent_text = {index: 0 for index, _ in flat}
        sent_tokens = {index: 0 for index, _ in flat}
        fmt = ChunkFormat(rid, object_, created, self.model_name, chat=chat)
        tasks: list = []

        def event(index, item) -> str | None:
            """The chunk of one stream's newest output (None: nothing new)."""
            if isinstance(item, Exception):
                return "data: " + json.dumps({"error": {"message": str(item),
                                                        "type": "server_error"}}) + "\n\n"
            comp = item.outputs[0]
            sent = sent_text[index]
            delta = comp.text[sent:]
            if echo and sent == 0 and sent_tokens[index] == 0:
                delta = self._prompt_text(item) + delta
            ntok = len(comp.token_ids)
            new_tokens = ntok - sent_tokens[index]
            finish = _finish(comp.finish_reason)
            sent_text[index] = len(comp.text)
            sent_tokens[index] = ntok
            if not finish and (logprobs is None or new_tokens == 0):
                if delta:  # the hot path: text, nothing else
                    return fmt.text(index, delta)
                if new_tokens == 0:
                    return None
            lp = None
            if logprobs is not None and new_tokens > 0:
                start = ntok - new_tokens
                if chat:
                    lp = {"content": self._chat_logprobs(comp, logprobs, start)}
                else:
                    lp = self._completion_logprobs(_Tail(comp, start), 0)
            if chat:
                choice = {"index": index, "delta": {"content": delta} if delta else {},
                          "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta, "logprobs": lp, "finish_reason": finish}
            if finish:
                choice["stop_reason"] = comp.stop_reason
                finals[index] = item
            return fmt.chunk(choice)

        try:
            if chat:
                for index, _ in flat:
                    yield fmt.chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None})
            if len(flat) == 1:  # one stream (n == 1): read it directly, no merging task
                index0, it0 = flat[0]
                try:
                    async for out in it0:
                        ev = event(index0, out)
                        if ev is not None:
                            yield ev
                except PagedKVError as e:
                    yield event(index0, e)
            else:
                queue: asyncio.Queue = asyncio.Queue()

                async def pump(index, it):
                    try:
                        async for out in it:
                            await queue.put((index, out))
                    except PagedKVError as e:
                        await queue.put((index, e))
                    finally:
                        await queue.put((index, None))

                tasks = [asyncio.create_task(pump(index, it)) for index, it in flat]
                open_ = len(tasks)
                while open_:
                    index, item = await queue.get()
                    if item is None:
                        open_ -= 1
                        continue
                    ev = event(index, item)
                    if ev is not None:
                        yield ev
            if include_usage:
                usage = _usage()
                for index, out in sorted(finals.items()):
                    _add_usage(usage, out, count_prompt=index % n == 0)
                yield fmt.usage(usage)
            yield "data: [DONE]\n\n"
        finally:  # a disconnect lands here too: abort whatever still runs
            for t in tasks:
                t.cancel()
            for _, it in flat:
                it.close()

    # ----- tokenize --------------------------------------------------------------------------
    def tokenize(self, body: dict) -> dict:
        self.check_model(body)
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer")
        if "messages" in body:
            ids = self.render_chat(body)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise _bad("'prompt' (a string) or 'messages' is required", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=_get(body, "add_special_tokens", bool, True))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    def detokenize(self, body: dict) -> dict:
        self.check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _bad("'tokens' must be a list of token ids", "tokens")
        vocab = self.llm.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise _bad(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        if self.tokenizer is None:
            raise _bad("this model has no tokenizer")
        return {"prompt": self.tokenizer.decode(ids)}


class ChunkFormat:
    """The server-sent events of one streamed response (``data: <chunk JSON>\\n\\n``), exactly
    ``json.dumps`` of the chunk dicts: ``chunk(choice)`` encodes any choice; ``text(index,
    delta)``, the hot path of every token, fills a template preformatted per choice index with
    the JSON string of ``delta`` - the choice ``{"index", "text", "logprobs": null,
    "finish_reason": null}`` (completions) or ``{"index", "delta": {"content"}, "logprobs":
    null, "finish_reason": null}`` (chat)."""

    def __init__(self, rid: str, object_: str, created: int, model: str, *, chat: bool) -> None:
        self._head = {"id": rid, "object": object_, "created": created, "model": model}
        empty = json.dumps({**self._head, "choices": []})  # ... "choices": []}
        if not empty.endswith("[]}"):
            raise AssertionError(f"unexpected chunk encoding: {empty!r}")
        self._prefix = "data: " + empty[:-2]  # ... "choices": [
        self._chat = chat
        self._text_heads: dict[int, str] = {}

    def chunk(self, choice: dict) -> str:
        return "data: " + json.dumps({**self._head, "choices": [choice]}) + "\n\n"

    def usage(self, usage: dict) -> str:
        return "data: " + json.dumps({**self._head, "choices": [], "usage": usage}) + "\n\n"

    def text(self, index: int, delta: str) -> str:
        head = self._text_heads.get(index)
        if head is None:
            key = '"delta": {"content": ' if self._chat else '"text": '
            head = self._text_heads[index] = f'{self._prefix}{{"index": {index!r}, {key}'
        return head + _json_str(delta) + _TEXT_TAILS[self._chat]


_json_str = json.encoder.encode_basestring_ascii  # what json.dumps does to a str (ensure_ascii)
_TEXT_TAILS = {False: ', "logprobs": null, "finish_reason": null}]}\n\n',
               True: '}, "logprobs": null, "finish_reason": null}]}\n\n'}


class _Tail:
    """The tokens of a completion from ``start`` on (a streamed delta's logprobs)."""

    def __init__(self, comp, start: int) -> None:
        self.token_ids = comp.token_ids[start:]
        self.logprobs = (comp.logprobs or [])[start:]


def _usage() -> dict:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def _add_usage(usage: dict, out, count_prompt: bool) -> None:
    if count_prompt:
        usage["prompt_tokens"] += len(out.prompt_token_ids)
    usage["completion_tokens"] += len(out.outputs[0].token_ids)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


def _finish(reason: str | None) -> str | None:
    return {"abort": "abort"}.get(reason, reason)


# --------------------------------------------------------------------------------------------
# the app


def build_app(serving: OpenAIServing, *, api_key: str | None = None, drain_timeout: float = 30.0):
    """The FastAPI application around ``serving`` (started and stopped with the app)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    llm = serving.llm

    @asynccontextmanager
    async def lifespan(app):
        llm.start()
        try:
            yield
        finally:  # SIGTERM / Ctrl-C: stop admission, let running requests finish, then stop
            llm.stop_accepting()
            await llm.drain(drain_timeout)
            llm.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan)

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "Incorrect API key provided", "authentication_error", None,
                           "invalid_api_key")

    async def body_of(request: Request) -> dict:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _bad("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        return body

    async def handle(request: Request, fn):
        try:
            check_key(request)
            result = fn(await body_of(request))
            if asyncio.iscoroutine(result):
                result = await result
        except APIError as e:
            return error(e)
        except EngineOverloadedError as e:
            return error(APIError(503, str(e), "server_overloaded", None, "overloaded"))
        except (EngineDeadError, RequestFailedError) as e:
            return error(APIError(500, str(e), "server_error"))
        except InvalidRequestError as e:
            return error(APIError(400, str(e), "invalid_request_error"))
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, serving.completions)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, serving.chat)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle(request, serving.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle(request, serving.detokenize)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_key(request)
        except APIError as e:
            return error(e)
        return {"object": "list", "data": [{
            "id": serving.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "pagedkv", "max_model_len": serving.max_model_len}]}

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        if serving.metrics is None:
            return PlainTextResponse("", status_code=404)
        return PlainTextResponse(serving.metrics.export().decode(),
                                 media_type="text/plain; version=0.0.4")

    return app


SERVING_GC_GEN0_THRESHOLD = 10_000


def tune_gc_for_serving(gen0_threshold: int = SERVING_GC_GEN0_THRESHOLD) -> None:
    """Garbage-collector settings for a serving process (process-wide: ``pagedkv serve`` calls
    it once its app and engine front are built). What exists then (modules, the app, the
    tokenizer) is moved out of the collector's generations (``gc.freeze``: a collection no
    longer walks it), and the youngest generation is collected every ``gen0_threshold`` net
    allocations instead of 700: each streamed token allocates a few short-lived containers
    (freed by reference counting), and with Python's defaults the front spent about a fifth
    of its CPU in the collector (bench/bench_serve_front_cpu.py: 256 streams, one chunk per
    token, 41 -> 33 us of front CPU per token on the 2-core machine)."""
    import gc

    if not isinstance(gen0_threshold, int) or gen0_threshold < 1:
        raise ValueError(f"gen0_threshold must be a positive int, got {gen0_threshold!r}")
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(gen0_threshold, gc.get_threshold()[0]), gen1, gen2)


def make_server(llm, *, model_name: str | None = None, api_key: str | None = None,
                max_waiting: int | None = None, drain_timeout: float = 30.0):
    """``(app, AsyncLLM, OpenAIServing)`` for an ``LLM`` (its engine, tokenizer and chat
    template), with Prometheus metrics."""
    name = model_name or llm.model_name
    metrics = ServingMetrics(name)
    holder: dict = {}

    def on_step(engine, outs):
        metrics.on_step(engine, outs, holder["llm"].failed_steps)

    async_llm = AsyncLLM(llm.engine, max_waiting=max_waiting, on_step=on_step)
    holder["llm"] = async_llm
    try:
        template = llm.get_chat_template()
    except PagedKVError:
        template = None
    serving = OpenAIServing(async_llm, name, llm.tokenizer, template, metrics)
    return build_app(serving, api_key=api_key, drain_timeout=drain_timeout), async_llm, serving


def make_process_server(spec, *, model_name: str | None = None, api_key: str | None = None,
                        max_waiting: int | None = None, drain_timeout: float = 30.0,
                        engine_module: str = "pagedkv.entrypoints.engine_core"):
    """``(app, EngineCoreClient, OpenAIServing)`` with the engine in its own process
    (``python -m engine_module``, ``pagedkv.entrypoints.engine_core``): the process is
    started here and this returns once its engine is built (or raises what stopped it)."""
    from pagedkv.entrypoints.engine_core import EngineCoreClient

    name = model_name or spec.shape or spec.model
    metrics = ServingMetrics(name)
    client = EngineCoreClient(spec, max_waiting=max_waiting, on_step=metrics.observe_deltas,
                              engine_module=engine_module)
    client.start_process()
    serving = OpenAIServing(client, name, client.tokenizer, client.chat_template, metrics)
    return build_app(serving, api_key=api_key, drain_timeout=drain_timeout), client, serving


__all__ = ["APIError", "ChunkFormat", "OpenAIServing", "build_app", "make_process_server", "make_server",
           "sampling_params_from", "tune_gc_for_serving"]
