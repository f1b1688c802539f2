"""Tools that are not the engine: the trace page (more move here: the index driver, workloads,
benchmarks, the demo)."""
