"""The tokenized cache's rows: what is written is read back row for row, and reading it imports neither datasets nor
pandas (the ranks that read it start without them)."""

import pickle
import subprocess
import sys
import textwrap

import pytest

from phalanx.data.rows import TokenizedRows

EXAMPLES = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [4], "labels": [4]},
    {"input_ids": [5, 6, 2**31 - 1], "labels": [-100, -100, 2**31 - 1]},
]


def test_rows_round_trip_through_the_file(tmp_path):
    TokenizedRows.from_examples(EXAMPLES).write(tmp_path / "train.arrow")
    rows = TokenizedRows.read(tmp_path / "train.arrow")
    assert len(rows) == 3 and rows.column_names == ["input_ids", "labels"]
    assert [rows[i] for i in range(3)] == EXAMPLES
    assert rows[-1] == EXAMPLES[2]
    assert rows.__getitems__([2, 0, 2]) == [EXAMPLES[2], EXAMPLES[0], EXAMPLES[2]]
    assert rows["input_ids"] == [e["input_ids"] for e in EXAMPLES]
    assert rows["labels"] == [e["labels"] for e in EXAMPLES]
    with pytest.raises(IndexError, match="row 3 of 3"):
        rows[3]
    # A loader worker that is spawned, not forked, gets the file's name and maps it again, not a copy of the rows.
    sent = pickle.dumps(rows)
    assert len(sent) < 1000 and pickle.loads(sent)[2] == EXAMPLES[2]
    assert pickle.loads(pickle.dumps(TokenizedRows.from_examples(EXAMPLES)))[1] == EXAMPLES[1]


def test_an_empty_split_round_trips(tmp_path):
    TokenizedRows.from_examples([]).write(tmp_path / "eval.arrow")
    rows = TokenizedRows.read(tmp_path / "eval.arrow")
    assert len(rows) == 0 and rows["input_ids"] == []


def test_reading_imports_neither_datasets_nor_pandas(tmp_path):
    path = tmp_path / "train.arrow"
    TokenizedRows.from_examples(EXAMPLES).write(path)
    probe = textwrap.dedent(
        f"""
        import sys
        from phalanx.data.prepare import prepare_data  # the module a rank imports to read the cache
        from phalanx.data.rows import TokenizedRows
        rows = TokenizedRows.read({str(path)!r})
        assert rows.__getitems__([0, 2]) == [{EXAMPLES[0]!r}, {EXAMPLES[2]!r}]
        assert rows["labels"][1] == [4]
        print(sorted(name for name in ("datasets", "pandas") if name in sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
