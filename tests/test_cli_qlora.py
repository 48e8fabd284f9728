"""`phalanx train --load_in_4bit` (QLoRA) on 2 real gloo ranks: it trains, the adapter it saves is complete and
reproduces the run on a fresh 4-bit base, resume continues exactly, FSDP2 and ZeRO-3 train the same way as DDP,
and a combination that cannot work is refused before any rank starts."""

import contextlib
import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import read_metrics, run_phalanx, tiny_run, write_chat_jsonl

pytestmark = pytest.mark.distributed

QLORA = ["--load_in_4bit", "--bnb_4bit_quant_type", "nf4", "--bnb_4bit_use_double_quant", "true"]
# 24 rows -> 18 train, 6 eval; 2 ranks x batch 2 -> 4 steps fit in one epoch.
COMMON = (
    tiny_run({"world_size": 2, "batch_size": 2, "max_steps": 4, "save_steps": 2, "eval_steps": 2, "test_size": 0.25})
    + QLORA
)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("qlora") / "train.jsonl", 24)


def train(dataset: Path, out: Path, *extra: str):
    proc = run_phalanx("train", "--dataset_path", str(dataset), "--output_dir", str(out), *COMMON, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def ddp_run(dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("qlora-ddp")
    return out, train(dataset, out)


def losses(out: Path, kind: str = "train") -> list[float]:
    return [r["loss"] for r in read_metrics(out, kind)]


def lora_tensors(model) -> dict:
    """The live adapter, under the names save_pretrained writes."""
    return {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}


def test_qlora_ddp_trains_the_adapter_and_checkpoints_only_it(ddp_run):
    out, proc = ddp_run
    assert "lora on a 4-bit nf4 double-quantized base computing in fp32;" in proc.stdout
    assert "World Size: 2 (ddp" in proc.stdout
    train_losses, eval_losses = losses(out), losses(out, "eval")
    assert len(train_losses) == 4 and train_losses[-1] < train_losses[0]
    assert len(eval_losses) == 2 and eval_losses[-1] < eval_losses[0]
    adapter = load_file(out / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items()), "adapter left at zero"
    ckpt = out / "checkpoint-2"
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").is_file()
    saved = load_file(ckpt / "adapter_model.safetensors")
    assert saved.keys() == adapter.keys() and all("lora_" in k for k in saved)  # no 4-bit base weights
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(saved)  # moments for the adapter only


def test_saved_adapter_loads_on_a_4bit_and_a_plain_base_and_reproduces_the_run(ddp_run):
    from peft import PeftModel
    from torch.utils.data import DataLoader

    from phalanx.config.schema import RunConfig
    from phalanx.data.collate import pad_batch
    from phalanx.models.load import load_model, quantization_config
    from phalanx.train.evaluate import evaluate
    from phalanx.train.run import load_data

    out, _ = ddp_run
    cfg = RunConfig.model_validate(json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["config"])
    tokenizer, data = load_data(cfg)  # the run's own eval rows, from the shared tokenization cache
    batches = DataLoader(data.eval, batch_size=2, collate_fn=partial(pad_batch, pad_token_id=tokenizer.pad_token_id))
    adapter = load_file(out / "adapter_model.safetensors")
    results = {}
    for name, quantization in (("4bit", quantization_config(cfg.model, None)), ("plain", None)):
        base = load_model(cfg.model.model_name, torch.float32, quantization=quantization)
        model = PeftModel.from_pretrained(base, str(out))
        live = lora_tensors(model)
        assert live.keys() == adapter.keys(), name  # complete: every saved tensor has a home, none missing
        for key, value in adapter.items():
            assert torch.equal(live[key], value), (name, key)
        results[name] = evaluate(model, batches, torch.device("cpu"), contextlib.nullcontext)["loss"]
    # On the same 4-bit base the reloaded adapter is the trained one: it gives the run's final eval loss.
    assert results["4bit"] == pytest.approx(losses(out, "eval")[-1], abs=1e-4)
    # On the unquantized base it loads as well, and differs only by the 4-bit rounding of the base.
    assert abs(results["plain"] - results["4bit"]) < 0.1


def test_qlora_resume_continues_exactly(ddp_run, dataset, tmp_path):
    out, _ = ddp_run
    resumed = tmp_path / "resumed"
    proc = train(dataset, resumed, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert "Resuming from" in proc.stdout and "at step 2" in proc.stdout
    assert losses(resumed) == pytest.approx(losses(out)[2:], abs=1e-6)
    a, b = load_file(out / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert (a[key] - b[key]).abs().max() < 1e-6, key


@pytest.mark.parametrize(
    "strategy", [["--strategy", "fsdp"], ["--strategy", "deepspeed", "--zero_stage", "3"]], ids=["fsdp2", "zero3"]
)
def test_sharded_qlora_trains_like_ddp(ddp_run, dataset, tmp_path, strategy):
    """The 4-bit base shards too: FSDP2 all-gathers the packed bytes, ZeRO-3 partitions them; the losses are DDP's."""
    out, _ = ddp_run
    sharded = tmp_path / "sharded"
    proc = train(dataset, sharded, *strategy)
    assert f"({strategy[1]}, cpu" in proc.stdout
    assert losses(sharded) == pytest.approx(losses(out), abs=1e-5)
    assert losses(sharded, "eval") == pytest.approx(losses(out, "eval"), abs=1e-5)
    a, b = load_file(out / "adapter_model.safetensors"), load_file(sharded / "adapter_model.safetensors")
    assert a.keys() == b.keys()  # gathered complete on rank 0
    for key in a:
        assert (a[key] - b[key]).abs().max() < 1e-3, key


def test_4bit_full_finetuning_is_refused_before_any_rank_starts(tmp_path):
    out = tmp_path / "out"
    proc = run_phalanx(
        "train", "--world_size", "2", "--output_dir", str(out), "--finetune", "full", "--load_in_4bit", timeout=60
    )
    assert proc.returncode != 0
    assert "model.load_in_4bit" in proc.stderr and "--finetune lora" in proc.stderr
    assert "rank" not in proc.stderr.lower() and not out.exists()  # no rank started, nothing written
