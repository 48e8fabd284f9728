"""QLoRA's model side: the base really loads as 4-bit per the flags, only the adapter trains, gradients stay right
after an evaluation, and the settings that cannot work are refused by the config, before any process starts."""

from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch

from phalanx.config.loader import FLAT_FLAGS, all_dotted_fields, load_config, overrides_from_flags
from phalanx.config.schema import LoraConfig
from phalanx.errors import ConfigError
from phalanx.models.adapters import apply_finetuning
from phalanx.models.load import load_model, quantization_config

MODEL = "embedded:tiny-qwen3"
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def config(*flags: tuple[str, str]):
    return load_config(None, overrides_from_flags(list(flags)))


def load_4bit(cfg, dtype=torch.float32, run_dtype=None):
    return load_model(MODEL, dtype, quantization=quantization_config(cfg.model, run_dtype))


@pytest.mark.parametrize(
    "flags, quant_type, nested, compute",
    [
        ([("load_in_4bit", "true")], "nf4", True, torch.float32),  # the defaults: NF4, double quantization, fp32 on CPU
        (
            [
                ("load_in_4bit", "true"),
                ("bnb_4bit_quant_type", "fp4"),
                ("bnb_4bit_use_double_quant", "false"),
                ("bnb_4bit_compute_dtype", "bf16"),
            ],
            "fp4",
            False,
            torch.bfloat16,
        ),
    ],
)
def test_base_loads_as_4bit_per_the_flags(flags, quant_type, nested, compute):
    model = load_4bit(config(*flags))
    plain = load_model(MODEL, torch.float32)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(quantized) == model.config.num_hidden_layers * LINEARS_PER_LAYER
    # Every decoder linear is 4-bit; the output head stays in full precision.
    assert [name for name, m in model.named_modules() if type(m) is torch.nn.Linear] == ["lm_head"]
    reference = dict(plain.named_parameters())
    for name, layer in quantized.items():
        weight = layer.weight
        assert (
            weight.dtype == torch.uint8 and weight.numel() * 2 == layer.in_features * layer.out_features
        )  # 2 per byte
        assert weight.quant_state.quant_type == quant_type
        assert weight.quant_state.nested is nested
        assert layer.compute_dtype == compute
        # Dequantized, the weight is the original up to 4-bit rounding: really quantized, and from the right weights.
        restored = bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
        original = reference[name + ".weight"]
        error = (restored - original).norm() / original.norm()
        assert 0 < error < 0.2, (name, float(error))


def test_auto_compute_dtype_follows_the_run_precision():
    cfg = config(("load_in_4bit", "true"))
    assert quantization_config(cfg.model, None).bnb_4bit_compute_dtype == torch.float32
    assert quantization_config(cfg.model, torch.bfloat16).bnb_4bit_compute_dtype == torch.bfloat16
    assert (
        quantization_config(
            config(("load_in_4bit", "true"), ("bnb_4bit_compute_dtype", "fp16")).model, torch.bfloat16
        ).bnb_4bit_compute_dtype
        == torch.float16
    )
    assert quantization_config(config().model, torch.bfloat16) is None


def test_only_the_adapter_trains_in_fp32_and_the_base_keeps_its_dtype():
    cfg = config(("load_in_4bit", "true"))
    # As on a bf16 GPU run: the unquantized base weights load in bf16 and stay there (as in plain LoRA; an fp32
    # upcast would make the residual stream fp32), the adapter's weights are fp32 master weights.
    model = apply_finetuning(load_4bit(cfg, dtype=torch.bfloat16), cfg.model, LoraConfig(r=4))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    lora_layers = [
        m for m in model.modules() if hasattr(m, "base_layer") and isinstance(m.base_layer, bnb.nn.Linear4bit)
    ]
    assert (
        len(lora_layers) == model.config.num_hidden_layers * LINEARS_PER_LAYER
    )  # 'all-linear' adapts the 4-bit layers
    for name, p in model.named_parameters():
        expected = (
            torch.uint8 if isinstance(p, bnb.nn.Params4bit) else torch.float32 if p.requires_grad else torch.bfloat16
        )
        assert p.dtype == expected, name


def test_an_evaluation_leaves_training_gradients_unchanged():
    """bitsandbytes repacks CPU 4-bit weights into an inference-only layout on their first eval forward; training
    after that would send no gradient through the base layers. load_model keeps the trainable layout."""
    cfg = config(("load_in_4bit", "true"))
    torch.manual_seed(0)
    model = apply_finetuning(load_4bit(cfg), cfg.model, LoraConfig(r=4, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # a trained adapter: gradients reach lora_A of lower layers too
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def gradients() -> dict:
        model.train()
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    shapes = {n: p.shape for n, p in model.named_parameters()}
    before = gradients()
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    after = gradients()
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    first_layer = [n for n in before if ".layers.0." in n and "lora_A" in n]
    assert first_layer and all(before[n].abs().sum() > 0 for n in first_layer)
    for name in before:
        assert torch.equal(before[name], after[name]), name


# Refused by the config, so before any process starts ---------------------------------------------------------


def test_the_4bit_flags_map_to_fields():
    fields = set(all_dotted_fields())
    for flag in ("load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype"):
        assert FLAT_FLAGS[flag] == f"model.{flag}" and FLAT_FLAGS[flag] in fields
    cfg = config(("load_in_4bit", "true"), ("bnb_4bit_quant_type", "fp4"), ("bnb_4bit_use_double_quant", "false"))
    assert (cfg.model.load_in_4bit, cfg.model.bnb_4bit_quant_type, cfg.model.bnb_4bit_use_double_quant) == (
        True,
        "fp4",
        False,
    )


def test_4bit_full_finetuning_is_refused_with_the_fix(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"model.load_in_4bit.*finetune 'full'.*--finetune lora"):
        config(("load_in_4bit", "true"), ("finetune", "full"))
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model:\n  finetune: full\n  load_in_4bit: true\n")
    with pytest.raises(ConfigError, match=r"--finetune lora"):
        load_config(str(yaml_file))


def test_a_4bit_setting_without_load_in_4bit_is_refused():
    with pytest.raises(
        ConfigError, match=r"model.bnb_4bit_quant_type is set but model.load_in_4bit is not.*--load_in_4bit"
    ):
        config(("bnb_4bit_quant_type", "fp4"))
    # Saying load_in_4bit false on purpose turns QLoRA off and keeps the rest of the settings.
    assert not config(("bnb_4bit_quant_type", "fp4"), ("load_in_4bit", "false")).model.load_in_4bit
    with pytest.raises(ConfigError, match=r"model.bnb_4bit_quant_type.*'nf4' or 'fp4'"):
        config(("load_in_4bit", "true"), ("bnb_4bit_quant_type", "int4"))


def test_missing_4bit_packages_are_named_with_the_install_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs bitsandbytes, not installed.*pip install 'phalanx\[qlora\]'"):
        quantization_config(config(("load_in_4bit", "true")).model, None)


def test_parameter_count_counts_4bit_weights_at_their_real_size():
    from phalanx.models.adapters import trainable_parameter_count

    cfg = config(("load_in_4bit", "true"))
    plain, quantized = load_model(MODEL, torch.float32), load_4bit(cfg)
    assert trainable_parameter_count(quantized)[1] == trainable_parameter_count(plain)[1]


def test_the_banner_names_the_4bit_compute_dtype_the_layers_take(monkeypatch):
    """`--bnb_4bit_compute_dtype bf16` on a CPU run: bitsandbytes multiplies in bf16 (honoured, results differ from
    fp32), while the banner said only the run's fp32. The banner's words come from the dtype the layers take."""
    from phalanx.train.run import describe_4bit_base

    seen = []
    matmul = bnb.matmul_4bit
    monkeypatch.setattr(bnb, "matmul_4bit", lambda x, *a, **k: seen.append(x.dtype) or matmul(x, *a, **k))
    for asked, word, dtype in (("bf16", "bf16", torch.bfloat16), ("auto", "fp32", torch.float32)):
        cfg = config(("load_in_4bit", "true"), ("bnb_4bit_compute_dtype", asked))
        seen.clear()
        load_4bit(cfg)(torch.tensor([[1, 2, 3]]))  # a CPU run: the run's precision is fp32 (run_dtype None)
        assert set(seen) == {dtype}
        assert describe_4bit_base(cfg.model, None) == f" on a 4-bit nf4 double-quantized base computing in {word}"
