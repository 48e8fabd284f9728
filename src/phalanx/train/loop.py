"""The fine-tuning loop. Each concern is a call into a component; the control flow is all here."""

from __future__ import annotations

import time

import torch

from phalanx.runtime.dist import all_reduce_sum
from phalanx.train.evaluate import evaluate
from phalanx.train.loss import count_target_tokens, token_loss_sum
from phalanx.train.run import Run


def train_step(run: Run, micro_batches: list[dict]) -> dict:
    """One optimizer step over this rank's micro-batches; the loss is the mean over the global batch's target tokens."""
    device, strategy = run.rank.device, run.strategy
    counts = torch.tensor(
        [sum(count_target_tokens(mb["labels"]) for mb in micro_batches), sum(int(mb["attention_mask"].sum()) for mb in micro_batches)],
        dtype=torch.float64, device=device,
    )
    target_tokens, input_tokens = all_reduce_sum(counts).tolist()
    # DDP averages gradients over ranks; multiplying by world size turns that average into a global token sum.
    scale = run.rank.world_size / max(target_tokens, 1.0)
    loss_total = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        with strategy.micro_step(sync_gradients=i == len(micro_batches) - 1):
            with strategy.autocast():
                loss_sum = token_loss_sum(run.model, mb)
            strategy.backward(loss_sum * scale)
        loss_total += loss_sum.detach().double()
    grad_norm = strategy.step(run.cfg.training.max_grad_norm)
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    loss = (all_reduce_sum(loss_total) / max(target_tokens, 1.0)).item()
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "target_tokens": int(target_tokens), "input_tokens": int(input_tokens)}


def run_eval(run: Run) -> dict | None:
    if run.eval_batches is None:
        return None
    metrics = evaluate(run.strategy.eval_model(), run.eval_batches, run.rank.device, run.strategy.autocast)
    run.state.last_eval_loss = metrics["loss"]
    step = run.state.global_step
    run.reporter.log(step, metrics, kind="eval")
    run.reporter.say(f"✅ Eval at step {step} | loss: {metrics['loss']:.4f} | perplexity: {metrics['perplexity']:.2f}")
    if run.state.best_eval_loss is None or metrics["loss"] < run.state.best_eval_loss:
        run.state.best_eval_loss, run.state.best_step = metrics["loss"], step
        if run.cfg.checkpoint.save_best:
            run.save("checkpoint-best")
            run.reporter.say(f"💾 New best model saved at step {step} with loss: {metrics['loss']:.4f}")
    return metrics


def train(run: Run) -> None:
    cfg, state, reporter = run.cfg, run.state, run.reporter
    window = {"loss": 0.0, "steps": 0, "tokens": 0, "start": time.perf_counter()}
    while state.global_step < run.total_steps:
        run.sampler.set_epoch(state.epoch)
        epoch_losses = []
        for micro_batches in run.steps_of_epoch():
            metrics = train_step(run, micro_batches)
            state.global_step += 1
            state.tokens_seen += metrics["target_tokens"]
            epoch_losses.append(metrics["loss"])
            window["loss"] += metrics["loss"]; window["steps"] += 1; window["tokens"] += metrics["input_tokens"]
            tokens_per_s = window["tokens"] / max(time.perf_counter() - window["start"], 1e-9)
            reporter.advance(1, {"loss": f"{metrics['loss']:.4f}", "lr": f"{metrics['lr']:.2e}", "tok/s": f"{tokens_per_s:.0f}"})
            step, last = state.global_step, state.global_step >= run.total_steps
            if step % cfg.logging.log_steps == 0 or last:
                reporter.log(step, {"loss": window["loss"] / window["steps"], "lr": metrics["lr"], "grad_norm": metrics["grad_norm"],
                                    "tokens_per_s": tokens_per_s, "tokens_seen": state.tokens_seen, "epoch": state.epoch}, kind="train")
                window = {"loss": 0.0, "steps": 0, "tokens": 0, "start": time.perf_counter()}
            if step % cfg.eval.eval_steps == 0 or last:
                run_eval(run)
            if step % cfg.checkpoint.save_steps == 0:
                run.save(f"checkpoint-{step}")
            if last:
                break
        if run.sampler.exhausted:
            mean = sum(epoch_losses) / max(len(epoch_losses), 1)
            reporter.log(state.global_step, {"loss": mean}, kind="epoch")
            reporter.say(f"📊 Epoch {state.epoch + 1} average loss: {mean:.4f}")
            state.epoch += 1
