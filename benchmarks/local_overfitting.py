"""PUMBA's local-overfitting measurement on tinymath medium (issue 17 item 4; PUMBA §3.1, Fig. 2, App. D, Table 9).

    OMP_NUM_THREADS=1 python benchmarks/local_overfitting.py --json docs/results/pumba-local-overfitting.json
    python benchmarks/local_overfitting.py --report docs/results/pumba-local-overfitting.json

Each arm continues the warm start every Post-SFT arm uses (--start, default runs/medium-mdm-cont) on the tinymath data
(--data) for --updates updates at a constant learning rate after --warmup updates (App. D.1: insertions all happen at
the same learning rate):
  mdm      the MDM objective (PUMBA Eq. 2.1), fresh masks every update;
  pu-uN    progressive unmasking with the stage-indexed construction at a fixed K = round(M / N), M the mean number
           of maskable positions of a canvas (response, EOS, padding up to the canvas), no confidence threshold, no
           carry, no BPTT. Every trajectory advances exactly one stage per update, so it lasts exactly J = K updates
           (App. D.1; the library's construction recomputes the stage from a rounded count, which skips stages when
           L/K is small, see `ExactStages`).
16 validation sequences are followed (never trained on otherwise): 4 are inserted at each of the --insert-at updates
(PU: they take the places of the next samples to enter the pool, start at stage 0 and stay J updates; MDM: they replace
4 rows of one batch for one update), 4 are never inserted. After every update the completion loss of the 16 is
computed (prompt and first half of the answer revealed, mean cross-entropy over the rest of the answer up to and
including its first EOS; raw weights), and every --val-every updates the same quantity averaged over --val-n other
validation sequences. The relative completion loss of an inserted sequence is its loss over its mean in the 20 updates
before insertion, divided by the same ratio for the validation completion loss (App. D.1).

The JSON (default runs/pumba-local-overfitting.json) holds every per-update loss and the settings; --report turns it
into the .md beside it (a Table-9-like table) and the .png (Fig. 2 middle: mean log relative loss around insertion,
±1 s.e. over the inserted sequences), so the doc's numbers come from the JSON: the commands above rewrite the
committed docs/results/pumba-local-overfitting.*.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARMS = ["mdm", "pu-u2", "pu-u8", "pu-u4", "pu-u32"]  # the arms the paper's claim needs first
BEFORE = 20  # updates before insertion that normalise the relative completion loss (App. D.1)


# ---- the construction: exactly one stage per step ---------------------------------------------------------------
def exact_stages(K: int):
    """The stage-indexed construction with a fixed K, no threshold, advancing exactly one stage per step (App. D.1:
    "no trajectory skips a stage: every trajectory has J = K decoding steps")."""
    from dlm.diffusion import policies
    from dlm.diffusion.progressive import StageConstruction

    class ExactStages(StageConstruction):
        def start(self, maskable, generator, spread=False):
            """Stage 0 (with `spread`, row j at stage floor(j·K/n)), a random count of positions revealed that puts the
            fraction inside the stage's interval [p/K, (p+1)/K) (the library rounds, which can land in stage 1)."""
            n, L = maskable.shape[0], maskable.sum(-1)
            stage = (torch.arange(n) * self.K) // n if spread else torch.zeros(n, dtype=torch.long)
            count = self._count_in(stage, L, generator)
            scores = torch.rand(maskable.shape, generator=generator)
            return maskable & (policies.confidence_rank(scores, maskable) < count[:, None]), stage

        def _count_in(self, stage, L, generator):
            """A uniform count c with c / L in [stage/K, (stage+1)/K), capped at L-1."""
            lo = -(-(stage * L) // self.K)
            hi = -(-((stage + 1) * L) // self.K) - 1
            pick = lo + (torch.rand(stage.shape, generator=generator) * (hi - lo + 1).float()).long().clamp(max=hi - lo)
            return torch.minimum(pick, L - 1)

        def step(self, confidence, masked, maskable, revealed, stage, loss_mask, generator):
            nxt = stage + 1  # a count in the next stage's interval
            target = self._count_in(nxt, maskable.sum(-1), generator)
            need = (target - revealed.sum(-1)).clamp(min=0)
            reveal = masked & (policies.confidence_rank(confidence, masked) < need[:, None])
            return reveal, stage == self.K - 1, torch.clamp(nxt, max=self.K - 1)

    return ExactStages(K, None)


# ---- completion loss ----------------------------------------------------------------------------------------------
def completion_batch(examples, collate, mask_token_id: int, length: int) -> dict:
    """Canvases with the prompt and the first half of the answer revealed, everything after masked; `in_loss` marks
    the rest of the answer up to and including its first EOS (padding excluded). The same mask all run (App. D.1)."""
    batch = collate(examples, pad_to=length)
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1])
    prompt = batch["prompt_len"][:, None]
    answer = batch["loss_mask"].sum(-1)[:, None] - 1  # response tokens (loss_mask = response + first EOS)
    hidden = positions[None] >= prompt + answer // 2
    noised = torch.where(hidden, mask_token_id, ids)
    return {"input_ids": noised, "targets": ids, "in_loss": hidden & batch["loss_mask"],
            "attention_mask": batch["attention_mask"]}


@torch.no_grad()
def completion_losses(model, cb: dict, chunk: int = 32) -> torch.Tensor:
    """Mean cross-entropy over `in_loss` of each row [n] (raw weights, eval mode)."""
    was_training = model.training
    model.eval()
    out = []
    for i in range(0, cb["input_ids"].shape[0], chunk):
        sl = slice(i, i + chunk)
        logits = model(cb["input_ids"][sl], attention_mask=cb["attention_mask"][sl]).float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), cb["targets"][sl], reduction="none")
        m = cb["in_loss"][sl]
        out.append((ce * m).sum(-1) / m.sum(-1).clamp(min=1))
    model.train(was_training)
    return torch.cat(out)


def relative_loss(seq: list[float], val: list[float], entered: int, before: int = BEFORE) -> list[float]:
    """Relative completion loss (App. D.1) at every index s of a run: (seq[s] / mean seq[e-before..e-1]) /
    (val[s] / mean val[e-before..e-1]), where seq[s], val[s] are measured after s updates and the sequence is
    first trained in update `entered` (1-based), so index entered-1 is the last one before it."""
    if entered - before < 0:
        raise ValueError(f"insertion at update {entered} leaves fewer than {before} updates before it")
    window = slice(entered - before, entered)
    base_seq = sum(seq[window]) / before
    base_val = sum(val[window]) / before
    return [(s / base_seq) / (v / base_val) for s, v in zip(seq, val)]


def interpolate(points: list[int], values: list[float], n: int) -> list[float]:
    """Values at indices 0..n-1 by linear interpolation between measured points (held flat at the ends)."""
    import numpy as np

    return np.interp(np.arange(n), points, values).tolist()


# ---- MDM: one batch with rows swapped -----------------------------------------------------------------------------
def swap_rows(batch: dict, examples: list, collate, pad_id: int) -> dict:
    """`batch` with its first len(examples) rows replaced by `examples` (other rows unchanged, `example_id` kept, so
    each swapped row takes the mask its position would have drawn); widened with padding if an example is longer."""
    new = collate(examples, pad_to=batch["input_ids"].shape[1])
    width = new["input_ids"].shape[1]
    out = {}
    for key, value in batch.items():
        if value.dim() == 2 and value.shape[1] < width:  # pad like `collate`: pad id, attended, maskable, no loss
            fill = {"input_ids": pad_id, "attention_mask": 1, "maskable": True, "loss_mask": False}[key]
            value = torch.cat([value, torch.full((value.shape[0], width - value.shape[1]), fill, dtype=value.dtype)], 1)
        value = value.clone()
        if key in new:
            value[: len(examples)] = new[key]
        out[key] = value
    return out


class _SwapStream:
    """The trainer's batch stream, with `pending` examples swapped into the next batch."""

    def __init__(self, stream, collate, pad_id: int):
        self.stream, self.collate, self.pad_id, self.pending = stream, collate, pad_id, []

    def next_batches(self, count: int):
        batches = self.stream.next_batches(count)
        if self.pending:
            batches[0] = swap_rows(batches[0], self.pending, self.collate, self.pad_id)
            self.pending = []
        return batches

    def __getattr__(self, name):
        return getattr(self.stream, name)


def mean_maskable(start: str, data: str, canvas: int) -> float:
    """M: mean maskable positions (response, EOS, padding to the canvas) of the training canvases."""
    from dlm.data.pipeline import encode_examples
    from dlm.data.sources import read_jsonl
    from dlm.data.tokenizer import load_tokenizer
    from dlm.modeling.backbone import resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(start))
    examples, _ = encode_examples(tok, read_jsonl(Path(data) / "train.jsonl", required=("prompt", "response")), canvas)
    return sum(canvas - len(e.prompt_ids) for e in examples) / len(examples)


# ---- one arm ------------------------------------------------------------------------------------------------------
def parse_arm(arm: str) -> int | None:
    """'mdm' -> None; 'pu-u8' -> 8."""
    if arm == "mdm":
        return None
    if arm.startswith("pu-u") and arm[4:].isdigit() and int(arm[4:]) > 0:
        return int(arm[4:])
    raise ValueError(f"arm {arm!r} is not mdm or pu-uN (N > 0)")


def run_arm(arm: str, start: str, data: str, updates: int, batch_size: int, insert_at: list[int], val_every: int,
            val_n: int, seed: int, lr: float = 3e-4, warmup: int = 20, canvas: int = 144, workdir: str | None = None,
            recipe_overrides: list[str] | None = None, maskable_mean: float | None = None) -> dict:
    """Train one arm under the App. D.1 protocol and return every measured loss (see the module docstring)."""
    from dlm.config import load_recipe
    from dlm.data.pipeline import encode_examples
    from dlm.training.loop import Trainer

    u = parse_arm(arm)
    if any(t <= BEFORE or t > updates for t in insert_at):
        raise ValueError(f"insertions {insert_at} must lie in ({BEFORE}, {updates}]")
    workdir = workdir or tempfile.mkdtemp(prefix=f"overfit-{arm}-")
    overrides = [f"model.init_from={start}", f"data.dir={data}", f"model.max_length={canvas}",
                 f"train.batch_size={batch_size}", f"train.steps={updates}", f"train.seed={seed}",
                 f"optim.lr={lr}", f"optim.warmup_steps={warmup}", "optim.schedule=constant",
                 "train.eval_every=null", f"out_dir={workdir}", *(recipe_overrides or [])]
    K = None
    if u is not None:
        overrides += ["progressive.construction=stages", "progressive.threshold=null", "progressive.window=1",
                      "progressive.carry=false"]
    if u is None:
        recipe = load_recipe(ROOT / "recipes/tinymath/mdm.yaml", overrides)
    else:  # K from the data: M = mean maskable positions of a canvas
        M = maskable_mean if maskable_mean is not None else mean_maskable(start, data, canvas)
        K = max(2, round(M / u))
        recipe = load_recipe(ROOT / "recipes/tinymath/pu.yaml",
                             overrides + [f"progressive.stages_start={K}", f"progressive.stages_end={K}"])
    trainer = Trainer(recipe, progress=False)
    tok, model = trainer.tok, trainer.model
    val = trainer.splits["validation"]
    if len(val) < 16 + val_n:
        raise ValueError(f"{data}: {len(val)} validation records, need 16 followed + {val_n}")
    examples, coll = encode_examples(tok, val[: 16 + val_n], canvas)
    followed, held = examples[:16], examples[16:]
    cb_f = completion_batch(followed, coll, tok.mask_token_id, canvas)
    cb_v = completion_batch(held, coll, tok.mask_token_id, canvas)
    schedule = {t: list(range(4 * i, 4 * i + 4)) for i, t in enumerate(insert_at)}  # update -> tags entering it
    pool = None
    if u is None:
        trainer.stream = _SwapStream(trainer.stream, coll, tok.pad_token_id)
    else:
        pool = trainer.objective.pool
        if K > int(pool.maskable.sum(-1).min()):
            raise ValueError(f"u={u}: K={K} exceeds the maskable positions of a canvas in the pool")
        pool.construction = exact_stages(K)

    t0 = time.time()
    losses = [completion_losses(model, cb_f).tolist()]  # [s][16], s = updates done
    held_losses = [completion_losses(model, cb_v).tolist()]  # [point][val_n]: each held-out sequence's loss
    val_points, val_losses = [0], [sum(held_losses[0]) / len(held_losses[0])]
    entered, exited, train_loss = {}, {}, []
    for s in range(1, updates + 1):  # update s
        if s in schedule:
            tags = schedule[s]
            if pool is None:
                trainer.stream.pending = [followed[t] for t in tags]
                entered.update({t: s for t in tags})
                exited.update({t: s for t in tags})
            else:
                pool.insert([followed[t] for t in tags], tags)
        present = set(pool.origin.tolist()) if pool is not None else set()
        train_loss.append(trainer.train_step()["loss"])
        if pool is not None:
            for t in present - {-1}:  # trained in update s
                entered.setdefault(t, s)
                exited[t] = s
        losses.append(completion_losses(model, cb_f).tolist())
        if s % val_every == 0 or s == updates:
            val_points.append(s)
            held_losses.append(completion_losses(model, cb_v).tolist())
            val_losses.append(sum(held_losses[-1]) / len(held_losses[-1]))
    distinct = pool.samples_started if pool is not None else updates * batch_size
    return {"arm": arm, "u": u, "K": K, "maskable_mean": M if u is not None else None,
            "J": K if u is not None else 1, "seconds": round(time.time() - t0, 1),
            "distinct_sequences": int(distinct), "train_loss": train_loss,
            "completion_loss": [[round(v, 5) for v in x] for x in zip(*losses)],  # [16][updates + 1]
            "inserted": {str(t): {"requested": int(r), "entered": entered.get(t), "last_update": exited.get(t)}
                         for r, tags in schedule.items() for t in tags},
            "validation": {"updates": val_points, "loss": val_losses,
                           "per_sequence": [[round(v, 5) for v in x] for x in held_losses]}}


# ---- summary and report -------------------------------------------------------------------------------------------
def summarize(run: dict, later: int, tail: int) -> dict:
    """Table-9 row: distinct sequences, relative completion loss of the inserted sequences (mean over them of its
    minimum during the stay, at exit, and `later` updates after exit), validation loss over the last `tail` updates."""
    n = len(run["completion_loss"][0])
    val = interpolate(run["validation"]["updates"], run["validation"]["loss"], n)
    mins, exits, laters, curves = [], [], [], {}
    for tag, ins in run["inserted"].items():
        e, last = ins["entered"], ins["last_update"]
        if e is None or last - e + 1 != run["J"]:  # never entered, or still in the batch when the run ended
            continue
        rel = relative_loss(run["completion_loss"][int(tag)], val, e)
        curves[tag] = rel
        mins.append(min(rel[e : last + 1]))
        exits.append(rel[last])
        if last + later < n:
            laters.append(rel[last + later])
    pts = [(p, v) for p, v in zip(run["validation"]["updates"], run["validation"]["loss"]) if p > n - 1 - tail]
    stays = [ins["last_update"] - ins["entered"] + 1 for ins in run["inserted"].values() if ins["entered"]]

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    return {"J": run["J"], "stay": mean(stays), "distinct": run["distinct_sequences"], "minimum": mean(mins),
            "exit": mean(exits), "later": mean(laters), "n_later": len(laters), "n_inserted": len(mins),
            "validation": mean([v for _, v in pts]), "curves": curves}


def log_curve(run: dict, curves: dict, span: tuple[int, int]) -> tuple[list[int], list[float], list[float]]:
    """Mean and standard error of log relative loss over the inserted sequences, at offsets from insertion (offset 0:
    before the first update that trains on it)."""
    xs, means, ses = [], [], []
    n = len(run["completion_loss"][0])
    for k in range(span[0], span[1] + 1):
        vals = [math.log(c[run["inserted"][t]["entered"] - 1 + k]) for t, c in curves.items()
                if 0 <= run["inserted"][t]["entered"] - 1 + k < n]
        if len(vals) >= 4:  # the tail where fewer sequences remain is left out
            m = sum(vals) / len(vals)
            sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
            xs.append(k), means.append(m), ses.append(sd / math.sqrt(len(vals)))
    return xs, means, ses


PAPER = {"pu-u2": (231, "3.6k", 0.54, 0.88, 0.98, 6.92), "pu-u4": (115, "6.9k", 0.70, 0.71, 0.98, 6.58),
         "pu-u8": (57, "13.7k", 0.75, 0.75, 0.98, 5.72), "pu-u64": (7, "110k", 0.97, 0.99, 1.00, 4.37),
         "pu-u128": (4, "192k", 0.98, 1.00, 1.03, 4.36), "mdm": (None, "768k", 0.98, 0.98, 1.00, 4.72)}


def report(json_path: Path, md_path: Path, png_path: Path) -> str:
    """Write the results doc and the plot from the JSON; returns the doc's text."""
    result = json.loads(json_path.read_text())
    st = result["settings"]
    later, tail = st["later"], st["tail"]
    rows, lines = {}, []
    for arm, run in result["runs"].items():
        rows[arm] = summarize(run, later, tail)
    # The table's numbers, stored back in the JSON (claims.yaml checks read them there).
    result["summary"] = {arm: {k: (None if isinstance(v, float) and math.isnan(v) else
                                   round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "curves"}
                         for arm, r in rows.items()}
    json_path.write_text(json.dumps(result) + "\n")
    skipped = [a for a in st["arms"] if a not in result["runs"]]
    _plot(result, rows, png_path)
    ref = rows.get("mdm", {}).get("validation")
    lines += ["# PUMBA local overfitting at small training u, tinymath medium (PUMBA §3.1, Fig. 2, App. D, Table 9)",
              "",
              f"Generated by `python benchmarks/local_overfitting.py --report {json_path}` from the JSON of:", "",
              *(f"    {c}" for c in result.get("commands", [result["command"]])), "",
              f"Date {result['date']}, machine: {result['machine']}, seed {result['seed']}, total "
              f"{result['seconds'] / 60:.1f} min. Start: `{st['start']}` (the warm start of every Post-SFT arm), "
              f"data `{st['data']}`, recipes `recipes/tinymath/mdm.yaml` / `pu.yaml` with canvas "
              f"{st['canvas']} tokens (model.max_length of the Post-SFT arms), batch {st['batch_size']}, "
              f"{st['updates']} updates, lr {st['lr']} constant after {st['warmup']} warm-up updates. PU: "
              f"stage-indexed construction, fixed K = round(M/u) with M = {st.get('maskable_mean', 'n/a')} mean "
              "maskable positions (response, EOS and padding to the canvas; the loss covers response + EOS only, as "
              "in our recipes), no threshold, one stage per update (J = K), no carry, no BPTT. "
              f"4 validation sequences inserted at each of updates {st['insert_at']}, 4 never inserted; validation "
              f"completion loss over {st['val_n']} other validation sequences every {st['val_every']} updates, "
              f"reported as its mean over the last {tail} updates. Relative loss \"later\": {later} updates after "
              "exit (the paper's 300 of 3,000 updates, scaled to the run).", "",
              "| arm | J | distinct sequences | n | rel. loss minimum | at exit | later | validation completion loss | "
              "paper (J, distinct, min, exit, later, val) |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        p = PAPER.get(arm)
        paper = "—" if p is None else ", ".join("—" if x is None else str(x) for x in p)
        lines.append(f"| {arm} | {r['J']} | {r['distinct']:,} | {r['n_inserted']} | {r['minimum']:.2f} | "
                     f"{r['exit']:.2f} | {r['later']:.2f} (n={r['n_later']}) | {r['validation']:.3f} | {paper} |")
    if skipped:
        why = result.get("note", "The --max-minutes budget ran out first.")
        lines += ["", f"Not run: {', '.join(skipped)}. {why}"]
    lines += ["", f"![mean log relative completion loss around insertion]({png_path.name})", "",
              "Relative losses are means over the inserted sequences that completed their stay of J updates within "
              "the run (n in the table); the plot shows the mean of the log relative loss against updates since "
              "insertion, ±1 s.e. over them, thick while the sequence is in the batch (J updates; one for MDM), "
              "no smoothing.", "", "## Reading", ""]
    start_val = {run["validation"]["loss"][0] for run in result["runs"].values()}
    if len(start_val) == 1:
        lines.append(f"- The warm start's validation completion loss (before any update, the same in every arm): "
                     f"{start_val.pop():.3f}.")
    lines += reading(rows, ref, st)
    old = md_path.read_text().splitlines() if md_path.is_file() else []
    status = []  # a hand-written "> ..." status box under the title survives regeneration
    for line in old[1:]:
        if line.startswith(">") or (not line and not status):
            status.append(line)
        else:
            break
    lines[1:1] = status if any(status) else []  # lines[1] is the blank line after the title
    text = "\n".join(lines) + "\n"
    md_path.write_text(text)
    return text


def reading(rows: dict, ref: float | None, st: dict) -> list[str]:
    """Factual comparison of the measured rows with the paper's direction (Table 9)."""
    out = []
    small = {a: r for a, r in rows.items() if a != "mdm" and parse_arm(a) <= 8}
    if ref is not None and small:
        above = [a for a, r in small.items() if r["validation"] > ref]
        out.append(f"- PU above MDM in validation completion loss (the paper's direction for u <= 8): "
                   f"{len(above)} of {len(small)} arms with u <= 8 ({', '.join(above) or 'none'}).")
    pu = sorted(((parse_arm(a), r["minimum"]) for a, r in rows.items() if a != "mdm" and r["n_inserted"]))
    if len(pu) >= 2:
        ordered = all(x[1] <= y[1] for x, y in zip(pu, pu[1:]))
        out.append("- Relative loss minimum by u: " + ", ".join(f"u={u}: {m:.2f}" for u, m in pu) +
                   (" (deeper at smaller u, as in Table 9)." if ordered else " (not monotone in u)."))
    for arm, r in rows.items():
        if arm == "mdm" or ref is None:
            continue
        rel = "above" if r["validation"] > ref else "below"
        out.append(f"- {arm}: validation completion loss {r['validation']:.3f}, {rel} MDM's {ref:.3f} "
                   f"({r['validation'] - ref:+.3f}); inserted sequences' relative loss minimum {r['minimum']:.2f}, "
                   f"{r['exit']:.2f} at exit (J={r['J']}).")
    if "mdm" in rows:
        m = rows["mdm"]
        out.append(f"- mdm: relative loss minimum {m['minimum']:.2f}, {m['exit']:.2f} after its single update, "
                   f"{m['later']:.2f} {st['later']} updates later: the scale of the noise in a relative loss here.")
    out.append("- Paper (TinyGSM, 125M from scratch, 3,000 updates, batch 256): at u=2 the relative loss falls to "
               "0.54 and the validation completion loss is 6.92 against MDM's 4.72; PU trails MDM for every u <= 8.")
    out += ["", "What differs from App. D.1, and so limits the comparison: the runs continue a trained masked model "
            f"(the Post-SFT form of §4) instead of training from scratch, {st['updates']} updates (paper 3,000) of "
            f"batch {st['batch_size']} (paper 256), on a shared 2-core CPU; K = round(M/u) with M counting the "
            "padding to the canvas (maskable, as on TinyGSM) while the loss covers the answer and its EOS only "
            "(our recipes), so an answer gets fewer than u tokens per step on average; one seed and 12 inserted "
            "sequences, so the relative-loss numbers carry the noise of 12 sequences and the validation loss that "
            "of its sequences."]
    return out


def _plot(result: dict, rows: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for arm, r in rows.items():
        run = result["runs"][arm]
        J = run["J"]
        xs, m, se = log_curve(run, r["curves"], (-BEFORE, result["settings"]["updates"]))
        if not xs:
            continue
        line, = ax.plot(xs, m, lw=0.8, label=f"{arm} (J={J})")
        ax.fill_between(xs, [a - b for a, b in zip(m, se)], [a + b for a, b in zip(m, se)], color=line.get_color(),
                        alpha=0.2)
        inside = [i for i, x in enumerate(xs) if 0 <= x <= J]
        ax.plot([xs[i] for i in inside], [m[i] for i in inside], lw=2.2, color=line.get_color())
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("updates since insertion")
    ax.set_ylabel("mean log relative completion loss")
    ax.set_title("Inserted validation sequences (thick: in the batch)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


# ---- the command --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, help="mdm and/or pu-uN (default: %(default)s)")
    ap.add_argument("--start", default="runs/medium-mdm-cont", help="warm start every arm continues")
    ap.add_argument("--data", default="runs/calib-ar-medium/data", help="tinymath medium data directory")
    ap.add_argument("--updates", type=int, default=240, help="updates per arm (paper: 3,000)")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per update (paper: 256)")
    ap.add_argument("--insert-at", type=int, nargs=3, default=[60, 120, 180],
                    help="updates at which 4 followed sequences enter (paper: 750 1500 2250)")
    ap.add_argument("--val-every", type=int, default=10, help="validation completion loss every N updates (paper 20)")
    ap.add_argument("--val-n", type=int, default=48, help="validation sequences in that loss (paper: 256)")
    ap.add_argument("--tail", type=int, default=40, help="report the validation loss's mean over the last N updates")
    ap.add_argument("--later", type=int, default=24, help="relative loss N updates after exit (paper: 300)")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="skip the remaining arms once another arm as long as the last would exceed this budget")
    ap.add_argument("--warmup", type=int, default=20, help="linear warm-up updates, then a constant lr")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--canvas", type=int, default=144, help="canvas tokens (model.max_length of the Post-SFT arms)")
    ap.add_argument("--seed", type=int, default=0, help="train.seed: data order, masks, initial stages")
    ap.add_argument("--json", default="runs/pumba-local-overfitting.json",
                    help="where the results go (default: %(default)s; docs/results/ holds the committed one)")
    ap.add_argument("--report", metavar="JSON", help="only write the doc and plot from an existing JSON")
    ap.add_argument("--md", help="the results doc (default: beside the JSON, .md)")
    ap.add_argument("--png", help="the plot (default: beside the JSON, .png)")
    args = ap.parse_args(argv)
    source = Path(args.report or args.json)
    args.md, args.png = args.md or str(source.with_suffix(".md")), args.png or str(source.with_suffix(".png"))
    if args.report:
        if not Path(args.report).is_file():
            print(f"local_overfitting: --report {args.report}: no such file", file=sys.stderr)
            return 2
        report(source, Path(args.md), Path(args.png))
        print(f"wrote {args.md} and {args.png}")
        return 0
    for flag, path in (("--start", args.start), ("--data", args.data)):
        if not Path(path).is_dir():
            print(f"local_overfitting: {flag} {path}: no such directory (build it with the commands in "
                  "benchmarks/plans/pumba-table2.yaml, settings.starts)", file=sys.stderr)
            return 2
    if any(t <= BEFORE or t > args.updates for t in args.insert_at):
        print(f"local_overfitting: --insert-at {args.insert_at}: each must lie in ({BEFORE}, --updates {args.updates}] "
              f"(the relative loss needs {BEFORE} updates before an insertion)", file=sys.stderr)
        return 2
    try:
        for arm in args.arms:
            parse_arm(arm)
    except ValueError as e:
        print(f"local_overfitting: --arms: {e}", file=sys.stderr)
        return 2
    line = shlex.join(["benchmarks/local_overfitting.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": "OMP_NUM_THREADS=1 python " + line,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"CPU, {torch.get_num_threads()} thread(s)", "seed": args.seed,
              "settings": {k: getattr(args, k) for k in ("start", "data", "updates", "batch_size", "insert_at",
                                                         "val_every", "val_n", "tail", "later", "warmup", "lr",
                                                         "canvas", "arms")},
              "runs": {}}
    t0 = time.time()
    M = mean_maskable(args.start, args.data, args.canvas)
    result["settings"]["maskable_mean"] = round(M, 1)
    for i, arm in enumerate(args.arms):
        spent = time.time() - t0
        last = max((r["seconds"] for r in result["runs"].values()), default=0.0)
        if args.max_minutes and spent + last > 60 * args.max_minutes:
            result["skipped_arms"] = args.arms[i:]
            print(f"budget of {args.max_minutes} min: skipping {' '.join(args.arms[i:])}", flush=True)
            break
        run = run_arm(arm, args.start, args.data, args.updates, args.batch_size, args.insert_at, args.val_every,
                      args.val_n, args.seed, args.lr, args.warmup, args.canvas, maskable_mean=M)
        result["runs"][arm] = run
        result["seconds"] = round(time.time() - t0, 1)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result) + "\n")
        r = summarize(run, args.later, args.tail)
        print(f"[{arm}] K={run['K']} {run['seconds']:.0f}s distinct={run['distinct_sequences']} "
              f"val={r['validation']:.3f} rel.min={r['minimum']:.2f} exit={r['exit']:.2f}", flush=True)
    report(Path(args.json), Path(args.md), Path(args.png))
    print(f"wrote {args.json}, {args.md}, {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
