"""Mask discrepancy D_mask(t) (PUMBA Definition 1, Eq. C.1, App. C.4): how far the masks a training procedure
produces at masking ratio t are from the mask the sampler visits at t.

Per validation problem, masks live on its N response positions (response + first EOS; for a block-causal model the
response rounded up to whole blocks, EOS filler included, as both training and block decoding see it), the kernel is
k(m, m') = exp(-d_H(m, m') / σ) with σ = 0.2 N, and
    MMD² = 1/(n(n-1)) Σ_{i≠j} k(m_i, m_j) + 1 - 2/n Σ_i k(m_i, m_inf)
with n = 32 training masks and the (deterministic, greedy top-u) sampler's mask m_inf at the first step whose
masked fraction is ≤ t (a block-causal model decodes block by block). Training masks: MDM draws round(tN) positions
uniformly at random (also for block MDM: its per-block levels are not modelled here); progressive unmasking runs the
construction the run trained with at its step (`dlm.diffusion.progressive.construction_for`) on x_0 (a pool of
copies, ground-truth commits, carry passed along, the block-causal vectorised pass of training for block models) and
keeps the masks whose ratio lies within 0.05 of t. D_mask(t) is the mean over problems.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from dlm import checkpoint
from dlm.data.canvas import Example, collate
from dlm.data.tokenizer import encode_pair
from dlm.diffusion import policies
from dlm.diffusion.progressive import construction_for
from dlm.errors import DlmError
from dlm.modeling.blocks import block_forward, num_blocks
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


def inference_masks(model, prompt: Sequence[int], N: int, mask_id: int, pad_id: int,
                    u: int) -> dict[float, torch.Tensor]:
    """m_inf(t) for t on the grid: the mask after the first step with masked fraction ≤ t (greedy top-u; EOS never
    stops it, so all N positions are decoded; a carry model passes its carry as at evaluation)."""
    steps: list[dict] = []  # each decoding step, appended as it happens
    masked_generate(model, [list(prompt)], N, eos_id=-1, pad_id=pad_id, mask_id=mask_id, policy="top_u",
                    reveal_count=u, trace=steps)
    masks = [step["canvas"][0, -N:] == mask_id for step in steps]
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


def block_size_of(model) -> int | None:
    """The block size of a block-causal model (None: full canvas)."""
    spec = model.spec
    return spec.block_size if spec.attention == "block_causal" else None


def response_positions(model, response: Sequence[int]) -> int:
    """N: the response and its EOS, rounded up to whole blocks for a block-causal model."""
    block = block_size_of(model)
    return num_blocks(len(response) + 1, block) * block if block else len(response) + 1


@torch.no_grad()
def pu_masks(model, prompt: Sequence[int], response: Sequence[int], eos_id: int, mask_id: int, construction,
             n: int, generator: torch.Generator, pools: int = 5, pool_size: int = 32,
             steps: int = 64) -> dict[float, list]:
    """Masks produced by the progressive-unmasking construction on x_0, binned to the grid (±0.05), ≤ n per ratio.
    Each pool is `pool_size` copies of the sample started as in training (spread stages for PUMA) and advanced with
    the model's confidences from the pass training runs (the block-causal vectorised pass for a block-causal model),
    committing ground truth; finished trajectories restart."""
    block = block_size_of(model)
    batch = collate([Example(list(prompt), list(response))] * pool_size, eos_id, 0, block_size=block)
    P = len(prompt)
    maskable, target = batch["maskable"], batch["input_ids"]
    uses_carry = bool(getattr(model.spec, "carry", False))

    def forward(ids, carry):
        """(logits, next carry) as in training (`ProgressiveObjective`'s pass)."""
        if block:
            out = block_forward(model, ids, target, batch["prompt_len"], batch["attention_mask"].sum(-1), carry=carry,
                                return_hidden=uses_carry)
        elif uses_carry:
            out = model(ids, attention_mask=batch["attention_mask"], carry=carry, return_hidden=True)
        else:
            out = model(ids, attention_mask=batch["attention_mask"])
        return (out[0], out[1].float()) if uses_carry else (out, None)

    bins: dict[float, list] = {t: [] for t in GRID}
    for _ in range(pools):
        revealed, stage = construction.start(maskable, generator, spread=True)
        carry = torch.zeros(*target.shape, model.config.hidden_size) if uses_carry else None
        for _ in range(steps):
            ratio = 1.0 - revealed[:, P:].float().mean(-1)
            for b in range(pool_size):
                t = round(float(ratio[b]) * 10) / 10
                if t in bins and abs(float(ratio[b]) - t) <= 0.05 + 1e-9 and len(bins[t]) < n:
                    bins[t].append(~revealed[b, P:])
            masked = maskable & ~revealed
            logits, carry = forward(torch.where(masked, mask_id, target), carry)
            conf, _, _ = policies.confidences(logits, mask_id)
            reveal, retire, stage = construction.step(conf, masked, maskable, revealed, stage, batch["loss_mask"],
                                                      generator)
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
                     n_train: int = 32, n_problems: int = 50, seed: int = 0, progress: bool = True,
                     pools: int = 5, steps: int = 64) -> dict:
    """D_mask(t) on the grid for `training` in {"mdm", "pu"} (PU needs its construction), averaged over problems,
    and each problem's own values (`per_problem`: one list per problem, in GRID order, None where a ratio got no
    inference mask or fewer than two training masks) for paired comparisons between runs. PU costs up to
    pools x steps forward passes of its 32-trajectory pool per problem (`pu_masks`); a ratio bin that has not reached
    n_train masks by then is scored on what it has."""
    from tqdm import tqdm

    generator = torch.Generator().manual_seed(seed)
    sums = {t: 0.0 for t in GRID}
    counts = {t: 0 for t in GRID}
    per_problem = []
    model.eval()
    for r in tqdm(records[:n_problems], desc=f"mask discrepancy ({training})", disable=not progress):
        prompt, response = encode_pair(tok, r["prompt"], r["response"])
        N = response_positions(model, response)
        inf = inference_masks(model, prompt, N, tok.mask_token_id, tok.pad_token_id, u)
        if training == "pu":
            bins = pu_masks(model, prompt, response, tok.eos_token_id, tok.mask_token_id, construction, n_train,
                            generator, pools=pools, steps=steps)
        values: list[float | None] = []
        for t in GRID:
            if t not in inf:
                values.append(None)
                continue
            masks = mdm_masks(N, t, n_train, generator) if training == "mdm" else (
                torch.stack(bins[t]) if len(bins[t]) >= 2 else None)
            if masks is None:
                values.append(None)
                continue
            value = mmd2(masks, inf[t], 0.2 * N)
            values.append(value)
            sums[t] += value
            counts[t] += 1
        per_problem.append(values)
    return {"training": training, "u": u, "n_problems": min(n_problems, len(records)), "n_train_masks": n_train,
            "d_mask": {str(t): (sums[t] / counts[t] if counts[t] else None) for t in GRID},
            "problems_per_t": {str(t): counts[t] for t in GRID}, "per_problem": per_problem}


class RunConstruction(NamedTuple):
    training: str  # "mdm" | "pu"
    construction: object | None  # the PU construction (None for MDM)
    step: int | None  # the update the construction was built at
    step_source: str | None  # where that step came from


def training_construction(model_path) -> RunConstruction:
    """The masks the run a model came from trained on, from its recipe.yaml (MDM when there is none): for `pu`, the
    construction training builds at the model's step (read from its checkpoint; the recipe's train.steps only when
    there is none) with the run's block size."""
    from dlm.config import load_recipe

    path = Path(model_path)
    run = next((d for d in (path, *list(path.parents)[:3]) if (d / "recipe.yaml").is_file()), None)
    if run is None:
        return RunConstruction("mdm", None, None, None)
    recipe = load_recipe(run / "recipe.yaml", [])
    if recipe.train.objective != "pu":
        return RunConstruction("mdm", None, None, None)
    step, source = _checkpoint_step(path, run)
    if step is None:
        step, source = recipe.train.steps, f"recipe train.steps of {run / 'recipe.yaml'} (no checkpoint found)"
    block = recipe.model.block_size if recipe.model.attention == "block_causal" else None
    return RunConstruction("pu", construction_for(recipe.progressive, step, block), step, source)


def _checkpoint_step(path: Path, run: Path) -> tuple[int | None, str | None]:
    """(step, its source) of the model at `path`: a checkpoint dir (`step_N` or `step_N/model`) holds its own
    trainer.pt; a run dir or its final model is at the run's latest checkpoint (written with the final model)."""
    found: Path | None
    if (path / "trainer.pt").is_file():
        found = path / "trainer.pt"
    elif path.name == "model" and path.parent != run and (path.parent / "trainer.pt").is_file():
        found = path.parent / "trainer.pt"
    else:
        latest = checkpoint.latest(run / "checkpoints")
        found = latest / "trainer.pt" if latest is not None and (latest / "trainer.pt").is_file() else None
    if found is None:
        return None, None
    state = torch.load(found, map_location="cpu", weights_only=False, mmap=True)
    return int(state["step"]), f"checkpoint {found}"


def style_axes(ax, title: str) -> None:
    """The labels, grid and legend of a D_mask(t) plot (this module's and the study driver's)."""
    ax.set_xlabel("masking ratio t")
    ax.set_ylabel("D_mask(t)  (lower = closer to inference)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def run_mask_discrepancy(models: Sequence[str], data, u: int = 2, n: int = 50, seed: int = 0, out=None,
                         progress: bool = True) -> dict:
    """D_mask(t) for each model (training construction read from its run), as JSON and a plot of D_mask vs t."""
    import json

    from dlm.data.sources import read_jsonl
    from dlm.sampling import load_for_inference

    records = read_jsonl(data, required=("prompt", "response"))
    rows = []
    for path in models:
        model, tok = load_for_inference(path, dtype="float32", device="cpu")  # its pools and masks live on the CPU
        if model.spec.family != "masked":
            raise DlmError(f"{path}: mask discrepancy needs a masked model (family {model.spec.family!r})")
        run = training_construction(path)
        res = mask_discrepancy(model, tok, records, run.training, run.construction, u=u, n_problems=n, seed=seed,
                               progress=progress)
        res.update(model=str(path), step=run.step, step_source=run.step_source)
        rows.append(res)
        where = f", construction at step {run.step} from {run.step_source}" if run.training == "pu" else ""
        print(f"{path} ({run.training}{where}): "
              + "  ".join(f"t={t}: {v:.4f}" for t, v in res["d_mask"].items() if v is not None))
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
        style_axes(ax, f"mask discrepancy at u={u} (PUMBA Def. 1)")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        plt.close(fig)
    return result
