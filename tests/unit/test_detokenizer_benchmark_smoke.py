"""A smoke run of the detokenizer benchmark, so the script cannot rot: both detokenizers give each whole output's
text (the script exits non-zero otherwise) and the table has a row for each."""
from benchmark_smoke import run_smoke


def test_smoke_run_compares_incremental_with_whole_sequence_decoding(tmp_path):
    run_smoke("detokenizer.py", tmp_path, cpu=True)
    table = (tmp_path / "detokenizer.md").read_text()
    assert "Texts equal to decoding each whole output: True." in table
    assert "| whole sequence at every block (before) |" in table and "| incremental (now) |" in table
