"""The responses a server keeps (the Responses API's `store`): each with its conversation and input items, the
most recent STORED_RESPONSES in memory, and a background response's run, whose events are kept for clients to read
from any point while it runs and after.
"""

import asyncio
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import UserError
from .schemas import event_sse
from .worker import Job

STORED_RESPONSES = 1024  # kept for previous_response_id and GET; the oldest is forgotten first


class ResponseNotFound(Exception):
    """A response id this server does not hold (HTTP 404, as OpenAI answers)."""


@dataclass
class Stored:
    """A kept response: the object, the conversation up to and with its reply (for previous_response_id; None while a
    background response runs), its request's input items (for input_items), and its run where it was a background
    one."""

    response: dict
    conversation: list[dict] | None
    input_items: list[dict]
    run: "BackgroundRun | None" = None


class ResponseStore:
    """The most recent responses (Stored), thread-safe; the oldest is forgotten first."""

    def __init__(self, capacity: int = STORED_RESPONSES):
        self.capacity, self.kept, self.lock = capacity, OrderedDict(), threading.Lock()

    def put(self, stored: Stored) -> None:
        with self.lock:
            self.kept[stored.response["id"]] = stored
            while len(self.kept) > self.capacity:
                self.kept.popitem(last=False)

    def get(self, response_id: str) -> Stored:
        with self.lock:
            if response_id not in self.kept:
                raise ResponseNotFound(f"response {response_id!r} not found (this server keeps its last "
                                       f"{self.capacity} stored responses, in memory)")
            return self.kept[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self.lock:
            self.kept.pop(response_id, None)


def listed(items: list[dict], order: str, limit: int, after: str | None) -> dict:
    """A page of items as OpenAI's list endpoints answer: `order` asc or desc, at most `limit`, after the item
    `after`."""
    if order not in ("asc", "desc"):
        raise UserError(f"order must be asc or desc, got {order!r}")
    if not 1 <= limit <= 100:
        raise UserError(f"limit must be in [1, 100], got {limit}")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise UserError(f"after: no input item {after!r} in this response")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


class BackgroundRun:
    """A background response's events, numbered as they come and kept, so that a client can read them from any
    point while it runs and after (GET ... ?stream=true&starting_after=N); and its job, for cancel."""

    def __init__(self, job: Job):
        self.job, self.events, self.done, self.cancelled = job, [], False, False
        self.changed = asyncio.Event()
        self.task: asyncio.Task | None = None  # what reads the job's pieces into events (Responses.run)

    def add(self, event: dict) -> None:
        self.events.append({**event, "sequence_number": len(self.events)})
        self.changed.set()  # wakes the readers waiting on it; the next event gets a new one
        self.changed = asyncio.Event()

    def end(self) -> None:
        self.done = True
        self.changed.set()

    async def follow(self, after: int):
        """The events after the `after`-th (-1: all), then each as it comes, until the run ends."""
        at = max(after + 1, 0)
        while True:
            changed = self.changed
            while at < len(self.events):
                yield event_sse(self.events[at])
                at += 1
            if self.done:
                return
            await changed.wait()
