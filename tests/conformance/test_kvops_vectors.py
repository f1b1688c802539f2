"""Replay the kind-"kvops" trace through pagedkv's KVCacheManager and compare every field of
every log line with vLLM 0.33.0's recorded answers (tests/vectors/vllm-logs/kvops-*.jsonl).

Driver semantics (tests/vectors/FORMAT.txt):
  new {req, prompt}            build the Request (with the manager's block hasher iff caching)
  get_computed_blocks {req}    -> block_ids, num_computed_tokens; remember the hit
  allocate_slots {req, num_new_tokens: int | "rest" | "half", use_hit?, num_lookahead_tokens?,
                  full_sequence_must_fit?}
        rest = num_tokens - num_computed_tokens - hit, half = ceil(rest / 2); use_hit passes
        (and forgets) the remembered hit; 0 new tokens and no hit -> skipped. On success
        num_computed_tokens += hit + num_new_tokens. -> block_ids (None when the allocation
        failed), table (get_block_ids after the call)
  append {req, n}              n model tokens from traces.next_token(rid, pos, vocab)
  free {req}                   manager.free; num_computed_tokens = 0 (a preemption)
  cache_blocks {req, n}; reset_prefix_cache -> ok
Every op line also carries num_free and the whole free queue (head first). An exception is
logged as "error": "<ExceptionType>" and the replay goes on.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os

import pytest

from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import Request, RequestStatus
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

VECTORS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vectors")


def _load_traces_module():
    spec = importlib.util.spec_from_file_location("pagedkv_vector_traces", os.path.join(VECTORS, "traces.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


traces = _load_traces_module()


def _make_manager(engine: dict) -> KVCacheManager:
    groups = []
    for gid, g in enumerate(engine["groups"]):
        if g["type"] == "full":
            spec = FullAttentionSpec(block_size=engine["block_size"])
        elif g["type"] == "sliding_window":
            spec = SlidingWindowSpec(block_size=engine["block_size"], sliding_window=g["sliding_window"])
        else:
            raise ValueError(f"unknown group type {g['type']!r} in the trace")
        groups.append(KVCacheGroupSpec((f"layer{gid}",), spec))
    config = KVCacheConfig(num_blocks=engine["num_blocks"], kv_cache_groups=groups)
    return KVCacheManager(
        config,
        max_model_len=engine["max_model_len"],
        enable_caching=engine["enable_prefix_caching"],
    )


def _ids(lists):
    return [list(x) for x in lists]


def replay_kvops(trace: dict) -> list[dict]:
    """The log lines pagedkv produces for a kvops trace (same format as vLLM's log)."""
    engine = trace["engine"]
    manager = _make_manager(engine)
    pool = manager.block_pool
    vocab = trace["vocab"]
    requests: dict[str, Request] = {}
    hits: dict[str, tuple] = {}
    canonical = json.dumps(trace, sort_keys=True, separators=(",", ":")).encode()
    out = [{
        "kind": "header", "engine": engine, "seed": trace["seed"], "trace": trace["name"],
        "trace_kind": trace["kind"], "trace_sha256": hashlib.sha256(canonical).hexdigest(),
    }]
    errors = 0
    for i, op in enumerate(trace["ops"]):
        name = op["op"]
        line: dict = {"kind": "op", "i": i, "op": name}
        if "req" in op:
            line["req"] = op["req"]
        try:
            if name == "new":
                requests[op["req"]] = Request(
                    op["req"], list(op["prompt"]), block_hasher=manager.block_hasher
                )
            elif name == "get_computed_blocks":
                req = requests[op["req"]]
                blocks, num_hit = manager.get_computed_blocks(req)
                hits[op["req"]] = (blocks, num_hit)
                line["block_ids"] = _ids(blocks.get_block_ids())
                line["num_computed_tokens"] = num_hit
            elif name == "allocate_slots":
                req = requests[op["req"]]
                hit_blocks, hit = None, 0
                if op.get("use_hit"):
                    hit_blocks, hit = hits.pop(op["req"], (None, 0))
                n = op["num_new_tokens"]
                if n in ("rest", "half"):
                    rest = req.num_tokens - req.num_computed_tokens - hit
                    n = rest if n == "rest" else -(-rest // 2)
                if n == 0 and hit == 0:
                    line["skipped"] = True
                else:
                    line["num_new_tokens"] = n
                    result = manager.allocate_slots(
                        req,
                        n,
                        num_new_computed_tokens=hit,
                        new_computed_blocks=hit_blocks,
                        num_lookahead_tokens=op.get("num_lookahead_tokens", 0),
                        full_sequence_must_fit=op.get("full_sequence_must_fit", False),
                    )
                    if result is None:
                        line["block_ids"] = None
                    else:
                        line["block_ids"] = _ids(result.get_block_ids())
                        req.num_computed_tokens += hit + n
                        req.status = RequestStatus.RUNNING
                    line["table"] = _ids(manager.get_block_ids(op["req"]))
            elif name == "append":
                req = requests[op["req"]]
                for _ in range(op["n"]):
                    req.append_output_token_ids(traces.next_token(op["req"], req.num_tokens, vocab))
            elif name == "free":
                req = requests[op["req"]]
                manager.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                req.num_preemptions += 1
            elif name == "cache_blocks":
                manager.cache_blocks(requests[op["req"]], op["n"])
            elif name == "reset_prefix_cache":
                line["ok"] = manager.reset_prefix_cache()
            else:
                raise ValueError(f"unknown kvops operation {name!r}")
        except Exception as e:  # noqa: BLE001 - logged like the reference driver does
            errors += 1
            line["error"] = type(e).__name__
        line["num_free"] = pool.get_num_free_blocks()
        line["free_queue"] = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        out.append(line)
    out.append({
        "kind": "summary", "ops": len(trace["ops"]), "errors": errors,
        "num_free_blocks": pool.get_num_free_blocks(),
        "free_queue": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
    })
    return out


# Header fields that describe the reference run itself, not the trace.
_REFERENCE_ONLY = {"vllm", "v2_model_runner"}


def _compare(expected: list[dict], got: list[dict]) -> list[str]:
    problems = []
    if len(expected) != len(got):
        problems.append(f"line count: expected {len(expected)}, got {len(got)}")
    for exp, act in zip(expected, got):
        where = f"op {exp['i']} ({exp.get('op')} {exp.get('req', '')})" if exp["kind"] == "op" else exp["kind"]
        keys = set(exp) | set(act)
        if exp["kind"] == "header":
            keys -= _REFERENCE_ONLY
        for key in sorted(keys):
            if key not in exp:
                problems.append(f"{where}: field {key!r} not in the reference log (got {act[key]!r})")
            elif key not in act:
                problems.append(f"{where}: field {key!r} missing (expected {exp[key]!r})")
            elif exp[key] != act[key]:
                problems.append(f"{where}: field {key!r}: expected {exp[key]!r}, got {act[key]!r}")
    return problems


def _kvops_cases():
    out = []
    for log in sorted(glob.glob(os.path.join(VECTORS, "vllm-logs", "*.jsonl"))):
        base = os.path.basename(log)[: -len(".jsonl")]
        trace = os.path.join(VECTORS, "traces", base + ".json")
        with open(log) as f:
            header = json.loads(f.readline())
        if header.get("trace_kind") == "kvops" and os.path.exists(trace):
            out.append(pytest.param(trace, log, id=base))
    return out


@pytest.mark.parametrize("trace_path,log_path", _kvops_cases())
def test_kvops_trace_matches_vllm(trace_path, log_path):
    with open(trace_path) as f:
        trace = json.load(f)
    with open(log_path) as f:
        expected = [json.loads(line) for line in f if line.strip()]
    got = replay_kvops(trace)
    problems = _compare(expected, got)
    if problems:
        shown = "\n".join(problems[:20])
        pytest.fail(f"{len(problems)} differences from vLLM 0.33.0; first ones:\n{shown}")


def test_kvops_cases_found():
    assert _kvops_cases(), "no kvops trace/log pair under tests/vectors"
