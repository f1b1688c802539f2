"""Block tables: request row x logical block -> physical block id, one table per KV-cache group.

``block_table[row, i]`` is the physical block holding logical block ``i`` (tokens
``[i*B, (i+1)*B)``) of the request in persistent-batch row ``row``. The host copy is the
truth; ``commit_block_table(num_reqs)`` refreshes the device mirror with ONE non-blocking
copy of the first ``num_reqs`` rows, issued first in input preparation so it overlaps the
rest of the host work.

Storage: :class:`MultiGroupBlockTable` keeps every group's table side by side in one
``int32 [max_num_reqs, total_width]`` :class:`CpuGpuBuffer` (group ``g`` owns columns
``[col_start[g], col_start[g] + width[g])``). That makes a commit one copy and the per-step
slot mapping one kernel launch for all groups (into ``int64 [G, max_num_batched_tokens]``).
:class:`BlockTable` is one group's view (numpy column slice + device column view, whose row
stride is ``total_width``, not ``width``). A standalone ``BlockTable(...)`` owns a one-group
store of its own.

Row operations follow vLLM 0.33.0 (reference sec. 10.3) and work on the host copy only:

* ``append_row(ids, r)``: write at ``[r, n:n+len]``, ``n += len``; an empty list is a no-op.
* ``add_row(ids, r)``: ``n = 0`` then append. It does NOT zero a longer stale tail.
* ``clear_row(r)``: zero ``[r, :n]``, ``n = 0``.
* ``move_row(src, tgt)``: copy ``[src, :n]`` to ``tgt``, ``n_tgt = n_src``, zero the source
  prefix, ``n_src = 0``.
* ``swap_row(a, b)``: swap whole rows and counts.

Deliberate differences from vLLM (each covered by a test):

* Out-of-range input raises :class:`~pagedkv.errors.BlockTableError` and leaves the table
  unchanged (all groups are checked before any is written): a row outside
  ``[0, max_num_reqs)``, a write past the table width, a negative block id.
* ``move_row(r, r)`` is a no-op (vLLM would zero the row).
* Groups with ``SlotMappingMode.NONE`` get their slot-mapping row filled with ``-1`` by the
  fused kernel (the V2 runner's behaviour) instead of being left untouched (V1).
* There is no host copy of the slot mapping: it is produced and consumed on the device.
* Writers wait for an in-flight non-blocking commit from the pinned host copy before
  mutating it (design rule 7); vLLM relies on the step's later synchronisation instead.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import BlockTableError, ConfigError
from pagedkv.kernels import slot_mapping as _slot_mapping_module
from pagedkv.kernels._common import use_triton
from pagedkv.kernels.slot_mapping import compute_slot_mappings as _slot_mapping_kernel
from pagedkv.worker.buffers import CpuGpuBuffer

NULL_BLOCK_ID = 0  # block-table padding and skipped blocks (read-only null block)
PAD_SLOT_ID = -1  # slot-mapping padding: KV writers skip it

_INT32_MAX = np.iinfo(np.int32).max
_INT_TYPE_ONLY = {int}


def get_block_table_width(
    num_blocks: int,
    block_size: int,
    token_alignment: int = 128,
    slot_mapping_mode: SlotMappingMode = SlotMappingMode.TOKEN_TO_KV_SLOT,
) -> int:
    """Columns of a group's table: ``num_blocks`` rounded up so the table covers a multiple
    of ``token_alignment`` tokens, i.e. to a multiple of
    ``token_alignment / gcd(token_alignment, block_size)`` blocks.

    ``SlotMappingMode.NONE`` groups (Mamba state indices) are not aligned.
    Examples: B=16, 4 blocks -> 8 columns; a Mamba group with 3 -> 3.
    """
    if not isinstance(num_blocks, int) or num_blocks < 1:
        raise ConfigError(f"max_num_blocks must be a positive int, got {num_blocks!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
    if SlotMappingMode(slot_mapping_mode) == SlotMappingMode.NONE:
        return num_blocks
    multiple = token_alignment // math.gcd(token_alignment, block_size)
    return -(-num_blocks // multiple) * multiple


def _as_ids(ids: Sequence[int], group: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise BlockTableError(f"group {group}: block ids must be a flat list, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > _INT32_MAX):
        raise BlockTableError(
            f"group {group}: block ids must lie in [0, 2**31), got min {arr.min()} max {arr.max()}"
        )
    return arr


class _TableColumns:
    """One group's columns of the shared buffer: ``.cpu``/``.np``/``.gpu`` column views."""

    __slots__ = ("cpu", "np", "gpu")

    def __init__(self, buf: CpuGpuBuffer, start: int, width: int) -> None:
        self.cpu = buf.cpu[:, start : start + width]
        self.np = buf.host_view((slice(None), slice(start, start + width)))  # strict mode locks it
        self.gpu = buf.gpu[:, start : start + width]


class MultiGroupBlockTable:
    """All KV-cache groups' block tables in one buffer; row ops fan out per-group tuples.

    Args:
        max_num_reqs: rows (persistent-batch capacity).
        max_num_batched_tokens: slot-mapping length.
        device, pin_memory: where the mirror lives; pin the host copy (CUDA only).
        block_sizes: per group, the *manager* block size (not the kernel block size).
        max_num_blocks: per group, blocks one request may hold (before width alignment).
        slot_mapping_modes: per group; default all ``TOKEN_TO_KV_SLOT``.
        cp_world_size, cp_rank, cp_interleave: decode context parallelism (sec. 12).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        pin_memory: bool,
        block_sizes: Sequence[int],
        max_num_blocks: Sequence[int],
        slot_mapping_modes: Sequence[SlotMappingMode] | None = None,
        cp_world_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
    ) -> None:
        block_sizes = tuple(block_sizes)
        max_num_blocks = tuple(max_num_blocks)
        if slot_mapping_modes is None:
            slot_mapping_modes = (SlotMappingMode.TOKEN_TO_KV_SLOT,) * len(block_sizes)
        modes = tuple(SlotMappingMode(m) for m in slot_mapping_modes)
        if not block_sizes:
            raise ConfigError("MultiGroupBlockTable needs at least one KV-cache group")
        if not len(block_sizes) == len(max_num_blocks) == len(modes):
            raise ConfigError(
                f"block_sizes ({len(block_sizes)}), max_num_blocks ({len(max_num_blocks)}) and "
                f"slot_mapping_modes ({len(modes)}) must have one entry per group"
            )
        for name, v in (("max_num_reqs", max_num_reqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(cp_world_size, int) or cp_world_size < 1:
            raise ConfigError(f"cp_world_size must be a positive int, got {cp_world_size!r}")
        if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_world_size:
            raise ConfigError(f"cp_rank must lie in [0, {cp_world_size}), got {cp_rank!r}")
        if not isinstance(cp_interleave, int) or cp_interleave < 1:
            raise ConfigError(f"cp_interleave must be a positive int, got {cp_interleave!r}")
        if cp_world_size > 1:
            for b in block_sizes:
                if b % cp_interleave:
                    raise ConfigError(
                        f"block_size {b} must be a multiple of cp_interleave {cp_interleave}"
                    )

        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        self.block_sizes = block_sizes
        self.slot_mapping_modes = modes
        self.cp_world_size, self.cp_rank, self.cp_interleave = cp_world_size, cp_rank, cp_interleave
        self.widths = tuple(
            get_block_table_width(n, b, slot_mapping_mode=m)
            for n, b, m in zip(max_num_blocks, block_sizes, modes)
        )
        starts = np.concatenate([[0], np.cumsum(self.widths)[:-1]]).astype(int)
        self.col_starts = tuple(int(s) for s in starts)
        self.total_width = int(sum(self.widths))

        self.block_table = CpuGpuBuffer(
            max_num_reqs, self.total_width, dtype=torch.int32, device=self.device, pin_memory=pin_memory
        )
        self.num_blocks_per_row = np.zeros((self.num_groups, max_num_reqs), dtype=np.int32)
        # Device-only: produced by the slot-mapping kernel, consumed by KV writers.
        self.slot_mappings = torch.full(
            (self.num_groups, max_num_batched_tokens), PAD_SLOT_ID, dtype=torch.int64, device=self.device
        )
        as_dev = lambda xs: torch.tensor(xs, dtype=torch.int32, device=self.device)  # noqa: E731
        self.group_col_start = as_dev(self.col_starts)
        self.group_width = as_dev(self.widths)
        self.group_block_size = as_dev(block_sizes)
        self.group_mode = as_dev([1 if m == SlotMappingMode.TOKEN_TO_KV_SLOT else 0 for m in modes])
        self._groups = tuple(BlockTable._view_of(self, g, n) for g, n in enumerate(max_num_blocks))
        # CPU device: numpy views of the device-side tensors, for the host fast paths of
        # commit_block_table and compute_slot_mappings (see _slot_mappings_host).
        self._row_arange = np.arange(max_num_reqs, dtype=np.int64)
        self._device_table_np: np.ndarray | None = None
        self._slot_mappings_np: np.ndarray | None = None
        if self.device.type == "cpu":
            self._device_table_np = self.block_table.gpu.numpy()
            # Not when the Triton interpreter runs the kernel on CPU tensors (kernel tests).
            if not use_triton(_slot_mapping_module._slot_mappings_kernel, self.slot_mappings):
                self._slot_mappings_np = self.slot_mappings.numpy()

    # ------------------------------------------------------------------ access
    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def __getitem__(self, group: int) -> "BlockTable":
        return self._groups[group]

    def __len__(self) -> int:
        return self.num_groups

    def __iter__(self):
        return iter(self._groups)

    def slot_mapping(self, group: int) -> torch.Tensor:
        """Group ``group``'s slot mapping (device, int64 ``[max_num_batched_tokens]``)."""
        return self.slot_mappings[group]

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """All groups' device rows ``[:num_reqs]`` (``[num_reqs, total_width]``)."""
        return self.block_table.gpu[:num_reqs]

    # ----------------------------------------------------------------- checks
    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_reqs:
            raise BlockTableError(f"row {row} outside [0, {self.max_num_reqs})")

    def _check_groups(self, block_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if len(block_ids) != self.num_groups:
            raise BlockTableError(
                f"got block ids for {len(block_ids)} groups, the table has {self.num_groups}"
            )
        return [_as_ids(ids, g) for g, ids in enumerate(block_ids)]

    def _check_fit(self, arrays: Sequence[np.ndarray], starts: Sequence[int], row: int, groups) -> None:
        for g, arr, n in zip(groups, arrays, starts):
            if n + arr.size > self.widths[g]:
                raise BlockTableError(
                    f"group {g}, row {row}: {n} blocks + {arr.size} new exceed the table width "
                    f"{self.widths[g]}; the request holds more blocks than max_model_len allows"
                )

    # ------------------------------------------------------- row ops (host)
    def _write(self, arrays, starts, row: int, groups) -> None:
        self.block_table.wait_for_copy()
        table = self.block_table.np
        for g, arr, n in zip(groups, arrays, starts):
            if arr.size:
                s = self.col_starts[g] + n
                table[row, s : s + arr.size] = arr
            self.num_blocks_per_row[g, row] = n + arr.size

    def append_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        """Append each group's ids after that group's current blocks of ``row``."""
        if self._write_row_fast(block_ids, row, append=True):
            return
        self._check_row(row)
        arrays = self._check_groups(block_ids)
        groups = range(self.num_groups)
        starts = [int(self.num_blocks_per_row[g, row]) for g in groups]
        self._check_fit(arrays, starts, row, groups)
        self._write(arrays, starts, row, groups)

    def _write_row_fast(self, block_ids: Sequence[Sequence[int]], row: int, append: bool) -> bool:
        """``append_row`` (``append``) or ``add_row`` for the worker's per-step case (the
        scheduler's lists of plain Python ints): the same checks and writes without numpy
        conversions. Returns False, having written nothing, when anything is unusual (wrong
        row or group count, a non-list or non-int, an id out of range, a write past the
        width); the general path then raises exactly as before."""
        if type(row) is not int or not 0 <= row < self.max_num_reqs:
            return False
        if len(block_ids) != self.num_groups:
            return False
        counts = self.num_blocks_per_row
        widths = self.widths
        starts = []
        for g, ids in enumerate(block_ids):
            if type(ids) is not list:
                return False
            if len(ids) == 1:
                b = ids[0]
                if type(b) is not int or not 0 <= b <= _INT32_MAX:
                    return False
            elif ids and (
                set(map(type, ids)) != _INT_TYPE_ONLY or min(ids) < 0 or max(ids) > _INT32_MAX
            ):
                return False
            n = int(counts[g, row]) if append else 0
            if n + len(ids) > widths[g]:
                return False
            starts.append(n)
        self.block_table.wait_for_copy()
        table = self.block_table.np
        col_starts = self.col_starts
        for g, ids in enumerate(block_ids):
            n = starts[g]
            k = len(ids)
            if k == 1:
                table[row, col_starts[g] + n] = ids[0]  # a decoding request's new block
            elif k:
                s = col_starts[g] + n
                table[row, s : s + k] = ids
            counts[g, row] = n + k
        return True

    def add_row(self, block_ids: Sequence[Sequence[int]], row: int) -> None:
        """Overwrite ``row`` from column 0 (count reset to 0, then append)."""
        if self._write_row_fast(block_ids, row, append=False):
            return
        self._check_row(row)
        arrays = self._check_groups(block_ids)
        groups = range(self.num_groups)
        starts = [0] * self.num_groups
        self._check_fit(arrays, starts, row, groups)
        self._write(arrays, starts, row, groups)

    def clear_row(self, row: int) -> None:
        """Each group's ``BlockTable.clear_row(row)``: zero its blocks, count := 0."""
        self._check_row(row)
        counts = self.num_blocks_per_row
        for g, start in enumerate(self.col_starts):
            n = int(counts[g, row])
            if n:
                self.block_table.wait_for_copy()
                self.block_table.np[row, start : start + n] = 0
            counts[g, row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        self._check_row(src)
        self._check_row(tgt)
        for t in self._groups:
            t.move_row(src, tgt)

    def swap_row(self, a: int, b: int) -> None:
        self._check_row(a)
        self._check_row(b)
        if a == b:
            return
        self.block_table.wait_for_copy()
        table = self.block_table.np
        table[[a, b]] = table[[b, a]]
        self.num_blocks_per_row[:, [a, b]] = self.num_blocks_per_row[:, [b, a]]

    # ---------------------------------------------------------- device side
    def commit_block_table(self, num_reqs: int) -> None:
        """ONE non-blocking host -> device copy of rows ``[:num_reqs]`` of every group."""
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise BlockTableError(f"commit_block_table({num_reqs}) outside [0, {self.max_num_reqs}]")
        if self._device_table_np is not None:
            # CPU device: the same copy through numpy views (no torch per-call overhead).
            self._device_table_np[:num_reqs] = self.block_table.np[:num_reqs]
            self.block_table.note_copy()
            return
        self.block_table.copy_to_gpu(num_reqs)

    def fill_padding_rows(self, num_reqs: int, num_reqs_padded: int) -> None:
        """Device rows ``[num_reqs, num_reqs_padded)`` of every group := ``NULL_BLOCK_ID``."""
        if not 0 <= num_reqs <= num_reqs_padded <= self.max_num_reqs:
            raise BlockTableError(
                f"padding rows [{num_reqs}, {num_reqs_padded}) outside [0, {self.max_num_reqs}]"
            )
        if num_reqs_padded > num_reqs:
            self.block_table.gpu[num_reqs:num_reqs_padded].fill_(NULL_BLOCK_ID)

    def compute_slot_mappings(
        self,
        num_reqs: int,
        num_tokens: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        max_query_len: int | None = None,
    ) -> torch.Tensor:
        """Every group's slot mapping in ONE launch; returns ``int64 [G, max_num_batched_tokens]``.

        ``max_query_len`` (host int, optional) only sizes the launch: 1 for a pure-decode step
        gives narrow per-request programs; results never depend on it.

        ``query_start_loc`` (int32, ``>= num_reqs+1`` entries) and ``positions`` (int64,
        ``>= num_tokens`` entries) are device tensors. Entries ``[num_tokens:]``, groups with
        ``SlotMappingMode.NONE`` and non-local CP tokens get ``PAD_SLOT_ID``.
        """
        self._check_step(num_reqs, num_tokens, query_start_loc, positions)
        if self._slot_mappings_np is not None and _slot_mappings_host(
            self, num_reqs, num_tokens, query_start_loc, positions
        ):
            return self.slot_mappings
        _slot_mapping_kernel(
            self.block_table.gpu,
            self.group_col_start,
            self.group_width,
            self.group_block_size,
            self.group_mode,
            query_start_loc,
            positions,
            self.slot_mappings,
            num_reqs,
            num_tokens,
            self.cp_world_size,
            self.cp_rank,
            self.cp_interleave,
            max_query_len=max_query_len,
        )
        return self.slot_mappings

    @property
    def computes_slot_mappings_on_host(self) -> bool:
        """True on a CPU device, where slot mappings are computed in numpy on the host."""
        return self._slot_mappings_np is not None

    def compute_slot_mappings_host(
        self, token_rows: np.ndarray, positions: np.ndarray
    ) -> torch.Tensor:
        """CPU device only: ``compute_slot_mappings`` for the step whose token ``t`` (of
        ``T = len(positions)``) belongs to row ``token_rows[t]`` at ``positions[t]``, i.e. the
        call with ``query_start_loc`` = the rows' cumulative token counts from 0 and
        ``num_tokens = T`` (what :meth:`InputPreparer.prepare` issues), from the host arrays
        the caller already has: int64 ``token_rows`` (non-decreasing, each in
        ``[0, num_reqs)``) and ``positions``. Same values in the same buffer (entries
        ``[T:]`` are ``PAD_SLOT_ID``).
        """
        if self._slot_mappings_np is None:
            raise BlockTableError(
                "compute_slot_mappings_host needs a CPU device (see computes_slot_mappings_on_host)"
            )
        num_tokens = positions.shape[0]
        if token_rows.shape[0] != num_tokens or not 0 <= num_tokens <= self.max_num_batched_tokens:
            raise BlockTableError(
                f"compute_slot_mappings_host: {token_rows.shape[0]} token rows, {num_tokens} "
                f"positions (at most {self.max_num_batched_tokens})"
            )
        pos = positions.astype(np.int64, copy=False)
        _write_slot_mappings(self, token_rows, pos, 0, num_tokens)
        return self.slot_mappings

    def _check_step(self, num_reqs, num_tokens, query_start_loc, positions) -> None:
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise BlockTableError(f"num_reqs {num_reqs} outside [0, {self.max_num_reqs}]")
        if not 0 <= num_tokens <= self.max_num_batched_tokens:
            raise BlockTableError(
                f"num_tokens {num_tokens} outside [0, {self.max_num_batched_tokens}]"
            )
        if query_start_loc.shape[0] < num_reqs + 1 or positions.shape[0] < num_tokens:
            raise BlockTableError(
                f"query_start_loc needs >= {num_reqs + 1} entries (has {query_start_loc.shape[0]}), "
                f"positions >= {num_tokens} (has {positions.shape[0]})"
            )

    def clear(self) -> None:
        """Zero both copies of every group and all counts."""
        self.block_table.wait_for_copy()
        self.block_table.cpu.zero_()
        self.block_table.gpu.zero_()
        self.num_blocks_per_row[:] = 0


_HOST_INDEX_DTYPES = (torch.int32, torch.int64)


def _slot_mappings_host(
    bt: MultiGroupBlockTable,
    num_reqs: int,
    num_tokens: int,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
) -> bool:
    """``compute_slot_mappings`` on a CPU device in numpy, for the per-step input preparation.

    The kernel module's CPU path is its torch reference (a dozen torch ops per group, most of
    the CPU input-preparation time); this computes the same values the same way (same bounds
    rules: a position outside ``[0, 2**31)``, a column past the group's width or the table, or
    a token on another CP rank gives -1; ``[min(query_start_loc[num_reqs], num_tokens):]`` is
    -1; entries before ``query_start_loc[0]`` are left as they are).

    Returns False, having written nothing, for arguments it does not handle (non-int counts,
    other dtypes/devices/layouts, a negative or decreasing ``query_start_loc``): the caller
    then runs the kernel module, which validates them.
    """
    if not (
        type(num_reqs) is int
        and type(num_tokens) is int
        and query_start_loc.dtype in _HOST_INDEX_DTYPES
        and positions.dtype in _HOST_INDEX_DTYPES
        and query_start_loc.dim() == 1
        and positions.dim() == 1
        and query_start_loc.device.type == "cpu"
        and positions.device.type == "cpu"
        and query_start_loc.is_contiguous()
        and positions.is_contiguous()
    ):
        return False
    qsl = query_start_loc.numpy()[: num_reqs + 1]
    first = int(qsl[0])
    end = int(qsl[num_reqs])
    last = end if end < num_tokens else num_tokens  # the padding starts here
    counts = qsl[1:] - qsl[:-1]
    if num_reqs:
        min_count = int(counts.min())
        if min_count < 0:
            return False
    if first < 0 or last < 0:
        return False
    if num_reqs == 0 or last <= first:
        bt._slot_mappings_np[:, last:] = PAD_SLOT_ID
        return True
    # Row owning each token (query_start_loc is non-decreasing): token t in
    # [qsl[r], qsl[r + 1]) belongs to row r. One token per row (decode): token i is row i.
    if end - first == num_reqs and min_count == 1:
        rows = bt._row_arange[: last - first]
    else:
        rows = np.repeat(bt._row_arange[:num_reqs], counts)[: last - first]
    pos = positions.numpy()[first:last].astype(np.int64, copy=False)
    _write_slot_mappings(bt, rows, pos, first, last)
    return True


def _write_slot_mappings(
    bt: MultiGroupBlockTable, rows: np.ndarray, pos: np.ndarray, first: int, last: int
) -> None:
    """Slots of tokens ``[first, last)`` (row ``rows[i]``, int64 position ``pos[i]`` for
    token ``first + i``) for every group; ``[last:]`` := ``PAD_SLOT_ID``; ``[:first]``
    untouched. The rules of the kernel module's torch reference, in numpy."""
    out = bt._slot_mappings_np
    out[:, last:] = PAD_SLOT_ID
    if last <= first:
        return
    table = bt._device_table_np
    num_table_rows, table_width = table.shape
    cp, rank, inter = bt.cp_world_size, bt.cp_rank, bt.cp_interleave
    for g, mode in enumerate(bt.slot_mapping_modes):
        dst = out[g, first:last]
        if mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
            dst[:] = PAD_SLOT_ID
            continue
        bsz, width, col_start = bt.block_sizes[g], bt.widths[g], bt.col_starts[g]
        if cp == 1 and col_start + width <= table_width and width * bsz <= _INT32_MAX + 1:
            # Common case: every token's block column lies in [0, width) (so its position in
            # [0, width * B), within [0, 2**31)) and in the table: no -1. The unsigned view
            # checks 0 <= column < width in one pass; a power-of-two B uses shift and mask
            # (the same floor division and remainder for every int64).
            if bsz & (bsz - 1) == 0:
                vblk = pos >> (bsz.bit_length() - 1)
                off = pos & (bsz - 1)
            else:
                vblk, off = np.divmod(pos, bsz)
            if int(vblk.view(np.uint64).max()) < width:
                np.multiply(table[rows, vblk + col_start if col_start else vblk], bsz, out=dst,
                            dtype=np.int64)
                dst += off
                continue
        in_range = (pos >= 0) & (pos <= _INT32_MAX)
        safe = np.where(in_range, pos, 0)
        vbs = bsz * cp
        vblk, voff = safe // vbs, safe % vbs
        local = ((voff // inter) % cp) == rank
        local_off = (voff // (cp * inter)) * inter + voff % inter
        col = col_start + vblk
        ok = local & in_range & (vblk < width) & (col >= 0) & (col < table_width)
        if num_table_rows == 0 or table_width == 0:
            blk = np.zeros(ok.shape, dtype=np.int64)
        else:
            blk = table[np.where(ok, rows, 0), np.where(ok, col, 0)].astype(np.int64)
        dst[:] = np.where(ok, blk * bsz + local_off, PAD_SLOT_ID)


class BlockTable:
    """One KV-cache group's block table.

    Standalone: ``BlockTable(block_size, max_num_reqs, max_num_blocks_per_req,
    max_num_batched_tokens, pin_memory, device, ...)`` owns a one-group store. Inside a
    :class:`MultiGroupBlockTable` it is a view of the shared buffer (``multi[g]``); its row
    ops then touch only this group's columns and counts.

    Attributes: ``block_size``, ``width`` (aligned columns, also ``max_num_blocks_per_req``),
    ``block_table`` (``.cpu``/``.np``/``.gpu`` column views), ``num_blocks_per_row`` (numpy
    int32 view), ``slot_mapping`` (device int64 view), ``slot_mapping_mode``.
    """

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device | str,
        cp_kv_cache_interleave_size: int = 1,
        slot_mapping_mode: SlotMappingMode = SlotMappingMode.TOKEN_TO_KV_SLOT,
        cp_world_size: int = 1,
        cp_rank: int = 0,
    ) -> None:
        owner = MultiGroupBlockTable(
            max_num_reqs,
            max_num_batched_tokens,
            device,
            pin_memory,
            [block_size],
            [max_num_blocks_per_req],
            [slot_mapping_mode],
            cp_world_size=cp_world_size,
            cp_rank=cp_rank,
            cp_interleave=cp_kv_cache_interleave_size,
        )
        self._bind(owner, 0, max_num_blocks_per_req)

    @classmethod
    def _view_of(cls, owner: MultiGroupBlockTable, group: int, num_blocks: int) -> "BlockTable":
        view = cls.__new__(cls)
        view._bind(owner, group, num_blocks)
        return view

    def _bind(self, owner: MultiGroupBlockTable, group: int, num_blocks: int) -> None:
        self._owner = owner
        self.group_id = group
        self.block_size = owner.block_sizes[group]
        self.slot_mapping_mode = owner.slot_mapping_modes[group]
        self.num_blocks_requested = num_blocks
        self.width = owner.widths[group]
        self.max_num_blocks_per_req = self.width
        self.max_num_reqs = owner.max_num_reqs
        self._start = owner.col_starts[group]
        self.block_table = _TableColumns(owner.block_table, self._start, self.width)
        self.num_blocks_per_row = owner.num_blocks_per_row[group]
        self.slot_mapping = owner.slot_mappings[group]

    @property
    def owner(self) -> MultiGroupBlockTable:
        return self._owner

    # ------------------------------------------------------- row ops (host)
    def append_row(self, block_ids: Sequence[int], row: int) -> None:
        o = self._owner
        o._check_row(row)
        arr = _as_ids(block_ids, self.group_id)
        n = int(self.num_blocks_per_row[row])
        o._check_fit([arr], [n], row, [self.group_id])
        o._write([arr], [n], row, [self.group_id])

    def add_row(self, block_ids: Sequence[int], row: int) -> None:
        o = self._owner
        o._check_row(row)
        arr = _as_ids(block_ids, self.group_id)
        o._check_fit([arr], [0], row, [self.group_id])
        o._write([arr], [0], row, [self.group_id])

    def clear_row(self, row: int) -> None:
        self._owner._check_row(row)
        n = int(self.num_blocks_per_row[row])
        if n:
            self._owner.block_table.wait_for_copy()
            self.block_table.np[row, :n] = 0
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        self._owner._check_row(src)
        self._owner._check_row(tgt)
        if src == tgt:
            return
        n = int(self.num_blocks_per_row[src])
        self._owner.block_table.wait_for_copy()
        t = self.block_table.np
        t[tgt, :n] = t[src, :n]
        t[src, :n] = 0
        self.num_blocks_per_row[tgt] = n
        self.num_blocks_per_row[src] = 0

    def swap_row(self, a: int, b: int) -> None:
        self._owner._check_row(a)
        self._owner._check_row(b)
        if a == b:
            return
        self._owner.block_table.wait_for_copy()
        t = self.block_table.np
        t[[a, b]] = t[[b, a]]
        nb = self.num_blocks_per_row
        nb[a], nb[b] = nb[b], nb[a]

    # ---------------------------------------------------------- device side
    def commit_block_table(self, num_reqs: int) -> None:
        """Non-blocking copy of rows ``[:num_reqs]`` (this group's columns) to the device."""
        o = self._owner
        if o.num_groups == 1:
            o.commit_block_table(num_reqs)
            return
        if not 0 <= num_reqs <= o.max_num_reqs:
            raise BlockTableError(f"commit_block_table({num_reqs}) outside [0, {o.max_num_reqs}]")
        o.block_table.copy_to_gpu(num_reqs, columns=slice(self._start, self._start + self.width))

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """Device rows ``[:num_reqs]`` of this group (a strided view of the shared buffer)."""
        return self.block_table.gpu[:num_reqs]

    def get_cpu_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.block_table.cpu[:num_reqs]

    def compute_slot_mapping(
        self, num_reqs: int, query_start_loc: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """This group's slot mapping for ``positions.shape[0]`` tokens (tail := -1)."""
        o = self._owner
        num_tokens = int(positions.shape[0])
        o._check_step(num_reqs, num_tokens, query_start_loc, positions)
        g = self.group_id
        _slot_mapping_kernel(
            o.block_table.gpu,
            o.group_col_start[g : g + 1],
            o.group_width[g : g + 1],
            o.group_block_size[g : g + 1],
            o.group_mode[g : g + 1],
            query_start_loc,
            positions,
            o.slot_mappings[g : g + 1],
            num_reqs,
            num_tokens,
            o.cp_world_size,
            o.cp_rank,
            o.cp_interleave,
        )
        return self.slot_mapping

    def clear(self) -> None:
        """Zero both copies of this group's columns and its counts."""
        self._owner.block_table.wait_for_copy()
        self.block_table.cpu.zero_()
        self.block_table.gpu.zero_()
        self.num_blocks_per_row[:] = 0
