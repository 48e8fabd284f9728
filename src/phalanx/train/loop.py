"""The fine-tuning loop. Each concern is a call into a component; the control flow is all here."""

from __future__ import annotations

import math
import time

import torch

from phalanx.data.collate import batch_counts, host_to_device, merge_packed, to_device
from phalanx.errors import PhalanxError
from phalanx.models.graphs import say_graph_skips
from phalanx.runtime.dist import all_reduce_sum
from phalanx.runtime.faults import kill_self
from phalanx.runtime.signals import Preempted
from phalanx.runtime.watch import set_collective_timeout, set_phase
from phalanx.train.evaluate import evaluate
from phalanx.train.loss import token_loss_sum
from phalanx.train.run import Run

# Skipping cannot rescue a run whose loss is NaN step after step (diverged weights): stop instead of looping.
MAX_CONSECUTIVE_SKIPS = 10


def inject_fault(run: Run, step: int, loss_sum: torch.Tensor) -> torch.Tensor:
    fault, rank = run.fault, run.rank.rank
    if fault is None:
        return loss_sum
    if fault.due("kill", step, rank):
        kill_self()
    if fault.due("raise", step, rank):
        raise RuntimeError(f"injected fault in forward at step {step}")
    if fault.due("nan", step, rank):
        run.fault = None  # once: the step number does not advance past a skipped step
        return loss_sum * float("nan")
    return loss_sum


def train_step(run: Run, micro_batches: list[dict], after_a_save: bool = False) -> dict | None:
    """One optimizer step over this rank's micro-batches; the loss is the mean over the global batch's target tokens.

    One host read per step: the global loss (the NaN decision every rank must share) with the step's token
    counts. Counts come from the collator on the host; the normalisation is applied as a device tensor, and
    the gradient norm stays on the device until a log step reads it.

    A stop request travels in both of the step's collectives, so every rank learns it in the same step: one that
    came before the step (while the last one was saved) is seen first; `after_a_save` (the last step is committed)
    then reads it at once and returns None, this step untrained, as the checkpoint the run stops at is there. One
    that comes during the step is seen at its end, with the loss: the step finishes and the run stops after it,
    never a step later. (One that comes during an evaluation is read after it, by the loop.)"""
    device, strategy, step = run.rank.device, run.strategy, run.state.global_step + 1
    if run.merge_tokens:  # fewer, larger passes over the same rows (training.merge_micro_batches)
        micro_batches = merge_packed(micro_batches, run.merge_tokens)
    if run.graph_shapes:  # the few shapes CUDA-graphed layers were captured for (training.cuda_graphs)
        micro_batches = [run.graph_shapes.pad(mb) for mb in micro_batches]
    local = [batch_counts(mb) for mb in micro_batches]
    counts = all_reduce_sum(
        host_to_device(
            torch.tensor(
                [sum(t for t, _ in local), sum(i for _, i in local), float(run.preemption.requested)],
                dtype=torch.float64,
            ),
            device,
        )
    )
    if after_a_save and counts[2].item() > 0:  # a host read only on the step after a save
        return None
    # DDP averages gradients over ranks; multiplying by world size turns that average into a global token sum.
    scale = (run.rank.world_size / counts[0].clamp(min=1.0)).float()
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro_batches):
        mb = to_device(mb, device)
        if run.graph_shapes:
            run.graph_shapes.begin_pass()
        with strategy.micro_step(sync_gradients=i == len(micro_batches) - 1):
            with strategy.autocast():
                loss_sum = inject_fault(run, step, token_loss_sum(run.model, mb))
            strategy.backward(loss_sum * scale)
        loss_total += loss_sum.detach().double()
    # Reduced before the optimizer step, so a NaN on any rank is seen, and decided on, by all of them; with a stop
    # request that came during the forward and backward passes.
    late = host_to_device(torch.tensor(float(run.preemption.requested), dtype=torch.float64), device)
    global_loss, preempted_during, target_tokens, input_tokens, preempted_before = torch.cat(
        [all_reduce_sum(torch.stack([loss_total, late])), counts]
    ).tolist()
    preempt = preempted_before + preempted_during
    loss = global_loss / max(target_tokens, 1.0)
    lr = run.scheduler.get_last_lr()[0]
    metrics = {
        "loss": loss,
        "lr": lr,
        "target_tokens": int(target_tokens),
        "input_tokens": int(input_tokens),
        "preempt": preempt > 0,
        "finite": math.isfinite(loss),
    }
    if not metrics["finite"]:
        strategy.discard_gradients()
        return {**metrics, "grad_norm": float("nan")}
    metrics["grad_norm"] = strategy.step(run.cfg.training.max_grad_norm)  # a device tensor: read at log steps only
    run.scheduler.step()
    return metrics


def run_eval(run: Run) -> dict | None:
    if run.eval_batches is None:
        return None
    step = run.state.global_step
    set_phase(run.rank.rank, f"evaluating at step {step}")
    metrics = evaluate(
        run.strategy.eval_model(), run.eval_batches, run.rank.device, run.strategy.autocast, shapes=run.graph_shapes
    )
    run.state.last_eval_loss = metrics["loss"]
    run.reporter.log(step, metrics, kind="eval")
    run.reporter.say(f"✅ Eval at step {step} | loss: {metrics['loss']:.4f} | perplexity: {metrics['perplexity']:.2f}")
    if run.checkpointer.maybe_save_best(metrics["loss"], step) is not None:
        run.reporter.say(f"💾 New best model saved at step {step} with loss: {metrics['loss']:.4f}")
    return metrics


def handle_non_finite(run: Run, metrics: dict) -> None:
    """NaN/Inf global loss: the same decision on every rank, because the loss was reduced first."""
    step = run.state.global_step + 1
    if run.cfg.training.nan_policy == "stop":
        run.checkpointer.maybe_save(run.state.global_step, stopping=True)
        raise PhalanxError(
            f"non-finite loss ({metrics['loss']}) at step {step}; checkpoint-{run.state.global_step} "
            "saved. Lower the learning rate or check the data, then resume; or use --nan_policy skip."
        )
    run.state.skipped_steps += 1
    run.consecutive_skips += 1
    run.reporter.say(
        f"⚠️  Step {step}: non-finite loss ({metrics['loss']}); update skipped ({run.state.skipped_steps} so far)"
    )
    if run.consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
        raise PhalanxError(
            f"the loss stayed non-finite for {MAX_CONSECUTIVE_SKIPS} steps in a row from step {step}; "
            "the run cannot recover by skipping. Lower the learning rate or check the data."
        )


def stop_requested_anywhere(run: Run) -> bool:
    """Whether any rank was asked to stop: one collective and one host read, so every rank decides the same (called
    where all ranks are, after an evaluation, not in every step)."""
    asked = host_to_device(torch.tensor(float(run.preemption.requested), dtype=torch.float64), run.rank.device)
    return all_reduce_sum(asked).item() > 0


def preempted(run: Run, step: int) -> Preempted:
    """The stop after checkpoint-{step} is committed (every caller has waited for it): a second Ctrl-C from now on
    ends the process with the same status, 75, and says nothing of a save it did not skip."""
    run.preemption.committed = True
    return Preempted(
        f"preempted ({run.preemption.signal_name or 'signal on another rank'}) at step {step}; checkpoint-{step} saved"
    )


def train(run: Run) -> None:
    cfg, state, reporter = run.cfg, run.state, run.reporter
    # from_pretrained hands back a model in eval mode: without this, dropout and activation checkpointing
    # (which transformers applies only in training mode) would silently be off for the whole run.
    run.model.train()
    window = {"tokens": 0, "start": time.perf_counter()}  # throughput since the last log line
    started, saved_at = False, None  # saved_at: the last step whose checkpoint-{step} this run saved
    while state.global_step < run.total_steps:
        run.sampler.set_epoch(state.epoch)
        for micro_batches in run.steps_of_epoch():
            if run.fault is not None and run.fault.due("hang", state.global_step + 1, run.rank.rank):
                return  # this rank stops taking part, as a rank with fewer batches would
            set_phase(run.rank.rank, f"training step {state.global_step + 1}")
            metrics = train_step(run, micro_batches, after_a_save=saved_at == state.global_step)
            if metrics is None:  # asked to stop while the last step's checkpoint was saved: it is where the run stops
                run.checkpointer.wait()  # committed before exiting, had it been written in the background
                raise preempted(run, state.global_step)
            if not metrics["finite"]:
                handle_non_finite(run, metrics)
                continue
            run.consecutive_skips = 0
            if not started:
                set_collective_timeout(cfg.distributed.timeout_minutes)  # start-up (and the first step) is over
                started = True
                if run.graph_shapes:
                    say_graph_skips(run.rank.device, reporter.say)
            state.global_step += 1
            state.tokens_seen += metrics["target_tokens"]
            state.add_loss(metrics["loss"])
            window["tokens"] += metrics["input_tokens"]
            tokens_per_s = window["tokens"] / max(time.perf_counter() - window["start"], 1e-9)
            reporter.advance(
                1, {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics['lr']:.2e}", "tok/s": f"{tokens_per_s:.0f}"}
            )
            step, last = state.global_step, state.global_step >= run.total_steps
            if step % cfg.logging.log_steps == 0 or last:
                reporter.log(
                    step,
                    {
                        "loss": state.take_log_mean(),
                        "lr": metrics["lr"],
                        "grad_norm": float(metrics["grad_norm"]),
                        "tokens_per_s": tokens_per_s,
                        "tokens_seen": state.tokens_seen,
                        "epoch": state.epoch,
                    },
                    kind="train",
                )
                window = {"tokens": 0, "start": time.perf_counter()}
            evaluated = step % cfg.eval.eval_steps == 0 or last
            if evaluated:
                run_eval(run)
            # A stop asked for during the evaluation (seconds to minutes on a large eval set) stops at this step, not
            # after one more: the step under way when it came is this one, already trained.
            stop = metrics["preempt"] or (evaluated and not last and stop_requested_anywhere(run))
            if run.checkpointer.maybe_save(step, stopping=stop) is not None:  # preempted: committed
                saved_at = step
            if stop:
                raise preempted(run, step)
            if last:
                break
        if run.sampler.exhausted:
            epoch, mean = state.epoch, state.end_epoch()
            reporter.log(state.global_step, {"loss": mean}, kind="epoch")
            reporter.say(f"📊 Epoch {epoch + 1} average loss: {mean:.4f}")
