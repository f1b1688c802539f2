"""Smoke test of bench/bench_dsv32_decode.py: its main path with ``--tiny`` on the CPU (both
engines, a context past the top-k), the JSON record and the table."""

import importlib.util
import json
import os
import sys

from engine_helpers import assert_decode_records

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_dsv32_decode.py")


def test_tiny_main_path(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_dsv32_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    res = mod.main(["--tiny", "--prompt-len", "24", "--new-tokens", "3", "--json", str(out)])
    assert json.loads(out.read_text())["shape"] == "deepseek-v3.2-tiny"
    assert res["prompt_len"] > res["index_topk"]  # decode tokens attend to a strict subset
    engines = [r["engine"] for r in res["results"]]
    assert engines == ["pagedkv", "transformers generate (static batch)"]
    assert_decode_records(res, 3)
    assert "pagedkv / transformers (decode)" in capsys.readouterr().out
