"""FSDP2 and ZeRO-3 full fine-tuning: checkpoint-{step} holds the weights only in its sharded state (nothing is
gathered to rank 0), resumes exactly from it, and `phalanx export` turns it into a from_pretrained folder."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import phalanx.checkpoint.export as export_module
from checkpoint.resume_ranks import FLAGS, shape
from helpers import gone_pid, read_metrics, run_phalanx, write_payload
from phalanx.checkpoint.export import export_checkpoint
from phalanx.checkpoint.io import load_model_weights
from phalanx.checkpoint.safe_load import UnsafeCheckpointError
from phalanx.cli import main
from phalanx.errors import PhalanxError

pytestmark = pytest.mark.distributed


# Where each strategy's shards land, and how many files its two ranks write there.
SHARDS = {
    "fsdp": (["--strategy", "fsdp"], "sharded_state", "*.distcp"),
    "zero3": (["--strategy", "deepspeed", "--zero_stage", "3"], "deepspeed/state", "*optim_states.pt"),
}


@pytest.mark.parametrize("name", list(SHARDS))
def test_full_finetune_checkpoints_are_sharded_only_and_export(name, resume_data, tmp_path, monkeypatch):
    strategy, shard_dir, shard_glob = SHARDS[name]
    base = [
        "train",
        "--dataset_path",
        str(resume_data),
        *strategy,
        "--finetune",
        "full",
        *shape(2),
        *FLAGS,
        "--max_steps",
        "2",
        "--save_steps",
        "1",
        "--learning_rate",
        "1e-3",
        "--checkpoint.save_best",
        "true",
        "--eval_steps",
        "1",
    ]
    whole = tmp_path / "whole"
    proc = run_phalanx(*base, "--output_dir", str(whole))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in (1, 2):
        checkpoint = whole / f"checkpoint-{step}"
        assert not (checkpoint / "model.safetensors").exists(), "no gathered copy in an intermediate checkpoint"
        assert (checkpoint / "config.json").is_file() and (checkpoint / "tokenizer_config.json").is_file()
        assert len(list((checkpoint / shard_dir).glob(shard_glob))) == 2
    assert (whole / "checkpoint-best" / "model.safetensors").is_file() and (whole / "model.safetensors").is_file()

    # Export: the same bytes of weights as the final model the run wrote (checkpoint-2 is the last step).
    exported = tmp_path / "exported"
    # Another export into the same folder, still writing: its staging files are not this export's to clear.
    elsewhere = tmp_path / ".exported.staging-1"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_bytes(b"another export's bytes")
    # And the staging folder of an export that was killed (its process is gone) is removed.
    killed = tmp_path / f".exported.staging-{gone_pid()}"
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"cut short")
    # The checkpoint's generation settings (as a base model's sampling defaults and end-of-turn ids would be) travel.
    generation = {"eos_token_id": [1, 7], "pad_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    (whole / "checkpoint-2" / "generation_config.json").write_text(json.dumps(generation))
    assert main(["export", str(whole / "checkpoint-2"), str(exported)]) == 0  # the command, in this process
    saved = json.loads((exported / "generation_config.json").read_text())
    assert {k: saved.get(k) for k in generation} == generation, saved
    assert (elsewhere / "model.safetensors").read_bytes() == b"another export's bytes"
    assert not killed.exists()
    assert sorted(p.name for p in tmp_path.glob(".exported.staging*")) == [elsewhere.name]  # its own is gone
    # And when that other export finished first, this one stops without touching its folder or leaving files.
    real_fsync = export_module.fsync_tree

    def other_export_finishes(path):
        real_fsync(path)
        (tmp_path / "exported-raced").mkdir()
        (tmp_path / "exported-raced" / "model.safetensors").write_bytes(b"the other export")

    with monkeypatch.context() as patch, pytest.raises(PhalanxError, match="appeared while this export was writing"):
        patch.setattr(export_module, "fsync_tree", other_export_finishes)
        export_checkpoint(whole / "checkpoint-2", tmp_path / "exported-raced")
    assert (tmp_path / "exported-raced" / "model.safetensors").read_bytes() == b"the other export"
    assert not list(tmp_path.glob(".exported-raced.staging*"))
    final, export = load_file(whole / "model.safetensors"), load_file(exported / "model.safetensors")
    assert final.keys() == export.keys() and all(torch.equal(final[k], export[k]) for k in final)
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported).lm_head.weight.shape[0] > 0

    # A shard file replaced by a pickle that runs code is refused before anything unpickles it for real.
    tampered = tmp_path / "tampered"
    shutil.copytree(whole / "checkpoint-2", tampered)
    victim = (
        (tampered / shard_dir / ".metadata") if name == "fsdp" else sorted((tampered / shard_dir).glob(shard_glob))[0]
    )
    marker = tmp_path / "payload-ran"
    write_payload(victim, marker)
    with pytest.raises(UnsafeCheckpointError, match=victim.name):
        export_checkpoint(tampered, tmp_path / "exported-tampered")
    assert not marker.exists() and not (tmp_path / "exported-tampered").exists()

    # A strategy that would read model.safetensors is told where the weights are.
    with pytest.raises(PhalanxError, match="phalanx export"):
        load_model_weights(AutoModelForCausalLM.from_pretrained(exported), whole / "checkpoint-1", "full")

    # Resume from the sharded-only checkpoint-1: step 2 and the final weights as the uninterrupted run's.
    resumed = tmp_path / "resumed"
    proc = run_phalanx(*base, "--output_dir", str(resumed), "--resume_from_checkpoint", str(whole / "checkpoint-1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(whole)][1:]
    again = load_file(resumed / "model.safetensors")
    assert all(torch.equal(final[k], again[k]) for k in final)
