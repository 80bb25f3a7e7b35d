"""Async plumbing between the AsyncEngine and HTTP: merged streams, client disconnects, SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from samebits.engine.outputs import RequestOutput


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def merged(gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from several engine streams, as they come.

    Leaving early (an error, a disconnect) cancels the pumps, which closes every engine
    stream and so aborts its request.
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    pending = len(tasks)
    try:
        while pending:
            i, item = await queue.get()
            if item is None:
                pending -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def finals(gens: list) -> list[RequestOutput]:
    """Every stream's last (finished) output, in prompt order."""
    last: dict[int, RequestOutput] = {}
    async for i, out in merged(gens):
        last[i] = out
    return [last[i] for i in range(len(gens))]


async def unless_disconnected(request, coro):
    """Await coro; if the client goes away first, cancel it (aborting its requests)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_disconnect(request))
    done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def _disconnect(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(obj) -> str:
    """One server-sent event carrying a JSON object (NaN never occurs: see formats.finite)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
