"""Block hashing: expected values computed here directly with hashlib + pickle."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from pagedkv.core import hashing
from pagedkv.core.hashing import (
    HASH_FUNCTIONS,
    BlockHashListWithBlockSize,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    sha256,
)
from pagedkv.core.request import Request
from pagedkv.errors import ConfigError


def _sha(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


@dataclass
class Lora:
    lora_name: str
    lora_path: str


@dataclass
class Pos:
    offset: int
    length: int


@dataclass
class MM:
    identifier: str
    mm_position: Pos


@pytest.fixture
def fixed_seed(monkeypatch):
    """NONE_HASH from the fixed seed string; restored afterwards."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(sha256)
    yield _sha("vllm-none-hash")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    init_none_hash(sha256)


def test_sha256_is_sha256_of_highest_protocol_pickle():
    obj = (b"x", (1, 2, 3), None)
    assert sha256(obj) == _sha(obj)
    assert len(sha256(obj)) == 32
    assert get_hash_fn("sha256") is sha256


def test_none_hash_fixed_seed(fixed_seed):
    assert hashing.get_none_hash(sha256) == fixed_seed == _sha("vllm-none-hash")


def test_none_hash_from_pythonhashseed(monkeypatch, fixed_seed):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert init_none_hash(sha256) == _sha("123")
    assert hash_block_tokens(sha256, None, [1, 2]) == _sha((_sha("123"), (1, 2), None))


def test_hash_block_tokens_chain(fixed_seed):
    h0 = hash_block_tokens(sha256, None, [1, 2, 3, 4])
    assert h0 == _sha((fixed_seed, (1, 2, 3, 4), None))
    h1 = hash_block_tokens(sha256, h0, [5, 6, 7, 8], (("cache_salt", "s"),))
    assert h1 == _sha((h0, (5, 6, 7, 8), (("cache_salt", "s"),)))


def test_block_hash_with_group_id():
    h = _sha("a")
    key = make_block_hash_with_group_id(h, 3)
    assert key == h + b"\x00\x00\x00\x03"
    assert get_block_hash(key) == h and get_group_id(key) == 3
    assert make_block_hash_with_group_id(h, 258)[-4:] == (258).to_bytes(4, "big")


def test_coarser_group_uses_last_fine_hash():
    fine = [bytes([i]) for i in range(7)]
    view = BlockHashListWithBlockSize(fine, 4, 8)
    assert len(view) == 3
    assert list(view) == [fine[1], fine[3], fine[5]]
    assert view[-1] == fine[5]
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(ConfigError):
        BlockHashListWithBlockSize(fine, 4, 6)


def test_verified_extra_keys_example(fixed_seed):
    """Sec 3: block size 4, LoRA "L"/"/p", image at offset 2 length 5, salt "s1"."""
    req = Request(
        "r", list(range(100, 112)), lora_request=Lora("L", "/p"), cache_salt="s1",
        mm_features=[MM("img0", Pos(2, 5))],
    )
    k0, idx = generate_block_hash_extra_keys(req, 0, 4, 0)
    assert k0 == (("lora", "L", "/p"), ("mm", "img0", 2), ("cache_salt", "s1"))
    assert idx == 0  # the image continues into the next block
    k1, idx = generate_block_hash_extra_keys(req, 4, 8, idx)
    assert k1 == (("lora", "L", "/p"), ("mm", "img0", -2))
    assert idx == 1
    k2, _ = generate_block_hash_extra_keys(req, 8, 12, idx)
    assert k2 == (("lora", "L", "/p"),)

    # The request's block hashes are the chain over these keys.
    req2 = Request(
        "r2", list(range(100, 112)), lora_request=Lora("L", "/p"), cache_salt="s1",
        mm_features=[MM("img0", Pos(2, 5))], block_hasher=get_request_block_hasher(4, sha256),
    )
    e0 = _sha((fixed_seed, (100, 101, 102, 103), k0))
    e1 = _sha((e0, (104, 105, 106, 107), k1))
    e2 = _sha((e1, (108, 109, 110, 111), k2))
    assert req2.block_hashes == [e0, e1, e2]


def test_no_extra_keys_is_none():
    req = Request("r", [1, 2, 3, 4])
    assert generate_block_hash_extra_keys(req, 0, 4) == (None, 0)


def test_salt_only_on_first_block(fixed_seed):
    hasher = get_request_block_hasher(2, sha256)
    req = Request("r", [1, 2, 3, 4], cache_salt="abc", block_hasher=hasher)
    e0 = _sha((fixed_seed, (1, 2), (("cache_salt", "abc"),)))
    e1 = _sha((e0, (3, 4), None))
    assert req.block_hashes == [e0, e1]


def test_prompt_embeds_key(fixed_seed):
    emb = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    req = Request("r", list(range(8)), prompt_embeds=emb)
    keys, _ = generate_block_hash_extra_keys(req, 4, 8)
    assert keys == (("prompt_embeds", hashlib.sha256(emb[4:8].tobytes()).digest()),)


def test_incremental_hasher_matches_full_hash(fixed_seed):
    hasher = get_request_block_hasher(4, sha256)
    req = Request("r", list(range(10)), block_hasher=hasher)
    assert len(req.block_hashes) == 2
    req.append_output_token_ids(10)
    assert len(req.block_hashes) == 2  # 11 tokens: the third chunk is not full yet
    req.append_output_token_ids([11, 12, 13, 14, 15, 16])
    assert len(req.block_hashes) == 4
    parent, expected = fixed_seed, []
    for i in range(4):
        parent = _sha((parent, tuple(range(4 * i, 4 * i + 4)), None))
        expected.append(parent)
    assert req.block_hashes == expected
    # Hashes are only ever appended: the earlier entries are the same objects.
    assert hasher(req) == []


def test_prompt_hashes_are_made_at_the_first_read(fixed_seed):
    """A request's prompt is hashed when ``block_hashes`` is first read, not when it is made
    (the same hashes; tokens appended before the first read are hashed with it); a request
    given the hasher later (the scheduler's ``add_request``) is hashed at its first read too."""
    calls = []
    inner = get_request_block_hasher(4, sha256)

    def hasher(r):
        calls.append(len(r.__dict__.get("block_hashes", ())))
        return inner(r)

    req = Request("r", list(range(10)), block_hasher=hasher)
    assert calls == [] and "block_hashes" not in req.__dict__
    req.append_output_token_ids([10, 11])  # 12 tokens before the first read
    eager = Request("e", list(range(12)), block_hasher=inner)
    assert req.block_hashes == eager.block_hashes and len(req.block_hashes) == 3
    assert req.block_hashes is req.block_hashes  # a plain list from then on
    later = Request("l", list(range(10)))
    assert later.block_hashes == []
    later.block_hasher = inner
    later.defer_block_hashes()
    assert later.block_hashes == eager.block_hashes[:2]
    with pytest.raises(AttributeError):
        req.no_such_field  # noqa: B018


def test_memo_computes_a_shared_prefix_once_and_changes_no_hash(fixed_seed, monkeypatch):
    """Requests sharing a prompt prefix: the memoized hasher computes each shared block once
    (the hash function's calls counted), every request's hashes equal the plain chain's (built
    here by hand), and a full memo is emptied, not grown, with the values still right."""
    calls = []

    def counted(obj):
        calls.append(obj)
        return sha256(obj)

    hasher = get_request_block_hasher(4, counted)
    calls.clear()  # (the none hash)
    shared = list(range(100, 112))  # 3 blocks
    reqs = [Request(f"r{i}", shared + [i, i, i, i, i], block_hasher=hasher) for i in range(5)]
    for r in reqs:
        assert len(r.block_hashes) == 4
    assert len(calls) == 3 + 5  # the shared blocks once, each own block once
    none = hashing.get_none_hash(counted)  # (a wrapper is not a fixed-seed function)
    for i, r in enumerate(reqs):
        parent, want = none, []
        for j in range(4):
            chunk = tuple((shared + [i] * 4)[4 * j: 4 * j + 4])
            parent = _sha((parent, chunk, None))
            want.append(parent)
        assert r.block_hashes == want
    monkeypatch.setattr(hashing, "HASH_MEMO_BLOCKS", 2)
    small = get_request_block_hasher(4, counted)
    calls.clear()  # (the none hash)
    a = Request("a", shared, block_hasher=small)
    assert a.block_hashes == reqs[0].block_hashes[:3]
    c = Request("c", [7] * 12, block_hasher=small)  # b's last prompt: not a's (no shortcut)
    assert len(c.block_hashes) == 3
    b = Request("b", shared, block_hasher=small)
    assert a.block_hashes == b.block_hashes
    assert len(calls) > 3 + 3  # the memo was emptied on the way: some blocks hashed again


def test_incremental_mm_block_completed_by_outputs(fixed_seed):
    """A block finished by generated tokens looks at the last mm item only (vLLM's walk)."""
    hasher = get_request_block_hasher(4, sha256)
    req = Request("r", [1, 2, 3, 4, 5, 6], mm_features=[MM("a", Pos(4, 1)), MM("b", Pos(5, 1))],
                  block_hasher=hasher)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7, 8])
    assert len(req.block_hashes) == 2
    expected = _sha((req.block_hashes[0], (5, 6, 7, 8), (("mm", "b", 1),)))
    assert req.block_hashes[1] == expected


def test_numpy_tokens_become_python_ints(fixed_seed):
    hasher = get_request_block_hasher(2, sha256)
    req = Request("r", np.array([1, 2], dtype=np.int64), block_hasher=hasher)
    assert req.block_hashes == [_sha((fixed_seed, (1, 2), None))]


def test_registry_and_unknown_algo():
    assert "blake2b" in HASH_FUNCTIONS
    b = get_hash_fn("blake2b")
    assert b((1, 2)) == hashlib.blake2b(
        pickle.dumps((1, 2), protocol=pickle.HIGHEST_PROTOCOL), digest_size=16
    ).digest()
    with pytest.raises(ConfigError):
        get_hash_fn("md5")


@pytest.mark.skipif("xxhash" not in HASH_FUNCTIONS, reason="xxhash module not installed")
def test_xxhash_variant():
    import xxhash

    fn = get_hash_fn("xxhash")
    assert fn((1,)) == xxhash.xxh3_128_digest(pickle.dumps((1,), protocol=pickle.HIGHEST_PROTOCOL))


@pytest.mark.skipif("sha256_cbor" not in HASH_FUNCTIONS, reason="cbor2 not installed")
def test_sha256_cbor_variant():
    import cbor2

    fn = get_hash_fn("sha256_cbor")
    assert fn([1, 2]) == hashlib.sha256(cbor2.dumps([1, 2], canonical=True)).digest()


def test_bad_hash_block_size():
    with pytest.raises(ConfigError):
        get_request_block_hasher(0, sha256)


def test_numpy_output_tokens_hash_like_python_ints(fixed_seed):
    hasher = get_request_block_hasher(2, sha256)
    a = Request("a", [1], block_hasher=hasher)
    a.append_output_token_ids(np.int64(2))
    a.append_output_token_ids(np.array([3, 4], dtype=np.int32))
    b = Request("b", [1, 2, 3, 4], block_hasher=hasher)
    assert a.block_hashes == b.block_hashes and len(a.block_hashes) == 2
    assert all(type(t) is int for t in a.all_token_ids)


def test_shared_full_blocks_by_hand():
    """Leading equal blocks of two token lists, capped by ``limit``."""
    from pagedkv.core.hashing import shared_full_blocks

    a = list(range(40))
    assert shared_full_blocks(a, list(a), 4, 10) == 10
    assert shared_full_blocks(a, list(a), 4, 7) == 7
    b = list(a)
    b[17] = -1  # block 4 differs
    assert shared_full_blocks(a, b, 4, 10) == 4
    b[0] = -1
    assert shared_full_blocks(a, b, 4, 10) == 0
    assert shared_full_blocks(a, a[:12], 4, 0) == 0
    assert shared_full_blocks(a, [], 4, 0) == 0


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_shared_prefix_shortcut_gives_the_plain_chain(data):
    """Prompts built from a few shared heads (some cut mid-block, some with a cache salt),
    hashed in a random order by one hasher (its shortcut and memo), some then extended by
    generated tokens: every request's hashes equal those of a fresh hasher of its own."""
    init_none_hash(sha256)
    bs = data.draw(st.integers(1, 5), label="block_size")
    heads = [data.draw(st.lists(st.integers(0, 9), min_size=0, max_size=24), label="head")
             for _ in range(3)]
    hasher = get_request_block_hasher(bs, sha256)
    reqs = []
    for i in range(data.draw(st.integers(1, 8), label="requests")):
        head = heads[data.draw(st.integers(0, 2))]
        cut = data.draw(st.integers(0, len(head)))
        tail = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=12))
        salt = data.draw(st.sampled_from([None, None, "s"]))
        reqs.append(Request(f"r{i}", head[:cut] + tail, cache_salt=salt, block_hasher=hasher))
    for r in reqs:
        r.block_hashes  # noqa: B018  (hashes at the first read)
        if data.draw(st.booleans(), label="extend"):
            r.append_output_token_ids(data.draw(st.lists(st.integers(0, 9), max_size=9)))
    for r in reqs:
        fresh = Request("f", list(r.all_token_ids), cache_salt=r.cache_salt,
                        block_hasher=get_request_block_hasher(bs, sha256))
        assert r.block_hashes == fresh.block_hashes


def test_shortcut_takes_the_last_prompts_hashes(fixed_seed, monkeypatch):
    """With a one-entry memo, a prompt sharing 3 full blocks with the last one hashed costs
    only its own blocks (the shortcut, not the memo), a salted prompt takes nothing from it
    and is not taken from, and the values are the plain chain's."""
    calls = []

    def counted(obj):
        calls.append(obj)
        return sha256(obj)

    monkeypatch.setattr(hashing, "HASH_MEMO_BLOCKS", 1)
    hasher = get_request_block_hasher(4, counted)
    shared = list(range(100, 113))  # 3 full blocks and one token
    a = Request("a", shared + [1, 1, 1], block_hasher=hasher)
    calls.clear()
    assert len(a.block_hashes) == 4
    assert len(calls) == 4
    calls.clear()
    b = Request("b", shared + [2, 2, 2, 2, 2], block_hasher=hasher)
    assert len(b.block_hashes) == 4 and len(calls) == 1
    assert b.block_hashes[:3] == a.block_hashes[:3] and b.block_hashes[3] != a.block_hashes[3]
    calls.clear()
    salted = Request("s", shared + [2, 2, 2], cache_salt="x", block_hasher=hasher)
    assert len(salted.block_hashes) == 4 and len(calls) == 4
    calls.clear()
    c = Request("c", shared + [3, 3, 3], block_hasher=hasher)  # b's hashes, not the salted
    assert len(c.block_hashes) == 4 and len(calls) == 1
    fresh = Request("f", shared + [3, 3, 3], block_hasher=get_request_block_hasher(4, counted))
    assert c.block_hashes == fresh.block_hashes
