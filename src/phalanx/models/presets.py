"""Embedded models: tiny Hugging Face checkpoints phalanx builds locally, so demos and tests need no hub.

`model_name: "embedded:tiny-qwen3"` resolves here. The model is a randomly initialised Qwen3 (fixed
seed, so the same bytes on every machine with the same library versions) paired with a byte-level
tokenizer that carries a ChatML chat template with tool calls. The folder is written once per
preset and content hash, atomically, and loads with plain `AutoModelForCausalLM` / `AutoTokenizer`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from phalanx.errors import ConfigError, PhalanxError
from phalanx.runtime.durable import fsync_path, fsync_tree

EMBEDDED_PREFIX = "embedded:"

# Bumped when the way a folder is built changes in a way the preset fields do not capture.
_BUILD_FORMAT = 1

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# ChatML with tool calls. Every tag trims the whitespace before it ("{%-"/"{{-"), so only the
# quoted strings produce output and the layout below is free.
#
# Prefix stability: rendering messages[:k] is a prefix of rendering messages[:k+1]. Consecutive
# `tool` messages share one user turn, so that turn is closed lazily: by the next non-tool message
# or by the generation prompt. A conversation that *ends* on a tool message without a generation
# prompt therefore ends inside the open turn; the loss mask never needs that rendering.
CHAT_TEMPLATE = """\
{#- phalanx ChatML template: system + tools, user, assistant with <tool_call>, tool results as <tool_response>. -#}
{%- macro render_content(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- content | tojson -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content | string -}}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if (messages or add_generation_prompt) and (tools or has_system) -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if has_system -%}
        {{- render_content(messages[0].content) -}}
    {%- endif -%}
    {%- if tools -%}
        {%- if has_system -%}
            {{- '\\n\\n' -}}
        {%- endif -%}
        {{- '# Tools\\n<tools>' -}}
        {%- for tool in tools -%}
            {%- set fn = tool.function if tool.function is defined else tool -%}
            {{- '\\n' ~ (fn | tojson) -}}
        {%- endfor -%}
        {{- '\\n</tools>\\nCall a function with <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>' -}}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.index0 > 0 and loop.previtem.role == 'tool' and message.role != 'tool' -%}
        {{- '<|im_end|>\\n' -}}
    {%- endif -%}
    {%- if message.role == 'system' and loop.first -%}
        {#- already rendered above, together with the tools -#}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user\\n' -}}
        {%- else -%}
            {{- '\\n' -}}
        {%- endif -%}
        {{- '<tool_response>\\n' ~ render_content(message.content) ~ '\\n</tool_response>' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set text = render_content(message.content) -%}
        {{- '<|im_start|>assistant\\n' ~ text -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if text or not loop.first -%}
                {{- '\\n' -}}
            {%- endif -%}
            {%- if fn.arguments is string -%}
                {%- set arguments = fn.arguments -%}
            {%- else -%}
                {%- set arguments = fn.arguments | tojson -%}
            {%- endif -%}
            {{- '<tool_call>\\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' ~ arguments ~ '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' ~ message.role ~ '\\n' ~ render_content(message.content) ~ '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if messages and messages[-1].role == 'tool' -%}
        {{- '<|im_end|>\\n' -}}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}"""


@dataclass(frozen=True)
class EmbeddedPreset:
    """How to build one embedded model. Every field feeds the folder's content hash."""

    description: str
    # Qwen3Config keyword arguments; vocab size and special-token ids come from the tokenizer.
    model: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # The embedding table is padded to a multiple of this (the tokenizer has 260 entries).
    vocab_multiple: int = 8
    model_max_length: int = 4096


EMBEDDED_PRESETS: dict[str, EmbeddedPreset] = {
    # ~0.82M parameters. LoRA (r=8, all linear layers), batch 2 x 1024 byte-tokens, one CPU
    # thread per process, two processes on two cores: ~0.32 s per optimizer step (~0.14 s at 512).
    "tiny-qwen3": EmbeddedPreset(
        description="4-layer Qwen3, hidden 128, byte-level ChatML tokenizer with tool calls",
        model=dict(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            hidden_act="silu",
            tie_word_embeddings=True,
        ),
        seed=1234,
    ),
}


def preset_hash(name: str) -> str:
    """Short content hash of a preset, the chat template and the build format."""
    preset = _get_preset(name)
    blob = json.dumps(
        {
            "format": _BUILD_FORMAT,
            "preset": asdict(preset),
            "chat_template": CHAT_TEMPLATE,
            "special": [IM_START, IM_END],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def embedded_name_of(folder: str) -> str | None:
    """'embedded:NAME' when `folder` is named as materialize_embedded_model names the folder of that preset as it is
    built today (NAME-HASH), else None: an adapter's base_model_name_or_path records the cache folder, which another
    machine, or a cleared cache, does not have; the same preset and hash rebuild the same model."""
    name, _, digest = Path(folder).name.rpartition("-")
    if name in EMBEDDED_PRESETS and digest == preset_hash(name):
        return f"{EMBEDDED_PREFIX}{name}"
    return None


def materialize_embedded_model(name: str, root: Path) -> Path:
    """Write the embedded model `name` under `root` once and return its folder.

    `name` may carry the "embedded:" prefix. Safe to call from several processes at once: a file
    lock serialises builders, and the folder appears by an atomic rename only when complete.
    """
    from filelock import FileLock, Timeout

    name = name.removeprefix(EMBEDDED_PREFIX)
    preset = _get_preset(name)
    root = Path(root)
    target = root / f"{name}-{preset_hash(name)}"
    if target.is_dir():
        return target

    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".{target.name}.lock"
    try:
        with FileLock(str(lock_path), timeout=600):
            if target.is_dir():  # another process finished while we waited
                return target
            # Leftovers of a builder that died; nobody else builds while we hold the lock.
            for stale in root.glob(f".{target.name}.tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the model is for every user of the cache
            try:
                _build(preset, tmp)
                fsync_tree(tmp)
                os.replace(tmp, target)
            except BaseException as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                if isinstance(exc, OSError) and target.is_dir():  # lost a race on a filesystem where locks do not hold
                    return target
                from phalanx.data.prepare import cache_not_writable, disk_refusal

                refused = disk_refusal(exc)
                if refused is not None:  # safetensors' own error for a full disk; a traceback said no more
                    raise cache_not_writable(root, refused, f"the embedded model {name!r}") from None
                raise
            fsync_path(root)
    except Timeout as e:
        raise PhalanxError(
            f"waited 600 s for the lock {lock_path} while building embedded model {name!r}; "
            "if no other phalanx process is building it, delete the lock file and retry"
        ) from e
    return target


def build_embedded_tokenizer(model_max_length: int = 4096):
    """The byte-level ChatML tokenizer of the embedded models (needs no files)."""
    from transformers import AddedToken, ByT5Tokenizer

    # ByT5 would make its special tokens swallow the whitespace around them; "<|im_end|>\n" must
    # stay two tokens so that rendered chats tokenize the same as their pieces.
    def special(text: str) -> AddedToken:
        return AddedToken(text, lstrip=False, rstrip=False, normalized=False, special=True)

    tokenizer = ByT5Tokenizer(
        eos_token=special(IM_END),  # end of turn ends generation; takes ByT5's eos id (1)
        pad_token=special("<pad>"),
        unk_token=special("<unk>"),
        extra_ids=0,
        additional_special_tokens=[special(IM_START)],
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _get_preset(name: str) -> EmbeddedPreset:
    preset = EMBEDDED_PRESETS.get(name.removeprefix(EMBEDDED_PREFIX))
    if preset is None:
        known = ", ".join(f"{EMBEDDED_PREFIX}{k}" for k in sorted(EMBEDDED_PRESETS))
        raise ConfigError(f"unknown embedded model {name!r}; known embedded models: {known}")
    return preset


def _build(preset: EmbeddedPreset, folder: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_embedded_tokenizer(preset.model_max_length)
    vocab = -(-len(tokenizer) // preset.vocab_multiple) * preset.vocab_multiple
    config = Qwen3Config(
        vocab_size=vocab,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **preset.model,
    )
    # A private RNG stream: the weights depend only on the seed, and the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
