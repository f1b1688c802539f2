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
