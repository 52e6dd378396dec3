"""`dlm train RECIPE --dry-run`: what a recipe costs before it runs. Builds the recipe's model on the meta device
(no weights, no data, seconds for 8B), counts its parameters, and estimates per-device memory and time per update for
the parallelism of its `scale:` section (the accelerate config it names, `num_processes`, `gpu`, `mfu`).

Every number is arithmetic on stated formulas (`FORMULAS`), an upper bound where canvases are padded to
`model.max_length`; measured peaks on a real GPU come from benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import cast

import torch
import yaml
from transformers import PretrainedConfig

from dlm.config import GPUS, Recipe, family_of
from dlm.errors import DlmError
from dlm.modeling.backbone import DiffusionLM, kv_shape
from dlm.training.meta_model import backbone_config, meta_model, recipes_beside  # noqa: F401 (this module's API)
from dlm.training.parallel import Parallelism, from_accelerate_config, refusals

GiB = 1024**3

FORMULAS = {
    "weights": "fp32 training: 4 B/param. bf16 mixed (DDP, FSDP2): fp32 master 4 B/param (sharded under FSDP2) + a "
               "bf16 compute copy 2 B/param (DDP: autocast's cast cache, all trainable params; FSDP2: the unsharded "
               "bf16 params of 2 layers, the current and the prefetched). DeepSpeed bf16: 2 B/param (ZeRO-3: "
               "sharded); the fp32 master sits in the optimizer. LoRA: the frozen base at lora.base_dtype",
    "gradients": "one per trainable param: 4 B (fp32 master grads), DeepSpeed bf16: 2 B; sharded by ZeRO-2/3, FSDP2",
    "optimizer": "AdamW: 2 fp32 states = 8 B per trainable param; DeepSpeed bf16 adds the fp32 master: 12 B (ZeRO "
                 "paper §3.1, K=12); sharded by ZeRO-2/3, FSDP2",
    "ema": "train.ema_decay: an fp32 copy of the trainable params, 4 B each (sharded with the weights)",
    "activations": "per decoder layer, T = micro-batch x sequence positions, c = compute bytes (bf16 2, fp32 4): "
                   "c*T*(6h + 2h_kv + 4i) kept (2 norm inputs, 2 normed inputs, q + attention output, k/v, the "
                   "MLP's gate, up, activation, product; sdpa/flash attention keeps no s x s scores); with "
                   "train.activation_checkpointing c*T*h per layer (its input) + one layer recomputed. Plus the "
                   "logits c*T*V + their fp32 copy in the loss 4*T*V (reward models: c*T*h, no logits). Block "
                   "layouts hold clean + noised copies: T doubles. PU: W passes per update each keep theirs, unless "
                   "progressive.activation_checkpointing (then W x T*h*6 B of carry and hidden state + one pass "
                   "recomputed). Simplex: + the fp32 noisy simplex and its softmax 8*T*V, + previous logits 4*T*V "
                   "with self-conditioning",
    "flops": "per position: forward 2*N_mm + 4*L*h*s (PaLM App. B: attention over s positions; block-causal masks "
             "skip some, so an upper bound); backward 2x forward for trainable weights, 1x (input grads only) for "
             "frozen ones; + one forward per checkpointing level; x W passes (PU); + p forwards (simplex "
             "self-conditioning); N_mm = matrix params (not norms, not an untied input embedding)",
    "time": "FLOPs per update / (num_processes x GPU peak bf16 dense x mfu)",
    "grpo": "train.batch_size completions per micro-batch, x rl.mc_num passes for the elbo/spg estimators (1 for "
            "mean_field and AR); + a frozen reference's weights (rl.reference frozen: 2 B/param in bf16, 4 in fp32; "
            "the LoRA base costs nothing); FLOPs + the reference's forward, + rollouts once per rl.inner_steps "
            "updates: each completion NFE full-canvas forwards (NFE = max_new_tokens / eval.reveal_count for top_u, "
            "max_new_tokens / 2 under threshold decoding: a planning figure, as threshold NFE depends on the "
            "model's confidence; KV caches make rollouts cheaper than this), + with mu > 1 the old policy's "
            "forward once per update on average",
}


def grpo_passes(recipe: Recipe) -> int:
    """Forward passes of the policy per completion in one GRPO loss (elbo/spg: rl.mc_num; else 1)."""
    rl = recipe.rl
    return rl.mc_num if rl.family == "masked" and rl.estimator in ("elbo", "spg") else 1


def grpo_forwards(recipe: Recipe) -> float:
    """Forwards per completion position per update besides the loss's (FORMULAS["grpo"])."""
    rl, ev = recipe.rl, recipe.eval
    new = rl.max_new_tokens or ev.max_new_tokens
    nfe = new if rl.family == "autoregressive" else \
        new / (ev.reveal_count if ev.policy == "top_u" else 2)
    passes = grpo_passes(recipe)
    return nfe / rl.inner_steps + passes * (bool(rl.kl_beta) + (rl.inner_steps > 1))


def read_parallelism(recipe: Recipe, recipe_path: str | Path | None = None) -> Parallelism:
    """The parallelism of `scale.accelerate_config` (relative to the working directory, else to a directory above
    the recipe), over `scale.num_processes` processes: the description the trainer's strategies share
    (`dlm.training.parallel`); errors name the field or key."""
    sc = recipe.scale
    if sc.accelerate_config is None:
        return Parallelism("single" if sc.num_processes == 1 else "ddp", sc.num_processes, 1, None)
    path = _find(sc.accelerate_config, recipe_path)
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise DlmError(f"scale.accelerate_config: {path} is not valid YAML ({' '.join(str(err).split())})") from None
    par = from_accelerate_config(cfg, sc.num_processes, path)
    return dataclasses.replace(par, config=str(sc.accelerate_config))


def _find(name: str, recipe_path: str | Path | None) -> Path:
    candidates = [Path(name)]
    if recipe_path is not None and not Path(name).is_absolute():
        candidates += [parent / name for parent in Path(recipe_path).resolve().parents]
    for c in candidates:
        if c.is_file():
            return c
    raise DlmError(f"scale.accelerate_config: {name} not found (relative to the working directory or a directory "
                   f"above the recipe); see recipes/accelerate/")


# ---- the estimate -------------------------------------------------------------------------------------------------
def estimate(recipe: Recipe, recipe_path: str | Path | None = None, recipes: Sequence[str | Path] = ()) -> dict:
    """Parameters, per-device memory (bytes) and time per update of `recipe` at its `scale:` settings; `recipes`:
    the recipe files that may describe the run `model.init_from` continues (`meta_model.backbone_config`)."""
    model, source = meta_model(recipe, recipes)
    par = read_parallelism(recipe, recipe_path)
    tc, sc = recipe.train, recipe.scale
    gpu = GPUS[sc.gpu]
    n, shape = parameter_counts(model, tc.objective == "reward"), _shape(model.backbone.config)
    micro = micro_batch(recipe)
    memory = state_bytes(recipe, par, n)
    act_without, act_with = activation_bytes(recipe, shape, micro)
    memory["activations"] = act_with if tc.activation_checkpointing else act_without
    total_bytes = sum(memory.values())
    flops, global_seqs, canvas_tokens = update_flops(recipe, par, n, shape, micro)
    seconds = flops / (par.processes * gpu.peak_flops * sc.mfu)  # for this global batch, the one the run will take
    batch = {"batch_size": tc.batch_size, "grad_accum": tc.grad_accum, "processes": par.processes,
             "sequences": global_seqs}
    sized_for = written_batch(recipe_path)
    notes = [f"the trainer refuses this recipe here: {why}" for why in refusals(par.backend, recipe)]
    if total_bytes > gpu.memory_bytes and not tc.activation_checkpointing and act_with < memory["activations"]:
        notes.append(f"train.activation_checkpointing: true would cut activations to {_g(act_with)} (total "
                     f"{_g(total_bytes - memory['activations'] + act_with)})")
    if sized_for is not None and sized_for["sequences"] != global_seqs:
        notes.append(batch_note(batch, sized_for, seconds, tc.steps))
    if micro["pu_window"] > 1 and not micro["progressive_checkpointing"] and not tc.activation_checkpointing:
        notes.append(f"PU keeps the activations of all W={micro['pu_window']} passes: progressive.activation_"
                     f"checkpointing or train.activation_checkpointing keeps them from growing W-fold")
    return {
        "recipe": recipe.name, "objective": tc.objective, "family": family_of(recipe),
        "model_source": source, "architecture": type(model.backbone).__name__,
        "shape": {k: shape[k] for k in ("hidden", "layers", "kv_width", "intermediate", "vocab", "tied_embeddings")},
        "parameters": {"total": n["total"], "trainable": n["trainable"], "frozen": n["frozen"],
                       "lora": tc.lora is not None},
        "parallelism": asdict(par) | {"sharded": sorted(par.sharded)},
        "precision": tc.precision,
        "micro_batch": {k: micro[k] for k in ("sequences", "positions", "block_layout", "pu_window")},
        "activation_checkpointing": {"train": tc.activation_checkpointing,
                                     "progressive": micro["progressive_checkpointing"]},
        "memory_bytes": memory | {"total": total_bytes},
        "activations_bytes": {"without_checkpointing": act_without, "with_checkpointing": act_with},
        "gpu": {"name": sc.gpu, "memory_bytes": gpu.memory_bytes, "peak_bf16_flops": gpu.peak_flops},
        "fits": total_bytes <= gpu.memory_bytes,
        "tokens_per_update": canvas_tokens, "global_sequences_per_update": global_seqs,
        "global_batch": batch, "sized_for": sized_for,
        "flops_per_update": flops, "mfu": sc.mfu, "seconds_per_update": seconds,
        "hours_for_run": seconds * tc.steps / 3600, "steps": tc.steps,
        "notes": notes, "formulas": FORMULAS,
    }


def parameter_counts(model: DiffusionLM, reward: bool) -> dict[str, int]:
    """Parameters: total, trainable, frozen; `updated` (those that get a gradient and AdamW states: a reward model
    reads its scalar head, never an untied LM head); `matmul` weights (not norms, not the input embedding, a lookup:
    tied, it is still the LM head's matrix; not a reward model's LM head), and the largest decoder layer."""
    backbone = model.backbone
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    tied = bool(getattr(backbone.config, "tie_word_embeddings", False))
    embed_w, head_w = backbone.get_input_embeddings().weight, backbone.get_output_embeddings().weight
    layers = cast(torch.nn.ModuleList, backbone.base_model.layers)
    unused = head_w.numel() if reward and not tied else 0
    skip = ({id(embed_w)} if not tied else set()) | ({id(head_w)} if reward else set())
    matmul = [p for p in params if p.ndim >= 2 and id(p) not in skip]
    return {"total": total, "trainable": trainable, "frozen": total - trainable, "updated": trainable - unused,
            "matmul": sum(p.numel() for p in matmul),
            "matmul_trainable": sum(p.numel() for p in matmul if p.requires_grad),
            "layer": max(sum(p.numel() for p in layer.parameters()) for layer in layers)}


def _shape(cfg: PretrainedConfig) -> dict:
    return {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "kv_width": math.prod(kv_shape(cfg)),
            "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
            "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False))}


def state_bytes(recipe: Recipe, par: Parallelism, n: dict[str, int]) -> dict[str, float]:
    """Bytes per device of the weights, gradients, AdamW states and EMA (FORMULAS), sharded as `par` shards them."""
    tc = recipe.train
    trainable, frozen, updated = n["trainable"], n["frozen"], n["updated"]
    bf16 = tc.precision == "bf16"
    frozen_bytes = 2 if (tc.lora is not None and tc.lora.base_dtype == "bfloat16") or (bf16 and par.deepspeed) else 4
    shard = {k: (par.shard if k in par.sharded else 1) for k in ("weights", "gradients", "optimizer")}
    if bf16 and par.deepspeed:
        weights = (2 * trainable + frozen_bytes * frozen) / shard["weights"]
        grads = 2 * updated / shard["gradients"]
        optim = 12 * updated / shard["optimizer"]
    else:
        weights = (4 * trainable + frozen_bytes * frozen) / shard["weights"]
        if bf16:  # the bf16 compute copy of the trainable weights
            weights += 2 * (min(trainable, 2 * n["layer"]) if par.backend == "fsdp2" else trainable)
        grads = 4 * updated / shard["gradients"]
        optim = 8 * updated / shard["optimizer"]
    ema = 4 * trainable / shard["weights"] if tc.ema_decay else 0.0
    out = {"weights": weights, "gradients": grads, "optimizer": optim, "ema": ema}
    if tc.objective == "grpo":
        frozen_copy = recipe.rl.reference == "frozen" and recipe.rl.kl_beta
        out["reference"] = (2 if bf16 else 4) * (trainable + frozen) if frozen_copy else 0.0
    return out


def micro_batch(recipe: Recipe) -> dict:
    """One micro-batch: sequences (reward: chosen + rejected canvas per pair), positions per sequence (block
    layouts hold clean + noised copies), the PU window and whether PU checkpoints its passes."""
    tc, m = recipe.train, recipe.model
    pu = tc.objective == "pu"
    block = m.attention == "block_causal"
    many = 2 if tc.objective == "reward" else grpo_passes(recipe) if tc.objective == "grpo" else 1
    return {"sequences": tc.batch_size * many,
            "positions": m.max_length * (2 if block else 1), "block_layout": block,
            "pu_window": recipe.progressive.window if pu else 1,
            "progressive_checkpointing": bool(pu and recipe.progressive.activation_checkpointing)}


def activation_bytes(recipe: Recipe, shape: dict, micro: dict) -> tuple[float, float]:
    """Activation bytes per device of one micro-batch (FORMULAS): (without, with) layer checkpointing."""
    tc = recipe.train
    h, n_layers, vocab = shape["hidden"], shape["layers"], shape["vocab"]
    t = micro["sequences"] * micro["positions"]
    c = 2 if tc.precision == "bf16" else 4
    layer_full = c * t * (6 * h + 2 * shape["kv_width"] + 4 * shape["intermediate"])
    layer_ckpt = c * t * h
    head = c * t * h if tc.objective == "reward" else c * t * vocab + 4 * t * vocab  # reward: hidden states, no logits
    if tc.objective == "simplex":
        head += 8 * t * vocab + (4 * t * vocab if recipe.simplex.self_condition_prob > 0 else 0)
    pass_full = n_layers * layer_full + head
    pass_ckpt = n_layers * layer_ckpt + layer_full + head
    window, pu = micro["pu_window"], tc.objective == "pu"

    def acts(layer_checkpointing: bool) -> float:
        one = pass_ckpt if layer_checkpointing else pass_full
        if not pu:
            return one
        carry = 6 * t * h  # fp32 carry in + bf16/fp32 hidden state out, per pass
        if micro["progressive_checkpointing"]:
            return window * carry + one
        kept = n_layers * layer_ckpt + head if layer_checkpointing else pass_full
        return window * (kept + carry) + (layer_full if layer_checkpointing else 0)

    return acts(False), acts(True)


def update_flops(recipe: Recipe, par: Parallelism, n: dict[str, int], shape: dict, micro: dict
                 ) -> tuple[float, int, int]:
    """(FLOPs per update, global sequences, canvas tokens) for the global batch of `par.processes` (FORMULAS)."""
    tc, m = recipe.train, recipe.model
    global_seqs = tc.batch_size * tc.grad_accum * par.processes
    canvas_tokens = global_seqs * m.max_length * (2 if tc.objective == "reward" else 1)
    compute_positions = canvas_tokens * (2 if micro["block_layout"] else 1)
    n_mm, n_mm_trainable = n["matmul"], n["matmul_trainable"]
    attn = 4 * shape["layers"] * shape["hidden"] * micro["positions"]
    fwd = 2 * n_mm + attn
    bwd = 2 * (2 * n_mm + attn) - 2 * (n_mm - n_mm_trainable)  # frozen weights: input grads only
    recompute = (1 if tc.activation_checkpointing else 0) + (1 if micro["progressive_checkpointing"] else 0)
    per_position = fwd + bwd + recompute * fwd
    extra_fwd = recipe.simplex.self_condition_prob if tc.objective == "simplex" else 0.0
    passes = grpo_passes(recipe) if tc.objective == "grpo" else 1
    flops = compute_positions * (micro["pu_window"] * passes * per_position + extra_fwd * fwd)
    if tc.objective == "grpo":  # rollouts, the reference, the old policy: forwards only
        flops += canvas_tokens * grpo_forwards(recipe) * fwd
    return flops, global_seqs, canvas_tokens


def written_batch(recipe_path: str | Path | None) -> dict | None:
    """The global batch the recipe file is sized for, before any --set (train.batch_size x train.grad_accum x
    scale.num_processes); None without a file, or one that does not load alone."""
    if recipe_path is None:
        return None
    from dlm.config import load_recipe

    try:
        written = load_recipe(recipe_path)
    except DlmError:
        return None
    tc, sc = written.train, written.scale
    return {"batch_size": tc.batch_size, "grad_accum": tc.grad_accum, "processes": sc.num_processes,
            "sequences": tc.batch_size * tc.grad_accum * sc.num_processes}


def batch_note(batch: dict, sized_for: dict, seconds: float, steps: int) -> str:
    """What a setting that changes the global batch changes, and the train.grad_accum that restores it (time per
    update grows with it: FLOPs are linear in the global batch)."""
    note = (f"global batch {batch['sequences']} sequences ({_product(batch)}), not the {sized_for['sequences']} the "
            f"recipe is sized for ({_product(sized_for)}): time per update and whole run are for "
            f"{batch['sequences']}")
    per_accum = batch["batch_size"] * batch["processes"]
    if sized_for["sequences"] % per_accum:
        return note + f"; no whole train.grad_accum gives {sized_for['sequences']} with {_product(batch, accum=False)}"
    accum = sized_for["sequences"] // per_accum
    scaled = seconds * accum / batch["grad_accum"]
    return note + (f"; --set train.grad_accum={accum} keeps {sized_for['sequences']}: {_t(scaled)} per update, "
                   f"{_t(scaled * steps)} for {steps:,} updates")


def _product(b: dict, accum: bool = True) -> str:
    accums = [f"grad_accum {b['grad_accum']}"] if accum else []
    return " x ".join([f"batch_size {b['batch_size']}", *accums, f"{b['processes']} processes"])


# ---- output -------------------------------------------------------------------------------------------------------
def dry_run(recipe: Recipe, recipe_path: str | Path | None = None, as_json: bool = False,
            recipes: Sequence[str | Path] | None = None) -> dict:
    """Print the estimate of `recipe` (a table, or JSON) and return it; `recipes` (default: the recipe files beside
    `recipe_path`) may describe the run `model.init_from` continues."""
    report = estimate(recipe, recipe_path, recipes_beside(recipe_path) if recipes is None else recipes)
    print(json.dumps(report, indent=2) if as_json else render(report))
    return report


def _g(b: float) -> str:
    return f"{b / GiB:,.1f} GiB" if b >= GiB / 10 else f"{b / 1024**2:,.1f} MiB"


def _n(x: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x:,.0f}"


def _t(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def rows(r: dict) -> list[tuple[str, str]]:
    """The report as (quantity, value) rows: what the table and the guide show."""
    p, par, mem, mb = r["parameters"], r["parallelism"], r["memory_bytes"], r["micro_batch"]
    shard = f", sharded over {par['shard']}: {', '.join(par['sharded'])}" if par["sharded"] else ""
    ck = r["activation_checkpointing"]
    ckpt = ", ".join(k for k, v in (("train", ck["train"]), ("progressive", ck["progressive"])) if v) or "off"
    share = f" ({100 * p['trainable'] / p['total']:.2g} %)" if p["trainable"] != p["total"] else ""
    seqs, sized = r["global_sequences_per_update"], r.get("sized_for")
    differs = sized is not None and sized["sequences"] != seqs  # a --set changed the global batch: say so
    changed = f" = {_product(r['global_batch'])}; NOT the recipe's {sized['sequences']}" if sized and differs else ""
    this = f" for {seqs} seq" if differs else ""
    return [
        ("model", f"{r['architecture']} from {r['model_source']}"),
        ("parameters", f"{_n(p['total'])} total, {_n(p['trainable'])} trainable{share}"),
        ("parallelism", f"{par['backend']} x {par['processes']} processes{shard} ({par['config'] or 'no config'})"),
        ("precision", r["precision"] + (" + LoRA" if p["lora"] else "")),
        ("micro-batch", f"{mb['sequences']} seq x {mb['positions']} positions"
                        + (" (block: clean + noised)" if mb["block_layout"] else "")
                        + (f", PU window W={mb['pu_window']}" if mb["pu_window"] > 1 else "")),
        ("weights", _g(mem["weights"])),
        ("gradients", _g(mem["gradients"])),
        ("optimizer (AdamW)", _g(mem["optimizer"])),
        ("EMA", _g(mem["ema"]) if mem["ema"] else "off"),
        *([("RL reference", _g(mem["reference"]) if mem["reference"] else "none (LoRA base or no KL)")]
          if "reference" in mem else []),
        ("activations, no checkpointing", _g(r["activations_bytes"]["without_checkpointing"])),
        ("activations, layer checkpointing", _g(r["activations_bytes"]["with_checkpointing"])),
        ("checkpointing as configured", ckpt),
        ("total per device", f"{_g(mem['total'])} of {_g(r['gpu']['memory_bytes'])} ({r['gpu']['name']})"
                             + ("" if r["fits"] else "  DOES NOT FIT")),
        ("tokens per update (global)", f"{_n(r['tokens_per_update'])} ({seqs} seq{changed})"),
        ("time per update", f"{_t(r['seconds_per_update'])}{this} at MFU {r['mfu']:g} on "
                            f"{r['parallelism']['processes']} x {r['gpu']['name']} "
                            f"({r['flops_per_update'] / 1e12:,.4g} TFLOP)"),
        ("whole run", f"{_t(r['hours_for_run'] * 3600)} for {r['steps']:,} updates{this.replace('for', 'of')}"),
    ]


def render(r: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"dlm dry run: {r['recipe']} ({r['objective']})", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows(r):
        table.add_row(k, f"[red]{v}[/red]" if "DOES NOT FIT" in v else v)
    for note in r["notes"]:
        table.add_row("note", note)
    console = Console(width=120, record=True, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
        console.print("Estimates: states and activations by the formulas in `--dry-run --json` (formulas); canvases "
                      "counted full (max_length).")
    return cap.get()


def markdown(r: dict) -> str:
    """The report as a Markdown table (docs/guides/multi-gpu.md)."""
    lines = [f"**{r['recipe']}**", "", "| quantity | estimate |", "|---|---|"]
    lines += [f"| {k} | {v.replace('|', '/')} |" for k, v in rows(r)]
    lines += [f"| note | {n} |" for n in r["notes"]]
    return "\n".join(lines) + "\n"
