"""The engine stays consistent when the caller's loop is interrupted: an exception or a
KeyboardInterrupt inside ``LLM.generate`` (from the model, i.e. inside a step, or from between
steps) aborts that call's requests, frees their blocks, and the next ``generate`` works and
gives the same tokens; finished requests driven through ``add_request``/``step`` are forgotten
once reported; a dropped ``LLM`` is collectable although its start-up objects were frozen."""

import gc
import weakref

import pytest
from engine_helpers import TEXTS, make_llm, pool_is_idle

from pagedkv import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Boom(Exception):
    pass


def _raise_in_forward(llm, after_calls: int, exc):
    """Make the model's forward raise ``exc`` on call ``after_calls + 1`` (inside a step),
    once; returns a function that undoes it."""
    model = llm.engine.model
    inner = model.forward
    calls = [0]

    def forward(*a, **kw):
        calls[0] += 1
        if calls[0] == after_calls + 1:
            raise exc
        return inner(*a, **kw)

    model.forward = forward
    return lambda: setattr(model, "forward", inner)


def _raise_between_steps(llm, after_steps: int, exc):
    """Make ``engine.step`` raise ``exc`` after ``after_steps`` complete steps (the step
    itself finished: the interrupt lands between steps)."""
    engine = llm.engine
    inner = engine.step
    calls = [0]

    def step(*a, **kw):
        out = inner(*a, **kw)
        calls[0] += 1
        if calls[0] == after_steps:
            raise exc
        return out

    engine.step = step
    return lambda: setattr(engine, "step", inner)


def _reference(path, **kw):
    return [o.outputs[0].token_ids for o in make_llm(path, **kw).generate(TEXTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("where", ["forward", "between"])
@pytest.mark.parametrize("exc", [Boom("model failed"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_interrupted_generate_leaves_the_engine_clean(tiny_dir, async_scheduling, where, exc):
    path = tiny_dir("qwen3")
    want = _reference(path)
    llm = make_llm(path, async_scheduling=async_scheduling)
    mgr = llm.scheduler.kv_cache_manager
    free0 = mgr.num_free_blocks
    # a first call that fills the prefix cache, so a torn step could leave stale cached blocks
    assert [o.outputs[0].token_ids for o in llm.generate(TEXTS, GREEDY, use_tqdm=False)] == want
    undo = (_raise_in_forward if where == "forward" else _raise_between_steps)(llm, 3, exc)
    with pytest.raises(type(exc)):
        llm.generate(TEXTS[::-1], GREEDY, use_tqdm=False)
    undo()
    assert mgr.num_free_blocks == free0
    assert not llm.engine.has_unfinished_requests() and not llm.engine._requests
    assert not llm.scheduler.has_unfinished_requests()
    # the next call works and gives the same tokens (no stale prefix-cache blocks)
    again = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert pool_is_idle(llm) and mgr.num_free_blocks == free0


def test_interrupted_step_aborts_other_requests_too(tiny_dir):
    """A step torn by an exception cannot be trusted for anybody: requests of the step-level
    API that were in it are aborted (their blocks freed); requests added later run."""
    path = tiny_dir("llama")
    llm = make_llm(path)
    engine = llm.engine
    other = engine.add_request(TEXTS[1], GREEDY)
    engine.step()
    undo = _raise_in_forward(llm, 0, Boom("device error"))
    with pytest.raises(Boom):
        llm.generate(TEXTS[2:], GREEDY, use_tqdm=False)
    undo()
    assert pool_is_idle(llm) and not engine._requests
    with pytest.raises(Exception):
        engine.get_request(other)
    out = llm.generate(TEXTS[:2], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == _reference(path)[:2]


def test_interrupt_between_steps_keeps_other_requests(tiny_dir):
    """Between steps nothing is torn: only the interrupted call's requests are aborted; a
    request of the step-level API keeps running and finishes with the right tokens."""
    path = tiny_dir("llama")
    want = _reference(path)
    llm = make_llm(path)
    engine = llm.engine
    other = engine.add_request(TEXTS[1], GREEDY)
    undo = _raise_between_steps(llm, 2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate([TEXTS[3]], GREEDY, use_tqdm=False)
    undo()
    assert engine.has_unfinished_requests()
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == other
            final = o
    assert final.outputs[0].token_ids == want[1]
    assert pool_is_idle(llm) and not engine._requests


def test_step_loop_forgets_finished_requests(tiny_dir):
    """add_request/step: a finished request's state goes once its final output is returned,
    so a long-running loop holds only what is unfinished."""
    llm = make_llm(tiny_dir("llama"))
    engine = llm.engine
    finished = 0
    for wave in range(6):
        ids = [engine.add_request(t, SamplingParams(temperature=0, max_tokens=3 + wave))
               for t in TEXTS]
        while engine.has_unfinished_requests():
            for o in engine.step():
                finished += o.finished
        assert not engine._requests, "finished requests must be released"
        assert all(rid not in engine._requests for rid in ids)
    assert finished == 6 * len(TEXTS)
    assert pool_is_idle(llm)


def test_dropped_llm_is_collected(tiny_dir):
    """The start-up heap freeze must not keep a deleted engine (and its KV memory) alive."""
    llm = make_llm(tiny_dir("llama"))
    assert gc.get_freeze_count() > 0  # build_engine froze the start-up objects
    model_ref = weakref.ref(llm.engine.model)
    cache_ref = weakref.ref(llm.engine.runner.kv_caches[0])
    del llm
    gc.collect()
    assert model_ref() is None and cache_ref() is None
    llm = make_llm(tiny_dir("llama"))
    llm.shutdown()
    assert llm.engine is None


def test_torn_step_leaves_no_stale_prefix_cache_entries(tiny_dir):
    """The scheduler registers a prompt's full blocks in the prefix cache when it allocates
    them; a step torn before the forward wrote their KV must not leave them as hits."""
    path = tiny_dir("qwen3")
    want = _reference(path)
    llm = make_llm(path)
    undo = _raise_in_forward(llm, 0, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(TEXTS, GREEDY, use_tqdm=False)  # never computed
    undo()
    out = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == want


def test_sanitizer_runs_on_the_engine_every_step(tiny_dir):
    """LLM(sanitize=True) checks the prepared inputs of every step before the forward pass: a
    slot corrupted after preparation is caught (and the call's requests are aborted)."""
    from pagedkv.errors import InvariantError

    llm = make_llm(tiny_dir("llama"), sanitize=True)
    runner = llm.engine.runner
    checks = []
    inner_check = runner.step_check
    runner.step_check = lambda step: (checks.append(step.num_tokens), inner_check(step))
    n0 = runner.num_steps
    llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert len(checks) == runner.num_steps - n0 >= 12  # every step that ran the model
    prepare = runner.preparer.prepare

    def corrupting_prepare(*a, **kw):
        step = prepare(*a, **kw)
        step.slot_mappings[0, 0] += 1  # a token writes one slot off
        return step

    runner.preparer.prepare = corrupting_prepare
    with pytest.raises(InvariantError, match="slot"):
        llm.generate(TEXTS[:2], GREEDY, use_tqdm=False)
    runner.preparer.prepare = prepare
    assert pool_is_idle(llm)
    assert make_llm(tiny_dir("llama"), sanitize=False).engine.runner.step_check is None
