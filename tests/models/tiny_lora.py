"""The embedded tiny model with a LoRA adapter (phalanx's fused forward), a packed micro-batch and one step through
the target-only loss: what the compiled-layer and CUDA-graph tests train and compare."""

import torch

from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.data.collate import collate
from phalanx.models.adapters import apply_finetuning
from phalanx.models.attention import enable_varlen_attention
from phalanx.models.load import load_model
from phalanx.train.loss import install_target_head, token_loss_sum

CPU = torch.device("cpu")


def tiny_lora_model(gradient_checkpointing: bool):
    torch.manual_seed(0)
    model = load_model("embedded:tiny-qwen3", torch.float32, False, device=CPU)
    enable_varlen_attention(model, CPU)
    model = apply_finetuning(
        model, ModelConfig(gradient_checkpointing=gradient_checkpointing), LoraConfig(r=8, alpha=16, dropout=0.0)
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT starts B at zero, where A's gradient vanishes
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    install_target_head(model)
    return model.train()


def packed_batch(lengths=(37, 64, 23)):
    gen = torch.Generator().manual_seed(2)
    rows = []
    for n in lengths:
        ids = torch.randint(3, 250, (n,), generator=gen).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
    return collate(rows, pad_token_id=0, packing=True)


def step(model, batch):
    loss = token_loss_sum(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads
