"""The ops a profiled tf.function call ran (no TensorFlow): TensorFlow's
host profiler names each op by its node in the function it ran in, and a
function called from the step runs in an executor of its own; each op is
named here as the step's graph would name it, ``call/node`` (the call op's
name first)."""
import collections
from typing import Any, Dict, Iterable, List, Tuple

__all__ = ["Event", "step_ops"]

# (thread, name, start, end in microseconds, arguments), as ``compat.tf.profiled_events`` gives.
Event = Tuple[Any, str, float, float, Dict[str, str]]

_CALL_STARTS = "ExecutorState::ProcessAsync::Start"
_CALLS = ("StatefulPartitionedCall", "PartitionedCall")
_RUN = "FunctionRun"  # a called function starts: its executor's id
_PROCESS = "ExecutorState::Process"  # an executor runs ops: its id


def step_ops(events: Iterable[Event]) -> List[Tuple[str, float, float]]:
    """(name in the step's graph, start, end) of every op event: ops of a
    function the step called prefixed by the call op's name (and its
    caller's, for calls within calls)."""
    threads: Dict[Any, List[Event]] = collections.defaultdict(list)
    for event in events:
        threads[event[0]].append(event)
    called: Dict[str, Tuple[str, str]] = {}  # executor id -> (caller's executor id, call op)
    ran: List[Tuple[str, float, float, str]] = []
    for thread in threads.values():
        thread.sort(key=lambda e: (e[2], -e[3]))
        _read_thread(thread, called, ran)
    return [(_named(node, executor, called), start, end) for node, start, end, executor in ran]


def _read_thread(events: List[Event], called: Dict[str, Tuple[str, str]],
                 ran: List[Tuple[str, float, float, str]]) -> None:
    """Calls made and ops run on one thread (events by start): an op belongs
    to the innermost executor run enclosing it, a function run to the call
    started just before it on this thread."""
    running: List[Event] = []  # executor runs enclosing the current event
    call = None  # (caller's executor id, call op, end of its start)
    for event in events:
        _, name, start, end, args = event
        while running and running[-1][3] < start:
            running.pop()
        if name == _PROCESS and "id" in args:
            running.append(event)
        elif name == _CALL_STARTS and args.get("kernel_type") in _CALLS:
            call = (args.get("step_id", ""), args.get("name", ""), end)
        elif name == _RUN and call is not None and start <= call[2]:
            called[args.get("id", "")] = call[:2]
            call = None
        elif "long_name" in args:
            ran.append((args["long_name"].rsplit(":", 1)[0], start, end,
                        running[-1][4]["id"] if running else ""))


def _named(node: str, executor: str, called: Dict[str, Tuple[str, str]]) -> str:
    seen = set()
    while executor in called and executor not in seen:
        seen.add(executor)
        executor, call = called[executor]
        node = f"{call}/{node}"
    return node
