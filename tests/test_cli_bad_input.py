"""Bad input gets one clear paragraph naming file, line or field; non-zero exit on every rank; earlier outputs untouched."""

import hashlib
import json
import sys
import time
from pathlib import Path

import pytest

from helpers import chat_row, run_phalanx, shared_template, write_chat_jsonl
from phalanx.cli import main


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def earlier_run(tmp_path: Path) -> Path:
    """An output_dir holding a previous run; --overwrite_output_dir is passed, yet bad input must not touch it."""
    out = tmp_path / "out"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "adapter_model.safetensors").write_bytes(b"weights")
    # no commit marker: a save that crashed, so there is nothing to resume and the run must not be replaced silently
    (out / "training_info.json").write_text(json.dumps({"global_step": 5}))
    return out


def lines(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD = chat_row(0)
BAD_ROLE = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hello"}]}
NO_ASSISTANT = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
BAD_ARGS = json.loads(json.dumps(GOOD))
BAD_ARGS["messages"][2]["tool_calls"][0]["function"]["arguments"] = "{weight: 70"

DATA_CASES = {
    "malformed_json": (lines(GOOD, GOOD, '{"messages": [oops'), ["train.jsonl line 3"]),
    "unknown_role": (lines(GOOD, BAD_ROLE), ["train.jsonl line 2", "messages[1].role", "'bot'", "assistant"]),
    "no_assistant": (lines(NO_ASSISTANT), ["train.jsonl line 1", "assistant"]),
    "args_not_json": (lines(GOOD, BAD_ARGS), ["train.jsonl line 2", "messages[2].tool_calls[0].function.arguments"]),
    "wrong_schema": (lines({"prompt": "x", "completion": "y"}), ["train.jsonl line 1", "messages"]),
}


def run_main(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_rows_are_named(case, tmp_path, earlier_run, capsys):
    """In one process, where the checks run; with --world_size N the ranks run the same checks (test below)."""
    content, needles = DATA_CASES[case]
    data = tmp_path / "train.jsonl"
    data.write_text(content)
    before = tree_digest(earlier_run)
    code, out = run_main(
        [
            "train",
            "--dataset_path",
            str(data),
            "--output_dir",
            str(earlier_run),
            "--overwrite_output_dir",
            "--max_length",
            "768",
        ],
        capsys,
    )
    assert code == 2
    for needle in needles:
        assert needle in out, (needle, out)
    assert tree_digest(earlier_run) == before


@pytest.mark.distributed
def test_bad_row_found_by_the_ranks_is_reported_once(tmp_path, earlier_run):
    """`--world_size 2` starts the ranks at once and they read the data: the bad row is printed once, every rank
    exits, the command exits 2 without a traceback, and the earlier run is untouched."""
    data = tmp_path / "train.jsonl"
    data.write_text(lines(GOOD, GOOD, BAD_ROLE))
    before = tree_digest(earlier_run)
    start = time.monotonic()
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(data),
        "--output_dir",
        str(earlier_run),
        "--overwrite_output_dir",
        "--world_size",
        "2",
        "--max_length",
        "768",
        timeout=120,
    )
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    message = "train.jsonl line 3: messages[1].role: unknown role 'bot'"
    assert out.count(message) == 1 and out.count("error:") == 1, out
    assert "Traceback" not in out and "[rank" not in out and "SIGTERM" not in out, out
    assert "Starting distributed training" not in out, "no rank got past the data"
    assert elapsed < 60
    assert tree_digest(earlier_run) == before


def test_non_utf8_bytes_are_named(tmp_path, earlier_run, capsys):
    data = tmp_path / "train.jsonl"
    data.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    code, out = run_main(
        ["train", "--dataset_path", str(data), "--output_dir", str(earlier_run), "--overwrite_output_dir"], capsys
    )
    assert code == 2 and "train.jsonl line 2" in out and "UTF-8" in out


def test_bad_rows_can_be_skipped_and_counted(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    write_chat_jsonl(data, 6)
    with open(data, "a") as f:
        f.write(lines(BAD_ROLE, '{"broken'))
    code, out = run_main(
        [
            "train",
            "--dataset_path",
            str(data),
            "--output_dir",
            str(tmp_path / "o"),
            "--on_bad_row",
            "skip",
            "--max_steps",
            "1",
            "--max_length",
            "768",
            "--test_size",
            "0",
            "--logging.progress_bar",
            "false",
        ],
        capsys,
    )
    assert code == 0, out
    assert "2 refused" in out and "line 7" in out and "line 8" in out


@pytest.mark.parametrize(
    "make_path,needle",
    [
        (lambda tmp: tmp / "missing.jsonl", "missing.jsonl"),
        (lambda tmp: (tmp / "empty.jsonl").write_text("") and None or tmp / "empty.jsonl", "empty.jsonl"),
    ],
)
def test_missing_or_empty_dataset(make_path, needle, tmp_path, capsys):
    code, out = run_main(
        ["train", "--dataset_path", str(make_path(tmp_path)), "--output_dir", str(tmp_path / "o")], capsys
    )
    assert code == 2 and needle in out


def test_config_with_unknown_and_mistyped_keys(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("training:\n  batch_size: two\n  lerning_rate: 1.0e-4\n")
    code, out = run_main(["train", str(cfg)], capsys)
    assert code == 2
    assert "run.yaml line 2" in out and "training.batch_size" in out and "'two'" in out
    assert "run.yaml line 3" in out and "Did you mean 'learning_rate'" in out


def test_model_path_that_does_not_exist(tmp_path, capsys):
    code, out = run_main(
        ["train", "--model_name", str(tmp_path / "no-model"), "--output_dir", str(tmp_path / "o")], capsys
    )
    assert code == 2 and "no-model" in out and "no such folder" in out


def test_world_size_larger_than_the_machine(tmp_path, capsys):
    import os

    too_many = (os.cpu_count() or 1) + 1
    code, out = run_main(["train", "--world_size", str(too_many), "--output_dir", str(tmp_path / "o")], capsys)
    assert code == 2 and f"world_size = {too_many}" in out and "core" in out


def test_batch_size_zero(tmp_path, capsys):
    code, out = run_main(["train", "--batch_size", "0"], capsys)
    assert code == 2 and "training.batch_size" in out and "greater than 0" in out


def test_a_precision_the_device_lacks_is_refused_before_output_dir_is_made(tmp_path, capsys):
    out = tmp_path / "new-run"
    code, said = run_main(["train", "--mixed_precision", "bf16", "--output_dir", str(out), "--max_steps", "1"], capsys)
    assert code == 2 and "training.mixed_precision = 'bf16' needs a CUDA device" in said
    assert not out.exists(), "a refused run leaves no folder (it held only the lock file)"


def test_a_mistyped_or_missing_command_is_named_with_the_nearest(capsys):
    assert main(["trian", "--max_steps", "3"]) == 2
    assert "error: unknown command 'trian'. Did you mean 'train'?" in capsys.readouterr().err
    assert main(["--max_steps", "3"]) == 2
    assert "The command comes first: phalanx train --max_steps 3" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "commands:" in capsys.readouterr().out


def test_every_subcommand_answers_help_with_its_usage_and_refuses_stray_arguments(capsys):
    """`--help` after a subcommand's own subcommand printed "unknown flag --help" (data preview) or was ignored."""
    for argv, needle in (
        (["data", "preview", "--help"], "usage: phalanx data preview"),
        (["data", "templates", "-h"], "usage: phalanx data preview"),
        (["config-docs", "--help"], "usage: phalanx config-docs"),
    ):
        assert main(argv) == 0, argv
        assert needle in capsys.readouterr().out, argv
    assert main(["config-docs", "--out"]) == 2
    assert "phalanx config-docs: unexpected argument '--out'" in capsys.readouterr().err
    assert main(["data", "templates", "qwen"]) == 2
    assert "phalanx data templates takes no arguments, got 'qwen'" in capsys.readouterr().err


def test_output_into_a_closed_pipe_stops_quietly(tmp_path):
    """`phalanx train --help | head -1`: the reader closes the pipe early, and the help text's last write (or the
    flush at exit) failed with a BrokenPipeError traceback. Now: nothing on stderr, the status of a program a closed
    pipe stopped (141, as `yes | head` shows). The pipe is closed before the process writes, so the write fails."""
    import os
    import subprocess

    for argv in (["train", "--help"], ["config-docs"]):
        read_end, write_end = os.pipe()
        os.close(read_end)
        with open(tmp_path / "stderr", "w+") as stderr:
            code = subprocess.call(
                [sys.executable, "-m", "phalanx", *argv], stdout=write_end, stderr=stderr, timeout=120
            )
            stderr.seek(0)
            assert (code, stderr.read()) == (141, ""), argv
        os.close(write_end)


def test_existing_run_is_not_overwritten_silently(earlier_run, capsys):
    before = tree_digest(earlier_run)
    code, out = run_main(["train", "--output_dir", str(earlier_run)], capsys)
    assert (
        code == 2
        and "already holds a run" in out
        and "no committed checkpoint" in out
        and "--overwrite_output_dir" in out
    )
    assert tree_digest(earlier_run) == before


@pytest.mark.distributed
def test_every_rank_exits_under_torchrun(tmp_path, earlier_run):
    """No parent to pre-check under torchrun: each rank meets the bad row itself and exits non-zero, quickly."""
    data = tmp_path / "train.jsonl"
    data.write_text(lines(GOOD, BAD_ROLE))
    before = tree_digest(earlier_run)
    start = time.monotonic()
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "0",
            "-m",
            "phalanx",
            "train",
            "--dataset_path",
            str(data),
            "--output_dir",
            str(earlier_run),
            "--overwrite_output_dir",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "error: " in proc.stderr and "train.jsonl line 2" in proc.stderr
    # Rank 0 prints it; rank 1 hands the same message to torchrun (its failure summary), not to the console.
    assert "[rank 1] error" not in proc.stderr
    assert elapsed < 60
    assert tree_digest(earlier_run) == before


def test_master_port_already_taken(tmp_path, capsys):
    import socket

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        data = write_chat_jsonl(tmp_path / "train.jsonl", 4)
        start = time.monotonic()
        code, out = run_main(
            [
                "train",
                "--dataset_path",
                str(data),
                "--output_dir",
                str(tmp_path / "o"),
                "--world_size",
                "2",
                "--master_port",
                str(port),
                "--max_length",
                "768",
            ],
            capsys,
        )
    assert code == 2 and str(port) in out and time.monotonic() - start < 60


def test_hybrid_shard_on_one_node_is_refused_before_any_rank_starts(tmp_path, capsys):
    """HYBRID_SHARD needs several nodes; `--world_size N` is one node, so the launcher refuses it and starts nothing."""
    out = tmp_path / "out"
    started = time.perf_counter()
    code, output = run_main(
        [
            "train",
            "--strategy",
            "fsdp",
            "--sharding_strategy",
            "HYBRID_SHARD",
            "--world_size",
            "2",
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
        ],
        capsys,
    )
    assert code == 2 and "HYBRID_SHARD" in output and "Use FULL_SHARD" in output, output
    assert time.perf_counter() - started < 10, "refused by the config check, not by ranks timing out"
    assert not out.exists(), "nothing is written"


def test_rows_dropped_by_max_length_are_explained(tmp_path, earlier_run, capsys):
    """Every row is cut before its first assistant token: the error says so, with the lengths and the remedy."""
    data = tmp_path / "train.jsonl"
    write_chat_jsonl(data, 4)
    before = tree_digest(earlier_run)
    code, out = run_main(
        [
            "train",
            "--dataset_path",
            str(data),
            "--output_dir",
            str(earlier_run),
            "--overwrite_output_dir",
            "--max_length",
            "64",
            "--test_size",
            "0",
        ],
        capsys,
    )
    assert code == 2, out
    assert "no usable training rows (4 read, 0 skipped, 4 dropped, 0 held out for evaluation)" in out
    assert (
        "dropped: 4 no assistant token left within max_length (cut at max_length 64 before its first assistant "
        "token: raise max_length" in out
    )
    assert "; row lengths " in out and " tokens (median " in out
    assert tree_digest(earlier_run) == before


def test_deepseek_r1_distill_template_that_drops_tool_calls_is_refused(tmp_path, capsys):
    """The model's own template writes a tool call only when content is null: the row is refused, not trained as an
    empty turn, and the error names the call and the corrected template phalanx ships."""
    data = tmp_path / "train.jsonl"
    write_chat_jsonl(data, 2)
    code, out = run_main(
        [
            "train",
            "--dataset_path",
            str(data),
            "--output_dir",
            str(tmp_path / "o"),
            "--max_length",
            "768",
            "--chat_template",
            str(shared_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")),
        ],
        capsys,
    )
    assert code == 2, out
    assert (
        "train.jsonl line 1: messages[2].tool_calls[0]: the chat template dropped the tool call's name 'get_bmi'" in out
    )
    assert "--chat_template deepseek-r1-distill" in out
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("inside", [False, True], ids=["is-a-file", "under-a-file"])
def test_an_output_dir_that_is_or_sits_under_a_file_is_refused_by_name(tmp_path, capsys, inside):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    out = blocker / "run" if inside else blocker
    code, text = run_main(["train", "--output_dir", str(out), "--max_steps", "1"], capsys)
    assert code == 2 and f"output_dir = '{out}': {blocker} is a file, not a folder" in text, text
    assert "Traceback" not in text and blocker.read_text() == "keep me"


@pytest.mark.parametrize(
    "command",
    [
        ["launcher", "--num_gpus_per_node", "0", "--output"],
        ["config", "deepspeed", "--output"],
        ["train", "--output_dir"],
    ],
    ids=["launcher", "config", "train"],
)
def test_an_output_that_cannot_be_created_is_refused_by_name(tmp_path, capsys, command):
    """Under a file, or where no folder can be made (/proc takes no new entry, whoever runs this): status 2 and the
    path, no traceback, nothing written."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    config = tmp_path / "run.yaml"
    config.write_text("training:\n  max_steps: 1\n")
    before = sorted(tmp_path.iterdir())
    for target, reason in [(blocker / "x" / "out", f"{blocker} is a file, not a folder"), (Path("/proc/nope/out"), "")]:
        argv = [*command, str(target)] + (["--config", str(config)] if command[0] == "launcher" else [])
        code, text = run_main(argv, capsys)
        assert code == 2 and "Traceback" not in text, text
        assert reason in text and (reason or "cannot create or write into /proc (") in text, text
    assert sorted(tmp_path.iterdir()) == before and blocker.read_text() == "keep me"


@pytest.mark.parametrize("variable", ["HOME", "PHALANX_CACHE"])
def test_a_cache_folder_that_cannot_be_made_is_named_with_its_variable(tmp_path, capsys, monkeypatch, variable):
    """A HOME this user cannot write (a service account's) or a bad PHALANX_CACHE ended in five chained
    FileNotFoundError tracebacks from the embedded model's builder; now status 2, the folder and the way out."""
    monkeypatch.delenv("PHALANX_CACHE")
    monkeypatch.setenv(variable, "/proc/nohome")
    code, text = run_main(["generate", "--num_questions", "1", "--output", str(tmp_path / "g.jsonl")], capsys)
    assert code == 2 and "Traceback" not in text, text
    assert "phalanx's cache folder /proc/nohome" in text and "set PHALANX_CACHE to a folder this user can write" in text
    code, text = run_main(["train", "--output_dir", str(tmp_path / "out"), "--max_steps", "1"], capsys)
    assert code == 2 and "Traceback" not in text and f"{variable}=/proc/nohome" in text, text
    assert sorted(tmp_path.iterdir()) == [], "nothing written"


def test_data_preview_refuses_what_train_refuses_in_a_dataset_folder(tmp_path, capsys):
    """`phalanx data preview --dataset_path data/` on seed 001's folder (traj_chat.jsonl beside traj_val.jsonl)
    previewed the held-out rows as training rows, status 0, where `phalanx train` on the same flags refuses it; and
    `--rows -1` was taken as 'show none'."""
    write_chat_jsonl(tmp_path / "data" / "traj_chat.jsonl", 4)
    write_chat_jsonl(tmp_path / "data" / "traj_val.jsonl", 2)
    code, text = run_main(["data", "preview", "--dataset_path", str(tmp_path / "data")], capsys)
    assert code == 2 and "traj_val.jsonl too, whose name marks a held-out split ('val')" in text, text
    # the training file given again as the eval file: scored on what it trained on, silently, in train and preview
    train = str(tmp_path / "data" / "traj_chat.jsonl")
    for command in (["train", "--output_dir", str(tmp_path / "out")], ["data", "preview"]):
        code, text = run_main([*command, "--dataset_path", train, "--eval_dataset_path", train], capsys)
        assert code == 2 and f"data.eval_dataset_path {train} is the training file" in text, text
    assert not (tmp_path / "out").exists()
    code, text = run_main(["data", "preview", "--rows", "-1"], capsys)
    assert code == 2 and "--rows -1: expected a whole number of rows, 0 or more" in text, text


def test_ctrl_c_before_a_command_installs_its_handler_is_one_line_and_status_130(tmp_path):
    """`phalanx generate --world_size 2` reads the prompts (importing transformers, seconds) before it starts the
    ranks, with Python's own Ctrl-C: a KeyboardInterrupt traceback from deep inside a library, status -2."""
    import subprocess

    code = (
        "import os, signal, sys\n"
        "class CtrlCOnImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'transformers':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, CtrlCOnImport())\n"
        "from phalanx.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    output = tmp_path / "data" / "traj_chat.jsonl"
    argv = ["generate", "--world_size", "2", "--output", str(output)]
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip() == "⏹️  phalanx generate: stopped by Ctrl-C; what was committed earlier is kept"
    assert not (tmp_path / "data").exists()
