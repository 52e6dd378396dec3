"""What one request of `dlm serve` receives, without a server: a job's events from sampler steps (masked and simplex,
whole batches and rows of the running batch), its committed text, step events and final results. Token ids are
characters (id = code point) so that every text is visible in the assertions."""

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from dlm.serve.protocol import ApiError
from dlm.serve.stream import ChoiceText, Job, Pieces, StepFeed, _borders, serialized

M, E = 1, 2  # mask and EOS ids (never printed: the texts are ids >= 97)


def chars(ids, skip_special_tokens=False):  # as a tokenizer's decode: special tokens shown unless asked
    return "".join(chr(t) for t in ids if not (skip_special_tokens and t in (M, E)))


def job(n=1, stream=True, steps=False, family="masked", max_tokens=8, stops=(), block_size=None, **kw) -> Job:
    """A job whose events are collected in `job.sink` (as the scheduler does)."""
    j = Job(rows=[[97]] * n, options=None, max_tokens=max_tokens, temperature=0.0, seed=None, key=None,
            texts=[ChoiceText(chars, list(stops), max_tokens) for _ in range(n)], stream=stream, steps=steps,
            family=family, mask_id=M, eos_id=E, block_size=block_size, pieces=Pieces(chars, [M, E]), **kw)
    j.sink = []
    return j


def events(j: Job) -> list:
    out = [e for _, e in j.sink]
    j.sink.clear()
    return out


def ids(text: str) -> list[int]:
    return [M if c == "_" else E if c == "$" else ord(c) for c in text]


def masked_step(canvases: list[str], revealed: list[str], conf: list[list[float]], P=1) -> dict:
    """A masked sampler's trace step over rows of `canvases` ("_": mask, "$": EOS) behind a prompt of width P."""
    canvas = torch.tensor([[99] * P + ids(c) for c in canvases])
    new = torch.tensor([[False] * P + [r == "x" for r in row] for row in revealed])
    confidence = torch.tensor([[0.0] * P + c for c in conf])
    return {"canvas": canvas, "revealed": new, "confidence": confidence}


def test_a_step_feed_keeps_nothing_and_serialized_holds_the_lock():
    seen = []
    feed = StepFeed(seen.append)
    feed.append({"a": 1})
    feed.append({"b": 2})
    assert seen == [{"a": 1}, {"b": 2}] and list(feed) == [] and len(feed) == 0
    lock = threading.Lock()
    held = serialized(lambda *a, **k: (lock.locked(), a, k), lock)
    assert held(1, x=2) == (True, (1,), {"x": 2}) and not lock.locked()


def test_choice_text_cuts_at_max_tokens_and_the_first_stop():
    text = ChoiceText(chars, ["cd", "b"], 4)
    assert text.text(ids("abcdef")) == ("a", True)
    assert ChoiceText(chars, ["cd"], 4).text(ids("abcdef")) == ("ab", True)
    assert ChoiceText(chars, ["ef"], 4).text(ids("abcdef")) == ("abcd", False)  # cut at 4 tokens before the stop
    assert ChoiceText(chars, [], 8).text(ids("a$b")) == ("ab", False)  # special tokens skipped
    assert ChoiceText(chars, ["zz", "c"], 8).text(ids("abc")) == ("ab", True)


def test_updates_send_each_new_piece_once_and_hold_back_a_possible_stop():
    text = ChoiceText(chars, ["xyz"], 100)
    assert text.update(ids("ab"), final=False) == "ab"
    assert text.update(ids("ab"), final=False) == ""
    assert text.update(ids("abx"), final=False) == ""  # "x" may begin the stop
    assert text.update(ids("abxy"), final=False) == ""
    assert text.update(ids("abxyq"), final=False) == "xyq"
    assert text.sent == "abxyq" and not text.stopped
    assert text.update(ids("abxyqx"), final=True) == "x"  # final: nothing is held back
    text = ChoiceText(chars, ["xyz"], 100)
    assert text.update(ids("abxyzcd"), final=False) == "ab" and text.stopped
    assert text.update(ids("abxyzcdef"), final=True) == ""  # after the stop nothing more
    text = ChoiceText(chars, [], 100)
    assert text.stopped is False
    assert text.update(ids("ab"), final=False) == "ab"
    assert text.update(ids("ac"), final=False) == ""  # the text changed behind what was sent: nothing
    assert text.update(ids("acd"), final=False) == ""  # nor when it also grew
    assert text.update(ids("a"), final=True) == ""
    assert ChoiceText(chars, [], 100).update(ids("abX"), final=False) == "abX"  # only U+FFFD is held back
    assert ChoiceText(chars, ["XXXXY"], 100).update(ids("XXXX"), final=False) == ""  # all of it may begin the stop
    text = ChoiceText(lambda t, skip_special_tokens=True: "ab\ufffd", [], 100)
    assert text.update([0], final=False) == "ab" and text.update([0], final=True) == "\ufffd"


def test_borders_are_the_kmp_failure_function():
    assert _borders("") == [] and _borders("a") == [0]
    assert _borders("aabaaab") == [0, 1, 0, 1, 2, 2, 3]
    assert _borders("abab") == [0, 0, 1, 2]
    assert _borders("abcabd") == [0, 0, 0, 1, 2, 0]


def test_pieces_are_cached_and_special_tokens_show_empty():
    calls = []

    def decode(t):
        calls.append(t)
        return chars(t)

    pieces = Pieces(decode, [M, E])
    assert pieces([97, M, 98, E, 97]) == ["a", "", "b", "", "a"]
    assert pieces([98]) == ["b"] and calls == [[97], [98]]


def test_a_masked_step_commits_the_revealed_prefix_and_shows_the_step():
    j = job(n=2, steps=True, block_size=4)
    step = masked_step(["ab__", "_c__"], ["xx..", ".x.."], [[0.9, 0.8, 0, 0], [0, 0.7, 0, 0]])
    j.step(step, slice(0, 2), 1)
    got = events(j)
    assert got[0] == ("step", {"object": "dlm.denoise.step", "index": 0, "step": 1, "nfe": 1, "tokens": ids("ab__"),
                               "pieces": ["a", "b", "", ""], "masked": [False, False, True, True],
                               "confidence": [0.9, 0.8, 0.0, 0.0], "block_size": 4, "eos": None, "new": [0, 1]})
    assert got[1] == ("text", 0, "ab")
    assert got[2][0] == "step" and got[2][1]["index"] == 1 and got[2][1]["new"] == [1]
    assert got[2][1]["pieces"] == ["", "c", "", ""] and got[2][1]["confidence"] == [0.0, 0.7, 0.0, 0.0]
    assert len(got) == 3  # row 1 commits nothing: its first position is still masked
    # the next step: row 0 reveals its EOS (text ends there), row 1 reveals nothing (no event, no NFE)
    step = masked_step(["ab$d", "_c__"], ["..x.", "...."], [[0.9, 0.8, 0.66666, 0], [0, 0.7, 0, 0]])
    j.step(step, slice(0, 2), 1)
    got = events(j)
    assert [e[0] for e in got] == ["step"] and j.nfe == [2, 1]
    assert got[0][1]["eos"] == 2 and got[0][1]["step"] == 2 and got[0][1]["new"] == [2]
    assert got[0][1]["confidence"] == [0.9, 0.8, 0.6667, 0.0]  # the confidence each token was revealed with
    j.finish([ids("ab"), ids("c")], [2, 1])
    assert events(j) == [("text", 1, "c"), ("done", [
        {"text": "ab", "finish_reason": "stop", "completion_tokens": 2, "nfe": 2},
        {"text": "c", "finish_reason": "stop", "completion_tokens": 1, "nfe": 1}])]


def test_revealed_confidence_is_kept_from_the_step_that_revealed_it():
    j = job(steps=True)
    j.step(masked_step(["a__"], ["x.."], [[0.5, 0.1, 0.1]]), slice(0, 1), 1)
    j.step(masked_step(["ab_"], [".x."], [[0.2, 0.6, 0.1]]), slice(0, 1), 1)
    step = [e for e in events(j) if e[0] == "step"][-1][1]
    assert step["confidence"] == [0.5, 0.6, 0.0] and step["masked"] == [False, False, True]
    assert step["tokens"] == ids("ab_")


def test_rows_are_the_jobs_slice_of_the_batch_and_text_only_without_steps():
    j = job(n=1, steps=False)
    step = masked_step(["zz__", "ab__"], ["xx..", "xx.."], [[1, 1, 0, 0], [1, 1, 0, 0]], P=2)
    j.step(step, slice(1, 2), 2)
    assert events(j) == [("text", 0, "ab")]


def test_a_simplex_step_shows_its_argmax_and_timestep_and_commits_nothing():
    j = job(steps=True, family="simplex")
    step = {"tokens": torch.tensor([ids("abc")]), "confidence": torch.tensor([[0.5, 0.25, 0.125]]),
            "timestep": torch.tensor(7)}
    j.step(step, slice(0, 1), 0)
    (event,) = events(j)
    assert event[0] == "step" and event[1]["timestep"] == 7 and "new" not in event[1]
    assert event[1]["masked"] == [False] * 3 and event[1]["confidence"] == [0.5, 0.25, 0.125]
    assert event[1]["pieces"] == ["a", "b", "c"] and j.nfe == [1]
    j.step({"tokens": torch.tensor([ids("abc")]), "confidence": torch.zeros(1, 3)}, slice(0, 1), 0)
    assert events(j) == [] and j.nfe == [1]  # a step that changed nothing is no step


def test_step_events_need_the_pieces():
    j = job(steps=True)
    j.pieces = None
    with pytest.raises(RuntimeError, match=r"^Job: step events show each token's text; set job.pieces \(the engine's "
                                           r"Pieces\)$"):
        j.step(masked_step(["a"], ["x"], [[1.0]]), slice(0, 1), 1)


def test_rows_of_the_running_batch():
    j = job(n=2, steps=True)
    row = SimpleNamespace(nfe=1, region=lambda: torch.tensor(ids("a_")),
                          last={"revealed": torch.tensor([True, False]), "confidence": torch.tensor([0.5, 0.0])})
    j.row_step(1, row)
    got = events(j)
    assert j.nfe == [0, 1] and got[0][1]["index"] == 1 and got[0][1]["nfe"] == 1 and got[1] == ("text", 1, "a")
    j.row_step(1, row)  # the same NFE again: the row is finished, waiting for the others
    assert events(j) == []
    ar = job(n=1, family="autoregressive")
    tokens = ids("ab")
    ar.row_step(0, SimpleNamespace(nfe=1, tokens=lambda: tokens[:1]))
    ar.row_step(0, SimpleNamespace(nfe=2, tokens=lambda: tokens))
    assert events(ar) == [("text", 0, "a"), ("text", 0, "b")]


def test_finish_streams_what_is_left_and_says_why_each_row_ended():
    j = job(n=3, max_tokens=3, stops=["c"])
    j.finish([ids("ab"), ids("xyz"), ids("abcd")], [4, 5, 6], truncated=[True, False, False])
    got = events(j)
    assert got[:3] == [("text", 0, "ab"), ("text", 1, "xyz"), ("text", 2, "ab")]
    assert got[3] == ("done", [{"text": "ab", "finish_reason": "length", "completion_tokens": 2, "nfe": 4},
                               {"text": "xyz", "finish_reason": "length", "completion_tokens": 3, "nfe": 5},
                               {"text": "ab", "finish_reason": "stop", "completion_tokens": 3, "nfe": 6}])
    quiet = job(n=1, stream=False, max_tokens=5)
    quiet.finish([ids("ab")], [2])
    assert events(quiet) == [("done", [{"text": "ab", "finish_reason": "stop", "completion_tokens": 2, "nfe": 2}])]
    ar = job(n=1, family="autoregressive", max_tokens=4)
    ar.finish([ids("abc")], [3])
    assert events(ar) == [("text", 0, "a"), ("text", 0, "b"), ("text", 0, "c"),
                          ("done", [{"text": "abc", "finish_reason": "stop", "completion_tokens": 3, "nfe": 3}])]
    capped = job(n=1, family="autoregressive", max_tokens=2)
    capped.finish([ids("abcd")], [4])
    assert events(capped) == [("text", 0, "a"), ("text", 0, "b"),
                              ("done", [{"text": "ab", "finish_reason": "length", "completion_tokens": 2, "nfe": 4}])]


def test_posting_to_the_event_loop_and_cancelling():
    async def main():
        j = job()
        j.sink = None
        with pytest.raises(RuntimeError, match=r"^Job.post: the job has no event loop to deliver to; set job.loop "
                                               r"before submitting it$"):
            j.post("text", 0, "x")
        j.loop = asyncio.get_running_loop()
        await asyncio.to_thread(j.post, "text", 0, "x")
        await asyncio.to_thread(j.fail, ValueError("boom"))
        await asyncio.sleep(0.01)
        got = [j.events.get_nowait() for _ in range(j.events.qsize())]
        j.cancelled = True
        j.post("text", 0, "y")
        j._queue(("text", 0, "z"))
        await asyncio.sleep(0.01)
        return got, j.events.qsize()

    got, left = asyncio.run(main())
    assert got[0] == ("text", 0, "x") and got[1][0] == "error" and str(got[1][1]) == "boom" and left == 0
    j = job()
    j.cancelled = True
    j.post("text", 0, "x")
    assert j.sink == []
    closed = asyncio.new_event_loop()
    closed.close()
    j = job()
    j.sink, j.loop = None, closed
    j.post("text", 0, "x")  # the server is stopping: dropped quietly


def test_a_full_queue_leaves_one_error_event():
    async def main():
        j = job(events=asyncio.Queue(2))
        j.sink, j.loop = None, asyncio.get_running_loop()
        for k in range(3):
            j._queue(("text", 0, str(k)))
        return j, [j.events.get_nowait() for _ in range(j.events.qsize())]

    j, got = asyncio.run(main())
    assert j.cancelled and len(got) == 1 and got[0][0] == "error"
    err = got[0][1]
    assert isinstance(err, ApiError) and (err.status, err.code, err.kind) == (503, "slow_reader", "server_error")
    assert err.message == "the client read the stream too slowly (2 events waiting); the request is cancelled"


def test_masked_positions_show_no_piece_even_when_the_mask_is_not_special():
    j = job(steps=True)
    j.pieces = Pieces(chars, [E])
    j.step(masked_step(["a_"], ["x."], [[1.0, 0.0]]), slice(0, 1), 1)
    assert events(j)[0][1]["pieces"] == ["a", ""]


def test_autoregressive_text_holds_back_a_possible_stop_until_the_end():
    for finish in (True, False):
        j = job(family="autoregressive", stops=["bc"], max_tokens=8)
        tokens = ids("abcd")
        if finish:
            j.finish([tokens], [4])
        else:
            for k in range(1, 5):
                j.row_step(0, SimpleNamespace(nfe=k, tokens=lambda k=k, t=tokens: t[:k]))
        assert [e for e in events(j) if e[0] == "text"] == [("text", 0, "a")], finish
