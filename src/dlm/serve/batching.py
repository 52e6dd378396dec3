"""Dynamic batching: requests that arrive within a short window and decode alike (same options, same max_tokens,
greedy) run as one batched `generate` call in the decoding thread, one batch at a time. The samplers are
batch-invariant for greedy decoding, so each row gets what it would get alone. Sampled requests (temperature > 0,
and every simplex request: its noise is drawn for the whole batch) decode alone, with their own seeded generator.

A client that leaves (disconnect or timeout) is dropped from the queue; once a batch is under way its rows cannot
be removed from the sampler's tensors, so its results are discarded, and a batch whose every client has left is
stopped at its next denoising step (masked and simplex samplers; the AR sampler has no step hook and runs to its
end)."""

from __future__ import annotations

import asyncio
import logging
import random
from concurrent.futures import ThreadPoolExecutor

from dlm.errors import DlmError
from dlm.modeling.device import make_generator
from dlm.sampling import generate
from dlm.serve.stream import Job, StepFeed

log = logging.getLogger("dlm.serve")


class Abandoned(Exception):
    """Every client of a batch has left: stop decoding it."""


class Batcher:
    """Collects jobs, groups compatible ones into batches of at most `max_batch_size` rows, decodes them in one
    worker thread. `stats` counts batches, rows, the largest batch and the batches stopped for lack of clients."""

    def __init__(self, model, tok, max_batch_size: int = 8, window_s: float = 0.01):
        self.model, self.tok = model, tok
        self.max_batch_size, self.window_s = max_batch_size, window_s
        self.pending: list[Job] = []
        self.current: list[Job] = []  # the batch being decoded
        self.running = 0  # its rows
        self.stats = {"batches": 0, "rows": 0, "largest_batch": 0, "abandoned": 0, "failed": 0}
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlm-decode")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop collecting; the batch under way stops at its next step (nobody waits for it any more)."""
        for job in self.current + self.pending:
            job.cancelled = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Job) -> None:
        self.pending.append(job)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.window_s)  # let concurrent requests join
            batch = self._take()
            if not self.pending:
                self._wake.clear()
            if batch:
                self.current, self.running = batch, sum(len(j.rows) for j in batch)
                try:
                    await loop.run_in_executor(self._pool, self._decode, batch)
                finally:
                    self.current, self.running = [], 0

    def _take(self) -> list[Job]:
        """The next batch: the oldest live job and the later ones with its key, up to max_batch_size rows."""
        self.pending = [j for j in self.pending if not j.cancelled]
        if not self.pending:
            return []
        first = self.pending[0]
        batch, rows = [first], len(first.rows)
        if first.key is not None:
            for job in self.pending[1:]:
                if job.key == first.key and rows + len(job.rows) <= self.max_batch_size:
                    batch.append(job)
                    rows += len(job.rows)
        taken = {id(j) for j in batch}
        self.pending = [j for j in self.pending if id(j) not in taken]
        return batch

    def _decode(self, batch: list[Job]) -> None:
        """One batched `generate` call (decoding thread); each job gets its rows' results or the error."""
        ids = [row for job in batch for row in job.rows]
        spans, start = [], 0
        for job in batch:
            spans.append(slice(start, start + len(job.rows)))
            start += len(job.rows)
        first, P = batch[0], max(map(len, ids))
        # Every diffusion step passes through the feed: streams get their events, and a batch nobody waits for stops.
        feed = StepFeed(lambda step: self._on_step(batch, spans, step, P)) if first.family != "autoregressive" else None
        if first.family == "simplex" or first.temperature > 0:  # these run alone (key None)
            seed = first.seed if first.seed is not None else random.getrandbits(63)
            generator = make_generator(seed, self.model)
        else:
            generator = None  # greedy masked / AR decoding draws nothing
        self.stats["batches"] += 1
        self.stats["rows"] += len(ids)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(ids))
        try:
            out = generate(self.model, ids, first.options, max_new_tokens=first.max_tokens,
                           eos_id=self.tok.eos_token_id, pad_id=self.tok.pad_token_id,
                           temperature=first.temperature, generator=generator, trace=feed)
        except Abandoned:
            self.stats["abandoned"] += 1
            return
        except Exception as err:  # a sampler's refusal, a bug, out of memory: this batch fails, the server goes on
            if not isinstance(err, DlmError):
                log.exception("decoding a batch of %d rows failed", len(ids))
            self.stats["failed"] += 1
            for job in batch:
                job.fail(err)
            return
        for job, span in zip(batch, spans):
            if not job.cancelled:
                job.finish(out.tokens[span], out.nfe[span])

    def _on_step(self, batch: list[Job], spans: list[slice], step: dict, P: int) -> None:
        if all(job.cancelled for job in batch):
            raise Abandoned
        for job, span in zip(batch, spans):
            if job.stream and not job.cancelled:
                job.step(step, span, P)
