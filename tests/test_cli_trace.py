"""`pagedkv trace`, the README's main job: runs, prints tables/slots/CSR, returns every block."""

from pagedkv.cli import main


def test_trace_prints_steps_and_summary(capsys):
    rc = main(["trace", "--requests", "4", "--num-blocks", "24", "--groups", "full,swa:32",
               "--sanitize", "--max-tokens", "2:6", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "step    0" in out and "g0 table" in out and "g1 slots" in out and "csr" in out
    assert "all blocks returned: True" in out


def test_trace_compressed_group_and_errors(capsys):
    rc = main(["trace", "--requests", "2", "--groups", "mla:4", "--max-tokens", "2:3",
               "--quiet", "--device", "cpu"])
    assert rc == 0
    assert "all blocks returned: True" in capsys.readouterr().out
    rc = main(["trace", "--groups", "bogus", "--device", "cpu"])
    assert rc == 2
    assert "unknown group 'bogus'" in capsys.readouterr().err


def test_trace_limit_prints_exactly_n_entries(capsys):
    from pagedkv.cli import _short

    xs = list(range(100, 130))
    for n in range(0, 12):
        shown = _short(xs, n)
        entries = [e for e in shown.split("]")[0].strip("[").split(", ") if e and e != "..."]
        entries = [e.replace("... ", "") for e in entries]
        assert len(entries) == min(n, len(xs)), (n, shown)
        assert "(30)" in shown
    assert _short([1, 2], 5) == "[1, 2]"
    rc = main(["trace", "--requests", "3", "--num-blocks", "24", "--limit", "2", "--device", "cpu",
               "--max-tokens", "2:3"])
    assert rc == 0
    assert main(["trace", "--limit", "-1", "--device", "cpu"]) == 2


def test_trace_default_workload_shows_prefix_hits(capsys):
    """The README's command (shared prefix 0.5, seed 0) finds prefix-cache hits."""
    rc = main(["trace", "--requests", "8", "--shared-prefix", "0.5", "--num-blocks", "64",
               "--block-size", "16", "--groups", "full,swa:64", "--sanitize", "--quiet",
               "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(ln for ln in out.splitlines() if "prefix hit rate" in ln)
    assert not line.split()[3].startswith("0.0"), line


def test_trace_on_a_missing_device_is_a_clean_error(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert main(["trace", "--device", "cuda", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "Traceback" not in err


def test_python_dash_m_pagedkv():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pagedkv", "trace", "--requests", "2", "--quiet",
                           "--device", "cpu", "--max-tokens", "2:3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "all blocks returned: True" in proc.stdout
