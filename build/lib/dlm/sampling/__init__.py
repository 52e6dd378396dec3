"""Samplers. `generate` dispatches on the model family; every sampler returns tokens and per-sample NFEs."""

from __future__ import annotations

from collections.abc import Sequence

from dlm.sampling.options import (  # noqa: F401 (re-exported)
    AutoregressiveOptions,
    MaskedOptions,
    SamplingOptions,
    SamplingSettings,
    SimplexOptions,
    ignored,
    parse_options,
    parse_settings,
    resolve_options,
)


def generate(model, prompts: Sequence[Sequence[int]], options=None, *, max_new_tokens: int, eos_id: int, pad_id: int,
             temperature: float = 0.0, generator=None, return_trace: bool = False):
    """Tokens and per-sample NFE from the sampler of the model's family. `options`: that family's SamplingOptions,
    SamplingSettings (the family's share), a mapping of option values, or None (the family's defaults); options of
    another family are an error. `return_trace` records each step (diffusion samplers)."""
    family = model.spec.family
    if family not in ("autoregressive", "masked", "simplex"):
        raise NotImplementedError(f"no sampler for model family {family!r} yet")
    settings = resolve_options(family, options).model_dump()
    if family == "autoregressive":
        from dlm.sampling.autoregressive import generate as ar_generate

        if return_trace:
            raise ValueError("the autoregressive sampler records no trace")
        return ar_generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature, generator)
    if family == "masked":
        from dlm.sampling.masked import generate as masked_generate

        return masked_generate(model, prompts, max_new_tokens, eos_id, pad_id, model.spec.mask_token_id,
                               temperature=temperature, generator=generator, return_trace=return_trace, **settings)
    from dlm.sampling.simplex import generate as simplex_generate

    return simplex_generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature=temperature,
                            generator=generator, return_trace=return_trace, **settings)


# The precisions a model can be loaded at for decoding (`dlm generate/eval --dtype`).
DTYPES = ("float32", "bfloat16")


def resolve_dtype(dtype):
    """A torch dtype from a name in DTYPES, a torch dtype, or None (the checkpoint's loader default, float32)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def dtype_name(dtype) -> str:
    """The name in DTYPES of a dtype given to `load_for_inference` (None: float32), as results record it."""
    return str(resolve_dtype(dtype) or "float32").removeprefix("torch.")


def load_for_inference(path, dtype=None):
    """(model, tokenizer) from a dlm model dir, a run dir or a checkpoint dir (`dlm.modeling.build.load_model`);
    `dtype` (torch dtype or a name in DTYPES) is the precision of the whole model, dlm's extras included."""
    from dlm.data.tokenizer import load_tokenizer
    from dlm.modeling.backbone import resolve_model_dir
    from dlm.modeling.build import load_model

    model_dir = resolve_model_dir(path)
    return load_model(model_dir, dtype=resolve_dtype(dtype)), load_tokenizer(model_dir)


def generate_text(model_path, prompts: Sequence[str], options=None, *, max_new_tokens: int = 128,
                  temperature: float = 0.0, seed: int = 0, show_steps: bool = False, console=None,
                  dtype=None, truncate_prompts: bool = False) -> list[dict]:
    """Generate a response for each prompt (rendered with the model's chat template); returns text and NFE. `options`
    as for `generate`, except that options of another family than the model's give its defaults (the CLI's one set of
    flags serves any model). With `show_steps` a masked model's denoising is rendered step by step in the terminal
    (TESS 2 Fig. 4 style). `dtype` (e.g. "bfloat16") is the precision the model is loaded and run at. A prompt
    longer than the model's context is refused, or with `truncate_prompts` keeps its end (`dlm.data.prompts`)."""
    import torch

    from dlm.data.prompts import encode_prompts

    model, tok = load_for_inference(model_path, dtype=dtype)
    masked = model.spec.family == "masked"
    traced = show_steps and model.spec.family in ("masked", "simplex")
    options = resolve_options(model.spec.family, options, strict=False)
    ids = encode_prompts(tok, prompts, model, max_new_tokens, truncate=truncate_prompts)
    out = generate(model, ids, options, max_new_tokens=max_new_tokens, eos_id=tok.eos_token_id,
                   pad_id=tok.pad_token_id, temperature=temperature, generator=torch.Generator().manual_seed(seed),
                   return_trace=traced)
    results = [{"prompt": p, "response": tok.decode(t, skip_special_tokens=True), "nfe": n}
               for p, t, n in zip(prompts, out.tokens, out.nfe)]
    if show_steps and masked:
        from dlm.sampling.trace import show_steps as render

        for row, r in enumerate(results):
            print(f"user: {r['prompt']}")
            width = out.trace[0]["canvas"].shape[1] - max(map(len, ids))  # block-causal: whole blocks
            render(out.trace, tok, row, None, width, model.spec.mask_token_id, console=console)
    elif traced:  # simplex: the argmax prediction across the reverse process (TESS 2 App. F)
        from dlm.sampling.simplex import show_steps as render_simplex

        for row, r in enumerate(results):
            print(f"user: {r['prompt']}")
            render_simplex(out.trace, tok, row, tok.eos_token_id, console=console)
    return results
