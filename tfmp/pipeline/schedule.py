"""Pipeline schedules: the order in which each stage runs its micro-batches."""

from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Action(NamedTuple):
    """One stage's forward or backward pass of one micro-batch."""

    kind: str  # "forward" or "backward"
    stage: int
    microbatch: int


def stage_orders(schedule: str, num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Each stage's actions, in the order that stage runs them.

    `"gpipe"`: every forward, then every backward. `"1f1b"`: stage `k` runs
    `num_stages - k - 1` forwards ahead, then alternates one forward and one
    backward, then finishes the backwards; so it holds at most
    `num_stages - k` micro-batches' activations at a time.
    """
    orders = []
    for stage in range(num_stages):
        forwards = [Action("forward", stage, i) for i in range(num_microbatches)]
        backwards = [Action("backward", stage, i) for i in range(num_microbatches)]
        if schedule == "gpipe":
            orders.append(forwards + backwards)
            continue
        warmup = min(num_stages - stage - 1, num_microbatches)
        order = forwards[:warmup]
        for i in range(num_microbatches - warmup):
            order += [forwards[warmup + i], backwards[i]]
        orders.append(order + backwards[num_microbatches - warmup :])
    return orders


def emission_order(orders: list[list[Action]]) -> list[Action]:
    """All actions in one sequence that respects both each stage's order and
    the data flow: a forward after the previous stage's forward of its
    micro-batch, a backward after the next stage's backward of it."""
    num_stages = len(orders)
    done: set[Action] = set()
    position = [0] * num_stages
    sequence = []
    while any(position[s] < len(orders[s]) for s in range(num_stages)):
        progressed = False
        for stage in range(num_stages):
            if position[stage] == len(orders[stage]):
                continue
            action = orders[stage][position[stage]]
            if _inputs(action, num_stages) <= done:
                sequence.append(action)
                done.add(action)
                position[stage] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"Pipeline schedule deadlocks at {position}.")
    return sequence


def _inputs(action: Action, num_stages: int) -> set[Action]:
    stage, i = action.stage, action.microbatch
    if action.kind == "forward":
        return {Action("forward", stage - 1, i)} if stage > 0 else set()
    needed = {Action("forward", stage, i)}
    if stage < num_stages - 1:
        needed.add(Action("backward", stage + 1, i))
    return needed
