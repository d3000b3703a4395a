"""A Grid that collects replies as soon as they arrive.

Under ``flwr run`` in deployment the ServerApp gets Flower's ``HttpGrid``, whose
``send_and_receive`` pulls the replies, then sleeps 3 s before pulling again (Flower 1.41-1.42
hard-code it). A round whose replies arrive just after a pull therefore waits up to 3 s for
nothing, in every phase. ``PromptGrid`` wraps the grid the ServerApp is given and does the same
push-then-pull with a short, growing pause between pulls (``FIRST_PAUSE_S`` up to
``MAX_PAUSE_S``, the simulation engine's own 0.1 s), so a reply is seen within 0.1 s of
reaching the SuperLink. A pull that brings replies starts the pauses over: replies come one
after another (clients share the cores, or finish at similar times), so once one is in the
next is likely near, and the round's last reply is seen within a short pause rather than a
grown one. A pull is one small request to the SuperLink on the ServerApp's own machine.
In simulation the engine's prompt hand-offs (``fedfm_flower.simulation.prompt_engine``) cut both
waits short: a push sets ``PUSHED`` (the engine picks the messages up at once) and a pause ends when
the engine stores a reply (``REPLIED``). Everything else is the wrapped grid's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from flwr.app import Message
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=E0611
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from fedfm_flower.simulation.prompt_engine import PUSHED, REPLIED
from fedfm_flower.simulation.waits import GrowingWait

FIRST_PAUSE_S = 0.01
MAX_PAUSE_S = 0.1
GROWTH = 1.5


def pauses(first: float = FIRST_PAUSE_S, limit: float = MAX_PAUSE_S) -> GrowingWait:
    """The pauses between pulls: ``first``, growing by ``GROWTH``, capped at ``limit``."""
    return GrowingWait(first, limit, GROWTH)


def until_replied(seconds: float) -> None:
    """Wait ``seconds``, or less when the simulation engine stores a reply meanwhile
    (``fedfm_flower.simulation.prompt_engine``; elsewhere nothing sets it and this is a sleep)."""
    REPLIED.wait(seconds)


def push_and_pull(
    grid: Grid,
    messages: Iterable[Message],
    timeout: float | None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = until_replied,
) -> list[Message]:
    """Push ``messages``, then pull until every one has a reply or ``timeout`` seconds have
    passed (None: no limit); returns the replies received, as ``Grid.send_and_receive``."""
    waiting = set(grid.push_messages(messages))
    PUSHED.set()
    deadline = None if timeout is None else clock() + timeout
    replies: list[Message] = []
    schedule = pauses()
    while True:
        REPLIED.clear()  # a reply stored from here on ends the pause after this pull
        pulled = list(grid.pull_messages(waiting))
        replies.extend(pulled)
        waiting.difference_update(m.metadata.reply_to_message_id for m in pulled)
        if not waiting:
            break
        if pulled:  # progress: the next reply is likely near
            schedule.restart()
        pause = next(schedule)
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                break
            pause = min(pause, left)
        sleep(pause)
    return replies


class PromptGrid(Grid):
    """``grid`` with a ``send_and_receive`` that pulls every 0.01-0.1 s instead of every 3 s."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run: Run) -> None:
        """As the wrapped grid."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped grid's run."""
        return self.grid.run

    def create_message(self, *args, **kwargs) -> Message:  # noqa: ANN002, ANN003
        """As the wrapped grid."""
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        """As the wrapped grid."""
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        """As the wrapped grid."""
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """As the wrapped grid; then wakes the simulation engine's pickup (``PUSHED``)."""
        ids = list(self.grid.push_messages(messages))
        PUSHED.set()
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """As the wrapped grid."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push, then pull with short pauses until every reply is in or ``timeout`` passes."""
        return push_and_pull(self.grid, messages, timeout)
