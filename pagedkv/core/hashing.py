"""Prefix-cache block hashing (vLLM 0.33.0 semantics).

A request's token list is cut into full ``hash_block_size`` chunks. Chunk ``i`` gets

    hash_i = hash_fn((hash_{i-1} or NONE_HASH, tuple(chunk_tokens), extra_keys))

so every hash covers the whole prefix up to the end of its chunk (a chain). ``extra_keys``
is a tuple of tagged keys (LoRA, multimodal items, cache salt, prompt embeddings) or None.
The prefix-cache map key adds the KV-cache group: ``BlockHashWithGroupId = hash +
group_id.to_bytes(4, "big")``.

Only plain Python ints may appear in token lists: numpy ints pickle to other bytes.

Pure Python (control plane).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pagedkv.errors import ConfigError

if TYPE_CHECKING:
    from pagedkv.core.request import Request

HashFn = Callable[[Any], bytes]
BlockHash = bytes
BlockHashWithGroupId = bytes

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


# ----- hash functions --------------------------------------------------------------------
def sha256(obj: Any) -> bytes:
    """vLLM's default: SHA-256 over ``pickle.dumps(obj, HIGHEST_PROTOCOL)`` (32 bytes)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def blake2b(obj: Any) -> bytes:
    """Fast builtin alternative (not in vLLM): BLAKE2b with a 16-byte digest over the pickle.

    Used where speed matters more than interoperability with vLLM's hash values and the
    ``xxhash`` module is not installed.
    """
    return hashlib.blake2b(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL), digest_size=16).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256, "blake2b": blake2b}
# Hash functions whose NONE_HASH seed is the fixed string when PYTHONHASHSEED is unset.
_FIXED_SEED_FUNCTIONS: set[HashFn] = {sha256, blake2b}

try:  # optional: canonical CBOR instead of pickle (stable across Python versions)
    import cbor2 as _cbor2
except ImportError:  # pragma: no cover - depends on the environment
    _cbor2 = None

if _cbor2 is not None:

    def sha256_cbor(obj: Any) -> bytes:
        """SHA-256 over ``cbor2.dumps(obj, canonical=True)``."""
        return hashlib.sha256(_cbor2.dumps(obj, canonical=True)).digest()

    HASH_FUNCTIONS["sha256_cbor"] = sha256_cbor
    _FIXED_SEED_FUNCTIONS.add(sha256_cbor)

try:  # optional: xxh3_128, non-cryptographic and fast
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

if _xxhash is not None:

    def xxhash(obj: Any) -> bytes:
        """xxh3_128 over the pickle (16 bytes)."""
        return _xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))

    HASH_FUNCTIONS["xxhash"] = xxhash
    if _cbor2 is not None:

        def xxhash_cbor(obj: Any) -> bytes:
            """xxh3_128 over canonical CBOR (16 bytes)."""
            return _xxhash.xxh3_128_digest(_cbor2.dumps(obj, canonical=True))

        HASH_FUNCTIONS["xxhash_cbor"] = xxhash_cbor


def get_hash_fn(name: str) -> HashFn:
    """The hash function registered as ``name`` (``prefix_caching_hash_algo``)."""
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ConfigError(
            f"unknown prefix-caching hash algorithm {name!r}; available here: "
            f"{sorted(HASH_FUNCTIONS)} (sha256_cbor needs cbor2, xxhash needs xxhash)"
        ) from None


# ----- NONE_HASH -------------------------------------------------------------------------
NONE_HASH_SEED = "vllm-none-hash"
# One seed hash per hash function, computed on first use (or by ``init_none_hash``). This is
# process-wide configuration, not per-step state.
_NONE_HASHES: dict[HashFn, bytes] = {}


def init_none_hash(hash_fn: HashFn) -> bytes:
    """(Re)compute the parent hash of a request's first block for ``hash_fn`` and return it.

    The seed is ``$PYTHONHASHSEED`` when set. Otherwise it is the fixed string
    ``"vllm-none-hash"`` for the cryptographic functions (sha256, sha256_cbor, and our
    blake2b) and ``os.urandom(32).hex()`` for the xxhash variants (random per process).
    """
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        seed = NONE_HASH_SEED if hash_fn in _FIXED_SEED_FUNCTIONS else os.urandom(32).hex()
    value = hash_fn(seed)
    _NONE_HASHES[hash_fn] = value
    return value


def get_none_hash(hash_fn: HashFn) -> bytes:
    value = _NONE_HASHES.get(hash_fn)
    return value if value is not None else init_none_hash(hash_fn)


# ----- block hashes ----------------------------------------------------------------------
def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: bytes | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> bytes:
    """Hash of one full block: ``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``."""
    if not parent_block_hash:
        parent_block_hash = get_none_hash(hash_fn)
    return hash_fn((parent_block_hash, tuple(curr_block_token_ids), extra_keys))


def make_block_hash_with_group_id(block_hash: bytes, group_id: int) -> BlockHashWithGroupId:
    """Prefix-cache map key: the hash followed by the group id as 4 big-endian bytes."""
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> bytes:
    return key[:-4]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big")


class BlockHashListWithBlockSize:
    """Read-only view of fine hashes as hashes of a coarser block size.

    A group with ``block_size = k * hash_block_size`` uses the last fine hash inside each of
    its blocks: coarse hash ``j`` is ``fine[(j + 1) * k - 1]``; the view's length is
    ``len(fine) // k``. Nothing is concatenated or rehashed.
    """

    __slots__ = ("_hashes", "_k")

    def __init__(self, block_hashes: Sequence[bytes], hash_block_size: int, target_block_size: int):
        if target_block_size % hash_block_size:
            raise ConfigError(
                f"block size {target_block_size} is not a multiple of hash_block_size "
                f"{hash_block_size}"
            )
        self._hashes = block_hashes
        self._k = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._k

    def __getitem__(self, j: int) -> bytes:
        n = len(self)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(j)
        return self._hashes[(j + 1) * self._k - 1]

    def __iter__(self):
        for j in range(len(self)):
            yield self[j]


def resolve_block_hashes(
    block_hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> Sequence[bytes]:
    """The hash list as seen by a group of ``block_size`` (the list itself if equal)."""
    if block_size == hash_block_size:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


# ----- extra keys ------------------------------------------------------------------------
def _mm_position(feature: Any) -> tuple[int, int]:
    pos = getattr(feature, "mm_position", feature)
    return pos.offset, pos.length


def _gen_mm_extra_keys(
    request: "Request", start: int, end: int, start_mm_idx: int
) -> tuple[list, int]:
    """Multimodal keys ``("mm", identifier, offset - start)`` for items inside ``[start, end)``.

    Items are assumed sorted by offset. The walk starts at ``start_mm_idx`` (``-1`` = the last
    item, used when hashing blocks completed by generated tokens) and returns the index to
    resume from. This mirrors vLLM's walk exactly, including its edge behaviour: an
    incremental call looks at the last item only.
    """
    features = request.mm_features
    keys: list = []
    if not features:
        return keys, start_mm_idx
    last_off, last_len = _mm_position(features[-1])
    if last_off + last_len <= start:
        return keys, start_mm_idx
    idx = start_mm_idx + len(features) if start_mm_idx < 0 else start_mm_idx
    while idx < len(features):
        offset, length = _mm_position(features[idx])
        if end <= offset:
            break
        if start >= offset + length:
            idx += 1  # the block is past this item
            continue
        keys.append(("mm", features[idx].identifier, offset - start))
        if end >= offset + length:
            idx += 1
        else:
            break  # the item continues into the next block
    return keys, idx


def _prompt_embeds_digest(embeds: Any, start: int, end: int) -> bytes:
    """SHA-256 of the raw bytes of rows ``[start, end)`` of the prompt embeddings.

    Accepts a numpy array (or anything with ``tobytes``) or a torch tensor; torch is never
    imported here (a tensor can only exist if its creator imported torch already).
    """
    part = embeds[start:end]
    if hasattr(part, "tobytes"):
        data = part.tobytes()
    else:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(part, torch.Tensor):
            raise ConfigError(
                f"prompt_embeds of type {type(embeds).__name__} cannot be hashed; pass a numpy "
                "array or a torch tensor"
            )
        data = part.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).digest()


def generate_block_hash_extra_keys(
    request: "Request", start_token_idx: int, end_token_idx: int, start_mm_idx: int = 0
) -> tuple[tuple | None, int]:
    """Extra keys of the block ``[start_token_idx, end_token_idx)`` and the next mm index.

    Order: ``("lora", name, path)``; multimodal items; ``("cache_salt", salt)`` (block
    starting at token 0 only); ``("prompt_embeds", sha256 digest)``. None if empty.
    """
    keys: list = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.lora_name, getattr(lora, "lora_path", None)))
    mm_keys, next_mm_idx = _gen_mm_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx)
    keys.extend(mm_keys)
    if start_token_idx == 0 and request.cache_salt is not None:
        keys.append(("cache_salt", request.cache_salt))
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is not None:
        keys.append(
            ("prompt_embeds", _prompt_embeds_digest(embeds, start_token_idx, end_token_idx))
        )
    return (tuple(keys) if keys else None), next_mm_idx


def _needs_extra_keys(request: "Request") -> bool:
    return bool(
        request.mm_features
        or request.lora_request is not None
        or request.cache_salt is not None
        or getattr(request, "prompt_embeds", None) is not None
    )


def shared_full_blocks(a: Sequence[int], b: Sequence[int], block_size: int, limit: int) -> int:
    """How many leading blocks of ``block_size`` tokens (at most ``limit``) ``a`` and ``b``
    hold equal: one slice comparison when all are, else a binary search over block counts."""
    if limit <= 0:
        return 0
    n = limit * block_size
    if len(b) >= n and a[:n] == b[:n]:
        return limit
    lo, hi = 0, limit  # lo blocks equal, hi not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        x, y = lo * block_size, mid * block_size
        if a[x:y] == b[x:y]:
            lo = mid
        else:
            hi = mid
    return lo


# entries of a block hasher's memo (get_request_block_hasher): ~300 bytes each
HASH_MEMO_BLOCKS = 8192


def get_request_block_hasher(
    hash_block_size: int, hash_fn: HashFn
) -> Callable[["Request"], list[bytes]]:
    """A block hasher for ``Request``: returns the hashes of full chunks not hashed yet.

    It continues from ``len(request.block_hashes)`` and the last stored hash, so each call
    costs only the new chunks (``Request.update_block_hashes`` extends the list).

    Blocks without extra keys go through a memo ``(parent hash, tokens) -> hash`` (at most
    ``HASH_MEMO_BLOCKS`` entries, emptied when full): requests that share a prompt prefix share
    its hash chain, which is then computed once instead of once per request (W3: the same 128
    blocks at the head of 256 prompts). The hash function is pure, so the values are the same.
    Before the memo, a prompt hashed from its start takes the hashes of the full blocks it
    shares with the last such prompt (both without extra keys) as they are: a few list
    comparisons instead of a tuple and a memo lookup per block (:func:`shared_full_blocks`).
    """
    if not isinstance(hash_block_size, int) or hash_block_size < 1:
        raise ConfigError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
    none_hash = get_none_hash(hash_fn)
    memo: dict[tuple, bytes] = {}
    # the last request whose prompt was hashed from its start without extra keys: its live
    # token and hash lists (hashes[i] always covers tokens [i B, (i + 1) B)), as one pair
    # swapped in one assignment (a reader never sees one request's tokens with another's hashes)
    last: list = [((), ())]

    def request_block_hasher(request: "Request") -> list[bytes]:
        hashes = request.block_hashes
        start = len(hashes) * hash_block_size
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        if start + hash_block_size > num_tokens:
            return []
        parent = hashes[-1] if hashes else none_hash
        # A block completed by generated tokens can only overlap the last mm item.
        mm_idx = -1 if start > 0 else 0
        with_extra = _needs_extra_keys(request)
        new: list[bytes] = []
        if start == 0 and not with_extra:
            # the blocks this prompt shares with the last one hashed: the same chain
            last_tokens, last_hashes = last[0]
            k = shared_full_blocks(tokens, last_tokens, hash_block_size,
                                   min(len(last_hashes), num_tokens // hash_block_size))
            if k:
                new = last_hashes[:k]
                parent = new[-1]
                start = k * hash_block_size
            last[0] = (tokens, hashes)
        while start + hash_block_size <= num_tokens:
            end = start + hash_block_size
            chunk = tuple(tokens[start:end])
            if with_extra:
                extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
                if extra is not None:
                    parent = hash_fn((parent, chunk, extra))
                    new.append(parent)
                    start = end
                    continue
            key = (parent, chunk)
            h = memo.get(key)
            if h is None:
                h = hash_fn((parent, chunk, None))
                if len(memo) >= HASH_MEMO_BLOCKS:
                    memo.clear()
                memo[key] = h
            parent = h
            new.append(parent)
            start = end
        return new

    return request_block_hasher
