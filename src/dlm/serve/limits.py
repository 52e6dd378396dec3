"""What the server accepts (the `dlm serve` flags and their defaults, defined here once); no torch, so the CLI can
show these defaults without loading a model stack."""

from __future__ import annotations

from dataclasses import dataclass

from dlm.errors import DlmError

FALLBACK_MAX_TOKENS = 64  # max_tokens of a request that gives none, for a model without a run recipe


@dataclass(frozen=True)
class Limits:
    """What the server accepts (the `dlm serve` flags)."""

    max_tokens: int = 1024  # the largest max_tokens a request may ask for
    default_max_tokens: int | None = None  # None: the run's eval.max_new_tokens, else FALLBACK_MAX_TOKENS
    max_prompt_tokens: int | None = None  # None: the model's context minus the request's generation span
    max_batch_size: int = 8  # rows (prompts x n) decoded together
    batch_window_ms: float = 10.0  # how long the first request of a batch waits for others
    max_concurrent: int = 64  # requests queued or decoding; more: 429
    max_body_bytes: int = 1 << 20  # larger request bodies: 413
    body_timeout_s: float = 30.0  # a request body still arriving after this: 408 (a slow client holds no slot)
    timeout_s: float = 300.0  # per request, queueing included: 504, or an error event in a stream
    send_timeout_s: float = 30.0  # a stream its client has not read for this long is cancelled
    max_stop_chars: int = 256  # the longest stop string; longer: 400
    max_queued_events: int = 1024  # stream events waiting for a slow reader; one more: the request is cancelled
    max_nfe: int | None = None  # forward passes per row; None: as many as the canvas needs (its length at most)
    continuous: bool = True  # rows join and leave the running batch at step boundaries; False: whole batches

    def __post_init__(self):
        for name, value in vars(self).items():
            if value is not None and not isinstance(value, bool) and not value > 0:
                flag = {"timeout_s": "timeout", "body_timeout_s": "body_timeout", "send_timeout_s": "send_timeout"
                        }.get(name, name)
                raise DlmError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
