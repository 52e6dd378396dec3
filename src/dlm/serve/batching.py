"""The decoding scheduler: continuous batching. One decoding thread runs a batch of rows (a prompt per choice) one
step at a time (`dlm.sampling.continuous`); at every step boundary waiting requests join the running batch, up to
`max_batch_size` rows, and finished rows leave it, their request answered as soon as its last row is done. Rows of
any prompt length, join time and sampler options share a step: full-canvas masked rows at any step, block-causal rows
with their own KV cache (a row in its block's first step computes its just-finished block with it), AR rows one
token per step with their own KV cache. Greedy rows get what they get decoded alone; a sampled request draws from its
own seeded generator, shared by its rows, so its answer depends on its seed, not on the traffic beside it.

Requests whose decoding has no row form decode as one whole batch between two steps (the running rows wait):
simplex requests (TESS 2's reverse process draws its noise for the whole batch), Fast-dLLM's approximate caches and
a block-causal model without its KV cache. Compatible ones (same options, same max_tokens, greedy: `Job.key`) share
that batch; sampled ones decode alone with their own generator. `continuous=False` decodes every request that way
(the static batching the load benchmark compares against).

A client that leaves (disconnect, timeout, a stream that stops reading) cancels its job: its rows leave the batch at
the next step; a whole batch nobody waits for stops at its next denoising step."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor

from dlm.errors import DlmError
from dlm.modeling.device import make_generator
from dlm.sampling import generate
from dlm.sampling.continuous import Batch, Row, has_rows, make_row
from dlm.serve.stream import Job, StepFeed

log = logging.getLogger("dlm.serve")


def _deliver(events: list) -> None:
    """Hand (job, event) pairs to their event loop with one wake-up instead of one per event."""
    loop = events[0][0].loop
    try:
        loop.call_soon_threadsafe(lambda: [job._queue(event) for job, event in events if not job.cancelled])
    except RuntimeError:  # the event loop is closed: the server is stopping
        pass


class Abandoned(Exception):
    """Every client of a batch has left: stop decoding it."""


class Batcher:
    """Schedules jobs into the running batch (at most `max_batch_size` rows) and decodes in one worker thread.
    `stats` counts steps, rows, the largest step, whole batches, jobs stopped for lack of clients and failures."""

    def __init__(self, model, tok, max_batch_size: int = 8, window_s: float = 0.01, continuous: bool = True,
                 max_nfe: int | None = None):
        self.model, self.tok = model, tok
        self.max_batch_size, self.window_s, self.continuous, self.max_nfe = max_batch_size, window_s, continuous, \
            max_nfe
        self.pending: list[Job] = []
        self.active: list[tuple[Job, int, Row]] = []  # (job, choice index, row) of the running jobs
        self.batch = Batch(model, tok.pad_token_id)  # their rows still decoding
        self.current: list[Job] = []  # a whole batch being decoded
        self.stats = {"steps": 0, "rows": 0, "largest_batch": 0, "batches": 0, "abandoned": 0, "failed": 0}
        self._lock = threading.Lock()  # pending is appended to by the event loop, taken from by the decoding thread
        self._wake = asyncio.Event()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dlm-decode")
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def running(self) -> int:
        """Rows being decoded now."""
        return len(self.batch) + sum(len(j.rows) for j in self.current)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop scheduling; the step under way is the last (nobody waits for its rows any more)."""
        self._stopping = True
        with self._lock:
            jobs = self.current + self.pending + [job for job, _, _ in self.active]
        for job in jobs:
            job.cancelled = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Job) -> None:
        with self._lock:
            self.pending.append(job)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.window_s)  # let concurrent requests start together
            self._wake.clear()  # before the work: a job submitted from here on sets it again
            try:
                await loop.run_in_executor(self._pool, self._work)
            except Exception as err:  # a bug in scheduling: the jobs under way fail, the server goes on serving
                log.exception("the decoding loop failed")
                self._fail_all(err)

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            jobs = {id(j): j for j in [job for job, _, _ in self.active] + self.current}
        for job in jobs.values():
            job.fail(err)
        self.batch = Batch(self.model, self.tok.pad_token_id)
        self.active, self.current = [], []

    # ---- the decoding thread ----------------------------------------------------------------------------------
    def _work(self) -> None:
        """Run steps until no row is running and nothing waits: admit at each step boundary, retire finished rows."""
        while not self._stopping:
            whole = self._admit()
            if whole:
                self._decode(whole)
                continue
            left = [a for a in self.active if self._left(a[0])]
            if left:
                self.batch.drop([row for _, _, row in left])
                self.active = [a for a in self.active if not a[0].cancelled]
            if not self.active:
                with self._lock:
                    if not self.pending:
                        return
                continue
            self._step()

    def _left(self, job: Job) -> bool:
        if job.cancelled and not job.counted:
            job.counted = True
            self.stats["abandoned"] += 1
        return job.cancelled

    def _admit(self) -> list[Job]:
        """Move waiting jobs into the running batch while their rows fit; returns a whole batch to decode first when
        the oldest waiting job has no row form (or batching is static and nothing runs)."""
        with self._lock:
            self.pending = [j for j in self.pending if not self._left(j)]
            while self.pending:
                job = self.pending[0]
                if not (self.continuous and has_rows(self.model, job.options)):
                    return self._take_whole()  # static batching never has running rows
                if len(self.active) + len(job.rows) > self.max_batch_size:
                    return []
                self.pending.pop(0)
                self._join(job)
        return []

    def _join(self, job: Job) -> None:
        generator = self._generator(job)  # one per job, shared by its rows
        job.live = [make_row(self.model, prompt, job.options, max_new_tokens=job.max_tokens,
                             eos_id=self.tok.eos_token_id, temperature=job.temperature, generator=generator,
                             budget=self.max_nfe) for prompt in job.rows]
        self.active += [(job, i, row) for i, row in enumerate(job.live)]
        self.batch.add([row for row in job.live if not row.done])

    def _generator(self, job: Job):
        """A sampled job's generator, on the model's device, seeded by the request (or at random); None for greedy
        decoding, which draws nothing."""
        if job.family == "simplex" or job.temperature > 0:
            seed = job.seed if job.seed is not None else random.getrandbits(63)
            return make_generator(seed, self.model)
        return None

    def _take_whole(self) -> list[Job]:
        """The oldest waiting job and the later ones with its key, up to max_batch_size rows (lock held)."""
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

    def _step(self) -> None:
        """One forward pass for every running row; each job hears of its rows' steps, a finished job is answered."""
        self.stats["steps"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(self.batch))
        try:
            if len(self.batch):  # a job's finished rows wait for its others, computing nothing
                self.batch.step()
        except Exception as err:  # out of memory, a bug: these rows fail, the server goes on
            if not isinstance(err, DlmError):
                log.exception("a decoding step over %d rows failed", len(self.batch))
            self.stats["failed"] += 1
            for job in {id(j): j for j, _, _ in self.active}.values():
                job.fail(err)
            self.batch.drop(list(self.batch.rows))
            self.active = []
            return
        events: list = []  # every job's events of this step, delivered to the event loop in one call
        jobs = list({id(j): j for j, _, _ in self.active}.values())
        for job in jobs:
            job.sink = events
        try:
            for job, i, row in self.active:
                if job.stream and not job.cancelled:
                    job.row_step(i, row)
            finished = [job for job in jobs if all(r.done for r in job.live)]
            for job in finished:
                self.stats["rows"] += len(job.rows)
                if not job.cancelled:
                    job.finish([r.tokens() for r in job.live], [r.nfe for r in job.live],
                               [r.truncated for r in job.live])
        finally:
            for job in jobs:
                job.sink = None
            if events:
                _deliver(events)
        done = {id(j) for j in finished}
        self.active = [a for a in self.active if id(a[0]) not in done]

    def _decode(self, batch: list[Job]) -> None:
        """One batched `generate` call for whole jobs; each job gets its rows' results or the error."""
        self.current = batch
        try:
            self._decode_batch(batch)
        finally:
            self.current = []

    def _decode_batch(self, batch: list[Job]) -> None:
        ids = [row for job in batch for row in job.rows]
        spans, start = [], 0
        for job in batch:
            spans.append(slice(start, start + len(job.rows)))
            start += len(job.rows)
        first, P = batch[0], max(map(len, ids))
        # Every diffusion step passes through the feed: streams get their events, and a batch nobody waits for stops.
        feed = StepFeed(lambda s: self._on_step(batch, spans, s, P)) if first.family != "autoregressive" else None
        self.stats["batches"] += 1
        self.stats["rows"] += len(ids)
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(ids))
        try:
            out = generate(self.model, ids, first.options, max_new_tokens=first.max_tokens,
                           eos_id=self.tok.eos_token_id, pad_id=self.tok.pad_token_id,
                           temperature=first.temperature, generator=self._generator(first), trace=feed)
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
        if all(job.cancelled for job in batch) or self._stopping:
            raise Abandoned
        for job, span in zip(batch, spans):
            if job.stream and not job.cancelled:
                job.step(step, span, P)

    def decode_now(self, jobs: list[Job]) -> None:
        """Decode `jobs` to the end in the calling thread, as the scheduler would (tests, tools)."""
        with self._lock:
            self.pending += jobs
        self._work()
