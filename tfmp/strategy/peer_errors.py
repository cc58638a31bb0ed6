"""Errors of a step that another client caused, told as what they are.

When a client of a multi-client run dies or hangs, the survivors' steps fail
in their collectives with TensorFlow's words for it: the coordination
service's heartbeat check ("The following tasks are unhealthy (stopped
sending heartbeats)"), a collective aborted, a connection reset. Those are
neither a layout problem nor this client's: tfmp names the client and what
happened to it, and says where to look. TensorFlow's error class is kept
(code that catches `tf.errors.UnavailableError` still does), and the
original error is chained.
"""

from __future__ import annotations

import re

import tensorflow as tf

from tfmp import distributed

# Written in tfmp's watchdog's verdict (`tfmp.strategy.watchdog`) and so in
# TensorFlow's error after the watchdog aborted the collectives.
VERDICT_MARKER = "tfmp watchdog:"

_TASK = re.compile(r"/job:[\w-]+(?:/replica:\d+)?/task:(\d+)")
_NODE = re.compile(r"\[\[\{\{node ([^}]+)\}\}\]\]")
_FUNCTION_NODE = re.compile(r"\{\{function_node [^}]*\}\}\s*")
# (words in TensorFlow's message, what they say happened to the client).
_SIGNS = (
    ("stopped sending heartbeats", "stopped sending heartbeats: it crashed, was killed or cannot reach the others"),
    ("heartbeat", "missed its heartbeats: it crashed, was killed or cannot reach the others"),
    ("Connection reset", "closed its connection: it crashed or was killed"),
    ("Socket closed", "closed its connection: it crashed or was killed"),
    ("Connection refused", "cannot be reached: it is not running"),
    ("failed to connect", "cannot be reached: it is not running, or the network is down"),
    ("coordination service", "lost its connection to the coordination service"),
    ("CoordinationService", "lost its connection to the coordination service"),
    ("Collective ops is aborted", "aborted the collectives"),
)
# TensorFlow's last line of an aborted collective; the watchdog says more.
_RESTART = "The error could be from a previous operation. Restart your program to reset."
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError)


def is_peer_failure(error: BaseException) -> bool:
    """Whether `error` is a step failing because another client stopped,
    hung or cannot be reached (or tfmp's watchdog stopped the run)."""
    if not isinstance(error, tf.errors.OpError):
        return False
    text = str(error)
    return VERDICT_MARKER in text or isinstance(error, _PEER_ERRORS) or any(sign in text for sign, _ in _SIGNS)


def explain_peer_failure(error: tf.errors.OpError) -> tf.errors.OpError:
    """An error of `error`'s class naming the client and the fix.

    Example:

    >>> import tensorflow as tf
    >>> from tfmp.strategy.peer_errors import explain_peer_failure
    >>> lost = tf.errors.UnavailableError(None, None, "Collective ops is aborted by: The "
    ...     "following tasks are unhealthy (stopped sending heartbeats):\\n"
    ...     "/job:worker/replica:0/task:1\\n\\t [[{{node loss/DTensorAllReduceOp}}]]")
    >>> print(explain_peer_failure(lost).message.splitlines()[0])
    tfmp: client 1 of the run stopped sending heartbeats: it crashed, was killed or cannot reach the others. This client's op 'loss/DTensorAllReduceOp' waited for it (a multi-client failure, not a layout or model problem).
    """
    text = str(error)
    node = _NODE.search(text)
    waited = f"op {node.group(1)!r}" if node else "step"
    if VERDICT_MARKER in text:
        verdict = text[text.index(VERDICT_MARKER):]
        fix = verdict.find("\nFix: ")
        if fix != -1:  # TensorFlow repeats the verdict once per device's collective
            end = verdict.find("\n", fix + 1)
            verdict = verdict if end == -1 else verdict[:end]
        verdict = _NODE.sub("", verdict.replace(_RESTART, "")).rstrip()  # the op is named above
        message = f"tfmp: the run is stuck: this client's {waited} waited for the others.\n{verdict}"
    else:
        happened = next((said for sign, said in _SIGNS if sign in text), "stopped or cannot be reached")
        message = (
            f"tfmp: {_peers(text)} of the run {happened}. This client's {waited} waited for "
            "it (a multi-client failure, not a layout or model problem).\n"
            "Fix: look at that client's output for the first error (an exception, a kill, "
            "running out of memory, a preemption), then start every client again; "
            "keras.callbacks.BackupAndRestore resumes from the last backup."
            f"\nTensorFlow said: {_FUNCTION_NODE.sub('', text).strip().splitlines()[0]}"
        )
    return type(error)(error.node_def, error.op, message)


def _peers(text: str) -> str:
    """'client 1' (the other clients TensorFlow names), or 'a client'."""
    cluster = distributed.cluster()
    me = None if cluster is None else cluster.client_id
    named = []
    for found in _TASK.finditer(text):
        client = int(found.group(1))
        if client != me and client not in named:
            named.append(client)
    if not named:
        return "another client"
    return ("client " if len(named) == 1 else "clients ") + ", ".join(map(str, named))
