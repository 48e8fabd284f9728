"""`phalanx generate` as users run it: 1 vs 2 real ranks, SIGKILL and rerun, train on the output, bad input, OOM."""

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from helpers import (
    chat_row,
    ctrl_c_twice_while_starting,
    lock_held_elsewhere,
    run_phalanx,
    start_phalanx,
)
from phalanx.cli import main as phalanx_main
from phalanx.data.chat import IGNORE_INDEX, tokenize_conversation
from phalanx.data.formats import to_conversation
from phalanx.errors import DataError
from phalanx.models.load import load_tokenizer, resolve_model_path
from phalanx.runtime.output_lock import output_file_lock

pytestmark = pytest.mark.system

MODEL = "embedded:tiny-qwen3"
PROMPTS = 10
K = 4
FLAGS = [
    "--num_sequences_per_question",
    str(K),
    "--batch_size",
    "6",
    "--max_new_tokens",
    "32",
    "--temperature",
    "0.9",
    "--top_p",
    "0.95",
    "--top_k",
    "40",
    "--seed",
    "7",
    "--val_fraction",
    "0.2",
]


def write_prompts(path: Path) -> Path:
    rows = [chat_row(i) for i in range(3)]  # full tool-calling conversations: the last answer is regenerated
    rows += [{"question": "How much water should I drink a day?" + " Please be specific." * i} for i in range(5)]
    rows += [
        {"conversations": [{"from": "human", "value": "Suggest a stretch for my back."}]},
        {"instruction": "Give one tip for better sleep."},
    ]
    assert len(rows) == PROMPTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate_args(prompts: Path, output: Path, *extra: str) -> list[str]:
    return ["generate", "--prompts", str(prompts), "--output", str(output), *FLAGS, *extra]


def run_in_process(argv: list[str], capsys) -> tuple[int, str]:
    code = phalanx_main(argv)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    prompts = write_prompts(root / "prompts.jsonl")
    one = run_phalanx(*generate_args(prompts, root / "w1" / "traj_chat.jsonl"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    # The second job also decodes over the fixed-size cache (a CUDA graph per step on CUDA; eager here), which must
    # not change a byte either.
    two = run_phalanx(
        *generate_args(prompts, root / "w2" / "traj_chat.jsonl", "--world_size", "2", "--kv_cache", "fixed")
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    return root, prompts, one, two


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_one_rank_and_two_ranks_over_the_fixed_cache_write_identical_files(runs):
    root, _, one, two = runs
    assert "KV cache: fixed size" in two.stdout and "KV cache" not in one.stdout
    for name in ("traj_chat.jsonl", "traj_val.jsonl"):
        assert (root / "w1" / name).read_bytes() == (root / "w2" / name).read_bytes(), name
    assert sorted(p.name for p in (root / "w2" / "traj_chat.jsonl.shards").iterdir()) == [
        "manifest.json",
        "rank-0.jsonl",
        "rank-1.jsonl",
    ]
    assert "on 2 rank(s)" in two.stdout and "Wrote 32 records" in two.stdout and "and 8 (2 prompts)" in two.stdout
    train, val = read_jsonl(root / "w1" / "traj_chat.jsonl"), read_jsonl(root / "w1" / "traj_val.jsonl")
    keys = [(r["metadata"]["prompt_id"], r["metadata"]["sequence_index"]) for r in train + val]
    assert sorted(keys) == [(p, s) for p in range(PROMPTS) for s in range(K)]  # each pair exactly once
    assert not {k[0] for k in keys[: len(train)]} & {k[0] for k in keys[len(train) :]}  # split by whole prompt
    meta = train[0]["metadata"]
    assert meta["model"] == "embedded:tiny-qwen3" and meta["adapter"] is None
    assert meta["sampling"] == {"max_new_tokens": 32, "temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 7}
    assert {r["metadata"]["finish_reason"] for r in train + val} <= {"stop", "length"}
    assert all(r["metadata"]["completion_tokens"] <= 32 for r in train + val)
    # Sequences of a prompt differ from each other.
    first = [r["messages"][-1]["content"] for r in train if r["metadata"]["prompt_id"] == 0]
    assert len(set(first)) == K


def test_a_second_job_on_a_running_jobs_output_is_refused(runs, capsys):
    """Two jobs on one --output would append to the same shards: the second is refused, on one rank or several."""
    root, prompts, _, _ = runs
    output = root / "locked" / "traj_chat.jsonl"
    with lock_held_elsewhere(output_file_lock(output)) as holder:
        for extra in ([], ["--world_size", "2"]):
            code, text = run_in_process(generate_args(prompts, output, *extra), capsys)
            assert code == 2 and f"--output {output} is in use by another run (pid {holder} on " in text, text
    assert not (root / "locked" / "traj_chat.jsonl.shards").exists()  # nothing written


def test_records_train_as_they_are(runs):
    root, _, _, _ = runs
    tok = load_tokenizer("embedded:tiny-qwen3")
    rows = read_jsonl(root / "w1" / "traj_chat.jsonl") + read_jsonl(root / "w1" / "traj_val.jsonl")
    by_prompt = {r["metadata"]["prompt_id"]: r for r in rows}
    # A chat row with tools: the prompt's turns, then the generated answer after the tool result.
    tool_row = by_prompt[0]
    assert [m["role"] for m in tool_row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert tool_row["tools"][0]["function"]["name"] == "get_bmi"
    assert by_prompt[9]["messages"][0] == {"role": "user", "content": "Give one tip for better sleep."}
    for i, row in enumerate(rows):
        conv = to_conversation(row, f"row {i}")
        ids = tokenize_conversation(tok, conv, f"row {i}").examples[-1]  # the row holding the final turn
        last = len(ids["labels"]) - 1
        while ids["labels"][last] != IGNORE_INDEX:
            last -= 1
        # The final assistant turn is trained on: the generated text, then the template's end of turn.
        assert tok.decode(ids["labels"][last + 1 :]) == row["messages"][-1]["content"] + "<|im_end|>\n"


def test_finished_rerun_only_merges_again(runs, capsys):
    """w2 was generated over the fixed cache, which its manifest records (in bf16 the caches can round differently):
    a rerun that asks for the other cache is refused, naming it; the same command only merges again."""
    root, prompts, _, _ = runs
    before = (root / "w2" / "traj_chat.jsonl").read_bytes()
    code, out = run_in_process(generate_args(prompts, root / "w2" / "traj_chat.jsonl"), capsys)
    assert code == 2 and "other settings (kv_cache: 'fixed' before, None now)" in out, out
    code, out = run_in_process(generate_args(prompts, root / "w2" / "traj_chat.jsonl", "--kv_cache", "fixed"), capsys)
    assert code == 0, out
    assert f"Resuming: {PROMPTS * K} of {PROMPTS * K} sequences are already committed" in out
    assert "Generated 0 sequences" in out
    assert (root / "w2" / "traj_chat.jsonl").read_bytes() == before


def test_a_rerun_without_a_validation_share_points_out_the_earlier_validation_file(runs, tmp_path, capsys):
    """--val_fraction 0 on a finished job merges every prompt into the training file; the traj_val.jsonl an earlier
    merge wrote stayed beside it without a word, so `--eval_dataset_path traj_val.jsonl` scored training rows."""
    import shutil

    root, prompts, _, _ = runs
    shutil.copytree(root / "w1", tmp_path / "w1")
    output, val = tmp_path / "w1" / "traj_chat.jsonl", tmp_path / "w1" / "traj_val.jsonl"
    before = val.read_bytes()
    code, out = run_in_process(generate_args(prompts, output, "--val_fraction", "0"), capsys)
    assert code == 0, out
    assert len(read_jsonl(output)) == PROMPTS * K and val.read_bytes() == before
    assert f"⚠️  {val} is left as it was: --val_fraction 0 writes no validation file" in out
    # the same with the validation records written elsewhere (--val_output): the old traj_val.jsonl is pointed out
    other = tmp_path / "w1" / "held_out.jsonl"
    code, out = run_in_process(generate_args(prompts, output, "--val_output", str(other)), capsys)
    assert code == 0 and other.is_file() and val.read_bytes() == before, out
    assert f"⚠️  {val} is left as it was: this run wrote its validation records to {other}." in out, out


def test_one_prompt_writes_no_empty_validation_file(tmp_path, capsys):
    """One prompt cannot be split, yet an empty traj_val.jsonl was written beside the records, and `phalanx train` on
    that folder refused it ("no rows; the dataset is empty")."""
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"question": "Suggest a stretch for my back."}) + "\n")
    output = tmp_path / "out" / "traj_chat.jsonl"
    code, out = run_in_process(generate_args(prompts, output, "--max_new_tokens", "4"), capsys)
    assert code == 0, out
    assert len(read_jsonl(output)) == K and not (tmp_path / "out" / "traj_val.jsonl").exists()
    assert "No validation file written: 1 prompt is too few to hold any back for validation (it takes 2 or more)" in out


def committed_pairs(folder: Path) -> int:
    from phalanx.generate.shards import scan_folder

    return len(scan_folder(folder))


def children(pid: int) -> list[int]:
    """Child processes of pid (the elastic launcher starts its ranks in sessions of their own)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def wait_gone(pids: list[int], timeout: float = 30) -> bool:
    """True once every pid has exited (gone, or a zombie: its files are closed); False at the timeout."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                break  # gone
            if state == "Z":
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    return True


def freeze(pids: list[int]) -> None:
    """SIGSTOP each process and wait until every thread has stopped: a signal sent after that stays pending."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    for pid in pids:
        tasks = Path(f"/proc/{pid}/task")
        while any(t.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] != "T" for t in tasks.iterdir()):
            assert time.monotonic() < deadline, f"process {pid} did not stop"
            time.sleep(0.001)


def signal_pending(pid: int, sig: signal.Signals) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    pending = int(next(line for line in status.splitlines() if line.startswith("ShdPnd:")).split()[1], 16)
    return bool(pending & (1 << (sig - 1)))


def test_killed_launcher_then_preempted_launch_then_rerun_completes_without_duplicates(runs, tmp_path, capsys):
    """The `--world_size 2` launcher is SIGKILLed while its ranks start: they (in sessions of their own, so not
    killed along) notice and stop by themselves. A second launch gets SIGTERM mid-run: each rank finishes the batch
    it is generating, commits it and stops, and the launcher exits 75 (requeue me). Each rank's shard then holds the
    first of its batches, in order, and nothing torn. A rerun on one rank generates only what was not committed, and
    the files are the uninterrupted run's bytes."""
    from phalanx.generate.shards import scan_shard

    root, prompts, _, _ = runs
    out = tmp_path / "k" / "traj_chat.jsonl"
    shards = out.with_name("traj_chat.jsonl.shards")
    command = generate_args(prompts, out, "--world_size", "2")
    proc = start_phalanx(*command, output=False)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and len(children(proc.pid)) < 2:
            time.sleep(0.01)
        time.sleep(0.5)  # importing the model stack
        ranks = children(proc.pid)
        assert proc.poll() is None and len(ranks) == 2, "the run ended before it could be killed"
    finally:
        proc.kill()  # the launcher only, as the OOM killer or `kill -9` would
        proc.wait()
    assert wait_gone(ranks, timeout=20), "the ranks of a killed launcher must stop by themselves"

    # A batch takes a fraction of a second here: the ranks are frozen (SIGSTOP) at their first commit, so that the
    # SIGTERM the launcher passes on is waiting for them, mid-batch, when they go on.
    proc = start_phalanx(*command)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not committed_pairs(shards):
            time.sleep(0.01)
        ranks = children(proc.pid)
        freeze(ranks)
        at_signal = committed_pairs(shards)
        assert proc.poll() is None and len(ranks) == 2 and at_signal, "the launch ended before it could be preempted"
        proc.send_signal(signal.SIGTERM)
        passed_on = time.monotonic() + 30
        while not all(signal_pending(pid, signal.SIGTERM) for pid in ranks):
            assert time.monotonic() < passed_on, "the launcher did not pass SIGTERM on to its ranks"
            time.sleep(0.01)
    finally:
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr[-3000:]
    assert stderr.count("preempted (SIGTERM): every rank committed the batch it was generating") == 1, stderr[-3000:]

    done = committed_pairs(shards)
    assert at_signal < done < PROMPTS * K and not out.exists(), (at_signal, done)  # the batches in flight are kept
    planned = -(-PROMPTS * K // 6)  # batches of --batch_size 6
    for rank in (0, 1):
        shard = shards / f"rank-{rank}.jsonl"
        assert scan_shard(shard)[1] == shard.stat().st_size, "stopped between batches: no uncommitted tail"
        batches = [
            json.loads(line)["commit"]["batch"] for line in shard.read_text().splitlines() if '"commit"' in line[:12]
        ]
        assert batches == list(range(rank, planned, 2))[: len(batches)], (rank, batches)
    # Rerun the same command, on one rank this time: only what was not committed is generated.
    code, log = run_in_process(generate_args(prompts, out), capsys)
    assert code == 0, log
    assert f"Resuming: {done} of {PROMPTS * K} sequences" in log
    assert f"Generated {PROMPTS * K - done} sequences" in log
    # Same pairs, once each, and the very bytes of the uninterrupted runs.
    for name in ("traj_chat.jsonl", "traj_val.jsonl"):
        assert (out.parent / name).read_bytes() == (root / "w1" / name).read_bytes(), name


def rank_of(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"RANK=")).split(b"=", 1)[1])


def test_a_killed_rank_is_named_alone_and_the_other_stops_without_a_traceback(runs, tmp_path):
    """kill -9 of rank 1 mid-run: rank 0 met it next in a collective, printed gloo's "Connection closed by peer"
    traceback and was named as failing too (`failed on rank 0 (exit code 1), rank 1 (killed by SIGKILL)`). It stands
    aside now, as a training rank does, and the launcher names the killed rank only. A rerun completes the files."""
    root, prompts, _, _ = runs
    out = tmp_path / "r" / "traj_chat.jsonl"
    shards = out.with_name("traj_chat.jsonl.shards")
    command = generate_args(prompts, out, "--world_size", "2")
    proc = start_phalanx(*command)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not committed_pairs(shards):
            time.sleep(0.01)
        ranks = children(proc.pid)
        assert proc.poll() is None and len(ranks) == 2, "the run ended before a rank could be killed"
        os.kill(next(pid for pid in ranks if rank_of(pid) == 1), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "failed on rank 1 (killed by SIGKILL); the other ranks were stopped" in stderr, stderr[-3000:]
    assert "rank 0 (exit code" not in stderr, stderr[-3000:]
    rerun = run_phalanx(*command)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for name in ("traj_chat.jsonl", "traj_val.jsonl"):
        assert (out.parent / name).read_bytes() == (root / "w1" / name).read_bytes(), name


def test_ctrl_c_twice_while_the_ranks_start_stops_them_at_once(tmp_path):
    """Generation ranks answer Ctrl-C as training ranks do (the same flag): the first asks them to commit the batch
    they are generating and stop; a second one, pressed while they still start, stops them at once. The launcher
    exits 130, rank 0 says so in one line, and nothing is merged."""
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out, log = tmp_path / "c" / "traj_chat.jsonl", tmp_path / "stderr.log"
    proc = start_phalanx(*generate_args(prompts, out, "--world_size", "2"), new_session=True, stderr_to=log)
    try:
        ctrl_c_twice_while_starting(proc, log, lambda: ranks if len(ranks := children(proc.pid)) == 2 else [])
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            for pid in [proc.pid, *children(proc.pid)]:
                os.kill(pid, signal.SIGKILL)
    stderr = log.read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert "finishing the batch being generated and committing it before stopping" in stderr, stderr[-3000:]
    assert stderr.count("Ctrl-C again: stopped at once, without saving") == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "error:" not in stderr, stderr[-3000:]
    assert not out.exists()


def test_generate_then_train_then_generate_with_the_adapter(runs, tmp_path, capsys):
    root, prompts, _, _ = runs
    trained = tmp_path / "trained"
    proc = run_phalanx(
        "train",
        "--dataset_path",
        str(root / "w1" / "traj_chat.jsonl"),
        "--eval_dataset_path",
        str(root / "w1" / "traj_val.jsonl"),
        "--output_dir",
        str(trained),
        "--max_steps",
        "2",
        "--batch_size",
        "2",
        "--learning_rate",
        "1e-2",
        "--max_length",
        "768",
        "--eval_steps",
        "2",
        "--save_steps",
        "100",
        "--logging.progress_bar",
        "false",
        "--logging.tensorboard",
        "false",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads((trained / "final_training_info.json").read_text())
    assert info["global_step"] == 2 and info["tokens_seen"] > 0
    assert "32 train rows, 8 eval rows" in proc.stdout
    # The adapter goes back into generation; its base model comes from adapter_config.json.
    out = tmp_path / "adapted" / "answers.jsonl"
    code, log = run_in_process(
        [
            "generate",
            "--adapter",
            str(trained),
            "--prompts",
            str(prompts),
            "--num_questions",
            "2",
            "--num_sequences_per_question",
            "2",
            "--max_new_tokens",
            "8",
            "--output",
            str(out),
        ],
        capsys,
    )
    assert code == 0, log
    rows = read_jsonl(out) + read_jsonl(out.with_name("answers_val.jsonl"))
    assert len(rows) == 4
    assert {r["metadata"]["adapter"] for r in rows} == {str(trained)}
    assert rows[0]["metadata"]["model"] == "embedded:tiny-qwen3"  # the model the adapter was trained on, by its name
    manifest = json.loads((out.with_name("answers.jsonl.shards") / "manifest.json").read_text())
    assert len(manifest["settings"]["adapter_sha256"]) == 64


def test_bad_input_is_reported_once_before_ranks_start(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question": "fine"}) + "\n" + '{"question": "unterminated\n')
    out = tmp_path / "out" / "traj_chat.jsonl"
    proc = run_phalanx("generate", "--prompts", str(prompts), "--output", str(out), "--world_size", "2")
    assert proc.returncode == 2
    assert proc.stderr.count("error:") == 1 and f"{prompts} line 2: malformed JSON" in proc.stderr
    assert not out.parent.exists()  # nothing written


def test_a_rank_that_fails_is_status_1_and_bad_input_stays_2(tmp_path, capsys, monkeypatch):
    """What the launcher says a rank did keeps its status through `phalanx generate`: a rank's crash (RanksFailed,
    as launch_local raises it when a rank dies: tests/runtime/test_faults.py) is 1, bad input the ranks found is 2."""
    from phalanx.errors import RanksFailed
    from phalanx.launch import local

    prompts = write_prompts(tmp_path / "prompts.jsonl")
    argv = generate_args(prompts, tmp_path / "o" / "traj_chat.jsonl", "--world_size", "2")
    for error, status in ((RanksFailed("failed on rank 1 (killed by SIGKILL)"), 1), (DataError("row 3: bad"), 2)):

        def launch(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(local, "launch_local", launch)
        code, log = run_in_process(argv, capsys)
        assert code == status and f"error: phalanx generate: {error}" in log, log


def test_an_adapter_that_does_not_fit_is_said_once_with_status_2_by_every_rank(tmp_path):
    """Two ranks, one batch: rank 0 finds the --adapter does not fit the model while rank 1, with no batch, would
    wait at the end (it crashed there with gloo's 'Connection closed by peer' and status 1). Every rank meets once
    after loading, so the job ends with the adapter's message, once, and status 2."""
    from peft import LoraConfig, get_peft_model

    from phalanx.models.load import load_model

    adapter = tmp_path / "adapter"
    get_peft_model(load_model(MODEL, torch.float32), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        adapter
    )
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(base_model_name_or_path=MODEL, target_modules=["no_such_proj"])
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    prompts = tmp_path / "q.txt"
    prompts.write_text("What is a calorie?\n")
    output = tmp_path / "o" / "t.jsonl"
    run = run_phalanx(
        "generate",
        "--adapter",
        str(adapter),
        "--prompts",
        str(prompts),
        "--max_new_tokens",
        "4",
        "--world_size",
        "2",
        "--output",
        str(output),
    )
    said = run.stdout + run.stderr
    assert run.returncode == 2, said[-3000:]
    assert said.count("could not be loaded onto embedded:tiny-qwen3: NoMatchingPeftModuleError") == 1, said[-3000:]
    assert "Traceback" not in said and "Connection closed" not in said
    assert not output.exists()


def test_bad_flags_and_foreign_or_changed_outputs(runs, tmp_path, capsys):
    root, prompts, _, _ = runs
    code, out = run_in_process(["generate", "--num_sequences_per_question", "0"], capsys)
    assert code == 2 and "--num_sequences_per_question must be at least 1" in out
    code, out = run_in_process(["generate", "--top_p", "0"], capsys)
    assert code == 2 and "--top_p must be in (0, 1]" in out
    for value in ("inf", "nan", "-1"):  # inf sampled uniformly and wrote "temperature": Infinity, not JSON
        code, out = run_in_process(["generate", "--temperature", value], capsys)
        assert code == 2 and "--temperature must be 0 (greedy) or a finite number above it" in out
    code, out = run_in_process(["generate", "--prompts", str(prompts), "--num_questions", "0"], capsys)
    assert code == 2 and "--num_questions must be at least 1" in out
    # Same output, another seed: refused, naming what changed; nothing is touched.
    before = {p.name: p.read_bytes() for p in (root / "w1").iterdir() if p.is_file() and p.suffix != ".lock"}
    code, out = run_in_process(generate_args(prompts, root / "w1" / "traj_chat.jsonl") + ["--seed", "8"], capsys)
    assert code == 2 and "other settings" in out and "'seed': 7" in out and "'seed': 8" in out
    assert {p.name: p.read_bytes() for p in (root / "w1").iterdir() if p.is_file() and p.suffix != ".lock"} == before
    # A file phalanx did not write is not replaced without --overwrite.
    mine = tmp_path / "mine.jsonl"
    mine.write_text("precious\n")
    code, out = run_in_process(["generate", "--prompts", str(prompts), "--output", str(mine)], capsys)
    assert code == 2 and "was not written by a phalanx generate run" in out and mine.read_text() == "precious\n"
    # Nor is one given as the validation file (the merge replaced it, after all the generation).
    fresh = tmp_path / "fresh" / "traj_chat.jsonl"
    code, out = run_in_process(generate_args(prompts, fresh, "--val_output", str(mine)), capsys)
    assert code == 2 and f"{mine} already exists and was not written" in out and mine.read_text() == "precious\n"
    assert not fresh.exists()


def test_model_without_chat_template_falls_back_to_plain_prompts(tmp_path, capsys):
    model = tmp_path / "no-template"
    shutil.copytree(resolve_model_path("embedded:tiny-qwen3"), model)
    (model / "chat_template.jinja").unlink()
    prompts = tmp_path / "q.txt"
    prompts.write_text("What is a calorie?\n")
    out = tmp_path / "plain.jsonl"
    code, log = run_in_process(
        [
            "generate",
            "--model_name",
            str(model),
            "--prompts",
            str(prompts),
            "--max_new_tokens",
            "4",
            "--num_sequences_per_question",
            "2",
            "--output",
            str(out),
        ],
        capsys,
    )
    assert code == 0, log
    assert "warning: the tokenizer of" in log and "has no chat template" in log
    rows = read_jsonl(out)
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"] and len(rows) == 2


def test_a_fixed_cache_a_model_cannot_take_is_refused_before_any_rank_starts(tmp_path, capsys):
    """--kv_cache fixed on a sliding-window model whose window the prompts and answers outgrow: refused from the
    config, before the ranks load weights (a rank with no batch used to wait at the end while the others failed);
    nothing is written. auto takes the growing cache."""
    model = tmp_path / "windowed"
    shutil.copytree(resolve_model_path("embedded:tiny-qwen3"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
    config["layer_types"] = ["sliding_attention"] * config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "q.txt"
    prompts.write_text("What is a calorie?\nAnd a joule?\n")
    args = ["generate", "--model_name", str(model), "--prompts", str(prompts), "--max_new_tokens", "4"]
    refused = tmp_path / "refused" / "t.jsonl"
    code, log = run_in_process([*args, "--kv_cache", "fixed", "--world_size", "2", "--output", str(refused)], capsys)
    assert code == 2 and "--kv_cache fixed: " in log and "sliding-window layers keep 8 positions" in log, log
    assert "use growing" in log and "rank" not in log and not refused.parent.exists()
    code, log = run_in_process([*args, "--output", str(tmp_path / "auto" / "t.jsonl")], capsys)
    assert code == 0 and "KV cache: fixed" not in log, log


class OomAbove(torch.nn.Module):
    """A forward pass with more than `limit` rows raises torch.cuda.OutOfMemoryError (there is no GPU here)."""

    def __init__(self, model, limit: int):
        super().__init__()
        self.inner, self.limit = model, limit
        self.config, self.generation_config = model.config, model.generation_config

    def forward(self, input_ids, **kwargs):
        if input_ids.shape[0] > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner(input_ids=input_ids, **kwargs)


def test_out_of_memory_halves_the_batch_reports_it_and_changes_no_record(runs, tmp_path, capsys, monkeypatch):
    import phalanx.generate.job as job

    root, prompts, _, _ = runs
    real = job.load_generation_model
    monkeypatch.setattr(job, "load_generation_model", lambda *a, **k: OomAbove(real(*a, **k), limit=3))
    out = tmp_path / "oom" / "traj_chat.jsonl"
    code, log = run_in_process(generate_args(prompts, out), capsys)
    assert code == 0, log
    assert "out of memory with 6 sequences per forward pass; retrying with 3" in log
    assert "rank 0: out of memory; batch size reduced from 6 to 3" in log
    assert out.read_bytes() == (root / "w1" / "traj_chat.jsonl").read_bytes()


def test_text_rows_are_continued_and_written_back_as_text(tmp_path, capsys):
    prompts = tmp_path / "t.jsonl"
    prompts.write_text(json.dumps({"text": "Dear diary,"}) + "\n" + json.dumps({"text": "Step one:"}) + "\n")
    out = tmp_path / "text.jsonl"
    code, log = run_in_process(
        ["generate", "--prompts", str(prompts), "--max_new_tokens", "6", "--val_fraction", "0", "--output", str(out)],
        capsys,
    )
    assert code == 0, log
    rows = read_jsonl(out)
    assert rows[0]["text"].startswith("Dear diary,") and rows[1]["text"].startswith("Step one:")
    assert all("messages" not in r for r in rows) and not (tmp_path / "text_val.jsonl").exists()


def test_a_template_variable_nothing_sets_is_named_before_generating(tmp_path, capsys):
    """A chat template that writes a variable nothing sets (GigaChat 3.5's current_date) renders every prompt with it
    empty, silently in jinja: the job says so, and says nothing once --chat_template_kwargs gives it."""
    template = tmp_path / "dated.jinja"
    template.write_text(
        "Today: {{ current_date }}\n{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    prompts = tmp_path / "q.txt"
    prompts.write_text("What is a calorie?\n")
    base = ["generate", "--prompts", str(prompts), "--max_new_tokens", "2", "--num_sequences_per_question", "1"]
    base += ["--chat_template", str(template)]
    code, log = run_in_process([*base, "--output", str(tmp_path / "a.jsonl")], capsys)
    assert code == 0, log
    assert "note: the chat template writes current_date into every prompt, and nothing sets it" in log
    code, log = run_in_process(
        [*base, "--output", str(tmp_path / "b.jsonl"), "--chat_template_kwargs", "{current_date: 2026-11-27}"], capsys
    )
    assert code == 0 and "writes current_date" not in log, log
