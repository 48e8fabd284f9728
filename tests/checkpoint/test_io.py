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
    cfg = Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def test_full_model_round_trip_with_tied_head(tmp_path):
    model = tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    save_checkpoint(tmp_path / "checkpoint-1", rank=RANK, model=model, tokenizer=None,
                    stateful={"optimizer": optimizer}, trainer_state={"global_step": 1, "config": {}})
    fresh = tiny(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = load_checkpoint(tmp_path / "checkpoint-1", rank=RANK, model=fresh, stateful={"optimizer": fresh_opt}, finetune="full")
    assert state["global_step"] == 1
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr(), "tying survives loading"
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_model_of_another_shape_is_refused_with_names(tmp_path):
    save_checkpoint(tmp_path / "checkpoint-1", rank=RANK, model=tiny(hidden=32), tokenizer=None, stateful={},
                    trainer_state={"global_step": 1, "config": {}})
    with pytest.raises(PhalanxError) as err:
        load_checkpoint(tmp_path / "checkpoint-1", rank=RANK, model=tiny(hidden=48), stateful={}, finetune="full")
    assert "model.embed_tokens.weight: checkpoint [64, 32] vs model [64, 48]" in str(err.value)


def test_uncommitted_folder_is_refused(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(PhalanxError, match="not a committed phalanx checkpoint"):
        load_checkpoint(tmp_path / "checkpoint-3", rank=RANK, model=tiny(), stateful={}, finetune="full")
