"""Fan one OpenAI request out to Triton (one generation per choice) and gather their chunks."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from openai_frontend.errors import APIError
from openai_frontend.triton import Chunk, Generation, Triton


class Run:
    """The generations of one request, index i = choice i. start() awaits each one's first
    response, so that a request the engine refuses gets its error before any HTTP reply begins."""

    def __init__(self, triton: Triton, choices: list[tuple[str, dict]], stream: bool, request_id: str):
        self.gens: list[Generation] = [triton.generate(prompt, sampling, stream, request_id)
                                       for prompt, sampling in choices]
        self.first: list[Chunk] = []
        self.input_tokens = [0] * len(self.gens)
        self.output_tokens = [0] * len(self.gens)

    async def start(self) -> None:
        results = await asyncio.gather(*(g.next() for g in self.gens), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.cancel()
            raise next((e for e in errors if isinstance(e, APIError)), errors[0])
        self.first = results
        for i, chunk in enumerate(results):
            self._count(i, chunk)

    async def collect(self) -> list[Chunk]:
        """Whole texts (each generation answered in one response: Triton stream=False)."""
        await self.start()
        return self.first

    async def events(self) -> AsyncIterator[tuple[int, Chunk]]:
        for i, chunk in enumerate(self.first):
            yield i, chunk
        live = [i for i, g in enumerate(self.gens) if not g.ended]
        if len(live) == 1:
            i = live[0]
            while (chunk := await self.gens[i].next()) is not None:
                self._count(i, chunk)
                yield i, chunk
        elif live:
            async for i, chunk in self._merged(live):
                yield i, chunk

    async def _merged(self, live: list[int]) -> AsyncIterator[tuple[int, Chunk]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                while (chunk := await self.gens[i].next()) is not None:
                    queue.put_nowait((i, chunk, None))
            except BaseException as e:
                queue.put_nowait((i, None, e))
                return
            queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in live]
        try:
            left = len(tasks)
            while left:
                i, chunk, error = await queue.get()
                if error is not None:
                    raise error
                if chunk is None:
                    left -= 1
                    continue
                self._count(i, chunk)
                yield i, chunk
        finally:
            for t in tasks:
                t.cancel()

    def _count(self, i: int, chunk: Chunk) -> None:
        self.input_tokens[i] = self.input_tokens[i] or chunk.num_input_tokens
        self.output_tokens[i] += chunk.num_output_tokens

    def usage(self, n: int) -> dict:
        """Choices i*n ... i*n+n-1 share prompt i: its tokens count once."""
        prompt = sum(self.input_tokens[::n])
        completion = sum(self.output_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def cancel(self) -> None:
        for g in self.gens:
            g.cancel()
