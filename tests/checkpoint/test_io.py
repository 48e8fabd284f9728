"""Checkpoint contents round-trip (full fine-tuning included) and refuse a model of another shape."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from phalanx.checkpoint.io import load_checkpoint, save_checkpoint
from phalanx.errors import PhalanxError
from phalanx.runtime.dist import RankInfo

RANK = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def tiny(hidden: int = 32, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(cfg)


def test_full_model_round_trip_with_tied_head(tmp_path):
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    save_checkpoint(
        tmp_path / "checkpoint-1",
        rank=RANK,
        model=model,
        tokenizer=None,
        stateful={"optimizer": optimizer},
        trainer_state={"global_step": 1, "config": {}},
    )
    fresh = tiny(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = load_checkpoint(
        tmp_path / "checkpoint-1", rank=RANK, model=fresh, stateful={"optimizer": fresh_opt}, finetune="full"
    )
    assert state["global_step"] == 1
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr(), "tying survives loading"
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_model_of_another_shape_is_refused_with_names(tmp_path):
    save_checkpoint(
        tmp_path / "checkpoint-1",
        rank=RANK,
        model=tiny(hidden=32),
        tokenizer=None,
        stateful={},
        trainer_state={"global_step": 1, "config": {}},
    )
    with pytest.raises(PhalanxError) as err:
        load_checkpoint(tmp_path / "checkpoint-1", rank=RANK, model=tiny(hidden=48), stateful={}, finetune="full")
    assert "model.embed_tokens.weight: checkpoint [64, 32] vs model [64, 48]" in str(err.value)


def test_uncommitted_folder_is_refused(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(PhalanxError, match="not a committed phalanx checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-3", rank=RANK, model=tiny(), stateful={}, finetune="full")


def test_background_save_writes_the_state_of_the_moment_it_was_called(tmp_path):
    """asynchronous=True: training may change every tensor right after the call; the checkpoint still holds the
    state at the call (copied first), is committed only by wait(), and equals a synchronous save's files."""
    from safetensors.torch import load_file

    from phalanx.checkpoint.commit import is_committed

    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    args = dict(
        rank=RANK,
        model=model,
        tokenizer=None,
        stateful={"optimizer": optimizer},
        trainer_state={"global_step": 1, "config": {}},
    )
    save_checkpoint(tmp_path / "sync", **args)
    pending = save_checkpoint(tmp_path / "checkpoint-1", asynchronous=True, **args)
    with torch.no_grad():  # the next steps, before the background write is done
        for p in model.parameters():
            p.add_(1.0)
        optimizer.state[next(iter(optimizer.state))]["exp_avg"].add_(1.0)
    pending.wait()
    assert is_committed(tmp_path / "checkpoint-1")
    for name in ("model.safetensors",):
        a, b = load_file(tmp_path / "sync" / name), load_file(tmp_path / "checkpoint-1" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (torch.load(tmp_path / f / "optimizer.pt", weights_only=True) for f in ("sync", "checkpoint-1"))
    assert all(torch.equal(a["state"][i]["exp_avg"], b["state"][i]["exp_avg"]) for i in a["state"])
    assert (tmp_path / "sync" / "trainer_state.json").read_text() == (
        tmp_path / "checkpoint-1" / "trainer_state.json"
    ).read_text()


@pytest.mark.parametrize("saved, resumed", [("full", "lora"), ("lora", "full")])
def test_a_checkpoint_of_another_finetune_kind_is_named_as_such(tmp_path, saved, resumed):
    """--finetune changed under --force: a full checkpoint resumed as LoRA was called damaged (its
    adapter_model.safetensors unreadable), a LoRA one resumed in full was said to hold its weights in a strategy's
    sharded state. The kind each side trains is named, with the ways on."""
    save_checkpoint(
        tmp_path / "checkpoint-1",
        rank=RANK,
        model=tiny(),
        tokenizer=None,
        stateful={},
        trainer_state={"global_step": 1, "config": {"model": {"finetune": saved}}},
    )
    with pytest.raises(PhalanxError) as refused:
        load_checkpoint(tmp_path / "checkpoint-1", rank=RANK, model=tiny(), stateful={}, finetune=resumed)
    said = str(refused.value)
    assert (
        f"{tmp_path / 'checkpoint-1'} holds a checkpoint of model.finetune {saved!r}, and this run trains with "
        f"{resumed!r}: a resume goes on with the training a checkpoint holds. Resume with --finetune {saved}"
    ) in said, said
    assert f"phalanx export {tmp_path / 'checkpoint-1'}" in said and "damaged" not in said, said


@pytest.mark.parametrize("sharded, strategy", [("sharded_state", "fsdp"), ("deepspeed", "deepspeed")])
def test_a_sharded_strategys_checkpoint_resumed_under_ddp_names_the_strategy(tmp_path, sharded, strategy):
    """An FSDP2 or DeepSpeed checkpoint resumed with --strategy ddp --force was called damaged ('optimizer.pt cannot
    be read'): it holds that strategy's own state, and says so."""
    model = tiny()
    save_checkpoint(
        tmp_path / "checkpoint-1", rank=RANK, model=model, tokenizer=None, stateful={}, trainer_state={"global_step": 1}
    )
    (tmp_path / "checkpoint-1" / sharded).mkdir()  # what the sharded strategy wrote in place of optimizer.pt
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(PhalanxError) as refused:
        load_checkpoint(
            tmp_path / "checkpoint-1", rank=RANK, model=tiny(), stateful={"optimizer": optimizer}, finetune="full"
        )
    said = str(refused.value)
    assert f"holds {strategy}'s sharded state ({sharded}/)" in said and f"--strategy {strategy}" in said, said
    assert "damaged" not in said, said


def test_a_failed_write_on_another_rank_leaves_the_staging_folder_to_rank_0(tmp_path):
    """The staging folder is rank 0's: rank 1's full-disk error removed it while rank 0 still wrote into it, and rank 0
    then reported 'Parent directory .checkpoint-4.staging does not exist' instead of the full disk."""
    from phalanx.checkpoint.io import CheckpointWriteError
    from phalanx.checkpoint.layout import staging_dir

    final = tmp_path / "checkpoint-4"
    staging = staging_dir(final)
    staging.mkdir()
    said = str(CheckpointWriteError(final, OSError(28, "No space left on device"), main=False))
    assert staging.is_dir() and "No space left on device" in said and "Committed checkpoints are intact" in said
    CheckpointWriteError(final, OSError(28, "No space left on device"), main=True)
    assert not staging.exists()
