"""Catching a multi-client run whose clients stopped meeting at their steps.

Every step on a mesh that spans several clients waits, in its collectives,
for every client to run the same step. A client that never gets there (it
sleeps in a callback, reads data that never comes, deadlocks in Python)
keeps sending heartbeats, so TensorFlow waits forever. Each client of a
`tfmp.initialize` run with more than one client therefore keeps a watchdog
thread while Keras' `fit`, `evaluate` and `predict` run: the steps only note
which one they enter and finish (a Keras callback, no communication), and
the thread publishes that in the coordination service's key-value store
about once a second. When a step stays unfinished past its bound, the client
that sees it writes a verdict naming the clients that have not reached the
step, and every client's watchdog, on reading it, prints it (the clients it
names print their own Python stack: where they are), aborts its collectives
(the blocked step then raises with the verdict and the op it waited on:
`tfmp.strategy.peer_errors`) and, if the program is still alive after a
grace period, ends the process with status 1, as PyTorch's collective
watchdog does.

Custom training loops (`strategy.run` in the user's own `tf.function`) and
`*_on_batch` calls have no step callbacks: there each call of a TensorFlow
function on the main thread is a step (`watched_function_call`), and the
clients not inside one when another's has run past its bound are the ones
the others wait for.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

from tfmp import distributed
from tfmp.integrations.internals import eager_context as context
from tfmp.strategy.callback_lists import with_callback
from tfmp.strategy.peer_errors import VERDICT_MARKER, explain_peer_failure

_PROGRESS_KEY = "tfmp/watchdog/progress/{}"
_VERDICT_KEY = "tfmp/watchdog/verdict"
_SEEN_KEY = "tfmp/watchdog/seen/{}"
_POLL_S = 1.0
_KEY_WAIT_MS = 50
# How long a client lets its program raise the verdict before it ends it.
_GRACE_S = 10.0
_DEFAULT_FLOOR_S = 300.0
_SLOWEST_STEP_FACTOR = 20.0
_LIBRARIES = tuple(
    os.path.dirname(module.__file__) + os.sep
    for module in (tf, keras, sys.modules[__name__.split(".")[0]])
)


@dataclasses.dataclass
class _Progress:
    """What this client's main thread is doing, written by the step callback
    and read by the watchdog thread (one attribute write per step)."""

    entered: int = 0  # steps entered in this process, over every call
    finished: int = 0
    label: str = "no step yet"
    entered_at: float = 0.0
    first_of_call: bool = False
    slowest_s: float = 0.0
    # Set when steps are function calls (a custom loop), not Keras' steps:
    # clients may call other functions besides their steps (one logs more).
    by_function_calls: bool = False


class _Watchdog:
    """This client's watchdog thread and what the steps tell it."""

    def __init__(self, cluster: distributed.Cluster):
        self.cluster = cluster
        self.progress = _Progress()
        self._active_calls = 0
        self._wake = threading.Event()
        self._stopped = False
        self._published: str | None = None
        self._fired = False
        self._main = threading.main_thread().ident
        self._watches_function_calls = False
        self._functions_run: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="tfmp-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def watch_function_calls(self) -> None:
        """From now on, outside Keras' `fit`, `evaluate` and `predict`, each
        call of a TensorFlow function on the main thread is a step."""
        if not self._watches_function_calls:
            self._watches_function_calls = True
            self._wake.set()

    def function_call_began(self, name: Any) -> bool:
        """Notes a function call about to run on this thread as a step, if
        this is the main thread outside Keras' own calls; whether it did."""
        if not self._watches_function_calls or self._active_calls or threading.get_ident() != self._main:
            return False
        function = (name.decode() if isinstance(name, bytes) else str(name)).removeprefix("__inference_")
        function = function.rsplit("_", 1)[0]
        progress = self.progress
        progress.by_function_calls = True
        # DTensor expands a function and places it on the devices at its first call.
        progress.first_of_call = function not in self._functions_run
        self._functions_run.add(function)
        self.step_entered(f"the call of {function} at {_program_line()}")
        return True

    def _watching(self) -> bool:
        return self._active_calls > 0 or self._watches_function_calls

    def call_began(self) -> None:
        self._active_calls += 1
        self.progress.first_of_call = True
        self._wake.set()

    def call_ended(self) -> None:
        """Also when the call raised: a step it left open is over (and not
        timed: it may have waited for a failed peer)."""
        self.progress.finished = self.progress.entered
        self.progress.first_of_call = False
        self._active_calls = max(0, self._active_calls - 1)

    def step_entered(self, label: str) -> None:
        progress = self.progress
        progress.label = label
        progress.entered_at = time.monotonic()
        progress.entered += 1

    def step_finished(self) -> None:
        progress = self.progress
        if progress.finished == progress.entered:
            return
        if not progress.first_of_call:  # a first step's time is mostly tracing
            progress.slowest_s = max(progress.slowest_s, time.monotonic() - progress.entered_at)
        progress.first_of_call = False
        progress.finished = progress.entered

    def bound_s(self) -> float:
        return step_bound_s(self.progress.first_of_call, self.progress.slowest_s, self.cluster)

    def stop(self) -> None:
        """Ends the thread (at exit: before TensorFlow's context goes).

        A client the watchdog stopped ends here with status 1: its
        collectives are aborted, and TensorFlow's shutdown would wait for
        the stuck clients at its shutdown barrier.
        """
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=2 * _KEY_WAIT_MS / 1000 + 1)
        if self._fired:
            self._wait_until_seen()
            _end_process(self.cluster.client_id)

    def _wait_until_seen(self) -> None:
        """Waits (a few seconds at most) until every client read the verdict:
        the key-value store ends with client 0."""
        ctx = context.context()
        end = time.monotonic() + 3 * _POLL_S
        for client in range(self.cluster.num_clients):
            wait_ms = int(max(0.0, end - time.monotonic()) * 1000) + 1
            with contextlib.suppress(tf.errors.OpError):
                ctx.get_config_key_value(_SEEN_KEY.format(client), wait_ms)

    def _run(self) -> None:
        ctx = context.context()
        while not self._stopped:
            if not self._watching():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                self._publish(ctx)
                verdict = self._read_verdict(ctx)
                if verdict is None and self._overdue():
                    verdict = self._write_verdict(ctx)
            except tf.errors.OpError:
                # The coordination service went away (its client ended):
                # TensorFlow's own heartbeat check reports that.
                verdict = None
            if verdict is not None:
                self._stop_client(ctx, verdict)
                return
            self._wake.wait(_POLL_S)
            self._wake.clear()

    def _state(self) -> dict[str, Any]:
        progress = self.progress
        open_step = progress.entered > progress.finished
        return {
            "entered": progress.entered,
            "finished": progress.finished,
            "label": progress.label,
            "for_s": round(time.monotonic() - progress.entered_at, 1) if open_step else None,
            "by_function_calls": progress.by_function_calls and self._active_calls == 0,
        }

    def _publish(self, ctx: Any) -> None:
        text = json.dumps(self._state())
        if text == self._published:
            return
        key = _PROGRESS_KEY.format(self.cluster.client_id)
        if self._published is not None:
            ctx.delete_config_key_value(key)
        ctx.set_config_key_value(key, text)
        self._published = text

    def _read_verdict(self, ctx: Any) -> dict | None:
        try:
            return json.loads(ctx.get_config_key_value(_VERDICT_KEY, _KEY_WAIT_MS))
        except tf.errors.DeadlineExceededError:
            return None

    def _overdue(self) -> bool:
        progress = self.progress
        return progress.entered > progress.finished and time.monotonic() - progress.entered_at > self.bound_s()

    def _write_verdict(self, ctx: Any) -> dict:
        states = {}
        for client in range(self.cluster.num_clients):
            try:
                states[client] = json.loads(ctx.get_config_key_value(_PROGRESS_KEY.format(client), _KEY_WAIT_MS))
            except tf.errors.DeadlineExceededError:
                states[client] = None
        states[self.cluster.client_id] = self._state()
        behind = clients_behind(states)
        verdict = {"behind": behind, "message": stuck_verdict(behind, self.bound_s(), states)}
        try:
            ctx.set_config_key_value(_VERDICT_KEY, json.dumps(verdict))
        except tf.errors.AlreadyExistsError:  # another client's came first
            verdict = self._read_verdict(ctx)
        return verdict

    def _stop_client(self, ctx: Any, verdict: dict) -> None:
        self._fired = True
        client_id = self.cluster.client_id
        lines = [verdict["message"] + "\n"]
        if client_id in verdict["behind"]:
            frame = sys._current_frames().get(self._main)  # noqa: SLF001
            if frame is not None:
                lines.append(f"Client {client_id} is here (its main thread's Python stack):\n")
                lines.extend(traceback.format_stack(frame))
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
        with contextlib.suppress(tf.errors.OpError):
            ctx.set_config_key_value(_SEEN_KEY.format(client_id), "1")
        with contextlib.suppress(tf.errors.OpError):
            ctx.abort_collective_ops(tf.errors.DEADLINE_EXCEEDED, verdict["message"])
        end = time.monotonic() + _GRACE_S
        while time.monotonic() < end and not self._stopped:
            time.sleep(0.1)
        if not self._stopped:  # the main thread is not in a collective: it cannot be interrupted
            _end_process(self.cluster.client_id)


def _end_process(client_id: int) -> None:
    sys.stdout.flush()
    sys.stderr.write(f"tfmp watchdog: ended client {client_id} with status 1.\n")
    sys.stderr.flush()
    os._exit(1)


def step_bound_s(first_of_call: bool, slowest_s: float, cluster: distributed.Cluster) -> float:
    """How long a step may take: the first of a call (which traces) gets
    `first_step_timeout_s`; a later one `step_timeout_s`, else 300 s or 20
    times the slowest later step seen so far, whichever is longer."""
    if first_of_call:
        return cluster.first_step_timeout_s
    if cluster.step_timeout_s is not None:
        return cluster.step_timeout_s
    return max(_DEFAULT_FLOOR_S, _SLOWEST_STEP_FACTOR * slowest_s)


def _program_line() -> str:
    """`file:line` of the innermost frame of the program's own code."""
    frame = sys._getframe(1)  # noqa: SLF001
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame = frame.f_back
    if frame is None:
        return "an unknown place"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _position(state: dict | None) -> float:
    """How far a client got: steps entered, half a step more once finished."""
    if state is None:
        return -1.0
    return state["entered"] + (0.5 if state["finished"] == state["entered"] else 0.0)


def clients_behind(states: dict[int, dict | None]) -> list[int]:
    """The clients furthest behind (none when all are at the same point).

    Where steps are function calls (a custom loop), clients may have made
    other calls besides their steps: those not inside a call are behind."""
    if any(state and state.get("by_function_calls") for state in states.values()):
        behind = [client for client, state in sorted(states.items()) if state is None or state["for_s"] is None]
        return [] if len(behind) == len(states) else behind
    position = {client: _position(state) for client, state in states.items()}
    behind = sorted(client for client, p in position.items() if p == min(position.values()))
    return [] if len(behind) == len(states) else behind


def stuck_verdict(behind: list[int], bound_s: float, states: dict[int, dict | None]) -> str:
    """The message naming the clients `behind` that have not reached the
    step the others wait in; `states` holds each client's published progress.

    Example:

    >>> from tfmp.strategy.watchdog import clients_behind, stuck_verdict
    >>> states = {
    ...     0: {"entered": 5, "finished": 4, "label": "fit step 4 of epoch 0", "for_s": 8.1},
    ...     1: {"entered": 4, "finished": 4, "label": "fit step 3 of epoch 0", "for_s": None}}
    >>> print(stuck_verdict(clients_behind(states), 8.0, states).splitlines()[0])
    tfmp watchdog: client 1 has not reached fit step 4 of epoch 0, which client 0 entered 8.1 s ago (bound 8 s): the others wait for it in the step's collectives.
    """
    in_step = [client for client, state in states.items() if state and state["for_s"] is not None]
    ahead = max(in_step or states, key=lambda client: _position(states[client]))
    waited = states[ahead]
    where = []
    for client in sorted(states):
        state = states[client]
        if state is None:
            where.append(f"  client {client}: published no progress")
        elif state["for_s"] is None:
            where.append(f"  client {client}: finished {state['label']}, outside any step since")
        else:
            callbacks = "" if state.get("by_function_calls") else " (or its callbacks)"
            where.append(f"  client {client}: in {state['label']}{callbacks} for {state['for_s']:g} s")
    them = "it" if len(behind) == 1 else "them"
    head = (
        f"{VERDICT_MARKER} {_clients(behind)} {'has' if len(behind) == 1 else 'have'} not reached "
        f"{waited['label']}, which client {ahead} entered {waited['for_s']:g} s ago (bound "
        f"{bound_s:g} s): the others wait for {them} in the step's collectives."
        if behind
        else f"{VERDICT_MARKER} every client is in {waited['label']} and none finished it within "
        f"{bound_s:g} s: they wait for each other in collectives they do not agree on "
        "(different programs, models or layouts on different clients), or a device hangs."
    )
    fix = (
        f"Fix: look at {_clients(behind)}'s output, which shows where its Python code is "
        "(a callback, the input pipeline, a lock); if the step is legitimately that slow, "
        "raise the bound: tfmp.initialize(step_timeout_s=...) or TFMP_STEP_TIMEOUT "
        "(first_step_timeout_s / TFMP_FIRST_STEP_TIMEOUT for the first step of each call)."
        if behind
        else "Fix: run the same program, model and layout rules on every client; if the step "
        "is legitimately that slow, raise the bound: tfmp.initialize(step_timeout_s=...)."
    )
    return "\n".join([head, "Where each client is:", *where, fix])


def _clients(ids: list[int]) -> str:
    return "client " + str(ids[0]) if len(ids) == 1 else "clients " + ", ".join(map(str, ids))


class _StepWatch(keras.callbacks.Callback):
    """Tells this client's watchdog which step Keras runs (added last, so a
    step counts as finished after every other callback's `on_*_batch_end`)."""

    def __init__(self, watchdog: _Watchdog):
        super().__init__()
        self.watchdog = watchdog
        self._epoch = 0

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.watchdog.step_entered(f"fit step {batch} of epoch {self._epoch}")

    def on_test_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.watchdog.step_entered(f"evaluate step {batch}")

    def on_predict_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        self.watchdog.step_entered(f"predict step {batch}")

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.watchdog.step_finished()

    on_test_batch_end = on_predict_batch_end = on_train_batch_end


_watchdog: _Watchdog | None = None


def _this_clients_watchdog() -> _Watchdog | None:
    """The watchdog of this client of a run of several clients, else None."""
    global _watchdog
    cluster = distributed.cluster()
    if cluster is None or cluster.num_clients < 2:
        return None
    if _watchdog is None:
        _watchdog = _Watchdog(cluster)
    return _watchdog


def watch_custom_loop_steps() -> None:
    """A custom loop's `strategy.run` or a `*_on_batch` call: in a run of
    several clients, the watchdog bounds each function call of the main
    thread from now on (`watched_function_call`)."""
    watchdog = _this_clients_watchdog()
    if watchdog is not None:
        watchdog.watch_function_calls()


def watched_function_call(call_function: Callable) -> Callable:
    """TensorFlow's `Context.call_function`, which runs every call of a
    `tf.function`: a step of a custom loop (or of `*_on_batch`) for the
    watchdog, which Keras' step callbacks do not see."""

    @functools.wraps(call_function)
    def wrapper(self, name, tensor_inputs, num_outputs):
        watchdog = _watchdog
        if watchdog is None or not watchdog.function_call_began(name):
            return call_function(self, name, tensor_inputs, num_outputs)
        try:
            return call_function(self, name, tensor_inputs, num_outputs)
        except tf.errors.OpError as error:
            if VERDICT_MARKER not in str(error):
                raise
            # TensorFlow repeats the verdict once per device's collective.
            raise explain_peer_failure(error) from error
        finally:
            watchdog.step_finished()

    return wrapper


@contextlib.contextmanager
def watched_call() -> Iterator[None]:
    """Around a `fit`, `evaluate` or `predict` whose callbacks went through
    `with_step_watch`: the watchdog watches while it runs."""
    watchdog = _this_clients_watchdog()
    if watchdog is None:
        yield
        return
    watchdog.call_began()
    try:
        yield
    finally:
        watchdog.call_ended()


def with_step_watch(callbacks: Any) -> Any:
    """`callbacks` (None, a list or a `CallbackList`) with this client's
    `_StepWatch` last, in a run of several clients; else as they are."""
    watchdog = _this_clients_watchdog()
    if watchdog is None:
        return callbacks
    return with_callback(callbacks, lambda: _StepWatch(watchdog), _StepWatch)
