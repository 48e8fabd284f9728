"""Kill the writer at random moments while it saves, 24 times: the newest committed checkpoint always loads.

The writer is a forked process running the real save path (safetensors weights, optimizer,
RNG, trainer state, staging -> rename -> marker, retention) in a loop; the parent SIGKILLs
it at a random time, then loads the newest committed checkpoint and takes a training step.
"""

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from phalanx.checkpoint.commit import STEP_DIR, apply_retention, committed_step_checkpoints
from phalanx.checkpoint.io import load_checkpoint, save_checkpoint
from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.models.adapters import apply_finetuning
from phalanx.models.load import load_model, load_tokenizer
from phalanx.runtime.dist import RankInfo

RANK = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
TRIALS = 24


def make_model():
    torch.manual_seed(0)
    model = apply_finetuning(load_model("embedded:tiny-qwen3", torch.float32), ModelConfig(), LoraConfig(r=4))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optimizer


def one_step(model, optimizer) -> float:
    ids = torch.randint(3, 250, (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def writer(out: Path, start_step: int, ready) -> None:
    torch.set_num_threads(1)
    model, optimizer = make_model()
    tokenizer = load_tokenizer("embedded:tiny-qwen3")
    if start_step:
        load_checkpoint(
            out / f"checkpoint-{start_step}", rank=RANK, model=model, stateful={"optimizer": optimizer}, finetune="lora"
        )
    ready.set()
    step = start_step
    while True:
        one_step(model, optimizer)
        step += 1
        save_checkpoint(
            out / f"checkpoint-{step}",
            rank=RANK,
            model=model,
            tokenizer=tokenizer,
            stateful={"optimizer": optimizer},
            trainer_state={"global_step": step, "config": {}},
        )
        apply_retention(out, 2, keep=set())


@pytest.mark.system
def test_random_kills_during_saves_never_lose_the_newest_committed_checkpoint(tmp_path):
    load_tokenizer("embedded:tiny-qwen3")  # build the embedded model once, outside the timed trials
    ctx = mp.get_context("fork")
    rng = random.Random(20261122)
    out = tmp_path / "run"
    out.mkdir()
    newest = 0
    for trial in range(TRIALS):
        ready = ctx.Event()
        child = ctx.Process(target=writer, args=(out, newest, ready))
        child.start()
        assert ready.wait(120), "the writer did not start"
        time.sleep(rng.uniform(0.0, 0.8))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        committed = committed_step_checkpoints(out)
        if not committed and newest == 0:
            continue  # killed before its first commit (a loaded machine): there was nothing to lose yet
        assert committed, f"trial {trial}: no committed checkpoint left"
        step, folder = committed[-1]
        assert step >= newest, f"trial {trial}: the newest committed checkpoint went backwards"
        assert len(committed) <= 3, "retention kept its bound"
        model, optimizer = make_model()
        state = load_checkpoint(folder, rank=RANK, model=model, stateful={"optimizer": optimizer}, finetune="lora")
        assert state["global_step"] == step
        assert torch.isfinite(torch.tensor(one_step(model, optimizer))), "training continues from it"
        newest = step
        # Uncommitted leftovers (a staging folder, an unmarked checkpoint-N) may exist; none is ever trusted.
        for child_dir in out.iterdir():
            match = STEP_DIR.fullmatch(child_dir.name)
            if match and int(match.group(1)) > step:
                assert not (child_dir / "phalanx_checkpoint.json").exists()
    assert newest > TRIALS // 2, f"saves progressed across trials (newest step {newest})"
