"""`phalanx generate`: sharded, resumable batch generation of training data on 1..N ranks.

    phalanx generate --model_name M [--adapter PATH] [--chat_template FILE|NAME] --prompts FILE \\
        --num_sequences_per_question K \\
        --batch_size B [--num_questions N] [--max_new_tokens --temperature --top_p --top_k --seed] \\
        [--val_fraction F] --output data/traj_chat.jsonl [--world_size N]

With --world_size N (and no torchrun around it) the command checks its input once, then starts N
ranks through torch's elastic launcher, as `phalanx train` does. Each rank generates its batches
(job.py), commits them to its shard (shards.py); rank 0 merges. Rerunning resumes.

Preemption: SIGTERM / SIGUSR1 make every rank finish the batch it is generating, commit it and exit
75, as training does. A rank decides between batches, on its own flag or on one another rank raised
in the store; the ranks then meet once, at the gather that ends every run, and no rank merges.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from phalanx.errors import PhalanxError, RanksFailed
from phalanx.generate.args import parse_args

# What a rank does when asked to stop (the first Ctrl-C says it): each batch is committed whole or not started.
WORK = "finishing the batch being generated and committing it"


def main(argv: Sequence[str]) -> int:
    import os

    from phalanx.models.packages import leave_out_bitsandbytes, leave_out_deepspeed
    from phalanx.runtime.quiet import quiet_libraries
    from phalanx.runtime.signals import PreemptionFlag

    # A rank (torchrun, `--world_size`) catches SIGTERM/SIGUSR1 from its first moment, before the model stack is
    # imported, as `phalanx train` does: a signal that comes while it starts is kept, not fatal. The `--world_size`
    # launcher leaves them to torch's agent, which passes them on to the ranks.
    is_rank = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # runtime.dist.launched_by_torchrun, without torch
    preemption = PreemptionFlag(WORK).install() if is_rank else None
    args = parse_args(argv)
    if args.world_size > 1 and not is_rank:
        from phalanx.generate.job import plan_job
        from phalanx.generate.shards import check_manifest
        from phalanx.launch.local import launch_local
        from phalanx.runtime.dist import check_world_fits
        from phalanx.runtime.output_lock import check_free, output_file_lock

        quiet_libraries()
        # Check what can be checked before any rank starts, so bad input is reported once; write nothing.
        check_world_fits(args.world_size, "auto")
        job = plan_job(args, warn=lambda message: None)
        check_manifest(job.folder, job.output, job.settings, args.overwrite, job.val_output)
        check_free(output_file_lock(job.output), f"--output {job.output}")
        try:
            # 75 or 130 when a signal stopped the ranks: rank 0 has said so
            return launch_local(
                ["generate", *argv], args.world_size, args.master_port, shutdown_timeout_s=args.shutdown_timeout_s
            )
        except PhalanxError as exc:
            error = PhalanxError(f"phalanx generate: {exc}")
            error.exit_code = exc.exit_code  # a rank's crash (1) stays told apart from bad input (2)
            raise error from None
    preemption = preemption or PreemptionFlag(WORK).install()
    leave_out_bitsandbytes()  # generation loads no 4-bit model: a second less per rank
    leave_out_deepspeed()  # nor uses DeepSpeed
    quiet_libraries()
    try:
        return run(args, preemption)
    except Exception as exc:
        if isinstance(exc, PhalanxError):
            # As train's ranks do: what a rank refuses is said once for the job, with its status (2 for bad input),
            # rather than once per rank; a rank's crash (RanksFailed) keeps its status 1.
            if not is_rank or int(os.environ["WORLD_SIZE"]) == 1 or isinstance(exc, RanksFailed):
                raise
            from phalanx.launch.local import report_bad_input

            return report_bad_input(exc, int(os.environ["RANK"]))
        from phalanx.launch.local import stand_aside_for_killed_peer

        # A peer killed mid-run (kill -9, the OOM killer) fails this rank's next collective: the launcher names the
        # killed rank, and this one says why it stopped in one line instead of gloo's traceback.
        if is_rank and int(os.environ["WORLD_SIZE"]) > 1 and stand_aside_for_killed_peer():
            return 1
        raise


def run(args: argparse.Namespace, preemption) -> int:
    """One rank's part (or the whole job in one process); returns 0, or 75 when a signal stopped it."""
    from phalanx.generate.job import plan_job
    from phalanx.runtime import dist as rt
    from phalanx.runtime.collector import startup_done
    from phalanx.runtime.output_lock import output_file_lock, release_lock
    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    startup_done()  # torch and transformers are imported (generate.job): collect as usual from here
    rank_id = rt.env_rank_info()[0]
    say = (lambda message: print(message, flush=True)) if rank_id == 0 else (lambda message: None)
    job = plan_job(args, warn=say)  # every rank reads the prompts: the batches are computed, not sent
    rank = rt.init_runtime("auto", args.timeout_minutes)
    try:
        done = _agree_on_state(job, rank, args.overwrite)
        stats = _generate(job, rank, done, say, preemption)
        # Every rank comes here, done or stopped; a signal that arrives later (the merge) lets the run finish.
        everyone = rt.gather_objects(stats)
        stopped = [s for s in everyone if s["stopped"]]
        if stopped:
            if rank.is_main:
                _report_stop(job, stopped, everyone, len(done))
            return PREEMPTED_EXIT_CODE
        if rank.is_main:
            _finish(job, rank.world_size, everyone, len(done), say)
        rt.barrier()
    finally:
        release_lock(output_file_lock(job.output))
        rt.shutdown()
    return 0


def _agree_on_state(job, rank, overwrite: bool) -> set[tuple[int, int]]:
    """Rank 0 checks and prepares the shard folder and finds what is done; every rank gets the answer or the error."""
    from phalanx.generate.shards import check_manifest, prepare_folder, scan_folder
    from phalanx.runtime.dist import broadcast_object
    from phalanx.runtime.output_lock import hold_lock, output_file_lock

    answer: object = None
    if rank.is_main:
        try:
            # Held until this process ends: a second job on this output would append to the same shards.
            hold_lock(output_file_lock(job.output), f"--output {job.output}")
            action = check_manifest(job.folder, job.output, job.settings, overwrite, job.val_output)
            prepare_folder(job.folder, job.settings, action, job.val_output)
            expected = set(job.pairs())
            answer = sorted(key for key in scan_folder(job.folder) if key in expected)
        except PhalanxError as exc:
            answer = exc
    answer = broadcast_object(answer)
    if isinstance(answer, PhalanxError):
        raise answer
    return set(map(tuple, answer))


def _generate(job, rank, done: set, say, preemption) -> dict:
    from phalanx.generate.engine import generate_with_fallback
    from phalanx.generate.job import make_record, plan_batches, rank_batches
    from phalanx.generate.shards import ShardWriter, shard_path

    batches = plan_batches(job.prompts, job.num_sequences, job.batch_size)
    total = sum(len(b) for b in batches)
    say(
        f"🔧 Generation: {job.model_name}{f' + adapter {job.adapter}' if job.adapter else ''} ({job.dtype}, "
        f"{rank.device.type}); {len(job.prompts)} prompts x {job.num_sequences} sequences = {total}; "
        f"{len(batches)} batches of up to {job.batch_size} over {rank.world_size} rank(s); sampling {job.params.as_dict()}"
    )
    if done:
        say(f"♻️  Resuming: {len(done)} of {total} sequences are already committed in {job.folder}")
    mine = rank_batches(batches, rank.rank, rank.world_size, done)
    stats = {
        "rank": rank.rank,
        "sequences": 0,
        "tokens": 0,
        "seconds": 0.0,
        "batch_size": job.batch_size,
        "shrunk": False,
        "stopped": None,
    }

    def stop_requested() -> bool:
        # Checked only between batches: each batch is committed whole (one write, fsynced) or not started.
        if preemption.requested_anywhere():
            stats["stopped"] = preemption.signal_name or "signal"
            return True
        return False

    stopping = stop_requested()
    prefix = "" if rank.is_main else f"[rank {rank.rank}] "
    # Called by every rank, stopping or not: it is a collective, and ranks may see a stop request at different times.
    loaded = _load_model_everywhere(job, rank, bool(mine) and not stopping, prefix)
    if loaded is None:
        return stats
    model, decoder = loaded
    if decoder is not None:
        graphs = " (one CUDA graph per decoding step)" if rank.device.type == "cuda" else ""
        say(f"   KV cache: fixed size{graphs}; --kv_cache growing lets finished rows leave the batch instead")
    prompt_ids = {p.id: list(p.input_ids) for p in job.prompts}
    by_id = {p.id: p for p in job.prompts}

    def shrink(old: int, new: int) -> None:
        stats["shrunk"] = True
        print(f"{prefix}⚠️  out of memory with {old} sequences per forward pass; retrying with {new}", flush=True)

    writer = ShardWriter(shard_path(job.folder, rank.rank))
    micro = job.batch_size
    started = time.perf_counter()
    try:
        for number, (index, pairs) in enumerate(mine, start=1):
            if stop_requested():
                break
            t0 = time.perf_counter()
            finished, micro = generate_with_fallback(
                model,
                prompt_ids,
                pairs,
                job.params,
                job.stop_ids,
                job.tokenizer.pad_token_id,
                micro,
                shrink,
                len(job.tokenizer),
                decoder,
            )
            writer.commit(index, [make_record(job, by_id[p], s, f) for (p, s), f in zip(pairs, finished)])
            tokens = sum(f.computed_tokens for f in finished)
            stats["sequences"] += len(pairs)
            stats["tokens"] += tokens
            say(
                f"   batch {number}/{len(mine)} (rank 0): {len(pairs)} sequences, {tokens} new tokens, "
                f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f} tokens/s"
            )
    finally:
        writer.close()
    stats["seconds"] = time.perf_counter() - started
    stats["batch_size"] = micro
    return stats


def _load_model_everywhere(job, rank, needed: bool, prefix: str):
    """(model, decoder) on a rank with batches to generate, None on one without. Every rank meets here once: what
    loading found wrong (an --adapter that does not fit the model, say) stops every rank with that message, where
    the ranks without a batch would otherwise wait at the end for ranks that had already failed."""
    from phalanx.generate.job import load_generation_model, positions_needed
    from phalanx.generate.static_decode import choose_decoder
    from phalanx.runtime.dist import gather_objects

    loaded = problem = None
    if needed:
        try:
            model = load_generation_model(job, rank.device)
            decoder = choose_decoder(
                job.kv_cache,
                model,
                warn=lambda message: print(f"{prefix}{message}", flush=True),
                rows=job.batch_size,  # one cache shape for the job: a resumed job draws what an uninterrupted one draws
                capacity=positions_needed(job.prompts, job.params.max_new_tokens),
            )
            loaded = (model, decoder)
        except PhalanxError as exc:
            problem = exc
    problems = [p for p in gather_objects(problem) if p is not None]
    if problems:
        raise problems[0]
    return loaded


def _report_stop(job, stopped: list[dict], everyone: list[dict], resumed: int) -> None:
    from phalanx.runtime.signals import PREEMPTED_EXIT_CODE

    reasons = ", ".join(sorted({s["stopped"] for s in stopped}))
    committed = resumed + sum(s["sequences"] for s in everyone)
    print(
        f"⏸️  preempted ({reasons}): every rank committed the batch it was generating and stopped; {committed} of "
        f"{len(job.pairs())} sequences are committed in {job.folder}. Exiting with status {PREEMPTED_EXIT_CODE}: "
        "rerun the same command to resume.",
        file=sys.stderr,
        flush=True,
    )


def _finish(job, world_size: int, everyone: list[dict], resumed: int, say) -> None:
    from phalanx.generate.shards import default_val_output, merge, val_prompt_ids

    sequences = sum(s["sequences"] for s in everyone)
    tokens = sum(s["tokens"] for s in everyone)
    seconds = max(s["seconds"] for s in everyone)
    rate = f"{tokens / seconds:.1f} tokens/s" if seconds > 0 else "nothing left to generate"
    say(
        f"✅ Generated {sequences} sequences ({tokens} new tokens) in {seconds:.1f}s on {world_size} rank(s): {rate}"
        + (f"; {resumed} were already done" if resumed else "")
    )
    for s in everyone:
        if s["shrunk"]:
            say(f"⚠️  rank {s['rank']}: out of memory; batch size reduced from {job.batch_size} to {s['batch_size']}")
    val_ids = val_prompt_ids(len(job.prompts), job.val_fraction, job.params.seed)
    # One prompt cannot be split: an empty validation file would be refused by `phalanx train` ("no rows"), so none
    # is written and the run says why.
    val_output = job.val_output if val_ids else None
    n_train, n_val = merge(job.folder, job.pairs(), val_ids, job.output, val_output)
    where = f" and {n_val} ({len(val_ids)} prompts) to {val_output}" if val_output is not None else ""
    say(f"💾 Wrote {n_train} records to {job.output}{where}; shards kept in {job.folder}")
    if job.val_output is not None and val_output is None:
        why = f"{len(job.prompts)} prompt is too few to hold any back for validation (it takes 2 or more)"
        say(f"⚠️  No validation file written: {why}; every record is in {job.output}")
    else:
        why = "--val_fraction 0 writes no validation file"
    # An earlier merge's validation file that this one did not write: it is not deleted (it may be yours), but
    # evaluating on it could score prompts the training file now holds.
    stale, tail = job.val_output or default_val_output(job.output), "are training rows too"
    if val_output is not None:  # written elsewhere (--val_output): the default file beside the output is the stale one
        stale, tail = default_val_output(job.output), "may be training rows now"
        why = f"this run wrote its validation records to {val_output}"
    if stale.is_file() and (val_output is None or stale.resolve() != val_output.resolve()):
        every = f", and every prompt is now in {job.output}" if val_output is None else ""
        say(
            f"⚠️  {stale} is left as it was: {why}{every}. If an earlier run wrote {stale}, its prompts {tail}: "
            "do not evaluate on it."
        )
