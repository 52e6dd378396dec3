"""What one request receives while its rows are decoded: committed text in order and, on request, one
`dlm.denoise.step` event per denoising step. Runs in the decoding thread; events reach the event loop via a queue.

Committed text never changes afterwards: a masked model's longest fully revealed prefix of the generated region (a
revealed token is never masked again), a simplex model's final tokens (its argmax changes until the last step), an
AR model's tokens (sent token by token once decoded: the AR sampler has no per-token hook). Text is held back while
it could still become the start of a stop string or ends in an incomplete UTF-8 character."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch

from dlm.serve.protocol import ApiError


class StepFeed(list):
    """A sampler trace that keeps nothing: each step the sampler appends is handed to `on_step` as it happens."""

    def __init__(self, on_step):
        super().__init__()
        self.on_step = on_step

    def append(self, step: dict) -> None:
        self.on_step(step)


def serialized(fn, lock: threading.Lock):
    """`fn` called under `lock`: a HF fast tokenizer used from several threads at once can fail ("Already
    borrowed"), and the server encodes in request threads while the decoding thread decodes."""

    def call(*args, **kwargs):
        with lock:
            return fn(*args, **kwargs)
    return call


class ChoiceText:
    """One choice's text: its final form from token ids (cut at `max_tokens` and at the first stop string), and the
    part of it that may be sent so far. `decode` is the tokenizer's (serialized) decode."""

    def __init__(self, decode, stops: list[str], max_tokens: int):
        self.decode, self.stops, self.max_tokens = decode, stops, max_tokens
        self.sent = ""
        self.stopped = False
        self._borders = [_borders(s) for s in stops]
        self._scanned, self._matched = "", [0] * len(stops)  # the text scanned so far; each stop's match state

    def text(self, tokens: list[int]) -> tuple[str, bool]:
        """(text, stopped): the decoded `tokens` cut at the first stop string."""
        text = self.decode(tokens[: self.max_tokens], skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return (text[: min(cuts)], True) if cuts else (text, False)

    def update(self, tokens: list[int], final: bool) -> str:
        """The text to send now that `tokens` are committed (`final`: no more will come)."""
        if self.stopped:
            return ""
        text, self.stopped = self.text(tokens)
        if not (final or self.stopped):
            text = text.rstrip("\ufffd")  # an incomplete multi-byte character: wait for its other bytes
            text = text[: len(text) - self._stop_prefix(text)]
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _stop_prefix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string (it may still become one): at most the
        longest stop's length - 1. A Knuth-Morris-Pratt scan that goes on from the text scanned at the last update
        (committed text only grows), so a stream's cost is linear in its text and its stops' lengths."""
        if not text.startswith(self._scanned):  # the text changed behind its end: scan its tail afresh
            self._scanned, self._matched = "", [0] * len(self.stops)
        new = text[len(self._scanned):]
        for j, (stop, borders) in enumerate(zip(self.stops, self._borders)):
            k, tail = self._matched[j], new
            if len(new) >= len(stop) - 1:  # only the last len(stop) - 1 characters can hold a partial match
                k, tail = 0, new[len(new) - len(stop) + 1:]
            for c in tail:
                while k and (k == len(stop) or stop[k] != c):
                    k = borders[k - 1]
                if stop[k] == c:
                    k += 1
            self._matched[j] = k
        self._scanned = text
        return max(self._matched, default=0)


def _borders(s: str) -> list[int]:
    """KMP's failure function: borders[i] is the length of the longest proper prefix of s[:i + 1] that also ends it."""
    borders, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = borders[k - 1]
        if s[i] == s[k]:
            k += 1
        borders[i] = k
    return borders


class Pieces:
    """Display text of single token ids, cached; special tokens (mask, EOS, padding) show as ""."""

    def __init__(self, decode, special_ids):
        self.decode, self.cache, self.special = decode, {}, set(special_ids)

    def __call__(self, ids: list[int]) -> list[str]:
        out = []
        for t in ids:
            if t not in self.cache:
                self.cache[t] = "" if t in self.special else self.decode([t])
            out.append(self.cache[t])
        return out


@dataclass
class Job:
    """One request's rows (a prompt per choice) and the options they decode with; `events` receives ("text", index,
    delta), ("step", event), ("done", results) or ("error", exception), from the decoding thread."""

    rows: list[list[int]]
    options: object
    max_tokens: int
    temperature: float
    seed: int | None
    key: tuple | None  # requests with the same key decode in one batch; None: alone
    texts: list[ChoiceText]
    stream: bool = False
    steps: bool = False
    family: str = "masked"
    mask_id: int | None = None
    eos_id: int | None = None
    block_size: int | None = None
    pieces: Pieces | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(1024))  # bounded: see `post`
    cancelled: bool = False  # the client left or timed out: its rows' results are dropped
    counted: bool = False  # the scheduler has counted it as abandoned
    live: list = field(default_factory=list)  # its rows in the scheduler's running batch (dlm.sampling.continuous)
    sink: list | None = None  # set by the scheduler: events collected here and delivered once per step
    nfe: list[int] = field(default_factory=list)
    _reveal_conf: dict = field(default_factory=dict)

    def post(self, *event) -> None:
        if self.cancelled:
            return
        if self.sink is not None:  # the scheduler hands a step's events to the event loop at once
            self.sink.append((self, event))
            return
        if self.loop is None:
            raise RuntimeError("Job.post: the job has no event loop to deliver to; set job.loop before submitting it")
        try:
            self.loop.call_soon_threadsafe(self._queue, event)
        except RuntimeError:  # the event loop is closed: the server is stopping
            pass

    def _queue(self, event: tuple) -> None:
        """(In the event loop.) A full queue means the client reads slower than its rows decode: the job is cancelled
        (its rows are dropped) and one error event replaces what it has not read, instead of the queue growing."""
        if self.cancelled:
            return
        try:
            self.events.put_nowait(event)
        except asyncio.QueueFull:
            self.cancelled = True
            while not self.events.empty():
                self.events.get_nowait()
            self.events.put_nowait(("error", ApiError(
                503, f"the client read the stream too slowly ({self.events.maxsize} events waiting); the request is "
                "cancelled", None, "slow_reader", "server_error")))

    def step(self, step: dict, rows: slice, P: int) -> None:
        """A sampler trace step (batch-wide) → this job's events; `rows` are its rows, P the batch's prompt width."""
        if not self.nfe:
            self.nfe = [0] * len(self.rows)
        if "canvas" in step:  # masked: canvas after the step, what it revealed, with which confidence
            tokens, new, conf = step["canvas"][rows, P:], step["revealed"][rows, P:], step["confidence"][rows, P:]
        else:  # simplex: the argmax prediction of every position and its probability
            tokens, conf = step["tokens"][rows], step["confidence"][rows]
            new = None
        for i in range(len(self.rows)):
            if bool((new[i] if new is not None else conf[i] > 0).any()):
                self.nfe[i] += 1
                self._show(i, tokens[i], new[i] if new is not None else None, conf[i], step)

    def row_step(self, i: int, row) -> None:
        """Choice i's row of the running batch (`dlm.sampling.continuous`) has taken a step: its events."""
        if not self.nfe:
            self.nfe = [0] * len(self.rows)
        if row.nfe == self.nfe[i]:  # finished, waiting for the job's other rows
            return
        self.nfe[i] = row.nfe
        if self.family == "autoregressive":  # committed token by token
            delta = self.texts[i].update(row.tokens(), final=False)
            if delta:
                self.post("text", i, delta)
            return
        self._show(i, row.region(), row.last["revealed"], row.last["confidence"], {})

    def _show(self, i: int, tokens: torch.Tensor, new: torch.Tensor | None, conf: torch.Tensor, step: dict) -> None:
        """Row i's state after a step: its step event (when asked for) and the text it committed."""
        ids = tokens.tolist()
        if new is not None:
            before = self._reveal_conf.get(i, torch.zeros_like(conf))
            self._reveal_conf[i] = shown = torch.where(new, conf, before)
            masked = [t == self.mask_id for t in ids]
        else:
            shown, masked = conf, [False] * len(ids)
        if self.steps:  # the step, then the text it committed
            self.post("step", self._event(i, ids, masked, shown, new, step))
        if new is not None:
            self._commit(i, ids, masked)

    def _commit(self, i: int, ids: list[int], masked: list[bool]) -> None:
        """Send the text of row i's longest revealed prefix (up to its first EOS)."""
        end = masked.index(True) if True in masked else len(ids)
        if self.eos_id in ids[:end]:
            end = ids.index(self.eos_id)
        delta = self.texts[i].update(ids[:end], final=False)
        if delta:
            self.post("text", i, delta)

    def _event(self, i, ids, masked, confidence, new, step) -> dict:
        if self.pieces is None:
            raise RuntimeError("Job: step events show each token's text; set job.pieces (the engine's Pieces)")
        eos = ids.index(self.eos_id) if self.eos_id in ids else None
        event = {"object": "dlm.denoise.step", "index": i, "step": self.nfe[i], "nfe": self.nfe[i], "tokens": ids,
                 "pieces": [p if not m else "" for p, m in zip(self.pieces(ids), masked)], "masked": masked,
                 "confidence": [round(c, 4) for c in confidence.float().tolist()], "block_size": self.block_size,
                 "eos": eos}
        if new is not None:
            event["new"] = new.nonzero().squeeze(1).tolist()
        if "timestep" in step:
            event["timestep"] = int(step["timestep"])
        return event

    def finish(self, tokens: list[list[int]], nfe: list[int], truncated: list[bool] | None = None) -> None:
        """The decoded rows: send what is left of each choice's text, then ("done", results). A `truncated` row (it
        reached the server's NFE budget) ends with finish_reason "length"."""
        results = []
        for i, (ids, n) in enumerate(zip(tokens, nfe)):
            text, stopped = self.texts[i].text(ids)
            if self.stream:
                if self.family == "autoregressive":  # token by token, as the AR sampler produced them
                    for k in range(1, min(len(ids), self.max_tokens)):
                        delta = self.texts[i].update(ids[:k], final=False)
                        if delta:
                            self.post("text", i, delta)
                delta = self.texts[i].update(ids, final=True)
                if delta:
                    self.post("text", i, delta)
            cut = truncated is not None and truncated[i]
            finish = "stop" if stopped or (len(ids) < self.max_tokens and not cut) else "length"
            results.append({"text": text, "finish_reason": finish, "completion_tokens": min(len(ids),
                            self.max_tokens), "nfe": n})
        self.post("done", results)

    def fail(self, error: Exception) -> None:
        self.post("error", error)
