"""Command line: ``pagedkv trace`` (the index layer, step by step, on a synthetic workload)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedkv.errors import ConfigError, PagedKVError


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        a = int(lo)
        b = int(hi) if hi else a
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {text!r}") from None
    return a, b


def parse_groups(text: str, block_size: int):
    """``full``, ``swa:W``, ``local:C`` or ``mla`` items, comma separated -> KV-cache groups."""
    from pagedkv.core.spec import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    groups = []
    for i, item in enumerate(x.strip() for x in text.split(",") if x.strip()):
        kind, _, arg = item.partition(":")
        name = (f"layer{i}",)
        if kind == "full":
            spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128)
        elif kind == "mla":
            spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576)
        elif kind == "swa" and arg.isdigit():
            spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                     sliding_window=int(arg))
        elif kind == "local" and arg.isdigit():
            spec = ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                             attention_chunk_size=int(arg))
        else:
            raise ConfigError(
                f"unknown group {item!r}: use full, mla, swa:WINDOW or local:CHUNK, comma separated"
            )
        groups.append(KVCacheGroupSpec(name, spec))
    if not groups:
        raise ConfigError("--groups needs at least one group")
    return groups


def _short(xs, limit: int) -> str:
    xs = list(xs)
    if len(xs) <= limit:
        return "[" + ", ".join(map(str, xs)) + "]"
    head = ", ".join(map(str, xs[: limit - 3]))
    return f"[{head}, ... {', '.join(map(str, xs[-2:]))}] ({len(xs)})"


def print_step(rec, num_groups: int, limit: int, out=sys.stdout) -> None:
    so = rec.scheduler_output
    sched = " ".join(f"{rid}+{n}" for rid, n in so.num_scheduled_tokens.items()) or "-"
    print(f"step {rec.step:4d}  scheduled {so.total_num_scheduled_tokens:5d} tokens: {sched}", file=out)
    if so.scheduled_new_reqs:
        print("  new       " + "  ".join(
            f"{r.req_id}(hit {r.num_computed_tokens}, blocks {[list(b) for b in r.block_ids]})"
            for r in so.scheduled_new_reqs), file=out)
    cached = so.scheduled_cached_reqs
    grown = [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids) if ids]
    if grown:
        print("  +blocks   " + "  ".join(
            f"{rid}{'(resumed)' if rid in cached.resumed_req_ids else ''}:{[list(b) for b in ids]}"
            for rid, ids in grown), file=out)
    if rec.preempted:
        print(f"  preempted {rec.preempted}", file=out)
    for g in range(num_groups):
        rows = "  ".join(f"r{i}={rid}:{_short(rec.block_tables[g][i], limit)}"
                         for i, rid in enumerate(rec.row_req_ids))
        print(f"  g{g} table {rows}", file=out)
        if rec.groups:
            gi = rec.groups[g]
            print(f"  g{g} slots {_short(gi.slot_mapping, limit)}", file=out)
            if gi.indptr is not None:
                print(f"  g{g} csr   indptr {_short(gi.indptr, limit)} indices "
                      f"{_short(gi.indices, limit)} last_page_len {_short(gi.last_page_len, limit)}",
                      file=out)
    if rec.finished:
        print(f"  finished  {rec.finished}", file=out)
    print(f"  free blocks {rec.num_free_blocks}  usage {rec.usage:.1%}", file=out)


def cmd_trace(args) -> int:
    # Triton kernels need a GPU or the interpreter; without CUDA the kernels' launchers fall
    # back to their torch reference twins unless TRITON_INTERPRET=1 is set by the user.
    import torch

    from pagedkv.config import CacheConfig, SchedulerConfig
    from pagedkv.core.spec import KVCacheConfig
    from pagedkv.engine.index_driver import IndexLayerDriver
    from pagedkv.engine.workload import WorkloadSpec, fake_next_token, make_workload

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    groups = parse_groups(args.groups, args.block_size)
    kv = KVCacheConfig(num_blocks=args.num_blocks, kv_cache_groups=groups)
    sc = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    cc = CacheConfig(block_size=args.block_size, num_gpu_blocks=args.num_blocks,
                     enable_prefix_caching=not args.no_prefix_caching)
    spec = WorkloadSpec(
        num_requests=args.requests, shared_prefix_ratio=args.shared_prefix,
        prefix_len=args.prefix_len, tail_len=args.prompt_tail, max_tokens=args.max_tokens,
        arrival_rate=args.arrival_rate, seed=args.seed,
    )
    vocab = spec.vocab_size
    cap = min(args.max_model_len, (args.num_blocks - 1) * args.block_size)
    workload = make_workload(spec, max_len=cap)
    driver = IndexLayerDriver(kv, sc, cc, next_token=lambda r, p: fake_next_token(r, p, vocab),
                              device=device, sanitize=args.sanitize)
    print(f"pagedkv trace: {args.requests} requests, {args.num_blocks} blocks x {args.block_size} "
          f"tokens, groups {args.groups}, device {device}, prefix caching "
          f"{'off' if args.no_prefix_caching else 'on'}, sanitizer {'on' if args.sanitize else 'off'}")
    show = (lambda rec: print_step(rec, len(groups), args.limit)) if not args.quiet else None
    driver.run(workload, max_steps=args.max_steps, on_step=show)
    s = driver.summary()
    print("\nsummary")
    print(f"  steps              {s['steps']}")
    print(f"  tokens generated   {s['tokens_generated']}")
    print(f"  preemptions        {s['preemptions']}")
    print(f"  prefix hit rate    {s['prefix_hit_rate']:.1%} ({s['prefix_hits']} of "
          f"{s['prefix_queries']} prompt tokens)")
    print(f"  peak usage         {s['peak_usage']:.1%} of {s['num_blocks'] - 1} blocks")
    print(f"  free at end        {s['free_blocks_at_end']} (all blocks returned: "
          f"{s['free_blocks_at_end'] == s['num_blocks'] - 1})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedkv", description="pagedkv command line")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="replay a synthetic workload through the index layer, step by step")
    t.add_argument("--requests", type=int, default=8)
    t.add_argument("--shared-prefix", type=float, default=0.5, help="fraction of prompts with a shared prefix")
    t.add_argument("--prefix-len", type=int, default=48)
    t.add_argument("--prompt-tail", type=_range, default=(8, 64), help="LO:HI random tokens after the prefix")
    t.add_argument("--max-tokens", type=_range, default=(4, 24), help="LO:HI output tokens")
    t.add_argument("--arrival-rate", type=float, default=1.0, help="requests per step (0: all at once)")
    t.add_argument("--num-blocks", type=int, default=64, help="pool size incl. the null block")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--groups", default="full", help="e.g. full | full,swa:64 | full,local:32")
    t.add_argument("--max-num-seqs", type=int, default=8)
    t.add_argument("--max-num-batched-tokens", type=int, default=128)
    t.add_argument("--max-model-len", type=int, default=512)
    t.add_argument("--long-prefill-token-threshold", type=int, default=0)
    t.add_argument("--no-prefix-caching", action="store_true")
    t.add_argument("--sanitize", action="store_true", help="check every invariant every step")
    t.add_argument("--quiet", action="store_true", help="summary only")
    t.add_argument("--limit", type=int, default=16, help="max list entries printed")
    t.add_argument("--max-steps", type=int, default=100_000)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    t.add_argument("--json", default=None, help="write the summary as JSON here")
    t.set_defaults(func=cmd_trace)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PagedKVError as e:
        print(f"pagedkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
