"""Rows come with their location from every kind of source; unreadable input names file and line."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from phalanx.data.sources import bundled_dataset_path, iter_rows
from phalanx.errors import DataError


def rows_of(path, **kw):
    return list(iter_rows(path, kind=kw.pop("kind", "path"), **kw))


def test_jsonl_file_counts_lines_from_one_and_skips_blank_lines(tmp_path, write_jsonl):
    f = write_jsonl(tmp_path / "train.jsonl", [{"text": "a"}, "", {"text": "b"}])
    assert rows_of(f) == [(f"{f} line 1", {"text": "a"}), (f"{f} line 3", {"text": "b"})]
    assert rows_of(str(f)) == rows_of(f)


def test_json_file_holding_lines_or_an_array(tmp_path, write_jsonl):
    lines = write_jsonl(tmp_path / "lines.json", [{"text": "a"}])
    assert rows_of(lines) == [(f"{lines} line 1", {"text": "a"})]
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a"}, {"text": "b"}], indent=1))
    assert rows_of(array) == [(f"{array} row 0", {"text": "a"}), (f"{array} row 1", {"text": "b"})]


def test_a_byte_order_mark_at_the_start_is_skipped(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark; json refused the first line ("Unexpected UTF-8 BOM")."""
    bom = b"\xef\xbb\xbf"
    lines = tmp_path / "notepad.jsonl"
    lines.write_bytes(bom + b'{"text": "a"}\r\n{"text": "b"}\r\n')
    assert rows_of(lines) == [(f"{lines} line 1", {"text": "a"}), (f"{lines} line 2", {"text": "b"})]
    array = tmp_path / "notepad.json"
    array.write_bytes(bom + b'[{"text": "a"}]')
    assert rows_of(array) == [(f"{array} row 0", {"text": "a"})]
    inside = tmp_path / "inside.jsonl"  # only at the start of the file: elsewhere it is not whitespace to JSON
    inside.write_bytes(b'{"text": "a"}\n' + bom + b'{"text": "b"}\n')
    with pytest.raises(DataError, match=r"inside.jsonl line 2: malformed JSON"):
        rows_of(inside)


def test_folder_of_jsonl_files_in_sorted_order(tmp_path, write_jsonl):
    write_jsonl(tmp_path / "d" / "b.jsonl", [{"text": "b1"}])
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "a1"}, {"text": "a2"}])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    got = rows_of(tmp_path / "d")
    assert [r["text"] for _, r in got] == ["a1", "a2", "b1"]
    assert got[2][0] == f"{tmp_path / 'd' / 'b.jsonl'} line 1"


def test_save_to_disk_dataset_and_dataset_dict(tmp_path, tool_row):
    ds = datasets.Dataset.from_list([tool_row, {"messages": tool_row["messages"][:2], "tools": None}])
    ds.save_to_disk(str(tmp_path / "disk"))
    got = rows_of(tmp_path / "disk")
    assert [w for w, _ in got] == [f"{tmp_path / 'disk'} row 0", f"{tmp_path / 'disk'} row 1"]
    assert got[0][1]["messages"][2]["tool_calls"][0]["function"]["name"] == "get_weather"

    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    got = rows_of(tmp_path / "dict")
    assert len(got) == 2 and got[0][0] == f"{tmp_path / 'dict'} (split 'train') row 0"
    with pytest.raises(DataError, match=r"without a 'validation' split \(splits: train, test\)"):
        rows_of(tmp_path / "dict", split="validation")


def test_a_save_to_disk_folder_given_as_dataset_name(tmp_path, tool_row, monkeypatch):
    """Seed 000's ./health-agent-dataset (a save_to_disk folder) named seed 002's way, --dataset_name: a single
    Dataset was refused by load_dataset ("Please use `load_from_disk` instead", which no flag does). It is read as
    --dataset_path reads it; a DatasetDict's splits are picked by name (--eval_dataset_split test evaluates on its
    own test split); a split a single Dataset cannot have is refused, not read as its training rows."""
    monkeypatch.chdir(tmp_path)
    ds = datasets.Dataset.from_list([tool_row, {"messages": tool_row["messages"][:2], "tools": None}])
    ds.save_to_disk("health-agent-dataset")
    assert [row for _, row in rows_of("./health-agent-dataset", kind="name")] == [
        row for _, row in rows_of("./health-agent-dataset")
    ]
    with pytest.raises(DataError, match=r"\(split 'test'\): a save_to_disk Dataset has no splits"):
        rows_of("./health-agent-dataset", kind="name", split="test")
    datasets.DatasetDict({"train": ds, "test": ds.select([1])}).save_to_disk("dict")
    assert len(rows_of("./dict", kind="name")) == 2
    test = rows_of("./dict", kind="name", split="test")
    assert len(test) == 1 and test[0][0] == "./dict (split 'test') row 0"
    with pytest.raises(DataError, match=r"without a 'validation' split \(splits: train, test\)"):
        rows_of("./dict", kind="name", split="validation")


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def rows_unlike_in_shape(tool_row):
    """Two tool rows whose tools take other parameters and whose calls give other dict arguments, and a plain row:
    Arrow's one schema per column gives each the others' fields, as nulls."""

    def tool_chat(name, arguments, reply, **extra):
        properties = {key: {"type": "string"} for key in arguments}
        call = {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}
        return {
            "messages": [
                {"role": "user", "content": f"please {name}"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{name}", "content": "done"},
                {"role": "assistant", "content": reply, **extra},
            ],
            "tools": [{"type": "function", "function": {"name": name, "parameters": {"properties": properties}}}],
        }

    return [
        tool_chat("get_weather", {"city": "Paris"}, "18C."),
        tool_chat("book", {"clinic": "North", "day": "Mon"}, "Booked.", reasoning_content="North has a slot."),
        {"messages": tool_row["messages"][:2]},
    ]


def test_parquet_file_and_folder_as_the_hub_stores_datasets(tmp_path, tool_row, write_jsonl):
    """A Parquet file (a Hub dataset's data/train-00000-of-00001.parquet) is read a row at a time, each row as it was
    written: without the nulls Arrow's schema adds for what other rows hold (other tools' parameters, other calls'
    arguments, other messages' keys). A folder is read file by file, jsonl and Parquet alike."""
    rows = rows_unlike_in_shape(tool_row)
    f = write_parquet(tmp_path / "data" / "train-00000-of-00001.parquet", rows)
    stored = pq.read_table(f).to_pylist()  # what Arrow holds: the nulls are real
    assert stored[1]["tools"][0]["function"]["parameters"]["properties"]["city"] is None
    assert stored[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]["city"] is None
    assert stored[0]["messages"][0]["tool_calls"] is None and stored[0]["messages"][3]["reasoning_content"] is None
    got = rows_of(f)
    assert [w for w, _ in got] == [f"{f} row {i}" for i in range(3)]
    assert [r for _, r in got] == rows
    write_jsonl(tmp_path / "data" / "extra.jsonl", [{"text": "j"}])
    assert [w for w, _ in rows_of(tmp_path / "data")] == [
        f"{tmp_path / 'data' / 'extra.jsonl'} line 1",
        *(f"{f} row {i}" for i in range(3)),
    ]


def test_rows_of_a_save_to_disk_dataset_and_of_load_dataset_come_as_written(tmp_path, tool_row):
    """The same for the other Arrow sources: a save_to_disk folder, and load_dataset on a Hub-style folder of
    Parquet files (where the nulls were trained on: each tool listed every other tool's parameters)."""
    rows = rows_unlike_in_shape(tool_row)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    assert [r for _, r in rows_of(tmp_path / "disk")] == rows
    write_parquet(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet", rows)
    assert [r for _, r in rows_of(str(tmp_path / "repo"), kind="name")] == rows


def test_a_file_that_is_not_parquet_and_a_folder_whose_data_is_a_level_down(tmp_path):
    (tmp_path / "bad.parquet").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match=r"bad.parquet: cannot be read as Parquet: "):
        rows_of(tmp_path / "bad.parquet")
    repo = tmp_path / "repo"  # as `hf download --repo-type dataset` leaves it
    write_parquet(repo / "data" / "train-00000-of-00001.parquet", [{"text": "a"}])
    (repo / "README.md").write_text("# card")
    with pytest.raises(
        DataError,
        match=rf"folder holds no \*.jsonl or \*.parquet .*give one of {repo / 'data'}, or the folder as --dataset_name",
    ):
        rows_of(repo)


def test_load_dataset_on_a_local_dataset_repository(tmp_path, write_jsonl, chat_row):
    write_jsonl(tmp_path / "repo" / "data" / "train.jsonl", [chat_row(i) for i in range(3)])
    got = rows_of(str(tmp_path / "repo"), kind="name")
    assert [r["messages"][1]["content"] for _, r in got] == ["fine 0", "fine 1", "fine 2"]
    assert got[1][0] == f"{tmp_path / 'repo'} (split 'train') row 1"


def test_load_dataset_failures_name_the_dataset(tmp_path, write_jsonl, chat_row):
    write_jsonl(tmp_path / "repo" / "data" / "train.jsonl", [chat_row(0)])
    with pytest.raises(
        DataError, match=r"dataset '.*repo' \(split 'validation'\): datasets.load_dataset failed: .*split"
    ):
        rows_of(str(tmp_path / "repo"), kind="name", split="validation")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"dataset '.*empty' .*load_dataset failed: \w+"):
        rows_of(str(tmp_path / "empty"), kind="name")
    # seed 001's data/ as a dataset_name: datasets puts traj_val.jsonl in 'validation' and traj_chat.jsonl nowhere
    write_jsonl(tmp_path / "data" / "traj_chat.jsonl", [chat_row(0)])
    write_jsonl(tmp_path / "data" / "traj_val.jsonl", [chat_row(1)])
    with pytest.raises(DataError) as err:
        rows_of(str(tmp_path / "data"), kind="name")
    said = str(err.value)
    assert "Unknown split \"train\". Should be one of ['validation']. datasets names a local folder" in said, said
    assert "this folder holds traj_chat.jsonl, traj_val.jsonl. Give the training file as --dataset_path" in said


def test_a_dataset_name_that_is_a_file_or_a_missing_folder_says_so(tmp_path, write_jsonl, chat_row, monkeypatch):
    """Seed 002's --dataset_name given a local path by mistake: named as a missing folder, or a file that belongs to
    --dataset_path, before load_dataset answers with the Hub client's repo-id rules (or "couldn't find any data
    file" for a file that exists)."""
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "repo" / "data" / "train.jsonl", [chat_row(0)])
    with pytest.raises(DataError) as info:
        rows_of("./repo/data/train.jsonl", kind="name")
    assert "'./repo/data/train.jsonl' is a file" in str(info.value)
    assert "--dataset_path ./repo/data/train.jsonl" in str(info.value)
    for missing in ("./nothere", "/no/such/dataset", "~/nothere"):
        with pytest.raises(DataError) as info:
            rows_of(missing, kind="name")
        assert f"{missing!r}: no such folder, and not a Hub dataset id ('org/name')" in str(info.value)
    assert len(rows_of("./repo", kind="name")) == 1, "an existing folder still goes to load_dataset"


def test_a_malformed_line_in_a_dataset_name_folder_is_named_by_file_and_line(tmp_path, write_jsonl, chat_row):
    """load_dataset on a local folder fails whole on one bad line with "An error occurred while generating the
    dataset"; the error names the file and line as --dataset_path's reader does, and why on_bad_row cannot help."""
    rows = [chat_row(0), chat_row(1), '{"messages": [{"role": "user", "content": "cut short"}']
    bad = write_jsonl(tmp_path / "repo" / "data" / "train.jsonl", rows)
    with pytest.raises(DataError) as info:
        rows_of(str(tmp_path / "repo"), kind="name")
    assert f"{bad} line 3: malformed JSON" in str(info.value) and "on_bad_row" in str(info.value)


def test_a_load_dataset_failure_says_what_caused_it_unless_the_hub_was_unreachable(monkeypatch):
    """datasets wraps what went wrong ("An error occurred while generating the dataset"): the causes are said. An
    unreachable Hub is said by its own message and the way on, without the chain's noise ("not cached in None")."""
    from phalanx.errors import HubUnreachable

    def generation_failed(name, split):
        try:
            raise ValueError("Couldn't cast column 'messages'")
        except ValueError as cause:
            raise RuntimeError("An error occurred while generating the dataset") from cause

    monkeypatch.setattr(datasets, "load_dataset", generation_failed)
    with pytest.raises(DataError) as info:
        rows_of("org/data", kind="name")
    assert str(info.value).endswith(
        "load_dataset failed: RuntimeError: An error occurred while generating the dataset "
        "(ValueError: Couldn't cast column 'messages')"
    )

    def unreachable(name, split):
        try:
            raise FileNotFoundError(f"Dataset {name} is not cached in None")
        except FileNotFoundError:
            raise ConnectionError(f"Couldn't reach '{name}' on the Hub") from OSError(-2, "Name or service not known")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(HubUnreachable) as info:
        rows_of("org/data", kind="name")
    assert "load_dataset failed: ConnectionError: Couldn't reach 'org/data' on the Hub." in str(info.value)
    assert "not cached in None" not in str(info.value)


def test_missing_path_says_what_is_accepted(tmp_path):
    with pytest.raises(DataError) as info:
        rows_of(tmp_path / "nope.jsonl")
    msg = str(info.value)
    assert "nope.jsonl: no such file or folder" in msg and ".jsonl" in msg and "save_to_disk" in msg
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x.csv: unsupported file type '.csv'; accepted"):
        rows_of(tmp_path / "x.csv")
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"folder holds no \*.jsonl or \*.parquet files"):
        rows_of(tmp_path / "folder")


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl.*no rows"):
        rows_of(tmp_path / "empty.jsonl")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text("")
    with pytest.raises(DataError, match=r"folder' *: no rows"):
        rows_of(tmp_path / "folder")


def test_malformed_json_line(tmp_path, write_jsonl):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, {"text": "b"}, '{"text": "c",'])
    with pytest.raises(DataError) as info:
        rows_of(f)
    assert str(info.value).startswith(f"{f} line 3: malformed JSON: ")
    assert "column" in str(info.value)


def test_bytes_that_are_not_utf8(tmp_path):
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl line 2: not UTF-8 \(byte 0xe9"):
        rows_of(f)


def test_row_that_is_not_an_object(tmp_path, write_jsonl):
    f = write_jsonl(tmp_path / "list.jsonl", [{"text": "a"}, [1, 2]])
    with pytest.raises(DataError, match=r"list.jsonl line 2: expected a JSON object, found list"):
        rows_of(f)


def test_bad_rows_go_to_the_callback_and_reading_goes_on(tmp_path, write_jsonl):
    f = tmp_path / "mixed.jsonl"
    f.write_bytes(b'{"text": "a"}\n{oops\n\xff\n[1]\n{"text": "b"}\n')
    seen = []
    got = list(iter_rows(f, kind="path", on_bad_row=seen.append))
    assert [w for w, _ in got] == [f"{f} line 1", f"{f} line 5"]
    assert [str(e).split(":")[0] for e in seen] == [f"{f} line 2", f"{f} line 3", f"{f} line 4"]


def test_bundled_dataset_path_points_inside_the_package():
    path = bundled_dataset_path()
    assert path.name == "health_agent.jsonl" and path.parent.name == "bundled"
    assert path.parent.parent.name == "data" and (path.parent.parent / "sources.py").is_file()
