"""Reward guidance for the simplex sampler (TESS 2 §3.4, Eqs. 6–8): at each diffusion step the model's logits Ŝ over
the generated positions become soft inputs E_rm·softmax(Ŝ) to a reward model (the prompt as its real tokens, positions
as the reward model expects), and Ŝ takes gradient-ascent steps on the reward: Ŝ ← Ŝ + η ∇_Ŝ R."""

from __future__ import annotations

from pathlib import Path

import torch

from dlm.errors import OptionsError
from dlm.modeling.resolve import ResolvedModel, resolve_model
from dlm.modeling.reward import reward_scores

_LOADED: dict[tuple[str, str, str], object] = {}


def resolve_reward_model(reward_model, like=None):
    """A loaded reward model, or one loaded (once per process and placement) from a model or run directory (resolved
    or not) onto the device and dtype of the model `like` (the diffusion model it guides: its soft inputs live
    there)."""
    if not isinstance(reward_model, (str, Path, ResolvedModel)):
        return reward_model
    from dlm.modeling.build import load_model
    from dlm.modeling.device import model_device, model_dtype, place

    resolved = resolve_model(reward_model)
    path = str(resolved.path.resolve())
    device, dtype = (model_device(like), model_dtype(like)) if like is not None else ("cpu", torch.float32)
    key = (path, str(device), str(dtype))
    if key not in _LOADED:
        family = resolved.spec.family if resolved.spec is not None else "autoregressive"
        if family != "reward":  # known from dlm.json before any weights are read
            raise OptionsError(f"reward_model {path}: not a reward model (dlm.json family {family!r}; "
                               "train one with `dlm train recipes/tinymath/reward.yaml`)")
        _LOADED[key] = place(load_model(resolved, dtype=dtype), device, dtype)
    return _LOADED[key]


def check_compatible(model, reward_model) -> None:
    """Soft inputs are distributions over the diffusion model's vocabulary: the reward model must share it."""
    v_model = model.backbone.get_input_embeddings().weight.shape[0]
    v_rm = reward_model.backbone.get_input_embeddings().weight.shape[0]
    spec, rm_spec = model.spec, reward_model.spec
    problems = []
    if v_model != v_rm:
        problems.append(f"vocabulary {v_model} vs {v_rm} rows")
    for name in ("eos_token_id", "pad_token_id"):
        a, b = getattr(spec, name), getattr(rm_spec, name)
        if a is not None and b is not None and a != b:
            problems.append(f"{name} {a} vs {b}")
    if problems:
        raise OptionsError("reward guidance needs a reward model with the diffusion model's tokenizer (TESS 2 §3.4); "
                         f"they differ: {', '.join(problems)}. Train the reward model from the same checkpoint family "
                         "(e.g. model.init_from the AR baseline the diffusion model was adapted from).")


def first_eos_or_last(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Per row, the index of the first EOS, or the last index if there is none."""
    G = tokens.shape[1]
    is_eos = tokens == eos_id
    return torch.where(is_eos.any(-1), is_eos.int().argmax(-1), torch.full_like(tokens[:, 0], G - 1))


def reward_of_logits(reward_model, logits: torch.Tensor, context_ids: torch.Tensor, eos_id: int,
                     temperature: float = 1.0, attention_mask=None, position_ids=None) -> torch.Tensor:
    """R [B] of the soft sequence [prompt tokens | softmax(logits / temperature)] (TESS 2 Eqs. 6–7), read at the
    first predicted EOS of the generated region (the last position if none)."""
    weight = reward_model.backbone.get_input_embeddings().weight
    p = torch.softmax(logits.float() / temperature, dim=-1).to(weight.dtype)
    embeds = torch.cat([weight[context_ids], p @ weight], dim=1)  # Eq. 7: c = E p
    last = context_ids.shape[1] + first_eos_or_last(logits.argmax(-1), eos_id)
    return reward_scores(reward_model, last, inputs_embeds=embeds, attention_mask=attention_mask,
                         position_ids=position_ids)


def reward_guidance(logits: torch.Tensor, context_ids: torch.Tensor, reward_model, guidance_scale: float,
                    guidance_steps: int = 1, temperature: float = 1.0, attention_mask=None, position_ids=None,
                    eos_id: int = -1) -> torch.Tensor:
    """Ŝ after `guidance_steps` ascent steps Ŝ ← Ŝ + η ∇_Ŝ R (TESS 2 Eq. 8); logits [B, G, V] of the generated
    region."""
    s = logits.detach().float()
    with torch.enable_grad():
        for _ in range(guidance_steps):
            s = s.requires_grad_(True)
            r = reward_of_logits(reward_model, s, context_ids, eos_id, temperature, attention_mask, position_ids)
            (grad,) = torch.autograd.grad(r.sum(), s)  # rows are independent: the sum gives each row its own ∇R
            s = (s + guidance_scale * grad).detach()
    return s
