"""What the memory plan needs to know about the model, counted on the meta device: no weights are read.

The model is built from its config.json with `AutoModelForCausalLM.from_config` under
`torch.device("meta")`, then given the run's LoRA adapter through the same `apply_finetuning`
the trainer uses, so total and trainable parameter counts are exact for the run as configured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx.config.schema import RunConfig
from phalanx.errors import ConfigError

# Linear layers of a Llama-family decoder layer, by the role they play in the activation formula.
ROLES = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


@dataclass(frozen=True)
class ModelFacts:
    name: str
    total_params: int
    trainable_params: int
    layer_params: int  # one decoder layer, adapter included: the unit FSDP and ZeRO-3 gather
    layer_trainable: int
    root_params: int  # outside the decoder layers: embeddings, final norm, head (a tied head once)
    largest_trainable: int  # elements of the largest trainable tensor (the CPU optimizer's scratch)
    param_sizes: tuple[int, ...]  # elements of every parameter (ZeRO-3 keeps small ones whole)
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3)
    known_layout: bool  # q/k/v/o + gate/up/down projections; False: a generic activation formula is used
    trainable_linears: frozenset[str] = frozenset()  # roles whose weight trains (full fine-tuning: all)
    lora_ranks: dict[str, int] = field(default_factory=dict)  # role -> LoRA rank, for adapted roles
    trainable_norms: bool = False
    head_trainable: bool = False
    quantizable_params: int = 0  # frozen linear weights inside decoder layers: what load_in_4bit stores in 4 bits
    model_type: str = ""
    packable: bool = False  # trains on packed rows when data.packing asks (models/attention.py); else padded
    target_head: bool = False  # the output head computes the loss at target positions only (train/loss.py)
    lora_fused: bool = False  # the LoRA layers run phalanx's fused forward (models/lora_fused.py), not PEFT's

    @property
    def frozen_params(self) -> int:
        return self.total_params - self.trainable_params


def build_meta_model(cfg: RunConfig):
    """The model the run would train, on the meta device, and its transformers config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.models.adapters import apply_finetuning
    from phalanx.models.load import resolve_model_path
    from phalanx.runtime.hub import hub_load_failure

    path = resolve_model_path(cfg.model.model_name)
    remote = cfg.model.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    except (OSError, ValueError, KeyError) as exc:
        # A Hub id offline is the network's failure (status 1, a rerun may work), as train and generate say it
        raise hub_load_failure(
            exc, f"model.model_name = {cfg.model.model_name!r}: cannot build it from its config: {exc}", ConfigError
        ) from None
    # Checkpointing changes no parameter and the plan prices it separately; 4-bit storage is priced from the counts.
    off = {name: False for name in ("gradient_checkpointing", "load_in_4bit") if name in type(cfg.model).model_fields}
    model_cfg = cfg.model.model_copy(update=off)
    return apply_finetuning(model, model_cfg, cfg.lora), config


def model_facts(cfg: RunConfig) -> ModelFacts:
    from phalanx.models.attention import packing_unsupported_reason
    from phalanx.models.blocks import decoder_layers  # the same units FSDP wraps
    from phalanx.train.loss import TARGET_HEAD_MODEL_TYPES

    model, config = build_meta_model(cfg)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = list(model.parameters())  # unique tensors: a tied head is counted once
    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    first = layers[0] if layers else None
    layer_params = list(first.parameters()) if first is not None else []

    trainable_linears: set[str] = set()
    lora_ranks: dict[str, int] = {}
    trainable_norms = False
    fused = True
    names: set[str] = set()
    for name, module in first.named_modules() if first is not None else []:
        short = name.rsplit(".", 1)[-1]
        names.add(short)
        if short in ROLES:
            base = getattr(module, "base_layer", module)
            if getattr(base, "weight", None) is not None and base.weight.requires_grad:
                trainable_linears.add(ROLES[short])
            lora_a = getattr(module, "lora_A", None)
            if lora_a:
                lora_ranks[ROLES[short]] = next(iter(lora_a.values())).out_features
                fused = fused and type(module).__name__.startswith("FusedLoraLinear")
        if short.endswith("norm") and any(p.requires_grad for p in module.parameters(recurse=False)):
            trainable_norms = True
    import torch

    quantizable = sum(
        module.weight.numel()
        for layer in layers
        for module in layer.modules()
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad
    )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_type = str(getattr(config, "model_type", "") or "")
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    return ModelFacts(
        name=cfg.model.model_name,
        total_params=sum(p.numel() for p in params),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        layer_params=sum(p.numel() for p in layer_params),
        layer_trainable=sum(p.numel() for p in layer_params if p.requires_grad),
        root_params=sum(p.numel() for p in params if id(p) not in in_layers),
        largest_trainable=max((p.numel() for p in params if p.requires_grad), default=0),
        param_sizes=tuple(p.numel() for p in params),
        num_layers=len(layers),
        hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        vocab=int(text.vocab_size),
        qk_norm={"q_norm", "k_norm"} <= names,
        known_layout=set(ROLES) <= names,
        trainable_linears=frozenset(trainable_linears),
        lora_ranks=lora_ranks,
        trainable_norms=trainable_norms,
        quantizable_params=quantizable,
        head_trainable=bool(
            head is not None and getattr(head, "weight", None) is not None and head.weight.requires_grad
        ),
        model_type=model_type,
        packable=packing_unsupported_reason(model.get_base_model() if hasattr(model, "get_base_model") else model)
        is None,
        # The same test install_target_head makes at run time: a known model type and a plain (unadapted) head.
        target_head=model_type in TARGET_HEAD_MODEL_TYPES and type(head) is torch.nn.Linear,
        lora_fused=fused and bool(lora_ranks),
    )
