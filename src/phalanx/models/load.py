"""Find and load a causal LM and its tokenizer: a local folder, a Hub id, or an embedded preset; 4-bit for QLoRA.

Every model, the embedded default included, goes through `from_pretrained`, so what the
tests exercise is the path users' own models take.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from phalanx.config.schema import ModelConfig
from phalanx.errors import HUB_ID, ConfigError
from phalanx.models.packages import require_4bit_packages
from phalanx.runtime.hub import hub_load_failure, read_hub_from_cache_if_unresolvable

EMBEDDED_PREFIX = "embedded:"


def cache_root() -> Path:
    """Where phalanx keeps what it builds once per machine (embedded models, tokenized data), created here: a folder
    that cannot be (a HOME this user cannot write, a read-only PHALANX_CACHE) is named with the variable that sets it,
    where it otherwise surfaced as a chain of FileNotFoundError tracebacks from the first writer."""
    given = os.environ.get("PHALANX_CACHE")
    root = Path(given).expanduser() if given else Path.home() / ".cache" / "phalanx"
    try:
        root.mkdir(parents=True, exist_ok=True)
        problem = None if os.access(root, os.W_OK | os.X_OK) else "this user cannot write to it"
    except OSError as exc:
        problem = f"it cannot be created ({exc.strerror}: {exc.filename})"
    if problem is None:
        return root
    source = f"PHALANX_CACHE={given}" if given else f"the default ~/.cache/phalanx, with HOME={Path.home()}"
    raise ConfigError(
        f"phalanx's cache folder {root} ({source}): {problem}. It holds the embedded models and the tokenized data; "
        "set PHALANX_CACHE to a folder this user can write, on each machine's local disk (e.g. "
        "PHALANX_CACHE=/tmp/phalanx-cache)."
    )


def model_label(model_name: str, field: str) -> str:
    """How an error names the model: `model.model_name = 'x'` (a config field) or `--model_name 'x'` (a flag)."""
    return f"{field} {model_name!r}" if field.startswith("--") else f"{field} = {model_name!r}"


def resolve_model_path(model_name: str, field: str = "model.model_name") -> str:
    """Turn `model_name` into something from_pretrained accepts, or explain why it cannot be found; errors name it as
    `field` (the config field, or the flag of a command that takes it as one)."""
    if model_name.startswith(EMBEDDED_PREFIX):
        from phalanx.models.presets import materialize_embedded_model

        return str(materialize_embedded_model(model_name[len(EMBEDDED_PREFIX) :], cache_root() / "models"))
    path = Path(model_name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            what = "a file, not a model folder" if path.is_file() else "a folder without config.json"
            raise ConfigError(
                f"{model_label(model_name, field)} is {what}; expected a folder written by "
                "save_pretrained (config.json + *.safetensors + tokenizer files) or a Hub id like 'org/name'."
            )
        return str(path)
    if not HUB_ID.fullmatch(model_name):
        raise ConfigError(
            f"{model_label(model_name, field)}: no such folder. Give an existing folder written by save_pretrained, "
            f"a Hub id like 'Qwen/Qwen2.5-0.5B-Instruct', or '{EMBEDDED_PREFIX}tiny-qwen3'."
        )
    read_hub_from_cache_if_unresolvable()
    return model_name


def load_tokenizer(
    model_name: str,
    trust_remote_code: bool = False,
    chat_template: Optional[str] = None,
    field: str = "model.model_name",
) -> PreTrainedTokenizerBase:
    """The model's tokenizer; `chat_template` (a jinja or JSON file, a folder or a shipped name: config.chat_templates) replaces
    its chat template, and save_pretrained then writes that one (chat_template.jinja) with the tokenizer."""
    path = resolve_model_path(model_name, field)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise hub_load_failure(
            exc, f"{model_label(model_name, field)}: could not load its tokenizer: {exc}", ConfigError
        ) from None
    if tokenizer.pad_token_id is None:
        # Padding positions never reach the loss (labels -100, attention mask 0), so eos is a safe pad.
        tokenizer.pad_token = tokenizer.eos_token
    from phalanx.config.chat_templates import own_template_error, own_template_problem, resolve_chat_template

    if chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(chat_template)  # checked when the config was read
        tokenizer.chat_template_source = chat_template  # messages about the template name it (phalanx.data.chat)
    elif tokenizer.chat_template is not None:
        # A model's own template that does not compile renders no row: said now, naming its file and line, not at
        # the first row as if the row were at fault.
        broken = own_template_problem(tokenizer)
        if broken:
            name, problem = broken
            where = f"{model_label(model_name, field)}: its chat template {_template_file(path, name)}"
            raise own_template_error(where, problem)
    return tokenizer


def _template_file(path: str, name: Optional[str]) -> str:
    """Where transformers read a model folder's chat template (`name`: one of several named ones) from."""
    folder = Path(path)
    if name and name != "default" and (folder / "additional_chat_templates" / f"{name}.jinja").is_file():
        return str(folder / "additional_chat_templates" / f"{name}.jinja")
    if (name is None or name == "default") and (folder / "chat_template.jinja").is_file():
        return str(folder / "chat_template.jinja")
    named = f", {name!r}" if name else ""
    return f'{folder / "tokenizer_config.json"} ("chat_template"{named})'


# What PEFT's save_pretrained writes beside adapter_config.json (safetensors by default; .bin when asked for).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_base(adapter: str, named: str = "--adapter", model_name: Optional[str] = None) -> str:
    """The base model an adapter folder written by `phalanx train` (or PEFT) was trained on: `model_name` where one is
    given (the folder is still checked to hold an adapter), else the one its adapter_config.json names. `named`: how
    errors name the folder (the flag or command that gave it)."""
    config = Path(adapter) / "adapter_config.json"
    if not config.is_file():
        raise ConfigError(
            f"{named} {adapter}: no adapter_config.json there; give the output_dir (or a checkpoint "
            "folder) of `phalanx train`, which holds adapter_config.json + adapter_model.safetensors"
        )
    if not any((Path(adapter) / name).is_file() for name in ADAPTER_WEIGHTS):
        # PEFT would take the folder's name for a Hub id and try to download the weights from there.
        raise ConfigError(
            f"{named} {adapter}: adapter_config.json but no weights ({' or '.join(ADAPTER_WEIGHTS)}) there; "
            "the folder was not fully written or copied"
        )
    if model_name:
        return model_name
    try:
        base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except ValueError as e:
        raise ConfigError(f"{config}: not valid JSON ({e})") from None
    if not base:
        raise ConfigError(f"{config}: no base_model_name_or_path; pass --model_name")
    from phalanx.models.presets import embedded_name_of

    # An embedded model is named as such, whether or not its cached folder is here: another machine, or a cleared
    # cache, rebuilds it from the name, and what generate and export record reads as the model the run was given.
    return embedded_name_of(base) or base


def published_dtype(model_name: str, field: str = "model.model_name") -> torch.dtype:
    """The dtype the model's config.json says its weights were saved in (fp32 where it names none)."""
    from transformers import AutoConfig

    try:
        dtype = AutoConfig.from_pretrained(resolve_model_path(model_name, field)).dtype
    except (OSError, ValueError) as exc:
        raise hub_load_failure(
            exc, f"{model_label(model_name, field)}: could not read its config: {exc}", ConfigError
        ) from None
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def generation_config_eos_ids(model_name: str, field: str = "model.model_name") -> list[int]:
    """The token ids the model's generation config stops at (generation_config.json's eos_token_id: one id or a list;
    Llama 3.1 lists <|eom_id|> beside <|eot_id|>); [] where the model ships none."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(resolve_model_path(model_name, field))
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's end-of-sequence token is the stop
        return []
    ids = config.eos_token_id
    return [ids] if isinstance(ids, int) else [i for i in ids or [] if isinstance(i, int)]


def stop_also_at(model: torch.nn.Module, token_ids: list[int], eos_token_id: Optional[int]) -> list[int]:
    """Add `token_ids` to the end-of-sequence ids of `model`'s generation config (kept in their order, after the ids
    it stops at already, else after the tokenizer's `eos_token_id`); returns those it added. Saved with the model, it
    is what `generate` and servers that read generation_config.json stop at."""
    config = getattr(model, "generation_config", None)
    if config is None or not token_ids:
        return []
    current = config.eos_token_id if config.eos_token_id is not None else eos_token_id
    ids = [current] if isinstance(current, int) else [i for i in current or [] if isinstance(i, int)]
    added = [i for i in dict.fromkeys(token_ids) if i not in ids]
    if added:
        config.eos_token_id = ids + added
    return added


COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def quantization_config(model_cfg: ModelConfig, run_dtype: Optional[torch.dtype]) -> Optional[BitsAndBytesConfig]:
    """The bitsandbytes 4-bit settings `model_cfg` asks for (None: load unquantized).

    `run_dtype` is the run's mixed precision dtype (None = fp32); the 'auto' compute dtype follows it."""
    if not model_cfg.load_in_4bit:
        return None
    require_4bit_packages()
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=model_cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model_cfg.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=four_bit_compute_dtype(model_cfg, run_dtype),
    )


def four_bit_compute_dtype(model_cfg: ModelConfig, run_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a 4-bit layer dequantizes to and multiplies in: bnb_4bit_compute_dtype, 'auto' the run's.

    bitsandbytes honours it on CPU too (bf16 and fp16 matmuls there, the result cast back to the input's dtype), so
    a CPU run, fp32 everywhere else, takes an explicit bf16 here; the banner says so (train.run.announce)."""
    return COMPUTE_DTYPES.get(model_cfg.bnb_4bit_compute_dtype) or run_dtype or torch.float32


def load_model(
    model_name: str,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    *,
    quantization: Optional[BitsAndBytesConfig] = None,
    device: Optional[torch.device] = None,
    field: str = "model.model_name",
) -> PreTrainedModel:
    """Load the causal LM in `dtype`. With `quantization`, its linear layers are quantized while loading, onto
    `device`: a quantized model is placed once, where it will run, and never moved afterwards."""
    path = resolve_model_path(model_name, field)
    kwargs: dict = {}
    if quantization is not None:
        kwargs = {"quantization_config": quantization, "device_map": {"": device or torch.device("cpu")}}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError) as exc:
        raise hub_load_failure(
            exc, f"{model_label(model_name, field)}: could not load the model: {exc}", ConfigError
        ) from None
    if quantization is not None:
        keep_4bit_layout_trainable(model)
    return model


def keep_4bit_layout_trainable(model: torch.nn.Module) -> None:
    """Stop bitsandbytes repacking CPU 4-bit weights for inference the first time a layer runs in eval mode.

    On CPUs with AVX512-BF16, bitsandbytes (0.50 at least) rewrites a Linear4bit's weight in place into a bf16
    inference layout on its first eval-mode forward. Training forwards after that run through a kernel with no
    autograd support: no gradient flows through the base layers to the adapters below them, silently, and the
    matmuls drop to bf16. Training evaluates between steps, so the layout must stay the trainable one."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
