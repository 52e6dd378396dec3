"""The TESS 2 sampler: reverse simplex diffusion over a [prompt | generated] canvas (§3.1, Eqs. 4–5), with
self-conditioning on the previous step's logits, any number of steps spaced over the training timesteps, an optional
top-p projection, optional early stopping and optional reward guidance (§3.4, Eqs. 6–8).

Batched over left-padded prompts; the prompt is held as clean context (token embeddings) throughout."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dlm.data.canvas import left_pad
from dlm.diffusion.simplex import cosine_alpha_bar, inference_timesteps, project_argmax, project_top_p, reverse_step
from dlm.errors import OptionsError
from dlm.modeling.simplex import simplex_logits


@dataclass
class SimplexGeneration:
    tokens: list[list[int]]  # generated ids, up to but excluding the first EOS
    nfe: list[int]  # forward passes of the diffusion model each sample took part in
    trace: list[dict] | None = None  # per step: timestep, tokens [B, G] and top-token probability [B, G]


def _noise(shape, generator, device) -> torch.Tensor:
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where).to(device)


@dataclass
class _State:
    """A batch's sampling state: the [prompt | generated] canvas and what each reverse step reads and updates."""

    canvas: torch.Tensor  # [B, P + G] prompt ids then pad
    attention: torch.Tensor  # [B, P + G]
    positions: torch.Tensor  # [B, P + G]
    generating: torch.Tensor  # [B, P + G] bool: the generated region
    context: torch.Tensor  # [B, P, V] never read: context positions take their token embeddings
    simplex: torch.Tensor  # [B, G, V] S_t
    previous: torch.Tensor  # [B, P + G, V] self-conditioning input (uniform softmax at the start)
    tokens: torch.Tensor  # [B, G] the current argmax output
    unchanged: torch.Tensor  # [B] consecutive steps each row's output stayed the same
    done: torch.Tensor  # [B] rows stopped early
    nfe: torch.Tensor  # [B]
    prompt_length: int


def _check(model, temperature: float, reward_model, guidance_scale: float):
    """Refuse a non-simplex model or a temperature; return the reward model guidance will use (or the one given)."""
    spec = model.spec
    if spec.family != "simplex" or spec.simplex_k is None or spec.simplex_timesteps is None:
        raise ValueError("the simplex sampler needs a simplex model (dlm.json with simplex_k and simplex_timesteps)")
    if temperature > 0:
        raise OptionsError("the simplex sampler has no temperature: sample with top_p (e.g. 0.99) instead")
    if reward_model is not None and guidance_scale != 0:
        from dlm.sampling.guidance import check_compatible, resolve_reward_model

        reward_model = resolve_reward_model(reward_model, like=model)
        check_compatible(model, reward_model)
    return reward_model


def _start(model, prompts, gen_length: int, pad_id: int, generator) -> _State:
    """Left-padded prompts followed by `gen_length` positions whose simplex is S_T ~ N(0, k²I)."""
    device = next(model.parameters()).device
    ids, attention = (t.to(device) for t in left_pad(prompts, pad_id))
    B, P = ids.shape
    G = gen_length
    V = model.backbone.get_input_embeddings().weight.shape[0]
    canvas = torch.cat([ids, torch.full((B, G), pad_id, dtype=torch.long, device=device)], dim=1)
    attention = torch.cat([attention, torch.ones(B, G, dtype=attention.dtype, device=device)], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    generating = torch.zeros(B, P + G, dtype=torch.bool, device=device)
    generating[:, P:] = True
    context = torch.zeros(B, P, V, device=device)
    simplex = float(model.spec.simplex_k) * _noise((B, G, V), generator, device)  # S_T ~ N(0, k² I)
    previous = torch.zeros(B, P + G, V, device=device)
    tokens = torch.full((B, G), pad_id, dtype=torch.long, device=device)
    zeros = torch.zeros(B, dtype=torch.long, device=device)
    return _State(canvas, attention, positions, generating, context, simplex, previous, tokens, zeros,
                   torch.zeros(B, dtype=torch.bool, device=device), zeros.clone(), P)


@dataclass
class _Guidance:
    """Reward guidance settings (TESS 2 §3.4); `reward_model` None or `scale` 0: none."""

    reward_model: object
    scale: float
    steps: int
    temperature: float


def _reverse_step(model, state: _State, sub, t: int, a_next: float, top_p, guidance: _Guidance, eos_id: int,
                  generator) -> torch.Tensor:
    """One reverse step on rows `sub` at timestep t: logits → (guidance) → projection Ŝ → S_{t−1}; returns the
    generated region's logits."""
    k, T, P = model.spec.simplex_k, model.spec.simplex_timesteps, state.prompt_length
    time = torch.full((state.canvas[sub].shape[0],), t / T, device=state.canvas.device)
    simplex = torch.cat([state.context[sub], state.simplex[sub]], 1)
    logits = simplex_logits(model, state.canvas[sub], simplex, state.generating[sub], time, state.previous[sub],
                            attention_mask=state.attention[sub], position_ids=state.positions[sub])
    state.nfe[sub] += 1
    region = logits[:, P:].float()
    if guidance.reward_model is not None and guidance.scale != 0:
        from dlm.sampling.guidance import reward_guidance

        region = reward_guidance(region, state.canvas[sub, :P], guidance.reward_model, guidance.scale, guidance.steps,
                                 guidance.temperature, state.attention[sub], state.positions[sub], eos_id)
    s_hat = project_top_p(region, k, top_p, generator) if top_p is not None else project_argmax(region, k)
    new_tokens = s_hat.argmax(-1)  # Eq. 5 (or the top-p sample)
    state.simplex[sub] = reverse_step(s_hat, a_next, _noise(s_hat.shape, generator, state.canvas.device), k)  # Eq. 4
    state.previous[sub, P:] = region
    # the output, not the whole canvas: positions after either step's first EOS are left out of the comparison
    output = _through_eos(new_tokens, eos_id) | _through_eos(state.tokens[sub], eos_id)
    same = ((new_tokens == state.tokens[sub]) | ~output).all(-1)
    state.unchanged[sub] = torch.where(same, state.unchanged[sub] + 1, torch.zeros_like(state.unchanged[sub]))
    state.tokens[sub] = new_tokens
    return region


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    gen_length: int,
    eos_id: int,
    pad_id: int,
    inference_steps: int = 100,
    top_p: float | None = None,
    early_stop_patience: int | None = None,
    reward_model=None,
    guidance_scale: float = 0.0,
    guidance_steps: int = 1,
    guidance_temperature: float = 1.0,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    return_trace: bool = False,
    trace: list | None = None,
) -> SimplexGeneration:
    """Sample `gen_length` positions after each prompt: S_T ~ N(0, k²I), then for each of `inference_steps` timesteps
    t: logits → (reward guidance) → projection Ŝ (argmax, Eq. 5, or top-p) → S_{t−1} = √ᾱ Ŝ + √(1−ᾱ) k z (Eq. 4).
    A row stops early once its output (its tokens through the first EOS: what follows is discarded, and untrained
    positions there may never settle) is unchanged for `early_stop_patience` consecutive steps. `trace`: a list to
    append each step to as it happens (a live view, e.g. `dlm serve`); implies recording."""
    reward_model = _check(model, temperature, reward_model, guidance_scale)
    guidance = _Guidance(reward_model, guidance_scale, guidance_steps, guidance_temperature)
    T = model.spec.simplex_timesteps
    alpha_bar = cosine_alpha_bar(T)
    state = _start(model, prompts, gen_length, pad_id, generator)
    B, device = state.tokens.shape[0], state.tokens.device
    if trace is None:
        trace = [] if return_trace else None
    schedule = inference_timesteps(T, inference_steps)
    rows = torch.arange(B, device=device)
    for i, t in enumerate(schedule):
        if early_stop_patience is not None:  # rows only stop early: without it, no host sync before the pass
            rows = (~state.done).nonzero().squeeze(1)
        sub = slice(None) if len(rows) == B else rows
        a_next = float(alpha_bar[schedule[i + 1]]) if i + 1 < len(schedule) else 1.0
        region = _reverse_step(model, state, sub, t, a_next, top_p, guidance, eos_id, generator)
        if trace is not None:
            conf = torch.zeros(B, gen_length, device=device)
            conf[sub] = torch.softmax(region, -1).amax(-1)
            trace.append({"timestep": t, "tokens": state.tokens.cpu().clone(), "confidence": conf.cpu()})
        if early_stop_patience is not None:
            state.done[sub] = state.unchanged[sub] >= early_stop_patience
            if bool(state.done.all()):
                break
    out = []
    for row in state.tokens.tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return SimplexGeneration(out, state.nfe.tolist(), trace)


def _through_eos(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Positions up to and including each row's first EOS (every position of a row without one)."""
    is_eos = tokens == eos_id
    return is_eos.cumsum(-1) - is_eos.long() == 0


def show_steps(trace: list[dict], tok, row: int, eos_id: int, every: int | None = None, console=None) -> int:
    """Print the argmax prediction of `row` at the steps of a simplex trace, each token coloured by the probability
    of the top token (TESS 2 App. F, Fig. 4); everything after the first EOS is struck through. Returns the number
    of frames printed (about 10 by default)."""
    from rich.console import Console
    from rich.text import Text

    from dlm.sampling.trace import confidence_colour, visible

    console = console or Console(highlight=False)
    n = len(trace)
    every = every or max(1, n // 10)
    frames = [k for k in range(1, n + 1) if k % every == 0 or k == n]
    for k in frames:
        step = trace[k - 1]
        line = Text(f"step {k:>4}/{n} t={step['timestep']:>5} │ ", style="dim")
        cut = False
        for token, conf in zip(step["tokens"][row].tolist(), step["confidence"][row].tolist()):
            piece = "⟨eos⟩" if token == eos_id else visible(tok.decode([token]))
            line.append(piece, style=("strike dim " if cut else "") + f"on {confidence_colour(conf)}")
            cut = cut or token == eos_id
        console.print(line)
    return len(frames)
