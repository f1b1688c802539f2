"""``pagedkv trace --html``: the page's data (every step, every group's table with null and
prefix-cached blocks, slots, CSR, hits, preemptions), and, where Chromium is installed (CI
installs it), the page rendered by a real headless browser: the DOM after the script ran,
and a screenshot."""

import json
import os
import re
import shutil
import subprocess

import pytest

from pagedkv.cli import main

# a pool small enough to preempt and big enough to keep shared prefixes cached (measured:
# 2 preemptions, 96 of 814 prompt tokens hit)
ARGS = ["trace", "--requests", "10", "--shared-prefix", "0.8", "--prefix-len", "48",
        "--num-blocks", "40", "--groups", "full,swa:16", "--max-tokens", "16:40",
        "--arrival-rate", "1.0", "--max-num-batched-tokens", "64", "--device", "cpu", "--quiet"]


def _page(tmp_path):
    out = tmp_path / "trace.html"
    assert main(ARGS + ["--html", str(out)]) == 0
    text = out.read_text()
    blob = re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', text, re.S)
    return out, json.loads(blob.group(1).replace("<\\/", "</"))


def test_page_data_has_every_step_and_group(tmp_path, capsys):
    out, data = _page(tmp_path)
    summary = capsys.readouterr().out
    steps = data["steps"]
    assert len(steps) == data["summary"]["steps"] and f"wrote {out}" in summary
    assert len(data["groups"]) == 2 and "window 16" in data["groups"][1]
    assert all(len(s["groups"]) == 2 for s in steps)
    # the window's group nulls old blocks; the prefix cache keeps hashed blocks; hits happen
    assert any(0 in row for s in steps for row in s["groups"][1]["table"])
    assert any(s["cached"] for s in steps)
    assert any(n["hit"] > 0 for s in steps for n in s["new"])
    assert any(s["preempted"] for s in steps)
    # slots per row sum to the step's scheduled tokens; CSR per group
    for s in steps:
        for g in s["groups"]:
            assert sum(len(r) for r in g["row_slots"]) == sum(n for _, n in s["scheduled"]) \
                or not s["rows"]
            assert g["indptr"] is None or len(g["indptr"]) == len(s["rows"]) + 1


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_page_renders_in_headless_chromium(tmp_path):
    out, data = _page(tmp_path)
    k = next(i for i, s in enumerate(data["steps"])
             if s["preempted"] or any(0 in r for r in s["groups"][1]["table"]))
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={tmp_path / 'profile'}"]
    url = f"file://{out}#step={k}"
    dom = subprocess.run(["chromium", *flags, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    assert f"step {data['steps'][k]['step']} ({k + 1} of {len(data['steps'])})" in dom
    assert 'class="blk null"' in dom or "preempted:" in dom
    assert dom.count("<table") == 2  # one table per KV-cache group
    png = tmp_path / "trace.png"
    subprocess.run(["chromium", *flags, "--window-size=1300,1000", f"--screenshot={png}", url],
                   capture_output=True, timeout=120)
    assert png.exists() and os.path.getsize(png) > 10_000
