"""Exact resume: SIGKILL every rank mid-step, rerun, and every later loss is bit-identical (DDP, CPU, fp32)."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import read_metrics, run_phalanx, stopped_after, tiny_run, write_chat_jsonl

pytestmark = pytest.mark.distributed

# lora dropout stays on: identical losses after a resume prove the RNG state came back too.
COMMON = tiny_run(
    {
        "max_steps": 8,
        "save_steps": 2,
        "eval_steps": 4,
        "test_size": 0.2,
        "lora_dropout": 0.1,
        "batch_size": 2,
        "logging.tensorboard": None,
    }
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("resume") / "train.jsonl", 30)


def train(dataset: Path, out: Path, *extra: str, world: int = 2, fault: str | None = None):
    env = {"PHALANX_FAULT": fault} if fault else None
    return run_phalanx(
        "train",
        "--dataset_path",
        str(dataset),
        "--output_dir",
        str(out),
        "--world_size",
        str(world),
        *COMMON,
        *extra,
        env=env,
    )


@pytest.fixture(scope="module")
def uninterrupted(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    proc = train(dataset, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def killed(dataset, tmp_path_factory):
    """A run whose every rank is SIGKILLed in the middle of step 5 (after forward, before the update). It passes
    --resume_from_checkpoint latest, as a requeue script does every time; its first start says there is none yet."""
    out = tmp_path_factory.mktemp("killed")
    proc = train(dataset, out, "--resume_from_checkpoint", "latest", fault="kill@step=5")
    assert proc.returncode != 0 and "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert f"{out} holds no committed checkpoint yet; starting at step 0" in proc.stdout, proc.stdout[-3000:]
    return out


def test_resume_after_sigkill_is_bit_identical(dataset, uninterrupted, killed, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    proc = train(dataset, out)  # the same command again: resumes from the newest committed checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Resuming from" in proc.stdout and "checkpoint-4 at step 4" in proc.stdout
    reference = [r["loss"] for r in read_metrics(uninterrupted)]
    resumed = [r["loss"] for r in read_metrics(out)]
    assert resumed == reference  # bit-identical: exact float equality, steps 1-4 from before, 5-8 after the kill
    assert [r["loss"] for r in read_metrics(out, "eval")] == [r["loss"] for r in read_metrics(uninterrupted, "eval")]
    # 24 train rows / 2 ranks / batch 2 = 6 steps per epoch: the epoch mean at step 6 covers steps 1-6, not 5-6.
    epochs = read_metrics(out, "epoch")
    assert [(r["step"], r["loss"]) for r in epochs] == [
        (r["step"], r["loss"]) for r in read_metrics(uninterrupted, "epoch")
    ]
    assert [r["step"] for r in epochs] == [6]
    final = json.loads((out / "final_training_info.json").read_text())
    ref = json.loads((uninterrupted / "final_training_info.json").read_text())
    for key in ("global_step", "tokens_seen", "best_eval_loss", "best_step", "epoch"):
        assert final[key] == ref[key], key


@pytest.fixture(scope="module")
def forced_on_one_rank(dataset, killed, tmp_path_factory):
    """The killed run resumed on one rank with batch 4 (the same global batch) and another learning rate, with
    --force: one launch shared by the 2 -> 1 ranks test and the changed-config test (a resume with a changed
    config is what --force allows, and a batch_size change is one)."""
    out = tmp_path_factory.mktemp("forced") / "run"
    shutil.copytree(killed, out)
    proc = train(dataset, out, "--batch_size", "4", "--learning_rate", "3e-2", "--force", world=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_resume_on_one_rank_continues_the_same_data(forced_on_one_rank):
    """2 -> 1 ranks: the global data position carries over; the one rank reads the rows both would have read."""
    out, proc = forced_on_one_rank
    assert "checkpoint-4 at step 4" in proc.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["sampler"]["world_size"] == 1 and state["tokens_seen"] > 0
    assert "world_size 2 -> 1" not in proc.stdout, "batch 4 on 1 rank keeps the global batch: nothing to say"


def test_a_resume_on_fewer_ranks_says_that_each_step_trains_fewer_rows(dataset, killed, tmp_path):
    """world_size may change on a resume without --force, but batch_size is per rank: the killed 2-rank run resumed
    on 1 rank with the same command trains 2 rows a step instead of 4. Accepted, and said, with the way back."""
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    proc = train(dataset, out, world=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "world_size 2 -> 1: each optimizer step now trains 2 rows (batch_size 2 x 1 ranks x gradient_accumulation_steps"
        " 1), where the checkpoint's run trained 4; --batch_size 4 or --gradient_accumulation_steps 2 (with --force)"
        " keeps it"
    ) in proc.stdout, proc.stdout[-3000:]
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 9))


def test_changed_config_is_shown_and_refused_unless_forced(dataset, killed, forced_on_one_rank, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    proc = train(dataset, out, "--learning_rate", "3e-2")
    assert proc.returncode == 2
    assert (
        "different config" in proc.stderr
        and "training.learning_rate: 0.01 -> 0.03" in proc.stderr
        and "--force" in proc.stderr
    )
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4], "a refused resume touches nothing"
    forced_out, forced = forced_on_one_rank  # the same change, with --force
    assert forced.returncode == 0 and "checkpoint-4 at step 4" in forced.stdout
    info = json.loads((forced_out / "final_training_info.json").read_text())
    assert info["config"]["training"]["learning_rate"] == 3e-2, "the resumed run trained with the new value"


def test_speed_and_cadence_change_on_resume_without_force(dataset, uninterrupted, killed, tmp_path):
    """The killed run resumed with PEFT's own LoRA forward, a loader worker per rank, merged micro-batches off, and
    saves and evaluations at another cadence: no --force, a line that names each change, the same losses (to
    rounding) and checkpoints at the new cadence from the resumed step on."""
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    changes = ("--lora.kernel", "peft", "--training.loader_workers", "1", "--save_steps", "3", "--eval_steps", "2")
    changes += ("--gradient_checkpointing", "--shutdown_timeout_s", "900")  # for a resume out of memory, or of time
    proc = train(dataset, out, *changes, "--training.merge_micro_batches", "false", "--checkpoint.save_best", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-4 at step 4" in proc.stdout
    line = next(s for s in proc.stdout.splitlines() if "speed or save/eval cadence only" in s)
    for change in (
        "lora.kernel: 'fused' -> 'peft'",
        "training.loader_workers: None -> 1",
        "checkpoint.save_steps: 2 -> 3",
        "eval.eval_steps: 4 -> 2",
        "training.merge_micro_batches: 'auto' -> 'false'",
        "checkpoint.save_best: True -> False",
        "model.gradient_checkpointing: False -> True",
    ):
        assert change in line, line
    assert "from step 4 on" in line
    assert f"note: {out / 'checkpoint-best'} (step 4) stays as it is" in proc.stdout
    assert json.loads((out / "checkpoint-best" / "trainer_state.json").read_text())["global_step"] == 4
    reference = [r["loss"] for r in read_metrics(uninterrupted)]
    resumed = [r["loss"] for r in read_metrics(out)]
    # PEFT's forward draws the same masks, and an evaluation (now at step 6 too) draws nothing from the training RNG
    # (its loader has its own generator; with the global one, step 7's loss moved by 0.07). Each change alone leaves
    # the losses bit-identical; together they differ in the last bits (4e-7).
    assert len(resumed) == 8 and max(abs(a - b) for a, b in zip(resumed, reference)) < 1e-5, (resumed, reference)
    assert [r["step"] for r in read_metrics(out, "eval")] == [4, 6, 8]
    assert sorted(p.name for p in out.glob("checkpoint-[0-9]*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    info = json.loads((out / "final_training_info.json").read_text())
    assert info["config"]["checkpoint"]["save_steps"] == 3 and info["config"]["lora"]["kernel"] == "peft"


def test_only_speed_and_cadence_fields_are_free_on_resume():
    from phalanx.checkpoint.resume import config_diff, speed_and_cadence_changes

    saved = {"training": {"compile": "auto", "learning_rate": 1e-4}, "checkpoint": {"save_steps": 50}}
    faster = {"training": {"compile": "true", "learning_rate": 1e-4}, "checkpoint": {"save_steps": 10}}
    assert config_diff(saved, faster) == []
    assert speed_and_cadence_changes(saved, faster) == [
        "checkpoint.save_steps: 50 -> 10",
        "training.compile: 'auto' -> 'true'",
    ]
    other = {"training": {"compile": "true", "learning_rate": 2e-4}, "checkpoint": {"save_steps": 50}}
    assert config_diff(saved, other) == ["training.learning_rate: 0.0001 -> 0.0002"]
    assert speed_and_cadence_changes(saved, other) == ["training.compile: 'auto' -> 'true'"]


def test_the_way_back_to_the_global_batch_is_one_the_config_accepts():
    """A token budget must hold max_length: 2 ranks of 1,400 tokens resumed on 1 rank are kept by 2,800 tokens or
    2 micro-batches a step; 1 rank of 1,400 on 2 ranks by no budget (700 is less than max_length 1,024), which was
    what the line advised."""
    from phalanx.checkpoint.resume import global_batch_change
    from phalanx.config.schema import RunConfig

    budget = RunConfig(training={"batch_tokens": 1400}, data={"max_length": 1024}).model_dump()
    fewer = global_batch_change(budget, 2, budget, 1)
    assert fewer.endswith("--batch_tokens 2800 or --gradient_accumulation_steps 2 (with --force) keeps it"), fewer
    more = global_batch_change(budget, 1, budget, 2)
    assert "--batch_tokens 700" not in more and more.endswith("at 1,400 (--force) to keep it"), more


def test_named_checkpoint_and_finished_run(dataset, uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    proc = train(dataset, out)  # the same command again (a requeue after the run had finished): nothing to do
    assert proc.returncode == 0 and "holds a finished run with this config" in proc.stderr, proc.stderr[-2000:]
    assert "note: " in proc.stderr and "nothing to do" in proc.stderr and "error" not in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before, "nothing was written"
    proc = train(dataset, out, "--learning_rate", "3e-2")  # another config: still refused
    assert proc.returncode == 2 and "different config" in proc.stderr
    proc = train(dataset, out, "--resume_from_checkpoint", str(out / "checkpoint-6"), "--max_steps", "7", "--force")
    assert proc.returncode == 0 and "checkpoint-6 at step 6" in proc.stdout
    assert json.loads((out / "final_training_info.json").read_text())["global_step"] == 7


def test_elastic_restart_resumes_and_finishes_like_an_uninterrupted_run(dataset, uninterrupted, tmp_path):
    """--max_restarts 1: rank 1 is SIGKILLed mid step 5; the agent restarts both ranks, which resume from checkpoint-4."""
    out = tmp_path / "run"
    proc = train(dataset, out, "--max_restarts", "1", fault="kill@step=5,rank=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-4 at step 4" in proc.stdout
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(uninterrupted)]


def test_checkpoint_of_another_adapter_shape_is_refused_with_names(dataset, killed, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    proc = train(dataset, out, "--lora_r", "8", "--force")
    assert proc.returncode != 0
    assert "lora_A" in proc.stderr and "shape" in proc.stderr and "[4," in proc.stderr and "[8," in proc.stderr, (
        proc.stderr[-2000:]
    )


def test_kill_before_the_first_checkpoint_starts_over_and_keeps_the_crashed_logs(dataset, tmp_path, capsys):
    """Killed in step 3 with no checkpoint yet: the same command again (a SLURM requeue) starts over from step 0 and
    moves the crashed run's logs aside; another config, or the finished run, is still refused."""
    from phalanx.checkpoint.resume import resume_point
    from phalanx.cli import main
    from phalanx.config.loader import load_config

    out = tmp_path / "run"
    no_saves = ("--save_steps", "100", "--max_steps", "4")
    proc = train(dataset, out, *no_saves, fault="kill@step=3")
    assert proc.returncode != 0 and "killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2] and not list(out.glob("checkpoint-*"))
    flags = ["train", "--dataset_path", str(dataset), "--output_dir", str(out), "--world_size", "2", *COMMON, *no_saves]
    before = sorted(p.name for p in out.iterdir())
    assert main([*flags, "--learning_rate", "3e-2"]) == 2  # refused before any rank starts
    err = capsys.readouterr().err
    assert "stopped before its first checkpoint" in err and "training.learning_rate: 0.01 -> 0.03" in err, err
    assert sorted(p.name for p in out.iterdir()) == before, "a refused start touches nothing"
    assert (
        resume_point(
            load_config(None, {"output_dir": str(tmp_path / "empty"), "checkpoint.resume_from_checkpoint": "latest"})
        )
        is None
    )

    proc = train(dataset, out, *no_saves)  # the same command again
    assert proc.returncode == 0, proc.stderr[-3000:]
    restarts = [line for line in proc.stdout.splitlines() if "starting over from step 0" in line]
    assert len(restarts) == 1 and "last logged step 2" in restarts[0], proc.stdout[-3000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    (aside,) = out.glob("crashed-*")
    assert str(aside) in restarts[0]
    assert [r["step"] for r in read_metrics(aside)] == [1, 2] and list(
        (aside / "tensorboard").glob("events.out.tfevents.*")
    )
    assert json.loads((aside / "training_info.json").read_text())["config"]["checkpoint"]["save_steps"] == 100

    for extra in ([], ["--resume_from_checkpoint", "latest"]):  # a finished run without checkpoint-N
        assert main([*flags, *extra]) == 0  # the same command: nothing to do (a requeue ends cleanly)
        assert "holds a finished run with this config" in capsys.readouterr().err
    assert main([*flags, "--learning_rate", "3e-2"]) == 2  # another config is refused
    assert "holds a finished run" in capsys.readouterr().err


def test_a_log_line_that_spans_the_resume_averages_every_step_it_covers(dataset, tmp_path, capsys):
    """log_steps 3 with checkpoints every 2 steps: stopped after checkpoint-4, resumed from it, the line at step 6
    still averages steps 4-6 (step 4's loss came back with the checkpoint), as the uninterrupted run's does. The
    stopped run is the uninterrupted one's folder cut back to checkpoint-4 (helpers.stopped_after): the kill itself
    is the subject of test_resume_after_sigkill_is_bit_identical. In process, one rank: what is tested is the
    metrics' bookkeeping across a resume, which launched ranks do not change."""
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.runtime.signals import PreemptionFlag
    from phalanx.train.command import train_worker

    def run(out: Path) -> str:
        flags = ["--dataset_path", str(dataset), "--output_dir", str(out), *COMMON, "--log_steps", "3"]
        capsys.readouterr()
        assert train_worker(load_config(None, overrides_from_flags(split_flags(flags)[1])), PreemptionFlag()) == 0
        return capsys.readouterr().out

    reference = tmp_path / "reference"
    run(reference)
    assert [r["step"] for r in read_metrics(reference)] == [3, 6, 8]
    out = stopped_after(reference, 4, tmp_path / "run")
    said = run(out)
    assert "checkpoint-4 at step 4" in said, said[-3000:]
    assert [(r["step"], r["loss"]) for r in read_metrics(out)] == [
        (r["step"], r["loss"]) for r in read_metrics(reference)
    ]


def test_a_damaged_file_in_the_newest_checkpoint_is_named_with_the_way_on(dataset, killed, tmp_path):
    """A committed checkpoint whose file was truncated later (a disk fault, a copy cut short): every rank stops with
    the file's name and how to resume from an earlier checkpoint, not a traceback from torch's zip reader."""
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    path = out / "checkpoint-4" / "optimizer.pt"
    path.write_bytes(path.read_bytes()[:100])
    proc = train(dataset, out)
    # Found alike by both ranks: said once, with the status of refused input (a rerun repeats it), not a crash's 1.
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count(f"{path} cannot be read") == 1 and "--resume_from_checkpoint" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (out / "checkpoint-2" / "phalanx_checkpoint.json").is_file()


@pytest.mark.parametrize(
    "damaged", ["adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_0.pt", "trainer_state.json"]
)
def test_every_file_a_resume_reads_is_named_when_damaged(killed, tmp_path, damaged):
    """Each kind of file in checkpoint-N (safetensors, a torch zip, JSON), truncated: load_checkpoint names it and the
    way on. In-process, the rank side of the launched test above (which proves every rank stops on it)."""
    import torch

    from phalanx.checkpoint.io import load_checkpoint
    from phalanx.config.schema import EMBEDDED_MODEL, LoraConfig, ModelConfig
    from phalanx.errors import PhalanxError
    from phalanx.models.adapters import apply_finetuning
    from phalanx.models.load import load_model
    from phalanx.runtime.dist import RankInfo

    class Taker:  # a stateful object that takes any state: the subject is reading the file, not its content
        def load_state_dict(self, state: dict) -> None:
            assert isinstance(state, dict)

    folder = tmp_path / "checkpoint-4"
    shutil.copytree(killed / "checkpoint-4", folder)
    path = folder / damaged
    path.write_bytes(path.read_bytes()[:100])
    model = apply_finetuning(load_model(EMBEDDED_MODEL, torch.float32), ModelConfig(), LoraConfig(r=4))
    rank = RankInfo(rank=0, world_size=2, local_rank=0, local_world_size=2, device=torch.device("cpu"))
    stateful = {name: Taker() for name in ("optimizer", "scheduler", "precision")}
    with pytest.raises(PhalanxError) as err:
        load_checkpoint(folder, rank=rank, model=model, stateful=stateful, finetune="lora")
    assert f"{path} cannot be read" in str(err.value) and f"--resume_from_checkpoint {tmp_path}/checkpoint-N" in str(
        err.value
    )


def test_a_folder_with_model_files_and_no_run_is_refused_before_the_final_save_replaces_them(tmp_path):
    """output_dir = the base model's folder, or a folder with the user's README.md: refused at the start (the final
    save would write over them), allowed with --overwrite_output_dir; files no save writes (a config.yaml) are fine."""
    from phalanx.checkpoint.resume import resume_point
    from phalanx.config.loader import load_config
    from phalanx.errors import ConfigError

    out = tmp_path / "model"
    out.mkdir()
    (out / "README.md").write_text("my notes\n")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"")
    (out / "run.yaml").write_text("output_dir: .\n")
    with pytest.raises(ConfigError) as err:
        resume_point(load_config(None, {"output_dir": str(out)}))
    message = str(err.value)
    assert f"output_dir {out} holds files of a model folder that the final save would replace" in message
    assert "(README.md, model-00001-of-00002.safetensors)" in message and "--overwrite_output_dir" in message
    assert resume_point(load_config(None, {"output_dir": str(out), "overwrite_output_dir": True})) is None
    (out / "README.md").unlink()
    (out / "model-00001-of-00002.safetensors").unlink()
    assert resume_point(load_config(None, {"output_dir": str(out)})) is None
    assert (out / "run.yaml").is_file()


@pytest.mark.parametrize("field", ["dataset_path", "eval_dataset_path", "dataset_name"])
def test_an_output_dir_that_is_the_data_folder_is_refused(tmp_path, monkeypatch, field):
    """--dataset_path ./data --output_dir ./data (any spelling of it): the run's metrics.jsonl would be read as rows
    by the next run or a resume, which then stops on it; refused before anything is written. A folder inside the
    data folder is not read with it (its top-level *.jsonl only) and stays allowed."""
    from phalanx.checkpoint.resume import resume_point
    from phalanx.config.loader import load_config
    from phalanx.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    write_chat_jsonl(tmp_path / "data" / "train.jsonl", 2)
    data = {f"data.{field}": "./data"}
    with pytest.raises(ConfigError) as err:
        resume_point(load_config(None, {**data, "output_dir": str(tmp_path / "data"), "overwrite_output_dir": True}))
    assert f"is the folder data.{field} = './data' reads" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.jsonl"]
    assert resume_point(load_config(None, {**data, "output_dir": "data/run"})) is None


def test_two_spellings_of_one_path_are_no_config_change(tmp_path, monkeypatch):
    """`data/train.jsonl` when the run started, its absolute path on the rerun (or the other way): the same file, so
    the resume goes on without --force. A path that names another file, or none, is still a change."""
    from phalanx.checkpoint.resume import config_diff

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    (tmp_path / "data" / "other.jsonl").write_text("{}\n")
    saved = {"data": {"dataset_path": "data/train.jsonl"}}
    assert config_diff(saved, {"data": {"dataset_path": str(tmp_path / "data" / "train.jsonl")}}) == []
    assert config_diff(saved, {"data": {"dataset_path": "./data/../data/train.jsonl"}}) == []
    assert config_diff(saved, {"data": {"dataset_path": "data/other.jsonl"}}) == [
        "data.dataset_path: 'data/train.jsonl' -> 'data/other.jsonl'"
    ]
    assert config_diff({"model": {"model_name": "org/a"}}, {"model": {"model_name": "./org/a"}}) != []


def test_a_run_killed_in_its_final_save_starts_over_with_what_it_wrote_set_aside(tmp_path, monkeypatch):
    """SIGKILL while the final save moves the model's files into output_dir, in a run with no checkpoint-N (save_steps
    beyond max_steps): adapter_model.safetensors is there, adapter_config.json still in .final.staging, and no
    final_training_info.json, the record written after the model. The run did not finish: the same command, or a
    requeue, starts over with the half-moved model set aside with the logs (it was 'a finished run' and refused, a
    dead end for a requeue). With final_training_info.json it is finished: nothing to do."""
    from phalanx.checkpoint.resume import RUN_RECORD, resume_point, set_aside_crashed_run
    from phalanx.config.loader import load_config
    from phalanx.errors import NothingToDo

    out = tmp_path / "run"
    cfg = load_config(None, {"output_dir": str(out), "checkpoint.save_steps": 100})
    staging = out / ".final.staging"
    staging.mkdir(parents=True)
    (out / RUN_RECORD).write_text(json.dumps({"config": cfg.model_dump()}))
    (out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 5, "loss": 1.0}) + "\n")
    (out / "adapter_model.safetensors").write_bytes(b"weights")
    (staging / "adapter_config.json").write_text("{}")
    for requeued in ("0", "1"):
        monkeypatch.setenv("SLURM_RESTART_COUNT", requeued)
        assert resume_point(cfg) is None
    aside = set_aside_crashed_run(out)
    assert sorted(p.name for p in out.iterdir()) == [aside.name]
    assert (aside / "adapter_model.safetensors").read_bytes() == b"weights"
    assert (aside / ".final.staging" / "adapter_config.json").is_file() and (aside / RUN_RECORD).is_file()

    for name, text in ((RUN_RECORD, json.dumps({"config": cfg.model_dump()})), ("final_training_info.json", "{}")):
        (out / name).write_text(text)
    with pytest.raises(NothingToDo) as err:  # finished, with this config: nothing to do (exit 0, writes nothing)
        resume_point(cfg)
    assert "holds a finished run with this config (final_training_info.json)" in str(err.value)


def test_a_best_replacement_cut_short_before_the_first_checkpoint_sets_aside_the_committed_best(tmp_path):
    """Killed while checkpoint-best was replaced (step 4's best renamed in, its marker not yet written; step 2's
    committed best waiting as .checkpoint-best.retired) and before any checkpoint-N: the run starts over, and what
    moves to crashed-<time> is the committed best of step 2, not the unmarked copy. Before, the committed one stayed
    in output_dir, where the new run's first best save put it back and replaced it (or, under --force with another
    config, a resume kept it as the new run's best)."""
    from phalanx.checkpoint.commit import commit, fresh_staging_dir, is_committed
    from phalanx.checkpoint.resume import RUN_RECORD, set_aside_crashed_run

    out = tmp_path / "run"
    best = out / "checkpoint-best"
    staging = fresh_staging_dir(best)
    (staging / "weights").write_text("step 2")
    commit(staging, best, {"global_step": 2})
    best.rename(out / ".checkpoint-best.retired")
    best.mkdir()
    (best / "weights").write_text("step 4, unmarked")
    (out / RUN_RECORD).write_text("{}")
    aside = set_aside_crashed_run(out)
    assert sorted(p.name for p in out.iterdir()) == [aside.name]
    assert is_committed(aside / "checkpoint-best") and (aside / "checkpoint-best" / "weights").read_text() == "step 2"


def test_overwrite_cut_short_leaves_no_committed_checkpoint_with_files_missing(tmp_path, monkeypatch):
    """--overwrite_output_dir deletes the earlier run; killed while it deleted (one file of a checkpoint gone, here
    simulated by a delete that stops after one file), no checkpoint may still carry its marker: a later run without
    the flag (a requeue with --resume_from_checkpoint latest) would resume from it and stop on the missing file. The
    committed best a cut-short replacement left beside checkpoint-best goes too, not restored later as the new best."""
    from phalanx.checkpoint.commit import commit, committed_step_checkpoints, fresh_staging_dir, is_committed
    from phalanx.train import run as train_run

    out = tmp_path / "run"
    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-best"):
        staging = fresh_staging_dir(out / name)
        for part in ("adapter_model.safetensors", "optimizer.pt", "trainer_state.json"):
            (staging / part).write_text(part)
        commit(staging, out / name, {"global_step": 2})
    (out / "checkpoint-best").rename(out / ".checkpoint-best.retired")
    (out / "training_info.json").write_text("{}")

    def killed_after_one_file(path, *args, **kwargs):
        next(p for p in sorted(path.iterdir()) if p.name != "phalanx_checkpoint.json").unlink()
        raise KeyboardInterrupt  # the kill

    monkeypatch.setattr(train_run.shutil, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        train_run.clear_previous_run(out)
    assert committed_step_checkpoints(out) == [] and not is_committed(out / "checkpoint-best")
    assert not (out / ".checkpoint-best.retired").exists()
    monkeypatch.undo()
    train_run.clear_previous_run(out)  # the same command again finishes the job
    assert sorted(p.name for p in out.iterdir()) == []
