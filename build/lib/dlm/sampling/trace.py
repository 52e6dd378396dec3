"""The denoising of one sample shown step by step (in the spirit of TESS 2, Figure 4).

Reads the trace of `dlm.sampling.masked.generate(..., return_trace=True)`: one dict per denoising step with
`canvas` [B, P+G] (after the step), `revealed` [B, P+G] and `confidence` [B, P+G]. The generation region is the
last `gen_length` positions of each canvas row (prompts are left-padded to P). A row takes part in the steps up to
the one that finished it; later steps reveal nothing in it, so its frames stop at its last reveal (its NFE).

Tokens are decoded one at a time (`tok.decode([id])`) so that newlines and indentation of code survive; other
control characters show as their Unicode control pictures. Still-masked
positions show as a dim placeholder; tokens revealed at the step are bold on a background coloured by their
confidence; earlier tokens keep the colour of the confidence they were revealed with. Everything after the first
revealed EOS is struck through: the sampler cuts the output there.
"""

from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.text import Text

PLACEHOLDER = "░"  # one per still-masked position
EOS_MARK = "⟨eos⟩"
LOW, HIGH = 0.5, 0.9  # confidence bands: red < LOW <= yellow < HIGH <= green


def confidence_colour(confidence: float) -> str:
    return "red" if confidence < LOW else "yellow" if confidence < HIGH else "green"


def visible(piece: str) -> str:
    """Control characters other than newline and tab as their Unicode control pictures (a bell or a carriage
    return would disturb the terminal)."""
    return "".join(chr(0x2400 + ord(c)) if (ord(c) < 32 and c not in "\n\t") else "␡" if c == "\x7f" else c
                   for c in piece)


def row_steps(trace: list[dict], row: int) -> int:
    """Number of steps `row` took part in (its NFE): up to and including its last step with a reveal."""
    for k in range(len(trace), 0, -1):
        if bool(trace[k - 1]["revealed"][row].any()):
            return k
    return 0


def _region(trace: list[dict], row: int, gen_length: int, prompt_len: int | None) -> slice:
    width = trace[0]["canvas"].shape[-1] if trace else gen_length
    if gen_length > width:
        raise ValueError(f"gen_length {gen_length} exceeds the canvas width {width}")
    if prompt_len is not None and prompt_len > width - gen_length:
        raise ValueError(f"prompt_len {prompt_len} exceeds the padded prompt width {width - gen_length}")
    return slice(width - gen_length, width)


def _frame_steps(n_steps: int, every: int) -> list[int]:
    """1-based steps to show: every `every`-th, always the last."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    return [k for k in range(1, n_steps + 1) if k % every == 0 or k == n_steps]


def render_steps(trace: list[dict], tok, row: int, prompt_len: int | None, gen_length: int, mask_id: int,
                 every: int = 1, eos_id: int | None = None) -> list[Text]:
    """One `rich.text.Text` per shown step of sample `row`: a header line "step k (NFE k) · revealed n", then the
    generation region. `prompt_len` is only checked: the region is located from the canvas shape. `eos_id` defaults
    to `tok.eos_token_id`."""
    region = _region(trace, row, gen_length, prompt_len)
    eos_id = tok.eos_token_id if eos_id is None else eos_id
    n_steps = row_steps(trace, row)
    shown = set(_frame_steps(n_steps, every))
    pieces: dict[int, str] = {}

    def piece(token: int) -> str:
        if token not in pieces:
            pieces[token] = EOS_MARK if token == eos_id else visible(tok.decode([token]))
        return pieces[token]

    reveal_conf = torch.zeros(gen_length)  # confidence each position had when revealed
    frames = []
    for k in range(1, n_steps + 1):
        step = trace[k - 1]
        revealed = step["revealed"][row, region].cpu()
        confidence = step["confidence"][row, region].cpu().float()
        reveal_conf = torch.where(revealed, confidence, reveal_conf)
        if k not in shown:
            continue
        canvas = step["canvas"][row, region].tolist()
        new = revealed.tolist()
        conf = reveal_conf.tolist()
        text = Text(f"step {k} (NFE {k}) · revealed {sum(new)}\n", style="bold cyan")
        after_eos = False
        for i, token in enumerate(canvas):
            cut = " strike" if after_eos else ""
            if token == mask_id:
                text.append(PLACEHOLDER, style="dim" + cut)
                continue
            colour = confidence_colour(conf[i])
            style = f"bold black on {colour}" if new[i] else colour
            text.append(piece(token), style=style + cut)
            after_eos = after_eos or token == eos_id
        frames.append(text)
    return frames


def legend() -> Text:
    text = Text("legend: ")
    text.append(PLACEHOLDER, style="dim")
    text.append(" masked · ")
    text.append("new", style="bold black on white")
    text.append(" revealed this step · confidence ")
    text.append(f"< {LOW}", style="red")
    text.append(" ")
    text.append(f"{LOW}–{HIGH}", style="yellow")
    text.append(" ")
    text.append(f"≥ {HIGH}", style="green")
    text.append(" · ")
    text.append("struck", style="strike")
    text.append(f" after {EOS_MARK}: cut from the output")
    return text


def show_steps(trace: list[dict], tok, row: int, prompt_len: int | None, gen_length: int, mask_id: int,
               console: Console | None = None, every: int = 1, delay: float = 0.0, eos_id: int | None = None) -> None:
    """Print the frames of `render_steps` to `console`, then a colour legend. With `delay` > 0, animate: clear the
    console before each frame and wait `delay` seconds after it."""
    console = console or Console()
    for frame in render_steps(trace, tok, row, prompt_len, gen_length, mask_id, every=every, eos_id=eos_id):
        if delay > 0:
            console.clear()
            console.print(frame)
            time.sleep(delay)
        else:
            console.print(frame)
            console.print()
    console.print(legend())


def trace_to_records(trace: list[dict], row: int, prompt_len: int | None, gen_length: int) -> list[dict]:
    """JSON-serialisable steps of sample `row`: step (= NFE so far), revealed positions relative to the generation
    region, their token ids and confidences."""
    region = _region(trace, row, gen_length, prompt_len)
    records = []
    for k in range(1, row_steps(trace, row) + 1):
        step = trace[k - 1]
        revealed = step["revealed"][row, region].cpu()
        positions = revealed.nonzero().squeeze(1)
        records.append({
            "step": k,
            "positions": [int(p) for p in positions.tolist()],
            "tokens": [int(t) for t in step["canvas"][row, region].cpu()[positions].tolist()],
            "confidences": [float(c) for c in step["confidence"][row, region].cpu().float()[positions].tolist()],
        })
    return records
