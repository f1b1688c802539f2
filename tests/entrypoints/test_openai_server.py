"""The OpenAI-compatible server, live on 127.0.0.1 (uvicorn in a thread) over a tiny checkpoint
with a chat template, talked to with the official ``openai`` client and with raw HTTP (httpx).
Outputs equal a separate ``LLM``'s ``generate`` for the same prompts and seeds; the serving
engine runs with the sanitizer on every step."""

import asyncio
import json
import random
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from pagedkv import LLM, SamplingParams  # noqa: E402
from pagedkv.entrypoints.openai_server import make_server  # noqa: E402
from server_helpers import ServeProcess, ThreadedServer  # noqa: E402

ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch_ref", max_num_seqs=8,
              max_num_batched_tokens=256, max_model_len=256, kv_cache_memory_bytes=2 << 20,
              seed=0)
PROMPTS = ["Hello", "The block table maps a request row", "Chunked prefill splits a long prompt",
           "Prefix caching hashes full blocks so that", "A slot is a block id times"]


class LiveServer(ThreadedServer):
    def __init__(self, llm, **kw):
        self.llm = llm
        self.app, self.async_llm, self.serving = make_server(llm, model_name="tiny", **kw)
        super().__init__(self.app, start_timeout=5.0)


@pytest.fixture(scope="module")
def live(model_dir):
    s = LiveServer(LLM(model_dir, sanitize=True, **ENGINE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(model_dir):
    """A second engine (same checkpoint and settings) giving the expected outputs."""
    return LLM(model_dir, **ENGINE)


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused")


def _expected(ref, prompt, **params):
    p = SamplingParams(**params)
    if isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    return ref.generate([prompt], p, use_tqdm=False)[0].outputs[0]


def _pool_idle(llm, timeout=10.0):
    mgr = llm.engine.scheduler.kv_cache_manager
    total = llm.engine.scheduler.kv_cache_config.num_blocks - 1
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if mgr.num_free_blocks == total and not llm.engine.scheduler.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


def test_models_health(client, live):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(live.url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.9, 1234)])
def test_completion_equals_generate(client, ref, temperature, seed):
    for prompt in PROMPTS[:3]:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                        temperature=temperature, seed=seed,
                                        extra_body={"ignore_eos": True})
        want = _expected(ref, prompt, max_tokens=12, temperature=temperature, seed=seed,
                         ignore_eos=True)
        c = got.choices[0]
        assert c.text == want.text and c.finish_reason == "length"
        assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens > 0


def test_penalties_equal_generate(client, ref):
    """presence / frequency (OpenAI's fields) and repetition_penalty (vLLM's, in extra_body)
    give what LLM.generate gives with the same SamplingParams, and they change the output."""
    kw = dict(presence_penalty=0.6, frequency_penalty=0.9)
    for prompt in PROMPTS[:2]:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                        temperature=0, **kw,
                                        extra_body={"ignore_eos": True, "repetition_penalty": 1.4})
        want = _expected(ref, prompt, max_tokens=16, temperature=0, ignore_eos=True,
                         repetition_penalty=1.4, **kw)
        plain = _expected(ref, prompt, max_tokens=16, temperature=0, ignore_eos=True)
        assert got.choices[0].text == want.text
        assert want.token_ids != plain.token_ids
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=8,
        temperature=0, frequency_penalty=1.0)
    assert chat.choices[0].message.content is not None


def test_streamed_completion_concatenates_to_the_text(client, ref):
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _expected(ref, PROMPTS[1], max_tokens=16, temperature=0, ignore_eos=True).text
    assert sum(1 for c in chunks if c.choices) >= 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]


def test_chat_and_streamed_chat(client, ref, model_dir):
    from pagedkv.models.chat_template import ChatTemplate

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    tok = ref.tokenizer
    ids = tok.encode(ChatTemplate.from_dir(model_dir).render(msgs), add_special_tokens=False)
    want = _expected(ref, ids, max_tokens=10, temperature=0, ignore_eos=True)
    got = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == want.text


def test_n_samples_share_the_prompt_and_follow_the_seeds(client, ref, live):
    got = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=8, n=3,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    for c in got.choices:
        want = _expected(ref, PROMPTS[3], max_tokens=8, temperature=1.0, seed=7 + c.index,
                         ignore_eos=True)
        assert c.text == want.text
    # the prompt is counted once
    n_prompt = len(ref.tokenizer.encode(PROMPTS[3]))
    assert got.usage.prompt_tokens == n_prompt and got.usage.completion_tokens == 24


def test_logprobs_formats(client):
    c = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    # a dict keyed by token text (OpenAI's legacy format): byte tokens can share a text
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert "".join(lp.tokens) == c.text
    ch = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3, extra_body={"ignore_eos": True}).choices[0]
    content = ch.logprobs.content
    assert len(content) == 4 and all(len(x.top_logprobs) == 3 for x in content)
    # greedy: the sampled token is the most likely one
    assert all(x.top_logprobs[0].token == x.token for x in content)


def test_echo_stop_and_tokenize(live, ref):
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0,
            "echo": True, "ignore_eos": True}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"].startswith(PROMPTS[2])
    full = _expected(ref, PROMPTS[2], max_tokens=6, temperature=0, ignore_eos=True).text
    stop = full[2:4]
    r = httpx.post(live.url + "/v1/completions", timeout=60,
                   json={**body, "echo": False, "stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and stop not in r["choices"][0]["text"]
    t = httpx.post(live.url + "/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert t["tokens"] == ref.tokenizer.encode(PROMPTS[1]) and t["count"] == len(t["tokens"])
    d = httpx.post(live.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == ref.tokenizer.decode(t["tokens"])


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "temperature": -1}, 400, None),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "word " * 400}, 400, None),  # longer than the context
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, None),
    ({"prompt": "x", "repetition_penalty": "high"}, 400, "repetition_penalty"),
    ({"prompt": "x", "n": 99}, 400, "n"),
    ({}, 400, "prompt"),
])
def test_errors_are_openai_json(live, body, status, param):
    r = httpx.post(live.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param
    assert _pool_idle(live.llm)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", top_p=0.0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_api_key_and_overload(model_dir):
    s = LiveServer(LLM(model_dir, **ENGINE), api_key="sekrit", max_waiting=0)
    try:
        bad = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong")
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        with pytest.raises(openai.InternalServerError) as e:  # 503: max_waiting=0
            good.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        s.stop()


def test_disconnect_aborts_at_once(live):
    before = live.async_llm.engine.stats.tokens_generated
    with httpx.stream("POST", live.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": PROMPTS[4], "max_tokens": 200,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert all(x.startswith("data: ") or x == "" for x in got)
    assert _pool_idle(live.llm)
    assert live.async_llm.engine.stats.tokens_generated - before < 150
    text = httpx.get(live.url + "/metrics").text
    assert 'pagedkv:request_success_total{finished_reason="abort",model_name="tiny"}' in text


def test_metrics_are_consistent(live, client):
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(live.url + "/metrics").text

    def value(name, **labels):
        want = ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model_name": "tiny"}.items()))
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}}"):
                return float(line.split()[-1])
        return None

    gen = value("pagedkv:generation_tokens_total")
    assert gen == live.async_llm.engine.stats.tokens_generated > 0
    assert value("pagedkv:num_requests_running") == 0
    assert value("pagedkv:time_to_first_token_seconds_count") > 0
    assert value("pagedkv:e2e_request_latency_seconds_count") >= value(
        "pagedkv:request_success_total", finished_reason="length")
    assert value("pagedkv:kv_cache_usage_perc") == 0.0
    assert value("pagedkv:failed_steps_total") in (None, 0.0)


def test_load_with_disconnects(live, ref):
    """200 streamed requests from 32 concurrent clients, a quarter of them disconnecting at a
    random point: afterwards no block is held, no step failed, and every completed response
    is the one a separate engine gives."""
    rng = random.Random(0)
    jobs = []
    for i in range(200):
        prompt = PROMPTS[i % len(PROMPTS)]
        max_tokens = rng.randint(4, 24)
        cut = rng.randint(1, 6) if i % 4 == 3 else None
        jobs.append((prompt, max_tokens, cut))
    expected = {(p, m): _expected(ref, p, max_tokens=m, temperature=0, ignore_eos=True).text
                for p, m, cut in jobs if cut is None}
    results = {}

    async def one(i, http, sem):
        prompt, max_tokens, cut = jobs[i]
        async with sem:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            text, n = "", 0
            async with http.stream("POST", live.url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    text += json.loads(line[6:])["choices"][0]["text"]
                    n += 1
                    if cut is not None and n >= cut:
                        return  # disconnect mid-stream
            results[i] = text

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.gather(*(one(i, http, sem) for i in range(len(jobs))))

    asyncio.run(main())
    done = [i for i, (_, _, cut) in enumerate(jobs) if cut is None]
    assert sorted(results) == done
    for i in done:
        prompt, max_tokens, _ = jobs[i]
        assert results[i] == expected[(prompt, max_tokens)], i
    assert _pool_idle(live.llm)
    assert live.async_llm.failed_steps == 0
    text = httpx.get(live.url + "/metrics").text
    assert "pagedkv:num_requests_running{model_name=\"tiny\"} 0.0" in text


def _mapped_libraries(pid: int) -> set[str] | None:
    """The shared libraries process ``pid`` has mapped (None where /proc has no maps)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return {line.split()[-1] for line in f if ".so" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None


def test_serve_front_loads_nothing_on_its_first_requests():
    """`pagedkv serve --shape`: the front process maps no new library for its first requests
    (text and token-id prompts, a streamed one, a refused one) and never torch (the engine is
    in its own process). The front once imported the engine module lazily to validate its first
    request: torch, 1.1 s on the 2-core CPU machine inside the event loop, ~4 s of TTFT for
    every request of a first W1 burst on the H200 host."""
    with ServeProcess(["--shape", "llama-tiny", "--device", "cpu", "--max-model-len", "64",
                       "--kv-cache-memory-bytes", "1000000"]) as server:
        before = _mapped_libraries(server.pid)
        if before is None:
            pytest.skip("no /proc/PID/maps here")
        for prompt, stream in (("t5 t6", False), ([5, 6, 7], False), ([8, 9], True)):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "llama-tiny", "prompt": prompt, "max_tokens": 2,
                                 "stream": stream, "ignore_eos": True})
            assert r.status_code == 200, r.text
        bad = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={"model": "llama-tiny", "prompt": [10 ** 9], "max_tokens": 2})
        assert bad.status_code == 400
        after = _mapped_libraries(server.pid)
        assert after - before == set()
        assert not any("libtorch" in lib for lib in after)


def test_serve_command_and_graceful_sigterm(model_dir):
    """`pagedkv serve DIR`: its front process loads the checkpoint's tokenizer without torch
    (the engine, in its own process, has it); it answers, and on SIGTERM lets the running
    request finish and exits 0."""
    with ServeProcess([model_dir, "--device", "cpu", "--dtype", "float32", "--max-model-len",
                       "128", "--kv-cache-memory-bytes", "1000000", "--served-model-name",
                       "tiny"]) as server:
        libs = _mapped_libraries(server.pid)
        assert libs is None or not any("libtorch" in lib for lib in libs)
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Hello", "max_tokens": 40,
                                "temperature": 0, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)  # mid-stream: the request still completes
            rest = list(lines)
        assert "data: [DONE]" in rest
        assert server.proc.wait(timeout=60) == 0


def test_bench_serve_replays_a_w1_variant(live):
    """``run_serve_bench``: every request completes with exactly its max_tokens (ignore_eos),
    one TTFT per request, ITLs between the remaining chunks, and the pool is idle afterwards."""
    from pagedkv.tools.benchmark import w1_workload
    from pagedkv.entrypoints.bench_serve import format_result, run_serve_bench

    vocab = live.llm.engine.model.config.vocab_size
    wl = w1_workload(6, 0.04, seed=3)
    prompts = [[t % vocab for t in p] for p in wl.prompts]
    res = asyncio.run(run_serve_bench(live.url, None, prompts, wl.max_tokens, request_rate=50.0,
                                      max_concurrency=4, seed=1))
    assert (res.completed, res.failed) == (6, 0)
    assert res.total_output_tokens == sum(wl.max_tokens)
    assert res.output_throughput > 0 and res.wall_s > 0
    for d in (res.ttft_ms, res.itl_ms, res.e2e_ms):
        assert 0 < d["p50"] <= d["p90"] <= d["p99"]
    assert res.ttft_ms["p50"] <= res.e2e_ms["p99"]
    assert "6 of 6 requests completed" in format_result(res)
    assert _pool_idle(live.llm)


def test_bench_serve_cli(live, tmp_path, capsys):
    from pagedkv.cli import main

    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", live.url, "--num-requests", "3", "--scale", "0.02",
               "--vocab-size", str(live.llm.engine.model.config.vocab_size),
               "--max-concurrency", "2", "--json", str(out)])
    assert rc == 0
    assert "3 of 3 requests completed" in capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["result"]["completed"] == 3 and rec["result"]["max_concurrency"] == 2


def test_bench_serve_errors(live, capsys):
    from pagedkv.cli import main

    assert main(["bench", "serve"]) == 2
    assert "--base-url" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", live.url, "--request-rate", "0"]) == 2
    assert "--request-rate must be > 0" in capsys.readouterr().err
    # a model the server does not serve: every request fails, exit status 1
    assert main(["bench", "serve", "--base-url", live.url, "--model-name", "nope",
                 "--num-requests", "2", "--scale", "0.02", "--vocab-size", "100"]) == 1


def test_serve_a_shape_with_the_synthetic_tokenizer(monkeypatch):
    """``pagedkv serve --shape NAME`` (the serving benchmark's server): random weights of a
    named shape and a word-level tokenizer over its whole vocabulary, so token-id prompts
    stream text; the streamed words are the generated ids. A small shape stands in for
    qwen3-0.6b on this CPU."""
    from pagedkv.cli import build_parser, build_serve_llm
    from pagedkv.tools.benchmark import w1_workload
    from pagedkv.entrypoints.bench_serve import run_serve_bench
    from pagedkv.models import config as model_config

    small = model_config.shape_config_dict("qwen3-0.6b")
    small.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                 max_position_embeddings=512)
    monkeypatch.setitem(model_config.SHAPES, "qwen3-test", small)
    args = build_parser().parse_args(
        ["serve", "--shape", "qwen3-test", "--device", "cpu", "--dtype", "float32",
         "--attention-backend", "torch_ref", "--max-model-len", "256", "--max-num-seqs", "8",
         "--kv-cache-memory-bytes", str(2 << 20)])
    llm, name = build_serve_llm(args)
    assert name == "qwen3-test" and llm.tokenizer.vocab_size == 1000
    want = llm.generate({"prompt_token_ids": [5, 17, 999]},
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert want.text.split() == [f"t{i}" for i in want.token_ids]
    s = LiveServer(llm)
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x")
        text = "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt=[5, 17, 999], max_tokens=6, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if ch.choices)
        assert text == want.text
        wl = w1_workload(4, 0.03, seed=2)
        res = asyncio.run(run_serve_bench(s.url, None, [[t % 1000 for t in p] for p in wl.prompts],
                                          wl.max_tokens, request_rate=float("inf"), seed=0))
        assert (res.completed, res.failed) == (4, 0)
        assert res.total_output_tokens == sum(wl.max_tokens)
        assert len(res.itl_ms) and res.itl_ms["p50"] is not None
    finally:
        s.stop()
    with pytest.raises(Exception, match="one of them"):
        build_serve_llm(build_parser().parse_args(["serve"]))


def test_streamed_wire_format_equals_unstreamed(live):
    """As test_engine_core's, with the engine in the server's thread."""
    from server_helpers import check_streamed_equals_unstreamed

    check_streamed_equals_unstreamed(live.url)
