"""`dlm train RECIPE --dry-run`: what a recipe costs before it runs. Builds the recipe's model on the meta device
(no weights, no data, seconds for 8B), counts its parameters, and estimates per-device memory and time per update for
the parallelism of its `scale:` section (the accelerate config it names, `num_processes`, `gpu`, `mfu`).

Every number is arithmetic on stated formulas (`FORMULAS`), an upper bound where canvases are padded to
`model.max_length`; measured peaks on a real GPU come from benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from dlm.config import FAMILIES, GPUS, Recipe, model_spec
from dlm.errors import DlmError
from dlm.modeling import lora
from dlm.modeling.backbone import PRESETS, DiffusionLM, kv_shape
from dlm.modeling.build import EXTRAS
from dlm.modeling.formats import FORMATS

GiB = 1024**3

# Published configs of the checkpoints the scale recipes start from, used when `model.init_from` is not on this
# machine; matched by a regular expression searched in its lower-cased basename. Values: the checkpoints'
# config.json (LLaDA-8B as quoted in dlm.modeling.formats; Dream-7B = Qwen2.5-7B's architecture; Mistral-7B-v0.1).
KNOWN_CONFIGS: dict[str, tuple[str, str, dict]] = {
    r"llada-?8b": ("LLaDA-8B", "llama", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        intermediate_size=12288, vocab_size=126464, tie_word_embeddings=False, rope_theta=500000.0,
        max_position_embeddings=8192)),
    r"dream": ("Dream-7B", "qwen2", dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6,
        max_position_embeddings=131072)),
    r"mistral-?7b": ("Mistral-7B-v0.1", "mistral", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0,
        max_position_embeddings=32768)),
}

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
}


@dataclass(frozen=True)
class Parallelism:
    """How the accelerate config distributes a run: which states are sharded, over how many processes."""

    backend: str  # single | ddp | fsdp2 | zero2 | zero3
    processes: int
    shard: int  # processes each sharded state is split over (HSDP: the shard group)
    config: str | None
    wrap: str | None = None  # FSDP2: fsdp_transformer_layer_cls_to_wrap

    @property
    def sharded(self) -> set[str]:
        return {"single": set(), "ddp": set(), "zero2": {"gradients", "optimizer"},
                "zero3": {"weights", "gradients", "optimizer"}, "fsdp2": {"weights", "gradients", "optimizer"}}[
            self.backend]

    @property
    def deepspeed(self) -> bool:
        return self.backend.startswith("zero")


def read_parallelism(recipe: Recipe, recipe_path: str | Path | None = None) -> Parallelism:
    """The parallelism of `scale.accelerate_config` (relative to the working directory, else to a directory above
    the recipe), over `scale.num_processes` processes; errors name the field or key."""
    sc = recipe.scale
    if sc.accelerate_config is None:
        return Parallelism("single" if sc.num_processes == 1 else "ddp", sc.num_processes, 1, None)
    wrap = None
    path = _find(sc.accelerate_config, recipe_path)
    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise DlmError(f"scale.accelerate_config: {path} is not valid YAML ({' '.join(str(err).split())})") from None
    kind = str(cfg.get("distributed_type", "NO")).upper()
    shard = sc.num_processes
    if kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        backend = "single" if sc.num_processes == 1 else "ddp"
    elif kind == "FSDP":
        fsdp = cfg.get("fsdp_config") or {}
        if int(fsdp.get("fsdp_version", 1)) != 2:
            raise DlmError(f"{path}: fsdp_config.fsdp_version must be 2 (FSDP2); dlm's configs use FSDP2 only")
        backend = "fsdp2"
        wrap = fsdp.get("fsdp_transformer_layer_cls_to_wrap")
        par = cfg.get("parallelism_config") or {}
        shard = int(par.get("parallelism_config_dp_shard_size", sc.num_processes) or sc.num_processes)
    elif kind == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        stage = ds.get("zero_stage")
        if stage not in (2, 3):
            raise DlmError(f"{path}: deepspeed_config.zero_stage is {stage!r}; the dry run knows ZeRO stages 2 and 3")
        backend = f"zero{stage}"
    else:
        raise DlmError(f"{path}: distributed_type {kind!r} is not one the dry run knows (NO, MULTI_GPU, FSDP, "
                       f"DEEPSPEED)")
    if sc.num_processes % shard:
        raise DlmError(f"scale.num_processes {sc.num_processes} is not a multiple of the shard size {shard} in {path}")
    return Parallelism(backend, sc.num_processes, shard if backend != "ddp" else 1, str(sc.accelerate_config), wrap)


def _find(name: str, recipe_path: str | Path | None) -> Path:
    candidates = [Path(name)]
    if recipe_path is not None and not Path(name).is_absolute():
        candidates += [parent / name for parent in Path(recipe_path).resolve().parents]
    for c in candidates:
        if c.is_file():
            return c
    raise DlmError(f"scale.accelerate_config: {name} not found (relative to the working directory or a directory "
                   f"above the recipe); see recipes/accelerate/")


# ---- the model, on the meta device --------------------------------------------------------------------------------
def backbone_config(recipe: Recipe, recipe_path: str | Path | None = None, _depth: int = 0
                    ) -> tuple[PretrainedConfig, str]:
    """The HF config the recipe's backbone has, and where it came from, first found of: `model.init_from`'s
    config.json when that directory exists here; the recipe under the same recipes/ tree whose out_dir is
    `model.init_from` (a run this one continues), followed back; a published config matched by the basename
    (`KNOWN_CONFIGS`); `model.arch` / `model.preset`."""
    m = recipe.model
    if m.init_from:
        directory = Path(m.init_from).expanduser()
        for d in (directory, directory / "model"):
            if (d / "config.json").is_file():
                return _read_config(d), f"{d / 'config.json'}"
        producer = _producing_recipe(m.init_from, recipe_path) if _depth < 8 else None
        if producer is not None:
            from dlm.config import load_recipe

            config, where = backbone_config(load_recipe(producer), producer, _depth + 1)
            return config, f"{where}, via {producer} (its out_dir {m.init_from} is not here)"
        key = next((k for k in KNOWN_CONFIGS if re.search(k, directory.name.lower())), None)
        if key is not None:
            label, arch, values = KNOWN_CONFIGS[key]
            return AutoConfig.for_model(arch, **values), f"the published {label} config ({m.init_from} is not here)"
    sizes = PRESETS.get(m.preset)
    if sizes is None:
        raise DlmError(f"model.preset: unknown {m.preset!r}; choose one of {', '.join(PRESETS)}")
    config = AutoConfig.for_model(m.arch, vocab_size=m.vocab_size, max_position_embeddings=m.max_length,
                                  tie_word_embeddings=True, **sizes)
    where = f"model.arch {m.arch} / preset {m.preset}, vocab {m.vocab_size}"
    return config, where + (f" ({m.init_from} is not here; assumed built by this preset)" if m.init_from else "")


def _producing_recipe(out_dir: str, recipe_path: str | Path | None) -> Path | None:
    """The recipe (in the recipes/ tree holding `recipe_path`) that writes `out_dir`; None if there is none."""
    if recipe_path is None:
        return None
    root = next((p for p in Path(recipe_path).resolve().parents if p.name == "recipes"), None)
    if root is None:
        return None
    for candidate in sorted(root.rglob("*.yaml")):
        try:
            raw = yaml.safe_load(candidate.read_text())
        except (yaml.YAMLError, OSError, UnicodeDecodeError):
            continue
        if isinstance(raw, dict) and raw.get("out_dir") == out_dir and "model" in raw:
            try:
                return candidate.relative_to(Path.cwd())
            except ValueError:
                return candidate
    return None


def _read_config(model_dir: Path) -> PretrainedConfig:
    raw = json.loads((model_dir / "config.json").read_text())
    fmt = FORMATS.get(raw.get("model_type"))
    if fmt is None:
        return AutoConfig.from_pretrained(model_dir)
    rows = raw.get("embedding_size") or raw.get("vocab_size")
    return AutoConfig.for_model(fmt.hf_model_type, **fmt.hf_config(raw, rows, model_dir / "config.json"))


def meta_model(recipe: Recipe, recipe_path: str | Path | None = None) -> tuple[DiffusionLM, str]:
    """The recipe's model with every parameter on the meta device: backbone, the extras its spec names
    (dlm.modeling.build.EXTRAS) and LoRA adapters, trainable flags as training sets them."""
    config, source = backbone_config(recipe, recipe_path)
    spec = model_spec(recipe, None, None, None)
    with torch.device("meta"):
        backbone = AutoModelForCausalLM.from_config(config)
        if spec.lora is not None:
            spec = spec.model_copy(update={"lora": lora.inject(backbone, spec.lora)})
        model = DiffusionLM(backbone, spec)
        extras = [e for e in EXTRAS if e.wanted(spec)]
        for extra in extras:
            backbone.add_module(extra.name, extra.create(backbone))
        if spec.lora is not None:
            lora.mark_trainable(backbone, [getattr(backbone, e.name) for e in extras])
    return model, source


# ---- the estimate -------------------------------------------------------------------------------------------------
def estimate(recipe: Recipe, recipe_path: str | Path | None = None) -> dict:
    """Parameters, per-device memory (bytes) and time per update of `recipe` at its `scale:` settings."""
    model, source = meta_model(recipe, recipe_path)
    par = read_parallelism(recipe, recipe_path)
    tc, m, sc = recipe.train, recipe.model, recipe.scale
    gpu = GPUS[sc.gpu]
    cfg = model.backbone.config
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = total - trainable
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    embed_w = model.backbone.get_input_embeddings().weight
    head_w = model.backbone.get_output_embeddings().weight
    # A reward model reads its scalar head, never the LM head: an untied LM head gets no gradient and no AdamW state.
    reward = tc.objective == "reward"
    unused = head_w.numel() if reward and not tied else 0
    updated = trainable - unused  # parameters that get a gradient and AdamW states
    # Matmul weights: not norms, not the input embedding (a lookup; tied, it is still the LM head's matrix), not the
    # LM head of a reward model.
    skip = {id(embed_w)} if not tied else set()
    skip |= {id(head_w)} if reward else set()
    matmul = [p for p in params if p.ndim >= 2 and id(p) not in skip]
    n_mm = sum(p.numel() for p in matmul)
    n_mm_trainable = sum(p.numel() for p in matmul if p.requires_grad)

    h, n_layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    h_kv = math.prod(kv_shape(cfg))
    inter = cfg.intermediate_size
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in model.backbone.base_model.layers)

    # ---- states (bytes per device)
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
            weights += 2 * (min(trainable, 2 * layer_params) if par.backend == "fsdp2" else trainable)
        grads = 4 * updated / shard["gradients"]
        optim = 8 * updated / shard["optimizer"]
    ema = 4 * trainable / shard["weights"] if tc.ema_decay else 0.0

    # ---- activations (bytes per device, one micro-batch)
    block = m.attention == "block_causal"
    seqs = tc.batch_size * (2 if reward else 1)  # reward: chosen + rejected canvas per pair
    positions = m.max_length * (2 if block else 1)
    t = seqs * positions
    c = 2 if bf16 else 4
    layer_full = c * t * (6 * h + 2 * h_kv + 4 * inter)
    layer_ckpt = c * t * h
    head = c * t * h if reward else c * t * vocab + 4 * t * vocab  # reward: the final hidden states, no logits
    if tc.objective == "simplex":
        head += 8 * t * vocab + (4 * t * vocab if recipe.simplex.self_condition_prob > 0 else 0)
    pass_full = n_layers * layer_full + head
    pass_ckpt = n_layers * layer_ckpt + layer_full + head
    pu = tc.objective == "pu"
    window = recipe.progressive.window if pu else 1
    pass_ckpt_pu = pu and recipe.progressive.activation_checkpointing

    def acts(layer_checkpointing: bool) -> float:
        one = pass_ckpt if layer_checkpointing else pass_full
        if not pu:
            return one
        carry = 6 * t * h  # fp32 carry in + bf16/fp32 hidden state out, per pass
        if pass_ckpt_pu:
            return window * carry + one
        kept = n_layers * layer_ckpt + head if layer_checkpointing else pass_full
        return window * (kept + carry) + (layer_full if layer_checkpointing else 0)

    act_without, act_with = acts(False), acts(True)
    activations = act_with if tc.activation_checkpointing else act_without
    memory = {"weights": weights, "gradients": grads, "optimizer": optim, "ema": ema, "activations": activations}
    total_bytes = sum(memory.values())

    # ---- time per update
    global_seqs = tc.batch_size * tc.grad_accum * par.processes
    canvas_tokens = global_seqs * m.max_length * (2 if reward else 1)
    compute_positions = canvas_tokens * (2 if block else 1)
    attn = 4 * n_layers * h * positions
    fwd = 2 * n_mm + attn
    bwd = 2 * (2 * n_mm + attn) - 2 * (n_mm - n_mm_trainable)  # frozen weights: input grads only
    recompute = (1 if tc.activation_checkpointing else 0) + (1 if pass_ckpt_pu else 0)
    per_position = fwd + bwd + recompute * fwd
    passes = window
    extra_fwd = recipe.simplex.self_condition_prob if tc.objective == "simplex" else 0.0
    flops = compute_positions * (passes * per_position + extra_fwd * fwd)
    seconds = flops / (par.processes * gpu.peak_flops * sc.mfu)  # for this global batch, the one the run will take
    batch = {"batch_size": tc.batch_size, "grad_accum": tc.grad_accum, "processes": par.processes,
             "sequences": global_seqs}
    sized_for = written_batch(recipe_path)

    notes = []
    if par.backend == "zero3" and tc.objective in ("pu", "simplex", "reward"):
        notes.append(f"the trainer refuses {tc.objective} under ZeRO-3 (weights used outside the forward): use "
                     "recipes/accelerate/fsdp2.yaml")
    if total_bytes > gpu.memory_bytes and not tc.activation_checkpointing and act_with < activations:
        notes.append(f"train.activation_checkpointing: true would cut activations to {_g(act_with)} (total "
                     f"{_g(total_bytes - activations + act_with)})")
    if sized_for is not None and sized_for["sequences"] != global_seqs:
        notes.append(batch_note(batch, sized_for, seconds, tc.steps))
    if tc.objective == "pu" and window > 1 and not pass_ckpt_pu and not tc.activation_checkpointing:
        notes.append(f"PU keeps the activations of all W={window} passes: progressive.activation_checkpointing or "
                     f"train.activation_checkpointing keeps them from growing W-fold")

    return {
        "recipe": recipe.name, "objective": tc.objective, "family": FAMILIES[tc.objective],
        "model_source": source, "architecture": type(model.backbone).__name__,
        "shape": {"hidden": h, "layers": n_layers, "kv_width": h_kv, "intermediate": inter, "vocab": vocab,
                  "tied_embeddings": tied},
        "parameters": {"total": total, "trainable": trainable, "frozen": frozen, "lora": tc.lora is not None},
        "parallelism": asdict(par) | {"sharded": sorted(par.sharded)},
        "precision": tc.precision,
        "micro_batch": {"sequences": seqs, "positions": positions, "block_layout": block, "pu_window": window},
        "activation_checkpointing": {"train": tc.activation_checkpointing, "progressive": bool(pass_ckpt_pu)},
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
def dry_run(recipe: Recipe, recipe_path: str | Path | None = None, as_json: bool = False) -> dict:
    """Print the estimate of `recipe` (a table, or JSON) and return it."""
    report = estimate(recipe, recipe_path)
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
    changed = f" = {_product(r['global_batch'])}; NOT the recipe's {sized['sequences']}" if differs else ""
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
