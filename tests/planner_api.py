"""How planner_trace opens a row and runs a step, on the code of the day (the trace is the contract)."""
from hasten.core.pricing import KnownCosts
from hasten.core.sizing import CostAwareSize, FixedSize
from hasten.engine.planner import DraftPlanner
from hasten.engine.sequence import open_row, step


def sizing_for(rule, curve, batch_cost):
    return DraftPlanner(CostAwareSize(costs=KnownCosts(curve, batch_cost)) if rule == "auto" else FixedSize())


def open_sequence(row, prompt, drafter, request, acceptance, stats, planner, clock):
    sequence = open_row(request, drafter, lambda features: (row, list(prompt), None), planner, acceptance, stats)
    sequence.clock = clock
    return sequence


def run_step(target, sequences, planner):
    return step(target, sequences, planner)
