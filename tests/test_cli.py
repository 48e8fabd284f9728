"""`phalanx train` end to end with the seeds' flags, on 2 real gloo ranks: what it prints and what it leaves behind."""

import json

import pytest
import torch

from helpers import read_metrics, run_phalanx, write_chat_jsonl

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed000")
    data = write_chat_jsonl(root / "health-agent-dataset" / "train.jsonl", 39)  # odd: ranks get uneven shares
    out = root / "health-agent-distributed"
    # seed 000's documented command line, scaled down
    proc = run_phalanx(
        "train",
        "--model_name",
        "embedded:tiny-qwen3",
        "--dataset_path",
        str(data.parent),
        "--output_dir",
        str(out),
        "--num_epochs",
        "2",
        "--batch_size",
        "2",
        "--learning_rate",
        "5e-3",
        "--world_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--max_grad_norm",
        "1.0",
        "--lora_r",
        "8",
        "--lora_alpha",
        "16",
        "--lora_dropout",
        "0.1",
        "--eval_steps",
        "3",
        "--save_steps",
        "3",
        "--log_steps",
        "2",
        "--max_length",
        "768",
        "--save_total_limit",
        "2",
        "--test_size",
        "0.2",
        "--mixed_precision",
        "no",  # a choice YAML 1.1 would read as false
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, proc


def test_console_shows_configuration_evals_and_summary(seed_run):
    _, proc = seed_run
    out = proc.stdout
    for needle in (
        "World Size: 2",
        "Effective Batch Size: 8",
        "✅ Eval at step 3",
        "💾 New best model saved",
        "📊 Epoch 1 average loss",
        "🏁 Done",
        "peak memory per rank (MB): [",
    ):
        assert needle in out, needle
    # stdout is a pipe, as in a SLURM .out file: one plain progress line per logged step (log_steps 2), no redraws.
    assert "\r" not in out
    progress = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("step ")]
    assert progress == ["step 2/8 (25%)", "step 4/8 (50%)", "step 6/8 (75%)", "step 8/8 (100%)"], out[-3000:]
    assert "tok/s" in out and "left" in out
    assert json.loads((seed_run[0] / "training_info.json").read_text())["config"]["training"]["mixed_precision"] == "no"


def test_outputs_layout_and_training_info(seed_run):
    out, _ = seed_run
    # 31 train rows -> 16 per rank (one wrapped) / batch 2 = 8 micro-batches = 4 steps per epoch, 2 epochs
    info = json.loads((out / "training_info.json").read_text())
    final = json.loads((out / "final_training_info.json").read_text())
    for key in (
        "model_name",
        "dataset_name",
        "global_step",
        "best_eval_loss",
        "world_size",
        "batch_size",
        "effective_batch_size",
        "learning_rate",
        "epoch",
        "tokens_seen",
    ):
        assert key in info and key in final, key
    assert final["global_step"] == 8 and final["world_size"] == 2 and final["effective_batch_size"] == 8
    assert final["epoch"] == 2 and final["tokens_seen"] > 0
    assert len(final["peak_memory_mb_per_rank"]) == 2
    # save_steps 3 over 8 steps -> 3 and 6, both kept with limit 2; best kept apart
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-best"]
    for name in ("checkpoint-3", "checkpoint-best"):
        ckpt = out / name
        for f in (
            "adapter_model.safetensors",
            "adapter_config.json",
            "tokenizer_config.json",
            "optimizer.pt",
            "scheduler.pt",
            "rng_state_0.pt",
            "rng_state_1.pt",
            "trainer_state.json",
            "phalanx_checkpoint.json",
        ):
            assert (ckpt / f).is_file(), f"{name}/{f}"
    assert (out / "loss_curve.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    evals = read_metrics(out, "eval")
    assert [e["step"] for e in evals] == [3, 6, 8]
    assert final["best_eval_loss"] == pytest.approx(min(e["loss"] for e in evals))
    assert evals[-1]["loss"] < evals[0]["loss"]


def test_final_adapter_loads_with_peft(seed_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = seed_run
    config = json.loads((out / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    model = PeftModel.from_pretrained(base, str(out))
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    logits = model(**ids).logits
    assert logits.shape[-1] == base.config.vocab_size and torch.isfinite(logits).all()


def test_checkpoint_contents_load_back(seed_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from phalanx.checkpoint.io import load_checkpoint
    from phalanx.runtime.dist import RankInfo
    from phalanx.train.state import TrainerState

    out, _ = seed_run
    ckpt = out / "checkpoint-6"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]), str(out), is_trainable=True
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1.0)
    rank = RankInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("cpu"))
    state = load_checkpoint(ckpt, rank=rank, model=model, stateful={"optimizer": optimizer}, finetune="lora")
    assert state["global_step"] == 6 and state["sampler"]["world_size"] == 2
    trainer = TrainerState()
    trainer.load_state_dict(state)
    assert trainer.global_step == 6
    saved = load_file(ckpt / "adapter_model.safetensors")
    live = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(live) > 0
    for key, value in saved.items():
        match = [v for k, v in live.items() if k.replace(".default", "") == key]
        assert match and torch.equal(match[0], value), key
    assert optimizer.state_dict()["state"], "optimizer moments restored"
    assert optimizer.param_groups[0]["lr"] != 1.0, "scheduled learning rate restored"


def test_seed002_hub_style_dataset_name_and_separate_eval_file(tmp_path):
    """`--dataset_name` goes through datasets.load_dataset (a local dataset repository here), eval from its own file."""
    repo = tmp_path / "health-agent-dataset"
    write_chat_jsonl(repo / "data" / "train.jsonl", 16)
    eval_file = write_chat_jsonl(tmp_path / "val.jsonl", 6, start=100)
    out = tmp_path / "health-agent-distributed-hub"
    proc = run_phalanx(
        "train",
        "--world_size",
        "2",
        "--dataset_name",
        str(repo),
        "--eval_dataset_path",
        str(eval_file),
        "--output_dir",
        str(out),
        "--num_epochs",
        "1",
        "--batch_size",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--max_length",
        "768",
        "--learning_rate",
        "5e-3",
        "--logging.progress_bar",
        "false",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "16 train rows, 6 eval rows" in proc.stdout
    info = json.loads((out / "final_training_info.json").read_text())
    assert info["dataset_name"] == str(repo) and info["global_step"] == 2
    assert read_metrics(out, "eval")[-1]["tokens"] > 0
