"""Mask discrepancy D_mask(t) (PUMBA Definition 1, Eq. C.1, App. C.4): how far the masks a training procedure
produces at masking ratio t are from the mask the sampler visits at t.

Per validation problem, masks live on its N response positions (response + first EOS), the kernel is
k(m, m') = exp(-d_H(m, m') / σ) with σ = 0.2 N, and
    MMD² = 1/(n(n-1)) Σ_{i≠j} k(m_i, m_j) + 1 - 2/n Σ_i k(m_i, m_inf)
with n = 32 training masks and the (deterministic, greedy top-u) sampler's mask m_inf at the first step whose
masked fraction is ≤ t. Training masks: MDM draws round(tN) positions uniformly at random; progressive unmasking runs
its own construction on x_0 (a pool of copies, ground-truth commits, carry passed along) and keeps the masks whose
ratio lies within 0.05 of t. D_mask(t) is the mean over problems.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlm.data.canvas import Example, collate
from dlm.data.tokenizer import encode_pair
from dlm.diffusion import policies
from dlm.sampling.masked import generate as masked_generate

GRID = tuple(round(0.1 * i, 1) for i in range(1, 10))


def mmd2(train_masks: torch.Tensor, inf_mask: torch.Tensor, sigma: float) -> float:
    """Eq. C.1 for n training masks [n, N] (bool) and one inference mask [N]."""
    m = train_masks.float()
    n = m.shape[0]
    if n < 2:
        raise ValueError("need at least two training masks")
    d = torch.cdist(m, m, p=1)
    k = torch.exp(-d / sigma)
    within = (k.sum() - k.diagonal().sum()) / (n * (n - 1))
    cross = torch.exp(-(m - inf_mask.float()).abs().sum(-1) / sigma).mean()
    return float(within + 1.0 - 2.0 * cross)


def inference_masks(model, prompt: Sequence[int], N: int, mask_id: int, pad_id: int, u: int) -> dict[float, torch.Tensor]:
    """m_inf(t) for t on the grid: the mask after the first step with masked fraction ≤ t (greedy top-u; EOS never
    stops it, so all N positions are decoded; a carry model passes its carry as at evaluation)."""
    out = masked_generate(model, [list(prompt)], N, eos_id=-1, pad_id=pad_id, mask_id=mask_id, policy="top_u",
                          reveal_count=u, return_trace=True)
    masks = [step["canvas"][0, -N:] == mask_id for step in out.trace]
    found = {}
    for t in GRID:
        for m in masks:
            if m.float().mean() <= t + 1e-9:
                found[t] = m
                break
    return found


def mdm_masks(N: int, t: float, n: int, generator: torch.Generator) -> torch.Tensor:
    """n masks with round(tN) positions drawn uniformly at random (dlm's MDM: count first, then a uniform subset)."""
    k = round(t * N)
    scores = torch.rand(n, N, generator=generator)
    rank = scores.argsort(-1).argsort(-1)
    return rank < k


@torch.no_grad()
def pu_masks(model, prompt: Sequence[int], response: Sequence[int], eos_id: int, mask_id: int, construction,
             n: int, generator: torch.Generator, pools: int = 5, pool_size: int = 32, steps: int = 64) -> dict[float, list]:
    """Masks produced by the progressive-unmasking construction on x_0, binned to the grid (±0.05), ≤ n per ratio.
    Each pool is `pool_size` copies of the sample started as in training (spread stages for PUMA) and advanced with
    the model's confidences, committing ground truth; finished trajectories restart."""
    ex = Example(list(prompt), list(response))
    batch = collate([ex] * pool_size, eos_id, 0)
    P, N = len(prompt), len(response) + 1
    maskable = batch["maskable"]
    uses_carry = bool(getattr(model.spec, "carry", False))
    bins: dict[float, list] = {t: [] for t in GRID}
    for _ in range(pools):
        revealed, stage = construction.start(maskable, generator, spread=True)
        carry = torch.zeros(pool_size, P + N, model.config.hidden_size) if uses_carry else None
        for _ in range(steps):
            ratio = 1.0 - revealed[:, P:].float().mean(-1)
            for b in range(pool_size):
                t = round(float(ratio[b]) * 10) / 10
                if t in bins and abs(float(ratio[b]) - t) <= 0.05 + 1e-9 and len(bins[t]) < n:
                    bins[t].append(~revealed[b, P:])
            ids = torch.where(maskable & ~revealed, mask_id, batch["input_ids"])
            if uses_carry:
                logits, hidden = model(ids, carry=carry, return_hidden=True)
                carry = hidden.float()
            else:
                logits = model(ids)
            conf, _, _ = policies.confidences(logits, mask_id)
            masked = maskable & ~revealed
            reveal, retire, stage = construction.step(conf, masked, maskable, revealed, stage, batch["loss_mask"], generator)
            revealed = revealed | (reveal & masked)
            if retire.any():  # restart at a random stage (a random row of a spread start)
                fresh, fresh_stage = construction.start(maskable[retire], generator, spread=True)
                order = torch.randperm(len(fresh), generator=generator)
                revealed[retire], stage[retire] = fresh[order], fresh_stage[order]
                if carry is not None:
                    carry[retire] = 0.0
            if all(len(v) >= n for v in bins.values()):
                return bins
    return bins


def mask_discrepancy(model, tok, records: Sequence[dict], training: str, construction=None, u: int = 2,
                     n_train: int = 32, n_problems: int = 50, seed: int = 0, progress: bool = True) -> dict:
    """D_mask(t) on the grid for `training` in {"mdm", "pu"} (PU needs its construction)."""
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    sums = {t: 0.0 for t in GRID}
    counts = {t: 0 for t in GRID}
    model.eval()
    for r in tqdm(records[:n_problems], desc=f"mask discrepancy ({training})", disable=not progress):
        prompt, response = encode_pair(tok, r["prompt"], r["response"])
        N = len(response) + 1
        inf = inference_masks(model, prompt, N, tok.mask_token_id, tok.pad_token_id, u)
        if training == "pu":
            bins = pu_masks(model, prompt, response, tok.eos_token_id, tok.mask_token_id, construction, n_train, generator)
        for t in GRID:
            if t not in inf:
                continue
            masks = mdm_masks(N, t, n_train, generator) if training == "mdm" else (
                torch.stack(bins[t]) if len(bins[t]) >= 2 else None)
            if masks is None:
                continue
            sums[t] += mmd2(masks, inf[t], 0.2 * N)
            counts[t] += 1
    return {"training": training, "u": u, "n_problems": min(n_problems, len(records)), "n_train_masks": n_train,
            "d_mask": {str(t): (sums[t] / counts[t] if counts[t] else None) for t in GRID},
            "problems_per_t": {str(t): counts[t] for t in GRID}}


def training_construction(model_path) -> tuple[str, object | None]:
    """('mdm' | 'pu', construction) from the recipe.yaml of the run a model came from (MDM when there is none)."""
    from pathlib import Path

    from dlm.config import load_recipe
    from dlm.diffusion.progressive import StageConstruction, ThresholdConstruction

    for base in (Path(model_path), Path(model_path).parent):
        if (base / "recipe.yaml").is_file():
            recipe = load_recipe(base / "recipe.yaml", [])
            if recipe.train.objective != "pu":
                return "mdm", None
            c = recipe.progressive
            if c.construction == "stages":
                return "pu", StageConstruction(c.stages_end if recipe.train.steps > c.stages_from else c.stages_start,
                                               c.threshold)
            return "pu", ThresholdConstruction(c.reveal_count, c.threshold, c.random_initial_masking)
    return "mdm", None


def run_mask_discrepancy(models: Sequence[str], data, u: int = 2, n: int = 50, seed: int = 0, out=None,
                         progress: bool = True) -> dict:
    """D_mask(t) for each model (training construction read from its run), as JSON and a plot of D_mask vs t."""
    import json
    from pathlib import Path

    from dlm.data.sources import read_jsonl
    from dlm.sampling import load_for_inference

    records = read_jsonl(data, required=("prompt", "response"))
    rows = []
    for path in models:
        model, tok = load_for_inference(path)
        if model.spec.family != "masked":
            raise ValueError(f"{path}: mask discrepancy needs a masked model (family {model.spec.family!r})")
        training, construction = training_construction(path)
        res = mask_discrepancy(model, tok, records, training, construction, u=u, n_problems=n, seed=seed,
                               progress=progress)
        res["model"] = str(path)
        rows.append(res)
        print(f"{path} ({training}): " + "  ".join(f"t={t}: {v:.4f}" for t, v in res["d_mask"].items() if v is not None))
    result = {"data": str(data), "u": u, "rows": rows}
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for r in rows:
            ts = [float(t) for t, v in r["d_mask"].items() if v is not None]
            ax.plot(ts, [v for v in r["d_mask"].values() if v is not None], marker="o",
                    label=f"{Path(r['model']).name} ({r['training']})")
        ax.set_xlabel("masking ratio t")
        ax.set_ylabel("D_mask(t)  (lower = closer to inference)")
        ax.set_title(f"mask discrepancy at u={u} (PUMBA Def. 1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        plt.close(fig)
    return result
