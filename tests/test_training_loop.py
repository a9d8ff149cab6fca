"""hasten's one training loop (core.training_loop): the updates of the hand-written loops it
replaced, bit for bit; time budgets (timed by a test clock that a batch advances); checkpoints
and evaluations at their cadence; a resumed run that continues exactly."""
from __future__ import annotations

import copy
import json
from dataclasses import asdict

import pytest
import torch

from hasten.core.schedule import adamw, optimizer_step, warmup_cosine
from hasten.core.training_loop import Budget, Checkpoints, RunState, Schedule, TrainingLoop


class Task:
    """A tiny regression: a seeded model, seeded batches, and a clock that each batch moves on by
    ``seconds_per_batch`` (the loop's time budget measured without a real clock)."""

    def __init__(self, seed: int = 0, seconds_per_batch: float = 1.0):
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.optimizer = adamw([{"params": list(self.model.parameters()), "lr": 0.05, "weight_decay": 0.01}])
        self.generator = torch.Generator().manual_seed(seed)
        self.seconds_per_batch, self.now, self.batches = seconds_per_batch, 0.0, 0
        self.rates: list[float] = []  # the learning rate of each update

    def loss(self) -> torch.Tensor:
        self.now += self.seconds_per_batch
        self.batches += 1
        x = torch.randn(16, 4, generator=self.generator)  # [batch, 4]
        return torch.nn.functional.mse_loss(self.model(x), x[:, :2].sin())

    def clock(self) -> float:
        return self.now

    def record_rate(self, state: RunState | None = None) -> None:
        self.rates.append(self.optimizer.param_groups[0]["lr"])

    def loop(self, schedule: Schedule, budget: Budget, **extra) -> TrainingLoop:
        return TrainingLoop(self.optimizer, self.loss, schedule, budget, after_step=self.record_rate,
                            clock=self.clock, show_progress=False, **extra)

    def same_as(self, other: Task) -> bool:
        return self.rates == other.rates and all(
            torch.equal(a, b) for a, b in zip(self.model.state_dict().values(), other.model.state_dict().values()))


# ---- the hand-written loops the trainers had, as references -----------------------------------
@torch.enable_grad()  # (each trainer turned autograd on, as the loop does: the tests run without it)
def steps_reference(task: Task, steps: int) -> None:
    """The diffusion recipes' loop: a step budget, warmup over a 20th of it, cosine to 0 over the steps."""
    warmup = max(1, steps // 20)
    for step in range(steps):
        optimizer_step(task.optimizer, task.loss(), warmup_cosine(step, warmup, step / steps))
        task.record_rate()


@torch.enable_grad()
def planned_steps_reference(task: Task, total: int, warmup: int, clip: float, no_label_at: int) -> None:
    """The drafter trainer's loop: cosine to 10% over the steps after the warmup; a batch without
    labels (here: batch ``no_label_at``) counts as a step but updates nothing."""
    for step in range(total):
        progress = 0.0 if step < warmup else (step - warmup) / max(1, total - warmup)
        scale = warmup_cosine(step, warmup, progress, 0.1)
        loss = task.loss()
        if step == no_label_at:
            loss = loss.detach()
        if loss.requires_grad:
            optimizer_step(task.optimizer, loss, scale, clip)
        task.record_rate()


@torch.enable_grad()
def timed_reference(task: Task, budget_s: float, max_steps: int, warmup: int) -> None:
    """The zoo's loop: a time budget and max_steps, the cosine (to 10%) following whichever is further spent."""
    start, step = task.clock(), 0
    while (elapsed := task.clock() - start) < budget_s and step < max_steps:
        progress = max(elapsed / budget_s, step / max_steps)
        loss = task.loss()
        optimizer_step(task.optimizer, loss, warmup_cosine(step, warmup, progress, 0.1))
        step += 1
        task.record_rate()


def test_a_step_budget_updates_as_the_hand_written_loop_did():
    reference, shared = Task(), Task()
    steps_reference(reference, 40)
    state = shared.loop(Schedule(warmup_steps=2), Budget(steps=40)).run()
    assert state.step == 40 and shared.same_as(reference)


def test_a_step_plan_with_the_cosine_after_the_warmup_updates_as_the_hand_written_loop_did():
    reference, shared = Task(), Task()
    planned_steps_reference(reference, total=30, warmup=6, clip=0.05, no_label_at=11)
    real_loss = shared.loss

    def loss_without_labels_at_11():  # the drafter's loss: (loss, metrics)
        loss = real_loss()
        return (loss.detach() if shared.batches == 12 else loss), {"accuracy": 0.5}

    shared.loss = loss_without_labels_at_11
    schedule = Schedule(warmup_steps=6, final_ratio=0.1, paced_by_time=False, cosine_after_warmup=True, clip=0.05)
    state = shared.loop(schedule, Budget(steps=30)).run()
    assert state.step == 30 and shared.same_as(reference)
    assert state.recent_metrics()["accuracy"] == 0.5 and len(state.metrics) == 30


@pytest.mark.parametrize("seconds_per_batch, stops_after", [(1.0, 10), (1.5, 8)])  # by steps, by time
def test_a_time_budget_updates_as_the_hand_written_loop_did(seconds_per_batch, stops_after):
    reference, shared = Task(seconds_per_batch=seconds_per_batch), Task(seconds_per_batch=seconds_per_batch)
    timed_reference(reference, budget_s=12.0, max_steps=10, warmup=3)
    state = shared.loop(Schedule(warmup_steps=3, final_ratio=0.1), Budget(steps=10, seconds=12.0)).run()
    assert state.step == stops_after == len(reference.rates) and shared.same_as(reference)
    assert state.elapsed_s == stops_after * seconds_per_batch


# ---- time budgets --------------------------------------------------------------------------------
def test_a_time_budget_stops_the_run_when_spent():
    task = Task(seconds_per_batch=2.0)
    state = task.loop(Schedule(warmup_steps=2), Budget(seconds=15.0)).run()
    assert state.step == 8 and state.elapsed_s == 16.0 and state.planned_steps is None
    assert task.rates[-1] < task.rates[2]  # the cosine followed the time


def test_a_step_paced_run_on_a_time_budget_plans_its_steps_in_the_warmup():
    timed, counted = Task(), Task()
    schedule = Schedule(warmup_steps=5, final_ratio=0.1, paced_by_time=False, cosine_after_warmup=True)
    state = timed.loop(schedule, Budget(seconds=30.0)).run()
    assert state.planned_steps == state.step == 30  # one second a step: 30 steps fit
    counted.loop(schedule, Budget(steps=30)).run()
    assert timed.same_as(counted)


def test_a_budget_needs_a_limit():
    with pytest.raises(ValueError, match="steps or seconds"):
        Budget()


# ---- checkpoints and evaluations ------------------------------------------------------------------
class Recorder:
    """Checkpoints' two callbacks: a held-out 'loss' (the step, so records are easy to read) and a
    save that keeps the run's state, weights and moments as a checkpoint file would."""

    def __init__(self, task: Task):
        self.task, self.saved = task, []

    def evaluate(self, state: RunState) -> dict:
        return {"loss": float(state.step)}

    def save(self, state: RunState) -> None:
        self.saved.append((json.dumps(asdict(state)), copy.deepcopy(self.task.model.state_dict()),
                           copy.deepcopy(self.task.optimizer.state_dict()), self.task.generator.get_state(),
                           self.task.now))

    def checkpoints(self, **cadence) -> Checkpoints:
        return Checkpoints(self.evaluate, self.save, **cadence)


def test_checkpoints_every_few_steps_at_the_start_and_at_the_end():
    task = Task()
    recorder = Recorder(task)
    state = task.loop(Schedule(), Budget(steps=7), checkpoints=recorder.checkpoints(every_steps=3, at_start=True)).run()
    assert [e["step"] for e in state.evals] == [0, 3, 6, 7] and len(recorder.saved) == 4
    assert state.evals[1] == {"step": 3, "minutes": round(3 / 60, 2), "loss": 3.0}
    assert json.loads(recorder.saved[-1][0])["evals"] == state.evals  # saved after the evaluation is recorded


def test_checkpoints_every_few_seconds_and_none_twice_at_the_end():
    task = Task(seconds_per_batch=1.0)
    recorder = Recorder(task)
    state = task.loop(Schedule(), Budget(steps=8), checkpoints=recorder.checkpoints(every_seconds=4.0)).run()
    assert [e["step"] for e in state.evals] == [4, 8]  # the last step had one: no second at the end


def test_a_resumed_run_continues_bit_for_bit():
    straight = Task()
    schedule, budget = Schedule(warmup_steps=3, final_ratio=0.1), Budget(steps=9, seconds=100.0)
    straight_state = straight.loop(schedule, budget, checkpoints=Recorder(straight).checkpoints(every_steps=4, at_start=True)).run()

    interrupted = Task()
    recorder = Recorder(interrupted)
    real_loss = interrupted.loss

    def stopped_in_step_7():
        if interrupted.batches == 6:
            raise KeyboardInterrupt
        return real_loss()

    interrupted.loss = stopped_in_step_7
    with pytest.raises(KeyboardInterrupt):
        interrupted.loop(schedule, budget, checkpoints=recorder.checkpoints(every_steps=4, at_start=True)).run()
    saved, weights, moments, generator, now = recorder.saved[-1]  # the checkpoint of step 4
    resumed = Task()
    resumed.model.load_state_dict(weights)
    resumed.optimizer.load_state_dict(moments)
    resumed.generator.set_state(generator)
    resumed.now, resumed.rates = now, straight.rates[:4]
    state = resumed.loop(schedule, budget, checkpoints=Recorder(resumed).checkpoints(every_steps=4, at_start=True)).run(
        RunState.restored({**json.loads(saved), "a trainer's own": 1}))
    assert resumed.same_as(straight) and state.evals == straight_state.evals  # no second evaluation at the start
    assert state.step == 9 and state.elapsed_s == straight_state.elapsed_s
