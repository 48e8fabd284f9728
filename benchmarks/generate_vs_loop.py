"""Generated tokens/s: phalanx's batched generation against a plain `model.generate` loop, same model and prompts.

One invocation, one process, one after the other on the same loaded model:

  (a) phalanx: the engine `phalanx generate` runs on each rank (phalanx.generate.engine), over
      the batches the command plans (prompts longest first, `--batch_size` sequences per batch);
  (b) loop: `model.generate` on one prompt at a time, once per (prompt, sequence) pair: what a
      hand-written script does;
  (c) loop, K per call: `model.generate(num_return_sequences=K)` once per prompt: the usual
      improvement on (b), shown for context.

Held equal: the model (fp32 on CPU, or --dtype on CUDA), the prompts (the bundled health-agent
chats rendered with the chat template, their final answer left out), temperature / top-p / top-k,
max_new_tokens, the stop tokens (EOS and end of turn) and the ids that can be drawn (the tokenizer's
vocabulary, not the padded embedding rows). Sampling is random in every arm, so arms differ in how
many tokens they produce before a stop; tokens/s counts the tokens each arm actually produced (the
stop token included) over the wall time of its generation calls (no model load, no file writing).
The arms run in interleaved rounds (--repeats, default 3) and the median round of each is reported,
with every round's time and the CPU that other processes used meanwhile (the machine may be shared).

What phalanx does that (b) does not: K sequences of a question share one prefill, sequences of
different questions share forward passes, and finished sequences leave the batch.

`--loop_sequences N` runs the loops on N of the (prompt, sequence) pairs only, taken round-robin over the prompts
so every prompt length is represented: a loop's tokens/s does not depend on how many sequences it is given (it
generates them one after the other), and at the seeds' shape (25 sequences per question, batch 38) the full loop
would take minutes of device time. The phalanx arm always generates every pair.

The phalanx arm's time is also split: its prefills (each distinct prompt alone, timed with a device sync around
each) against its decode steps (how many, the mean rows per step, ms per step), so a slow arm says where.

`--kv_caches` runs the phalanx arm once per decoding cache (default both): `growing` (finished rows leave the
batch; one device sync per step) and `fixed` (a preallocated cache; on CUDA each decoding step is one CUDA graph
replay, and the stop flags are read every few steps). In float32 both draw the same tokens for the same rows.

Run from the repository root:
  .venv/bin/python benchmarks/generate_vs_loop.py                       # 16 prompts x 4, 64 new tokens
  .venv/bin/python benchmarks/generate_vs_loop.py --num_questions 8 --no-results
Results are appended to benchmarks/RESULTS.md (reported, never asserted).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
sys.path.insert(0, str(ROOT / "src"))


def busy_core_seconds() -> float | None:
    """Core-seconds every process on the machine has spent busy since boot (Linux), or None."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_core_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_until_idle(limit: float, busy_below: float = 0.3) -> float:
    """Wait (at most `limit` seconds) for a second in which other processes keep less than `busy_below` of a core busy."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit:
        busy, own = busy_core_seconds(), own_core_seconds()
        if busy is None:
            break
        time.sleep(1.0)
        if (busy_core_seconds() - busy) - (own_core_seconds() - own) < busy_below:
            break
    return time.perf_counter() - start


class Timer:
    """Wall time of a block, and the core-seconds other processes used meanwhile (this machine is shared)."""

    def __enter__(self):
        self.busy, self.own, self.start = busy_core_seconds(), own_core_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.start
        busy = busy_core_seconds()
        self.others = None if busy is None else max(0.0, (busy - self.busy) - (own_core_seconds() - self.own))


def _git(*args: str) -> str:
    """git's output in the repository ("" where git or the repository is missing, as on a copied tree)."""
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model_name", default="embedded:tiny-qwen3")
    p.add_argument(
        "--gpu-shape",
        dest="gpu_shape",
        default=None,
        help="generate with a random-weight model of this shape (train_vs_hf's GPU_SHAPES, e.g. r1-distill-qwen-1.5b), "
        "built once under /tmp/phalanx-bench; replaces --model_name",
    )
    p.add_argument("--prompts", default="bundled:health-agent")
    p.add_argument("--num_questions", type=int, default=16)
    p.add_argument("--num_sequences_per_question", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top_p", type=float, default=0.95)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the same for every arm)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=3, help="rounds over all arms; the median round is reported")
    p.add_argument(
        "--wait-idle",
        dest="wait_idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each arm, wait up to SECONDS for the machine to be idle (shared machines)",
    )
    p.add_argument("--skip-k-loop", dest="skip_k_loop", action="store_true", help="leave out arm (c)")
    p.add_argument(
        "--loop_sequences",
        type=int,
        default=0,
        help="run the loops on this many (prompt, sequence) pairs, round-robin over the prompts (0: all)",
    )
    p.add_argument(
        "--kv_caches",
        default="growing,fixed",
        help="phalanx arms, one per decoding cache (comma-separated: growing, fixed)",
    )
    p.add_argument("--no-results", dest="no_results", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--note", default="", help="free text for the RESULTS.md entry")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("PHALANX_CACHE", str(Path.home() / ".cache" / "phalanx"))
    import torch
    import transformers

    from phalanx.generate import engine, static_decode
    from phalanx.generate.engine import generate_with_fallback
    from phalanx.generate.job import DTYPES, generation_stop_ids, plan_batches, positions_needed, resolve_dtype
    from phalanx.generate.prompts import read_prompts
    from phalanx.generate.sampling import SamplingParams
    from phalanx.generate.static_decode import choose_decoder
    from phalanx.models.load import load_model, load_tokenizer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype) if device.type == "cuda" else "float32"
    if args.gpu_shape:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from train_vs_hf import build_gpu_shape_folder

        folder = Path("/tmp/phalanx-bench") / f"{args.gpu_shape}-random"
        args.model_name = str(build_gpu_shape_folder(args.gpu_shape, folder, device=args.device))
    tok = load_tokenizer(args.model_name)
    model = load_model(args.model_name, DTYPES[dtype]).to(device).eval()
    prompts = read_prompts(args.prompts, tok, args.num_questions, warn=print)
    k = args.num_sequences_per_question
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=0
    )
    stops = generation_stop_ids(tok, args.model_name)
    vocab = len(tok)
    beyond = list(range(vocab, model.config.vocab_size))
    lengths = [len(p.input_ids) for p in prompts]
    print(
        f"model {args.model_name} ({dtype}, {device}, {args.threads} thread(s)); {len(prompts)} prompts "
        f"({min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}) x {k} sequences; "
        f"max_new_tokens {args.max_new_tokens}, temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}"
    )

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    caches = [c.strip() for c in args.kv_caches.split(",") if c.strip()]
    # As `phalanx generate` makes it: one cache shape for the job (batch_size rows, longest prompt + max_new_tokens).
    shape = dict(rows=args.batch_size, capacity=positions_needed(prompts, args.max_new_tokens))
    decoders = {cache: choose_decoder(cache, model, flag="--kv_caches", warn=print, **shape) for cache in caches}
    split = {"prefill_s": 0.0, "prefills": 0, "decode_steps": 0, "decode_rows": 0}
    prefill = engine._prefill

    def timed_prefill(*a, **kw):  # the phalanx arm's prefills, apart from its decode steps (one sync each)
        sync()
        start = time.perf_counter()
        out = prefill(*a, **kw)
        sync()
        split["prefill_s"] += time.perf_counter() - start
        split["prefills"] += len(a[1])
        return out

    def count_decode_step(_module, args_, kwargs):
        ids = kwargs.get("input_ids", args_[0] if args_ else None)
        if ids is not None and ids.shape[1] == 1:
            split["decode_steps"] += 1
            split["decode_rows"] += ids.shape[0]

    run_step = static_decode._Batch.run_step

    def counted_run_step(batch):  # a CUDA graph replay runs no Python forward for the hook above to see
        if batch.graph is not None:
            split["decode_steps"] += 1
            split["decode_rows"] += batch.rows
        return run_step(batch)

    def phalanx_arm(pairs_batches, cache: str):
        tokens = 0
        ids = {p.id: list(p.input_ids) for p in prompts}
        for key in split:
            split[key] = 0
        engine._prefill = timed_prefill
        static_decode._Batch.run_step = counted_run_step
        hook = model.register_forward_pre_hook(count_decode_step, with_kwargs=True)
        try:
            for pairs in pairs_batches:
                finished, _ = generate_with_fallback(
                    model,
                    ids,
                    pairs,
                    params,
                    stops,
                    tok.pad_token_id,
                    args.batch_size,
                    vocab_limit=vocab,
                    decoder=decoders[cache],
                )
                tokens += sum(f.computed_tokens for f in finished)
            sync()
        finally:
            engine._prefill = prefill
            static_decode._Batch.run_step = run_step
            hook.remove()
        return tokens

    hf_kwargs = dict(
        do_sample=args.temperature > 0,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=stops,
        pad_token_id=tok.pad_token_id,
        suppress_tokens=beyond or None,
    )
    if args.temperature > 0:
        hf_kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)

    def new_tokens(out, prompt_len):
        """Tokens generate() produced per row: up to and including the first stop token."""
        total = 0
        for row in out[:, prompt_len:].tolist():
            n = len(row)
            for i, t in enumerate(row):
                if t in stops:
                    n = i + 1
                    break
            total += n
        return total

    # The loops' calls: (prompt, call index) round-robin over the prompts, cut at --loop_sequences sequences.
    def loop_calls(per_call: int) -> list:
        calls = [(p, call) for call in range(k // per_call) for p in prompts]
        if args.loop_sequences:
            calls = calls[: max(1, args.loop_sequences // per_call)]
        return calls

    def loop_arm(per_call: int):
        tokens = 0
        with torch.inference_mode():
            for p, call in loop_calls(per_call):
                ids = torch.tensor([p.input_ids], device=device)
                torch.manual_seed(p.id * 1000 + call)
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), num_return_sequences=per_call, **hf_kwargs
                )
                tokens += new_tokens(out, ids.shape[1])
        sync()
        return tokens

    batches = plan_batches(prompts, k, args.batch_size)
    # Warm-up, untimed: the phalanx arm's first batch at its full size for a few tokens (batched shapes, padding masks,
    # cache reordering: on CPU a first round without it took 2.1x the second), and one call of the loop.
    warm_ids = {p.id: list(p.input_ids) for p in prompts}
    short = SamplingParams(**{**params.as_dict(), "max_new_tokens": min(4, args.max_new_tokens)})
    # The fixed cache is made (and its CUDA graph captured) here, in the job's one shape: a job pays one capture per
    # rank, which is not in the figures.
    for decoder in decoders.values():
        generate_with_fallback(
            model,
            warm_ids,
            batches[0],
            short,
            stops,
            tok.pad_token_id,
            args.batch_size,
            vocab_limit=vocab,
            decoder=decoder,
        )
    with torch.inference_mode():
        w = torch.tensor([prompts[0].input_ids], device=device)
        model.generate(input_ids=w, attention_mask=torch.ones_like(w), **{**hf_kwargs, "max_new_tokens": 4})
    sync()
    phalanx_runs = [
        (
            f"phalanx batched, {cache} KV cache (batch_size {args.batch_size}, {len(batches)} batches)",
            lambda cache=cache: phalanx_arm(batches, cache),
        )
        for cache in caches
    ]
    loop_label = "loop: model.generate, one prompt, one sequence per call"
    runs = [*phalanx_runs, (loop_label, lambda: loop_arm(1))]
    if not args.skip_k_loop and k > 1:
        runs.append((f"loop: model.generate, one prompt, num_return_sequences={k}", lambda: loop_arm(k)))
    sequences = {label: len(prompts) * k for label, _ in phalanx_runs}
    sequences[loop_label] = len(loop_calls(1))
    sequences.update({label: len(loop_calls(k)) * k for label, _ in runs[len(phalanx_runs) + 1 :]})
    # Rounds interleave the arms, so load from other processes falls on all of them alike; the median counts.
    timings: dict[str, list] = {label: [] for label, _ in runs}
    splits: dict[str, list[dict]] = {label: [] for label, _ in phalanx_runs}

    def phalanx_split(x: dict) -> str:
        decode = x["wall"] - x["prefill_s"]
        steps = max(1, x["decode_steps"])
        return (
            f"phalanx arm split: prefill {x['prefill_s']:.2f} s for {x['prefills']} distinct prompts; "
            f"decode {decode:.2f} s over {x['decode_steps']} steps, {x['decode_rows'] / steps:.1f} rows per step "
            f"on average, {1000 * decode / steps:.1f} ms per step"
        )

    for round_ in range(args.repeats):
        for label, fn in runs:
            if args.wait_idle:
                wait_until_idle(args.wait_idle)
            with Timer() as t:
                tokens = fn()
            timings[label].append((t.wall, tokens, t.others))
            print(f"round {round_ + 1}: {label}: {tokens} tokens in {t.wall:.2f}s")
            if label in splits:
                splits[label].append(dict(split, wall=t.wall))
                print(f"round {round_ + 1}: {phalanx_split(splits[label][-1])}")

    def median(label):
        ordered = sorted(timings[label], key=lambda x: x[0])
        return ordered[len(ordered) // 2]

    base_wall, base_tokens, _ = median(loop_label)
    base_rate = base_tokens / base_wall
    lines = []
    for label, _ in runs:
        wall, tokens, others = median(label)
        rate = tokens / wall
        spread = ", ".join(f"{w:.2f}" for w, _, _ in timings[label])
        lines.append(
            f"| {label} | {sequences[label]} | {tokens} | {wall:.2f} ({spread}) | {rate:.1f} | "
            f"{rate / base_rate:.2f}x | {'n/a' if others is None else f'{others:.1f}'} |"
        )
    header = [
        "| arm | sequences | generated tokens | seconds, median (all rounds) | tokens/s | vs one-at-a-time loop "
        "| other processes' core-s (median round) |",
        "|---|---|---|---|---|---|---|",
    ]
    print("\n".join(header + lines))
    ratios = {}
    for label, _ in phalanx_runs:
        wall, tokens, _ = median(label)
        ratios[label] = (tokens / wall) / base_rate
        print(f"{label} / one-at-a-time loop: {ratios[label]:.2f}x tokens/s")

    if args.no_results:
        return
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    commit = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = " (with uncommitted changes under src/)" if _git("status", "--porcelain", "--", "src") else ""
    entry = [
        f"\n### {stamp}: `generate_vs_loop.py` {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "",
        f"commit {commit}{dirty}; "
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{args.model_name} ({dtype}, {device}, {args.threads} thread(s)); {len(prompts)} prompts from {args.prompts} "
        f"({min(lengths)}-{max(lengths)} prompt tokens) x {k} sequences, max_new_tokens {args.max_new_tokens}, "
        f"temperature {args.temperature}, top_p {args.top_p}, top_k {args.top_k}; load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end.",
        "",
        *header,
        *lines,
        "",
        "**"
        + "; ".join(f"{label.split(' (')[0]}: {ratio:.2f}x" for label, ratio in ratios.items())
        + " the tokens/s of the one-prompt-at-a-time `model.generate` loop.**",
        "",
        *(
            f"{label.split(' (')[0]}: {phalanx_split(sorted(rounds, key=lambda x: x['wall'])[len(rounds) // 2])} "
            "(median round)."
            for label, rounds in splits.items()
        ),
    ]
    if args.note:
        entry += ["", args.note]
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write("# Benchmark results\n")
        f.write("\n".join(entry) + "\n")
    print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
