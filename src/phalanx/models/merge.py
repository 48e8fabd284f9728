"""A LoRA run's adapter merged into its base model: a from_pretrained folder to serve where adapters cannot be loaded.

    phalanx export OUTPUT_DIR MERGED_DIR [--model_name BASE]     # a LoRA run's adapter (or a checkpoint's)

The base (adapter_config.json's base_model_name_or_path, or --model_name) is loaded in fp32, the adapter merged by
PEFT, and the model written in the dtype the base was published in, with the run's tokenizer and chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from phalanx.checkpoint.export import check_new_export_folder, check_whole_adapter, write_new_folder
from phalanx.checkpoint.resume import run_config_of
from phalanx.errors import PhalanxError


def export_merged_adapter(folder: Path, out: Path, model_name: Optional[str] = None) -> tuple[Path, list[str]]:
    """Write `out` (a new folder): the LoRA adapter in `folder` (a run's output_dir or one of its checkpoints) merged
    into its base model (`model_name`, else the one adapter_config.json names); returns `out` and the lines that say
    what was merged."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from phalanx.models.load import adapter_base, load_model, load_tokenizer, published_dtype, stop_also_at

    folder, out = Path(folder), Path(out)
    check_whole_adapter(folder)
    field = "--model_name" if model_name else f"{folder / 'adapter_config.json'}: base_model_name_or_path"
    model_name = adapter_base(str(folder), "phalanx export", model_name)  # checks the adapter's files are there
    check_new_export_folder(out)
    dtype = published_dtype(model_name, field)
    # Merged in fp32 (W + scale * B @ A, rounded once) and cast to the dtype the base was published in.
    model = load_model(model_name, torch.float32, field=field)
    try:
        model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise PhalanxError(
            f"{folder}: the adapter does not fit {model_name} ({field}): {type(exc).__name__}: {exc}"
        ) from None
    model = model.to(dtype)
    # The run's tokenizer files hold the chat template it trained with; a bare PEFT adapter has none: the base's.
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        tokenizer = load_tokenizer(model_name, field=field)
    record = run_config_of(folder)
    ends = answer_end_ids(tokenizer, (record.get("data") or {}).get("chat_template_kwargs"))
    added = stop_also_at(model, ends, tokenizer.eos_token_id)  # [] where the base stops there already
    write_new_folder(out, model, tokenizer)
    said = [f"merged the LoRA adapter of {folder} into {model_name} ({str(dtype).removeprefix('torch.')}) -> {out}"]
    if added:
        names = ", ".join(f"{tokenizer.convert_ids_to_tokens(i)!r} ({i})" for i in added)
        said.append(
            f"generation_config.json stops at {names} too: the run's chat template ends an answer with it, and the "
            "base model's generation config did not stop there"
        )
    if (record.get("model") or {}).get("load_in_4bit"):
        said.append(
            "note: the adapter was trained on the 4-bit quantized base (QLoRA) and is merged into the unquantized "
            "weights, which differ from those it trained with by the quantization error"
        )
    return out, said


def answer_end_ids(tokenizer: Any, template_kwargs: Optional[dict]) -> list[int]:
    """The tokens the chat template ends an answer with besides the end-of-sequence token (ChatML's <|im_end|> under a
    base model's <|endoftext|>), found by masking a two-message row as training does: train/run.py adds those a full
    fine-tune's data trains to the model it saves; an adapter carries no generation config, so its merge adds them.
    [] where the template ends an answer with the end-of-sequence token, or masks no such row."""
    from phalanx.data.chat import tokenize_conversation
    from phalanx.data.formats import to_conversation

    row = {"messages": [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}]}
    try:
        masked = tokenize_conversation(
            tokenizer, to_conversation(row, "a probe row"), "a probe row", "auto", template_kwargs
        )
    except (PhalanxError, ValueError):
        return []
    ids = (tokenizer.convert_tokens_to_ids(token) for token in masked.end_tokens)
    return [i for i in ids if isinstance(i, int)]
