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
             temperature: float = 0.0, generator=None, return_trace: bool = False, trace: list | None = None):
    """Tokens and per-sample NFE from the sampler of the model's family. `options`: that family's SamplingOptions,
    SamplingSettings (the family's share), a mapping of option values, or None (the family's defaults); options of
    another family are an error. `return_trace` records each step (diffusion samplers); `trace`, a list the sampler
    appends each step to as it happens (a live view: `dlm serve`), implies it."""
    family = model.spec.family
    if family not in ("autoregressive", "masked", "simplex"):
        raise NotImplementedError(f"no sampler for model family {family!r} yet")
    settings = resolve_options(family, options).model_dump()
    if family == "autoregressive":
        from dlm.sampling.autoregressive import generate as ar_generate

        if return_trace or trace is not None:
            raise ValueError("the autoregressive sampler records no trace")
        return ar_generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature, generator)
    if family == "masked":
        from dlm.sampling.masked import generate as masked_generate

        return masked_generate(model, prompts, max_new_tokens, eos_id, pad_id, model.spec.mask_token_id,
                               temperature=temperature, generator=generator, return_trace=return_trace, trace=trace,
                               **settings)
    from dlm.sampling.simplex import generate as simplex_generate

    return simplex_generate(model, prompts, max_new_tokens, eos_id, pad_id, temperature=temperature,
                            generator=generator, return_trace=return_trace, trace=trace, **settings)


def load_for_inference(path, dtype="auto", device="auto"):
    """(model, tokenizer) from a dlm model dir, a run dir or a checkpoint dir (`dlm.modeling.build.load_model`), or
    a `ResolvedModel` (the directory is resolved once for both), placed once: on `device` ("auto": CUDA, then MPS,
    else CPU) at `dtype` ("auto": bfloat16 on a GPU that has it, float32 elsewhere; a name in DTYPES or a torch
    dtype), dlm's extras included (`dlm.modeling.device`)."""
    from dlm.data.tokenizer import load_tokenizer
    from dlm.modeling.build import load_model
    from dlm.modeling.device import place, resolve_device, resolve_dtype
    from dlm.modeling.resolve import resolve_model

    dev = resolve_device(device)  # first: an unavailable device is one line, not minutes of loading
    dt = resolve_dtype(dtype, dev)
    resolved = resolve_model(path)
    return place(load_model(resolved, dtype=dt), dev, dt), load_tokenizer(resolved)


def generate_text(model_path, prompts: Sequence[str], options=None, *, max_new_tokens: int = 128,
                  temperature: float = 0.0, seed: int = 0, show_steps: bool = False, console=None,
                  dtype="auto", device="auto", truncate_prompts: bool = False) -> list[dict]:
    """Generate a response for each prompt (rendered with the model's chat template); returns text and NFE. `options`
    as for `generate`, except that options of another family than the model's give its defaults (the CLI's one set of
    flags serves any model), with a note on stderr naming each given option the model does not use. With
    `show_steps` a masked model's denoising is rendered step by step in the terminal (TESS 2 Fig. 4 style). `device`
    and `dtype` place the model (`load_for_inference`); the sampling generator lives on that device. A prompt longer
    than the model's context is refused, or with `truncate_prompts` keeps its end (`dlm.data.prompts`)."""
    import sys
    from pathlib import Path

    from dlm.data.prompts import encode_prompts
    from dlm.modeling.device import make_generator

    model, tok = load_for_inference(model_path, dtype=dtype, device=device)
    family = model.spec.family
    masked = family == "masked"
    traced = show_steps and family in ("masked", "simplex")
    given, options = options, resolve_options(family, options, strict=False)
    notes = ignored(family, given, model.spec, options)
    if notes:  # never silently: --tau for an AR model, --no-kv-cache for a full-canvas one
        print(f"{Path(str(model_path)).name} ({family}) ignores {', '.join(notes)}", file=sys.stderr)
    ids = encode_prompts(tok, prompts, model, max_new_tokens, truncate=truncate_prompts)
    out = generate(model, ids, options, max_new_tokens=max_new_tokens, eos_id=tok.eos_token_id,
                   pad_id=tok.pad_token_id, temperature=temperature, generator=make_generator(seed, model),
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
