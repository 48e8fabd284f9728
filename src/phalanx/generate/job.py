"""What a generation job is, decided before any model loads: settings, prompts, the batches and who runs them.

The batches are a function of the prompts, `num_sequences_per_question` and `batch_size` only:
prompts sorted longest first (ties by id) so neighbours pad little, their (prompt, sequence)
pairs in that order, cut every `batch_size` rows. Batch b belongs to rank b mod world_size.
Because no batch depends on the world size, one rank and N ranks compute the very same
batches, and the merged files are byte-identical; per-row random streams (sampling.py) make
each sequence independent of its batch-mates as well.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from phalanx.checkpoint.resume import run_config_of
from phalanx.config.chat_templates import variables_written_empty, written_empty_notes
from phalanx.errors import ConfigError, DataError
from phalanx.generate.engine import Finished, stop_token_ids
from phalanx.generate.prompts import Prompt, has_chat_template, prompts_digest, read_prompts
from phalanx.generate.sampling import SamplingParams
from phalanx.generate.shards import shard_dir, val_output_of
from phalanx.models.load import (
    adapter_base,
    generation_config_eos_ids,
    load_model,
    load_tokenizer,
    resolve_model_path,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Job:
    model_name: str
    model_field: str  # how errors name the model: the flag that gave it, or the adapter's record of it
    adapter: Optional[str]
    dtype: str
    prompts: list[Prompt]
    num_sequences: int
    batch_size: int
    params: SamplingParams
    stop_ids: list[int]
    tokenizer: Any
    output: Path
    val_output: Optional[Path]
    val_fraction: float
    folder: Path
    settings: dict  # what the records depend on; a resume must match it exactly
    kv_cache: str = "auto"  # the decoding cache (--kv_cache); settings records a fixed one

    def pairs(self) -> list[tuple[int, int]]:
        return [(p.id, s) for p in self.prompts for s in range(self.num_sequences)]


def resolve_dtype(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def adapter_chat_template(adapter: Optional[str]) -> Optional[str]:
    """The template `phalanx train` saved with the adapter (what it trained on), when there is one."""
    if not adapter:
        return None
    saved = Path(adapter) / "chat_template.jinja"
    if (Path(adapter) / "additional_chat_templates").is_dir():
        return adapter  # a set of named templates: the folder gives them all (config.chat_templates)
    return str(saved) if saved.is_file() else None


def adapter_template_kwargs(adapter: Optional[str]) -> dict:
    """The template variables the adapter's run rendered its rows with (data.chat_template_kwargs), as recorded in
    its output_dir or checkpoint; none when there is no record."""
    config = run_config_of(Path(adapter)) if adapter else {}
    return dict((config.get("data") or {}).get("chat_template_kwargs") or {})


def adapter_digest(adapter: str) -> str:
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        path = Path(adapter) / name
        if path.is_file():
            h.update(name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def generation_stop_ids(tokenizer: Any, model_name: str) -> list[int]:
    """Stop ids from the tokenizer (its end-of-sequence and end-of-turn tokens) and the model folder's
    generation_config.json (no weights needed)."""
    return sorted(set(stop_token_ids(tokenizer)) | set(generation_config_eos_ids(model_name)))


def check_model_fit(prompts: list[Prompt], model_name: str, max_new_tokens: int, kv_cache: str) -> None:
    """What the model's config answers before any rank loads weights: room for prompt + max_new_tokens, and (with
    --kv_cache fixed) a cache that can be fixed in size; raised here, the error reaches the user once, from every
    rank alike, instead of from the ranks that got a batch while the others wait."""
    from transformers import AutoConfig

    from phalanx.generate.kv_cache import cache_layers_problem

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model_name))
    except (OSError, ValueError):
        return  # load_model reports an unreadable config properly
    limit = getattr(config, "max_position_embeddings", None)
    for p in prompts if limit else []:
        if len(p.input_ids) + max_new_tokens > limit:
            raise DataError(
                f"{p.where}: the prompt is {len(p.input_ids)} tokens; with --max_new_tokens {max_new_tokens} it needs "
                f"{len(p.input_ids) + max_new_tokens} positions, more than the model's {limit} "
                "(max_position_embeddings). Shorten the prompt or lower --max_new_tokens."
            )
    problem = cache_layers_problem(config, positions_needed(prompts, max_new_tokens)) if kv_cache == "fixed" else None
    if problem:
        raise ConfigError(
            f"--kv_cache fixed: {model_name} cannot decode over a fixed-size cache: {problem}; use growing"
        )


def positions_needed(prompts: Sequence[Prompt], max_new_tokens: int) -> int:
    """The longest prompt plus max_new_tokens: the positions a job's longest sequence takes (the fixed cache's length,
    what the model's max_position_embeddings and sliding window must hold)."""
    return max((len(p.input_ids) for p in prompts), default=0) + max_new_tokens


def decodes_over_fixed_cache(kv_cache: str) -> bool:
    """Whether --kv_cache means the fixed cache (auto: on CUDA; the model may still take the growing one, the same on
    every rerun). Decided before any model loads, as --dtype auto is."""
    return kv_cache == "fixed" or (kv_cache == "auto" and torch.cuda.is_available())


def plan_job(args, warn: Callable[[str], None]) -> Job:
    """Everything but the model: reads and checks the prompts (errors name the line), writes nothing."""
    default = args.model_name or "embedded:tiny-qwen3"
    model_name = adapter_base(args.adapter, model_name=args.model_name) if args.adapter else default
    model_field = "--model_name" if args.model_name or not args.adapter else "--adapter's base_model_name_or_path"
    tokenizer = load_tokenizer(
        model_name, args.trust_remote_code, args.chat_template or adapter_chat_template(args.adapter), model_field
    )
    if not has_chat_template(tokenizer):
        warn(
            f"warning: the tokenizer of {model_name} has no chat template; chat prompts are written as plain "
            "'role: content' lines ending in 'assistant: '. The records are chat rows: to train on them, use a "
            "tokenizer with a chat template."
        )
    template_kwargs = (
        args.chat_template_kwargs if args.chat_template_kwargs is not None else adapter_template_kwargs(args.adapter)
    )
    empty = variables_written_empty(tokenizer, template_kwargs) if has_chat_template(tokenizer) else {}
    advice = "give it as the model was trained with: --chat_template_kwargs '{{{name}: ...}}'"
    for note in written_empty_notes(empty, advice, rows="prompt"):
        warn(f"note: {note}")
    prompts = read_prompts(args.prompts, tokenizer, args.num_questions, warn, template_kwargs)
    check_model_fit(prompts, model_name, args.max_new_tokens, args.kv_cache)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    stop_ids = generation_stop_ids(tokenizer, model_name)
    dtype = resolve_dtype(args.dtype)
    settings = {
        "model_name": model_name,
        "adapter": args.adapter,
        "adapter_sha256": adapter_digest(args.adapter) if args.adapter else None,
        "dtype": dtype,
        "prompts_sha256": prompts_digest(prompts),
        "num_prompts": len(prompts),
        "num_sequences_per_question": args.num_sequences_per_question,
        "sampling": params.as_dict(),
        "stop_ids": stop_ids,
    }
    if decodes_over_fixed_cache(args.kv_cache):
        # In bf16 the two caches can round a token's logits differently (attention over other lengths), so the
        # records depend on it; a growing-cache job records nothing here, as jobs did before the fixed cache.
        settings["kv_cache"] = "fixed"
    output = Path(args.output)
    val_output = val_output_of(output, args.val_output, args.val_fraction)
    if val_output is not None and val_output.resolve() == output.resolve():
        raise ConfigError(f"--val_output {val_output} is the same file as --output; choose another name")
    return Job(
        model_name=model_name,
        model_field=model_field,
        adapter=args.adapter,
        dtype=dtype,
        prompts=prompts,
        num_sequences=args.num_sequences_per_question,
        batch_size=args.batch_size,
        params=params,
        stop_ids=stop_ids,
        tokenizer=tokenizer,
        output=output,
        val_output=val_output,
        val_fraction=args.val_fraction,
        folder=shard_dir(output),
        settings=settings,
        kv_cache=args.kv_cache,
    )


def plan_batches(prompts: list[Prompt], num_sequences: int, batch_size: int) -> list[list[tuple[int, int]]]:
    """All (prompt id, sequence index) pairs, longest prompts first, cut into batches of batch_size."""
    order = sorted(prompts, key=lambda p: (-len(p.input_ids), p.id))
    pairs = [(p.id, s) for p in order for s in range(num_sequences)]
    return [pairs[i : i + batch_size] for i in range(0, len(pairs), batch_size)]


def rank_batches(
    batches: list[list[tuple[int, int]]], rank: int, world_size: int, done: set[tuple[int, int]]
) -> list[tuple[int, list[tuple[int, int]]]]:
    """This rank's (batch index, pairs still to generate); batches already complete are left out."""
    mine = []
    for index in range(rank, len(batches), world_size):
        todo = [pair for pair in batches[index] if pair not in done]
        if todo:
            mine.append((index, todo))
    return mine


def load_generation_model(job: Job, device: torch.device, trust_remote_code: bool = False):
    """The base model in the job's dtype, with the adapter merged in, in eval mode on `device`."""
    model = load_model(job.model_name, DTYPES[job.dtype], trust_remote_code, field=job.model_field)
    if job.adapter:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, job.adapter).merge_and_unload()
        except (OSError, ValueError, RuntimeError, KeyError) as e:
            raise ConfigError(
                f"--adapter {job.adapter}: could not be loaded onto {job.model_name}: {type(e).__name__}: {e}"
            ) from None
    return model.to(device).eval()


def make_record(job: Job, prompt: Prompt, sequence_index: int, finished: Finished) -> dict:
    """A training row: the prompt's conversation plus the generated assistant turn (or the continued text)."""
    completion = job.tokenizer.decode(finished.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    metadata = {
        "prompt_id": prompt.id,
        "sequence_index": sequence_index,
        "model": job.model_name,
        "adapter": job.adapter,
        "sampling": job.params.as_dict(),
        "finish_reason": finished.finish_reason,
        "completion_tokens": len(finished.tokens),
    }
    if prompt.text is not None:
        return {"text": prompt.text + completion, "metadata": metadata}
    record: dict = {"messages": [*prompt.messages, {"role": "assistant", "content": completion}]}
    if prompt.tools:
        record["tools"] = prompt.tools
    record["metadata"] = metadata
    return record
