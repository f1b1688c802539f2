"""Helpers of the engine tests: engines on CPU (fp32, torch reference attention), transformers
references, pool checks."""

import pytest
import torch
import transformers

# The transformers release the newer families' CPU parity was shown against (5.24). An older
# one implements some of them differently: with transformers 5.17 (the H200's) the CPU parity
# tests of Bamba (1 of 4 variants) and GPT-OSS (6 of 6) fail on this machine too, from a
# 2-token prompt's first token, while against 5.24 they pass and our CPU, CUDA eager and
# CUDA-graph engines agree; 5.17's DeepSeek-V4 fails in bf16 inside its own forward.
TRANSFORMERS_REFERENCE = (5, 24)
needs_reference_transformers = pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < TRANSFORMERS_REFERENCE,
    reason=f"the parity reference is transformers >= 5.24; this is {transformers.__version__}")

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
TEXTS = [
    "Hello",
    "The block table maps a request row",
    "Chunked prefill splits a long prompt over several steps so that decode requests keep moving.",
    "Prefix caching hashes full blocks so that a new prompt can reuse the blocks of an old one. "
    "When the pool runs out of free blocks, the scheduler preempts the newest running request!",
]


class HFReference:
    """transformers' greedy ``generate`` (EOS off, no padding), memoized per prompt."""

    def __init__(self, path: str):
        self.path = path
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict = {}

    @torch.no_grad()
    def greedy(self, prompt, n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._cache:
            # a longer cached run of the same prompt answers shorter ones
            for (p, m), toks in self._cache.items():
                if p == key[0] and m >= n:
                    return toks[:n]
            ids = torch.tensor([list(prompt)])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)
            self._cache[key] = out[0, len(prompt):].tolist()
        return self._cache[key]

    @torch.no_grad()
    def logits(self, ids) -> torch.Tensor:
        return self.model(torch.tensor([list(ids)])).logits[0].float()


def greedy(n: int):
    """Greedy sampling of exactly ``n`` tokens (EOS ignored)."""
    from pagedkv import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def first_flip(logits_fn, prompt, ours, theirs) -> str:
    """Where two greedy continuations of ``prompt`` part (``""`` where they do not): the
    first differing position, both tokens, and the reference's logit margin there between its
    own choice and ours (``logits_fn(ids) -> [len(ids), vocab]``, the reference's logits over
    ``prompt`` + its tokens before the flip). A margin near 0 is a near-tie that rounding may
    flip; a large one is a wrong result."""
    ours, theirs = list(ours), list(theirs)
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if i is None:
        return "" if len(ours) == len(theirs) else f"lengths {len(ours)} / {len(theirs)}"
    row = logits_fn(list(prompt) + theirs[:i])[-1].float()
    margin = float(row[theirs[i]] - row[ours[i]])
    return (f"first flip at output position {i}: ours {ours[i]}, reference {theirs[i]}, "
            f"reference logit margin {margin:.3g} (its top-1 {float(row.max()):.4g})")


def check_greedy(llm, ref: HFReference, prompts, n: int):
    """``llm`` generates ``n`` greedy tokens for each prompt: each output equals transformers'
    greedy ``generate`` (``ref``), finished by length, and the pool is idle afterwards; a
    mismatch names its first flip and the reference's margin there (:func:`first_flip`).
    Returns the outputs."""
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    for o in outs:
        want = ref.greedy(o.prompt_token_ids, n)
        assert o.outputs[0].token_ids == want, (
            f"prompt of {len(o.prompt_token_ids)} tokens: "
            + first_flip(ref.logits, o.prompt_token_ids, o.outputs[0].token_ids, want))
        assert o.finished and o.outputs[0].finish_reason == "length"
    assert pool_is_idle(llm)
    return outs


def make_llm(path: str, **kw):
    """An engine on CPU, fp32, torch reference attention, a small KV pool by default, with the
    sanitizer checking every invariant on every step."""
    from pagedkv import LLM

    opts = dict(dtype="float32", device="cpu", max_num_seqs=8, max_num_batched_tokens=256,
                max_model_len=256, kv_cache_memory_bytes=2 << 20, attention_backend="torch_ref",
                sanitize=True)
    opts.update(kw)
    return LLM(path, **opts)


def churn_prompts(*, shared_len: int, n_shared: int, shared_base: int, unshared_base: int,
                  unshared_len: int) -> tuple[list, list]:
    """``(prompts, params)`` of :func:`run_churn`: ``n_shared`` requests on a common prefix of
    ``shared_len`` tokens (prefix hits; own tails ``[shared_base + i] * (3 + 7 i)``) with short
    outputs, one short request, and three unshared ones of ``unshared_len`` tokens with 30
    output tokens each (preemption in a small pool)."""
    from pagedkv import SamplingParams

    shared = list(range(3, 3 + shared_len))
    prompts = [shared + [shared_base + i] * (3 + 7 * i) for i in range(n_shared)]
    prompts += [list(range(50, 61))]
    prompts += [[unshared_base + i] * unshared_len for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 3 * (i % 3), ignore_eos=True)
              for i in range(n_shared + 1)]
    params += [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3
    return prompts, params


def run_churn(llm, prompts, params, *, abort_tokens: int) -> dict:
    """Every host write path of an async-scheduled engine: ``prompts`` generated to their full
    lengths, then four of them added again and stepped while two are aborted mid-run
    (``abort_tokens`` each); returns the KV stats."""
    from pagedkv import SamplingParams

    engine = llm.engine
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    for i, p in enumerate(prompts[:4]):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=abort_tokens,
                                             ignore_eos=True), request_id=f"ab{i}")
    for _ in range(4):
        engine.step()
    assert engine.abort("ab1") and engine.abort("ab2")
    while engine.has_unfinished_requests():
        engine.step()
    return llm.get_kv_stats()


def pool_is_idle(llm) -> bool:
    """No request holds a block: every block but the null block is free."""
    sched = llm.scheduler
    return (sched.kv_cache_manager.num_free_blocks == sched.kv_cache_config.num_blocks - 1
            and not sched.has_unfinished_requests())


def log_scheduled_steps(scheduler) -> list[dict]:
    """Wrap ``scheduler.schedule`` to record every SchedulerOutput's num_scheduled_tokens."""
    inner = scheduler.schedule
    log: list[dict] = []

    def schedule():
        so = inner()
        log.append(dict(so.num_scheduled_tokens))
        return so

    scheduler.schedule = schedule
    return log


def teacher_forced_agreement(hf_model, prompts, outs) -> tuple[int, int, float]:
    """``(exact, total, worst margin)`` of the engine's greedy outputs ``outs`` of ``prompts``
    under the transformers model ``hf_model`` fed our own tokens
    (``pagedkv.models.harness.teacher_forced_checks``): how many of our tokens are its top-1,
    out of how many, and the largest logit margin of one that is not."""
    from pagedkv.models.harness import teacher_forced_checks

    tf = teacher_forced_checks(hf_model, prompts, [o.outputs[0].token_ids for o in outs])
    return tf.exact, len(tf.margins), tf.max_margin


def check_bf16_teacher_forced(llm, path: str, prompts, label: str, n: int = 24,
                              max_margin: float = 1.0):
    """The bf16 GPU check of the hybrid and MoE families: ``llm`` (bf16 on CUDA) generates ``n``
    greedy tokens per prompt; transformers' model at ``path`` in bf16 on CUDA, fed our own
    tokens, has at least 90% of them as its top-1 and every one within a logit margin of
    ``max_margin`` of its top-1 (the agreement is printed). Returns the outputs."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16).to("cuda").eval()
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    exact, total, worst = teacher_forced_agreement(hf, [o.prompt_token_ids for o in outs], outs)
    print(f"{label} bf16 teacher-forced top-1 agreement {exact}/{total} = {exact / total:.3f}, "
          f"largest margin {worst:.3f}")
    assert exact / total >= 0.9 and worst < max_margin
    return outs


def record_replays(graphs, mixed: bool = False) -> list:
    """Wrap a ``CudaGraphManager``'s ``replay`` (``replay_mixed`` with ``mixed``) so that every
    replay appends its ``(size, variant)`` to the returned list, then replays."""
    name = "replay_mixed" if mixed else "replay"
    inner, seen = getattr(graphs, name), []

    def replay(size, variant=None):
        seen.append((size, variant))
        return inner(size, variant)

    setattr(graphs, name, replay)
    return seen


def assert_decode_records(res: dict, new_tokens: int) -> None:
    """The rows of a decode benchmark's record (``bench/decode_bench_common.decode_rate``): their
    arithmetic, not the timings themselves. On a loaded CPU a tiny 1-token run can take longer
    than the ``new_tokens`` one (a timed assertion was flaky: decode_s = -0.00055 in the
    twenty-fifth session's suite), so a decode rate is either None or the one the times give."""
    batch = res["batch"]
    for r in res["results"]:
        assert r["t_all_s"] > 0 and r["t_first_token_s"] > 0
        assert r["decode_s"] == r["t_all_s"] - r["t_first_token_s"]
        rate = r["decode_tokens_per_s"]
        assert (rate is None) == (r["decode_s"] <= 0)
        assert rate is None or rate == batch * (new_tokens - 1) / r["decode_s"]
        assert r["output_tokens_per_s"] == batch * new_tokens / r["t_all_s"]
