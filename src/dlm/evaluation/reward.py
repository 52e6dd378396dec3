"""Reward models on preference pairs: how often the chosen response outscores the rejected one (TESS 2 App. C)."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from dlm.data.canvas import collate, make_example
from dlm.data.tokenizer import encode_pair
from dlm.modeling.device import model_device
from dlm.modeling.reward import last_token_index, reward_scores


@torch.inference_mode()
def score_texts(model, tok, prompts: Sequence[str], responses: Sequence[str], batch_size: int = 50,
                max_length: int | None = None) -> list[float]:
    """R(x, y) for each (prompt, response): the reward head at the response's EOS."""
    max_length = max_length or model.config.max_position_embeddings
    device = model_device(model)
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        exs = [make_example(*encode_pair(tok, p, r), max_length)
               for p, r in zip(prompts[start : start + batch_size], responses[start : start + batch_size])]
        b = {k: v.to(device) for k, v in collate(exs, tok.eos_token_id, tok.pad_token_id).items()}
        out += reward_scores(model, last_token_index(b["loss_mask"]), input_ids=b["input_ids"],
                             attention_mask=b["attention_mask"]).tolist()
    return out


def evaluate_reward(model, tok, records: Sequence[dict], batch_size: int = 50, seed: int = 0) -> dict:
    """Pairwise accuracy of a reward model on records with `rejected` (tinymath records without one get a corrupted
    program). Shaped like the task evaluation so the training loop can report it."""
    from dlm.data.tinymath import corrupt_program

    model.eval()
    rng = random.Random(seed)
    rejected = [r["rejected"] if "rejected" in r else corrupt_program(rng, r) for r in records]
    prompts = [r["prompt"] for r in records]
    t0 = time.perf_counter()
    chosen_s = score_texts(model, tok, prompts, [r["response"] for r in records], batch_size)
    rejected_s = score_texts(model, tok, prompts, rejected, batch_size)
    seconds = time.perf_counter() - t0
    wins = [c > r for c, r in zip(chosen_s, rejected_s)]
    n = max(len(records), 1)
    return {"accuracy": sum(wins) / n, "n": len(records), "mean_nfe": 2.0, "tokens_per_nfe": 0.0, "wall_s": seconds,
            "ms_per_problem": 1000 * seconds / n,
            "samples": [{"prompt": p, "chosen_reward": c, "rejected_reward": r, "rejected": y, "correct": w}
                        for p, c, r, y, w in zip(prompts, chosen_s, rejected_s, rejected, wins)]}
