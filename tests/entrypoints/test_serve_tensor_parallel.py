"""``pagedkv serve --tensor-parallel-size 2`` (and with ``--decode-context-parallel-size 2``)
on the CPU: the real server process (``ServeProcess``), its engine process with two rank
workers (``multiprocessing`` spawn children, gloo), talked to with the official ``openai``
client. Greedy completions (a batch of prompts in one request, and a streamed one) equal an
in-process one-rank ``LLM``'s on the same tiny Llama checkpoint; stopping the server (SIGTERM)
exits 0 and leaves none of its processes (engine process, rank workers) behind. Processes are
found through /proc (Linux)."""

import os
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from pagedkv import LLM, SamplingParams  # noqa: E402
from server_helpers import ServeProcess  # noqa: E402

if not os.path.isdir("/proc/self"):
    pytest.skip("the process checks read /proc", allow_module_level=True)

MAX_TOKENS = 8
PROMPTS = ["Hello", "The block table maps a request row", "A slot is a block id times",
           "Prefix caching hashes full blocks so that"]
SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
         "--kv-cache-memory-bytes", "1000000", "--served-model-name", "tiny"]


@pytest.fixture(scope="module")
def path(tiny_dir):
    return tiny_dir("llama")  # 4 heads, 2 KV heads: split over 2 ranks, or shared by a DCP pair


@pytest.fixture(scope="module")
def expected(path):
    """The one-process engine's greedy text of every prompt."""
    llm = LLM(path, device="cpu", dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]
    finally:
        llm.shutdown()


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """Every process now: ``pid -> (parent pid, state, command line)``."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        table[int(name)] = (int(fields[1]), fields[0], cmd)
    return table


def descendants(pid: int) -> dict[int, str]:
    """``pid``'s living descendants (children, theirs, ...): ``pid -> command line``."""
    table = _proc_table()
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for p, (ppid, state, cmd) in table.items():
            if ppid == parent and state != "Z" and p not in found:
                found[p] = cmd
                frontier.append(p)
    return found


def alive(pids, timeout: float = 15.0) -> list[int]:
    """Those of ``pids`` still running (not gone, not a zombie) after up to ``timeout`` s."""
    end = time.monotonic() + timeout
    while True:
        table = _proc_table()
        left = [p for p in pids if p in table and table[p][1] != "Z"]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("parallel", [
    ["--tensor-parallel-size", "2"],
    ["-tp", "2", "-dcp", "2", "--attention-backend", "torch_ref"],
], ids=["tp2", "tp2-dcp2"])
def test_served_greedy_equals_one_rank_and_stop_leaves_no_process(path, expected, parallel):
    with ServeProcess([path, *SERVE, *parallel]) as server:
        procs = descendants(server.pid)
        workers = [p for p, cmd in procs.items() if "multiprocessing.spawn" in cmd]
        assert len(workers) == 2, procs  # one per rank, under the engine process
        assert "min over 2 ranks" in server.output()  # the pool agreed by both ranks

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        # every prompt in one request: the ranks run them as one batch
        got = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        choices = sorted(got.choices, key=lambda c: c.index)
        assert [c.text for c in choices] == expected
        assert {c.finish_reason for c in choices} == {"length"}
        assert got.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)

        chunks = list(client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1]
        assert sum(1 for c in chunks if c.choices) >= 2
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS

        assert server.stop() == 0, server.output()
    left = alive(procs)
    assert not left, {p: procs[p] for p in left}
