"""models.adapters: what a LoRA target list that matches nothing in the model is told."""

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from phalanx.config.schema import LoraConfig, ModelConfig
from phalanx.errors import ConfigError
from phalanx.models.adapters import apply_finetuning


def test_target_modules_that_match_nothing_name_the_linear_modules_in_one_sentence():
    """peft's own message ends with a period: it was followed by ". Linear modules ...", printing 'again..'."""
    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    with pytest.raises(ConfigError) as err:
        apply_finetuning(Qwen2ForCausalLM(config), ModelConfig(), LoraConfig(target_modules=["foo_proj"]))
    message = str(err.value)
    assert message.startswith("lora.target_modules = ['foo_proj']: ") and ".." not in message, message
    assert "Linear modules in this model: ['down_proj', 'gate_proj', 'k_proj'" in message
