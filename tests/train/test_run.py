"""The run's set-up and closing report (train.run)."""

import json
import shutil

import pytest

from helpers import read_metrics, tiny_run, write_chat_jsonl
from phalanx.config.flags import split_flags
from phalanx.config.loader import load_config, overrides_from_flags
from phalanx.config.schema import RunConfig
from phalanx.data.prepare import DataSource, source_digest
from phalanx.data.sampler import StatefulDistributedSampler
from phalanx.errors import ConfigError
from phalanx.runtime.signals import PreemptionFlag
from phalanx.train.command import train_worker
from phalanx.train.run import describe_dataset, describe_epochs, describe_eval
from phalanx.train.state import TrainerState


def test_the_closing_line_says_when_no_evaluation_ran():
    state = TrainerState()
    assert describe_eval(state) == "no evaluation (no eval rows: the data summary above says where they went)"
    state.last_eval_loss, state.best_eval_loss, state.best_step = 1.23456, 1.1, 4
    assert describe_eval(state) == "eval loss 1.2346 (best 1.1000 at step 4)"


def test_the_header_counts_the_epochs_max_steps_makes_not_num_epochs():
    """10 rows, 2 ranks x batch 2 x accumulation 2: 3 micro-batches per rank, 2 steps per epoch. Six steps are three
    epochs (the run prints "Epoch 3 average loss"); the header said "Epochs: 1.0"."""
    sampler = StatefulDistributedSampler(10, rank=0, world_size=2)
    cfg = RunConfig.model_validate({"training": {"batch_size": 2, "gradient_accumulation_steps": 2, "num_epochs": 1}})
    assert describe_epochs(cfg, sampler, 2) == "1.0 (2 optimizer steps)"
    cfg.training.max_steps = 6
    assert describe_epochs(cfg, sampler, 6) == (
        "3.00 (6 optimizer steps of 2 per epoch: max_steps sets them, num_epochs is not used)"
    )


def test_the_header_points_to_generated_records_that_a_run_without_a_dataset_leaves_out(tmp_path, monkeypatch):
    """Seed 001 runs generate_data.py then train_loop.py, which trained on data/traj_chat.jsonl; `phalanx train` with
    no dataset trains on the bundled chats, and said only that."""
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig()
    assert describe_dataset(cfg) == "bundled health-agent chats"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "traj_chat.jsonl").write_text("{}\n")
    (tmp_path / "data" / "traj_val.jsonl").write_text("{}\n")
    assert describe_dataset(cfg) == (
        "bundled health-agent chats (not data/traj_chat.jsonl, which `phalanx generate` wrote here: "
        "--dataset_path data/traj_chat.jsonl --eval_dataset_path data/traj_val.jsonl "
        "--output_dir data/results/traj_chat trains on it)"  # seed 001's results folder, as the launcher uses
    )
    cfg.output_dir = "runs/mine"  # an output folder the run names already stays
    assert describe_dataset(cfg).endswith("--eval_dataset_path data/traj_val.jsonl trains on it)")
    cfg.data.dataset_path = "mine.jsonl"
    assert describe_dataset(cfg) == "mine.jsonl"


def test_auto_compile_is_asked_with_the_runs_length_in_micro_batches(tmp_path, monkeypatch):
    """'auto' compile pays back its warm-up only in long runs (models/compile.py): the run asks with the micro-batches
    it will take per rank (optimizer steps x accumulation, or x the passes merged micro-batches make), whether the base
    is plain LoRA, whether the micro-batches are packed, and the strategy."""
    import phalanx.train.run as run_module
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.runtime.dist import shutdown

    asked = {}

    def record(setting, device, **kwargs):
        asked.update(setting=setting, device=device.type, **kwargs)
        return False

    monkeypatch.setattr(run_module, "compile_wanted", record)
    flags = ["--max_steps", "7", "--gradient_accumulation_steps", "3", "--test_size", "0"]
    flags += ["--logging.tensorboard", "false", "--max_length", "1024"]
    expected = {"setting": "auto", "device": "cpu", "plain_lora": True, "packed": True, "strategy": "ddp"}
    # Merged micro-batches (3 x 1,024 tokens in passes of 3,072): one pass per step, and the warm-up is paid per pass.
    for extra, passes in (([], 21), (["--training.merge_micro_batches", "true", "--training.merge_tokens", "3072"], 7)):
        out = ["--output_dir", str(tmp_path / f"out-{passes}")]
        run = run_module.build_run(load_config(None, overrides_from_flags(split_flags(flags + out + extra)[1])))
        del run
        shutdown()
        assert asked == {**expected, "micro_batches": passes}


def test_a_bf16_lora_run_keeps_adapter_casts_that_stay_equal_to_its_weights(tmp_path, monkeypatch):
    """A LoRA run under bf16 autocast, one process, eager (CUDA's default for short runs; forced onto CPU here, where
    the CLI refuses bf16) keeps every adapter's A and B in bf16 between steps (models/lora_fused.py KeptCasts): each
    fused layer holds the run's KeptCasts, and after every step the kept copies equal the bf16 casts of the weights
    the optimizer just wrote."""
    import torch

    import phalanx.train.run as run_module
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.models.lora_fused import KEPT_CASTS, _FusedForward
    from phalanx.parallel import Precision
    from phalanx.runtime.dist import shutdown
    from phalanx.train.loop import train_step

    monkeypatch.setattr(run_module.Precision, "choose", classmethod(lambda cls, *a: Precision(torch.bfloat16)))
    flags = ["--max_steps", "3", "--test_size", "0", "--logging.tensorboard", "false", "--max_length", "512"]
    flags += ["--training.compile", "false", "--output_dir", str(tmp_path / "out")]
    run = run_module.build_run(load_config(None, overrides_from_flags(split_flags(flags)[1])))
    try:
        layers = [m for m in run.model.modules() if isinstance(m, _FusedForward)]
        kept = {id(layer.__dict__[KEPT_CASTS]) for layer in layers}
        assert layers and len(kept) == 1
        steps = run.steps_of_epoch()
        for _ in range(2):
            train_step(run, next(steps))
            run.state.global_step += 1
            kept_casts = layers[0].__dict__[KEPT_CASTS]
            assert len(kept_casts._kept) == len(layers)  # every adapter ran with a kept copy
            for entry in kept_casts._kept.values():
                assert not entry.stale()
                for master, copy in zip(entry.masters, entry.copies):
                    assert copy.dtype == torch.bfloat16 and torch.equal(copy, master.detach().to(torch.bfloat16))
    finally:
        del run
        shutdown()


def test_liger_kernels_false_reaches_the_output_head(tmp_path):
    """`--training.liger_kernels false` keeps Liger's fused linear cross-entropy out of the run's output head too
    (train/loss.py: the head's chunks then always run phalanx's own path)."""
    import phalanx.train.run as run_module
    from phalanx.config.flags import split_flags
    from phalanx.config.loader import load_config, overrides_from_flags
    from phalanx.runtime.dist import shutdown

    flags = ["--max_steps", "1", "--test_size", "0", "--logging.tensorboard", "false", "--max_length", "512"]
    flags += ["--training.liger_kernels", "false", "--output_dir", str(tmp_path / "out")]
    run = run_module.build_run(load_config(None, overrides_from_flags(split_flags(flags)[1])))
    try:
        head = run.model.get_base_model().get_output_embeddings()
        assert head.phalanx_fused_head is False
    finally:
        del run
        shutdown()


def test_full_fine_tuning_saves_a_generation_config_that_stops_where_the_trained_turns_end(tmp_path):
    """A base model whose tokenizer and generation_config.json stop at <|endoftext|>, fine-tuned whole on ChatML rows
    that end every answer with <|im_end|>: the model it saves (checkpoints, best, final) lists <|im_end|> among its
    generation_config.json eos_token_id after <|endoftext|>, so it stops after an answer; the data summary says so."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from helpers import run_phalanx, write_chat_jsonl
    from phalanx.models.presets import materialize_embedded_model

    base = tmp_path / "base-model"
    shutil.copytree(materialize_embedded_model("tiny-qwen3", tmp_path / "embedded"), base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})  # id 260, inside the model's 264 embeddings
    tokenizer.save_pretrained(base)
    endoftext, im_end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((base / name).read_text())
        (base / name).write_text(json.dumps({**config, "eos_token_id": endoftext}))

    out = tmp_path / "out"
    proc = run_phalanx(
        "train",
        *("--model_name", str(base), "--finetune", "full", "--world_size", "1", "--output_dir", str(out)),
        *("--dataset_path", str(write_chat_jsonl(tmp_path / "rows.jsonl", 6)), "--test_size", "0.34"),
        *("--max_steps", "1", "--save_steps", "1", "--eval_steps", "1", "--logging.tensorboard", "false"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        f"end of turn '<|im_end|>' ({im_end}) is not a token this model stops at" in proc.stdout
        and f"the fine-tuned model's generation_config.json lists {im_end} too, so it stops there" in proc.stdout
    ), proc.stdout
    for folder in (out, out / "checkpoint-1", out / "checkpoint-best"):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert saved["eos_token_id"] == [endoftext, im_end], (folder, saved)


def config_of(flags: list[str]) -> RunConfig:
    return load_config(None, overrides_from_flags(split_flags(flags)[1]))


def test_a_resume_on_data_that_changed_since_its_checkpoint_is_refused_unless_forced(tmp_path, monkeypatch, capsys):
    """Rows appended to the training file between a crash and the rerun: the config names the same file, but the
    shuffled order and the train/eval split are new, so the saved data position would go on in another order. The
    rerun is refused with what changed and the way on, touching nothing; with --force it goes on and says so."""
    data = write_chat_jsonl(tmp_path / "train.jsonl", 24)
    out = tmp_path / "o"
    flags = tiny_run({"max_steps": 4, "save_steps": 2, "test_size": 0.25})
    flags += ["--dataset_path", str(data), "--output_dir", str(out), "--batch_size", "2"]
    monkeypatch.setenv("PHALANX_FAULT", "raise@step=3")
    with pytest.raises(RuntimeError, match="injected fault"):
        train_worker(config_of(flags), PreemptionFlag())
    monkeypatch.delenv("PHALANX_FAULT")
    saved = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["data_sources"]

    # The same file under another spelling of its path, or a copy elsewhere, holds the same rows.
    monkeypatch.chdir(tmp_path)
    shutil.copy(data, tmp_path / "copy.jsonl")
    for spelling in ("train.jsonl", str(data), "./copy.jsonl"):
        assert source_digest(DataSource.path(spelling).identity()) == saved["data.dataset_path"], spelling

    more = write_chat_jsonl(tmp_path / "more.jsonl", 8, start=24)
    data.write_text(data.read_text() + more.read_text())
    left = sorted(p.name for p in out.iterdir()), read_metrics(out)
    with pytest.raises(ConfigError) as refused:
        train_worker(config_of(flags), PreemptionFlag())
    assert (
        f"{out / 'checkpoint-2'} was trained on other data: data.dataset_path = {str(data)!r} holds other rows now "
        "than when it was saved"
    ) in str(refused.value)
    assert "Put the data back as it was, pass --force to go on with these rows anyway" in str(refused.value)
    assert (sorted(p.name for p in out.iterdir()), read_metrics(out)) == left, "a refused resume touches nothing"

    capsys.readouterr()
    assert train_worker(config_of(flags + ["--force"]), PreemptionFlag()) == 0
    said = capsys.readouterr().out
    assert f"data.dataset_path = {str(data)!r} holds other rows than when checkpoint-2 was saved (--force)" in said
    assert "checkpoint-2 at step 2" in said
    # Its own checkpoints record the rows it trained on: the next resume on them is a plain one.
    now = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["data_sources"]
    assert now.keys() == saved.keys() and now != saved


def test_a_resume_with_a_chat_template_edited_since_its_checkpoint_is_refused_unless_forced(
    tmp_path, monkeypatch, capsys
):
    """A --chat_template file edited between a crash and the rerun: the config names the same file, but the rows are
    rendered and masked otherwise from there. Refused as changed data is, naming the template; --force goes on."""
    from phalanx.models.load import load_tokenizer

    data = write_chat_jsonl(tmp_path / "train.jsonl", 12)
    template = tmp_path / "chat.jinja"
    template.write_text(load_tokenizer("embedded:tiny-qwen3").chat_template)
    out = tmp_path / "o"
    flags = tiny_run({"max_steps": 3, "save_steps": 1, "test_size": 0})
    flags += ["--dataset_path", str(data), "--output_dir", str(out), "--chat_template", str(template)]
    monkeypatch.setenv("PHALANX_FAULT", "raise@step=2")
    with pytest.raises(RuntimeError, match="injected fault"):
        train_worker(config_of(flags), PreemptionFlag())
    monkeypatch.delenv("PHALANX_FAULT")
    assert "data.chat_template" in json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["data_sources"]
    template.write_text(template.read_text().replace("<|im_start|>", "<|im_start|> "))
    with pytest.raises(ConfigError) as refused:
        train_worker(config_of(flags), PreemptionFlag())
    said = str(refused.value)
    assert f"was trained on other data: the chat template ({template}) writes other text now" in said, said
    assert "Put the template back as it was, pass --force to go on with it anyway" in said, said
    capsys.readouterr()
    assert train_worker(config_of(flags + ["--force"]), PreemptionFlag()) == 0
    assert f"the chat template ({template}) writes other text than when checkpoint-1 was saved (--force)" in (
        capsys.readouterr().out
    )


def test_a_resume_with_another_global_batch_trains_the_rest_of_its_epochs_once_and_none_past_its_end(
    tmp_path, monkeypatch, capsys
):
    """num_epochs 1 over 24 rows at 2 rows a step: 12 steps. Crashed in step 9 (checkpoint-8: 16 rows read) and
    resumed at 4 rows a step (--batch_size 4 --force; another world_size does the same), the run counted its steps
    from the start at the new batch (6), stopped at once and reported done with 8 rows never trained. The rest of
    the epoch is 8 rows, 2 steps: it ends at step 10 with every row trained once, and its schedule ends there."""
    data = write_chat_jsonl(tmp_path / "train.jsonl", 24)
    out = tmp_path / "o"
    flags = tiny_run({"max_steps": None, "num_epochs": 1, "save_steps": 2, "test_size": 0})
    flags += ["--dataset_path", str(data), "--output_dir", str(out), "--batch_size", "2"]
    monkeypatch.setenv("PHALANX_FAULT", "raise@step=9")
    with pytest.raises(RuntimeError, match="injected fault"):
        train_worker(config_of(flags), PreemptionFlag())
    monkeypatch.delenv("PHALANX_FAULT")
    rows = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())["sampler"]
    assert (rows["epoch"], rows["position"]) == (0, 16)  # the test's premise

    capsys.readouterr()
    assert train_worker(config_of(flags + ["--batch_size", "4", "--force"]), PreemptionFlag()) == 0
    said = capsys.readouterr().out
    assert "checkpoint-8 at step 8" in said and "the schedule now runs 10 steps" in said
    info = json.loads((out / "final_training_info.json").read_text())
    assert (info["global_step"], info["total_steps"], info["epoch"]) == (10, 10, 1)
    state = json.loads((out / "checkpoint-10" / "trainer_state.json").read_text())
    assert (state["sampler"]["epoch"], state["sampler"]["position"]) == (0, 24), "the epoch was read to its end"
    assert [r["step"] for r in read_metrics(out, "epoch")] == [10]

    # A checkpoint past the last step asked for leaves nothing to train: the run ended at once, 'Done: 10 steps', its
    # final model step 10's under a record of 6 steps. Refused with the checkpoint that ends where asked.
    left = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError) as refused:
        train_worker(config_of(flags + ["--batch_size", "4", "--max_steps", "6", "--force"]), PreemptionFlag())
    assert (
        f"{out / 'checkpoint-10'} is at step 10, past this run's last step 6 (training.max_steps): nothing is left to "
        f"train, and the final model would be step 10's. --resume_from_checkpoint {out / 'checkpoint-6'} ends it with "
        "step 6's model"
    ) in str(refused.value)
    assert sorted(p.name for p in out.iterdir()) == left
