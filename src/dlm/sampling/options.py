"""Sampling options: one pydantic model per model family, the single definition of every sampler setting (its range,
default and description). The recipe's eval section, the `dlm generate/eval` flags (generated from these fields),
`generate(model, prompts, options)` and sweeps all parse into them, so a value is checked once, with one message,
wherever it comes from. Pydantic only: the CLI builds its parser from these fields without importing torch.

`max_new_tokens` and `temperature` are arguments of `generate`, not options: every family takes them, and what they
mean (the AR token limit, the diffusion canvas length) belongs to the call, not to one family's sampler.

One rule for an option the masked sampler's policy does not read, wherever options come from (`implied_policy`,
`refuse_unused`): given without a policy, an option selects the policy that reads it (tau alone: threshold; u and
tau: top_u_or_threshold), even over a default policy (the recipe's, the server's); given with a policy that does not
read it, it is refused, naming both. Defaults (a recipe's eval section) are never refused. What a result lists is
`in_effect()`: the options the sampler read."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dlm.errors import OptionsError


def _must_be(domain: str) -> WrapValidator:
    """Every invalid value of a field (wrong type or out of range) is reported as 'must be <domain>'."""

    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("sampling_option", "must be {domain}", {"domain": domain}) from None

    return WrapValidator(check)


Policy = Literal["top_u", "threshold", "top_u_or_threshold"]
POLICIES = get_args(Policy)
Cache = Literal["prefix", "dual"]
Count = Annotated[int, Field(ge=1), _must_be("an integer >= 1")]
Fraction = Annotated[float, Field(gt=0, le=1), _must_be("a number in (0, 1]")]
Positive = Annotated[float, Field(gt=0), _must_be("a number > 0")]
Number = Annotated[float, _must_be("a number")]
Switch = Annotated[bool, _must_be("true or false")]
Directory = Annotated[str, BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v),
                      _must_be("a directory path")]


def _one_of(choices) -> WrapValidator:
    return _must_be("one of " + ", ".join(get_args(choices)))


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("sampling_options", "{message}", {"message": message})


# The decoders' rules beyond the policy (issue 45; `dlm.sampling.steps.Step`, `block_cache`), read wherever set
DECODER_RULES = ("sub_block_size", "refresh_every", "remask_threshold", "eos_confidence", "nfe_budget")

# The options each unmasking policy reads (PUMBA §2); under a policy the others change nothing.
POLICY_USES = {"top_u": ("reveal_count",), "threshold": ("confidence_threshold",),
               "top_u_or_threshold": ("reveal_count", "confidence_threshold")}
POLICY_OPTIONS = ("reveal_count", "confidence_threshold")


class UnusedOptionError(OptionsError):
    """An option the explicitly chosen policy does not read; `field` names it (the server's 400 names it as `param`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def implied_policy(given, current: str = "top_u") -> str:
    """The policy options `given` without a policy select: `current` where it reads every one of them, else the policy
    that reads exactly those (tau: threshold; u: top_u; u and tau: top_u_or_threshold)."""
    wanted = {k for k in given if k in POLICY_OPTIONS}
    if not wanted or current in POLICY_USES and wanted <= set(POLICY_USES[current]):
        return current
    return next(p for p, uses in POLICY_USES.items() if set(uses) == wanted)


def refuse_unused(values: Mapping[str, Any], names: Mapping[str, str] | None = None, *,
                  policies: Sequence[str] | None = None) -> None:
    """User input given with a policy (or the `policies` of a sweep): an option none of them reads is an
    UnusedOptionError naming the option and the policy. `names` maps a field to how the user wrote it (e.g. --tau)."""
    policies = policies or ([values["policy"]] if values.get("policy") in POLICY_USES else [])
    if not policies:
        return
    for field in POLICY_OPTIONS:
        if values.get(field) is not None and not any(field in POLICY_USES[p] for p in policies):
            readers = [p for p, uses in POLICY_USES.items() if field in uses]
            label = names.get(field, field) if names else field
            label = label if label == field else f"{label} ({field})"
            raise UnusedOptionError(
                f"{label} is not used by policy {' or '.join(policies)}; leave it out, or choose a policy that uses "
                f"it ({', '.join(readers)})", field)


class SamplingOptions(BaseModel):
    """A family's sampler settings: immutable, unknown keys rejected, every value checked on construction (a pydantic
    ValidationError; `parse_options` turns user input into options or one OptionsError line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    family: ClassVar[str]

    def replace(self, **changes) -> SamplingOptions:
        """A copy with `changes`, validated like any other value (no rule applied: `override` applies user input)."""
        return _validate(type(self), {**self.model_dump(exclude_unset=True), **changes}, None)

    def override(self, values: Mapping[str, Any], *, names: Mapping[str, str] | None = None) -> SamplingOptions:
        """These options as defaults (a recipe's eval section, a server's flags) with what a user set, `values`, on
        top, by the module's rule: an option the given policy does not read is refused (UnusedOptionError); policy
        options given without a policy select the one that reads them, even where the defaults name another."""
        values = {k: v for k, v in values.items() if v is not None}
        refuse_unused(values, names)
        if isinstance(self, MaskedOptions) and "policy" not in values:  # the one family with a policy
            policy = implied_policy(values, self.policy)
            if policy != self.policy:
                values["policy"] = policy
        return _validate(type(self), {**self.model_dump(exclude_unset=True), **values}, names)

    def in_effect(self, spec=None) -> dict[str, Any]:
        """The options the sampler reads with these settings (on a model of `spec`, a ModelSpec, where given), as JSON
        values: what a result row, a sweep's table or a server's response lists, so none names a setting that
        changed nothing."""
        return self.model_dump(mode="json")


class MaskedOptions(SamplingOptions):
    """The masked-diffusion sampler (PUMBA §2; `dlm.sampling.masked`)."""

    family: ClassVar[str] = "masked"
    policy: Annotated[Policy, _one_of(Policy)] = Field(
        "top_u", description="unmasking policy (PUMBA §2): top_u reveals the u most confident masked positions per "
        "step, threshold every one with confidence >= tau (at least one; Fast-dLLM), top_u_or_threshold the top u "
        "plus every other one >= tau; unset: the policy that reads the options given (tau alone: threshold; u and "
        "tau: top_u_or_threshold), else top_u. With a policy given, an option it does not read is refused")
    reveal_count: Count = Field(2, description="u: positions revealed per step by top_u and top_u_or_threshold")
    confidence_threshold: Fraction = Field(0.9, description="tau: the confidence at or above which threshold and "
                                           "top_u_or_threshold reveal a position")
    block_size: Count | None = Field(None, description="decode left to right in blocks of this many positions (block "
                                     "diffusion); unset: the whole canvas at once, or a block-causal model's own size")
    kv_cache: Switch = Field(True, description="block-causal models: reuse finished blocks' keys and values, exactly "
                             "(off: recompute the whole canvas every step, the reference)")
    cache: Annotated[Cache, _one_of(Cache)] | None = Field(
        None, description="full-canvas models with a block_size: Fast-dLLM's approximate KV cache, prefix (prompt and "
        "finished blocks) or dual (also the later, masked blocks); unset: none")
    reset_carry_per_block: Switch = Field(False, description="full-canvas models with a carry and a block_size: "
                                          "restart the carry from zero at each new block (block-causal models always "
                                          "do, PUMBA App. B.4.3)")
    sub_block_size: Count | None = Field(None, description="sub-blocks of this many positions (dividing the block "
                                         "size): a step reveals only in the first with a mask (Fast-dLLM v2; exact)")
    refresh_every: Count | None = Field(None, description="block-causal models, APPROXIMATE: reuse keys and values "
                                        "inside the block, recomputing it whole every k steps and at each sub-block; "
                                        "between, only what was masked a step before (dKV-Cache); 1 = exact")
    remask_threshold: Fraction | None = Field(None, description="re-mask a token committed at an earlier step of the "
                                              "block whose probability falls below this (lowest first)")
    edit_budget: Count = Field(4, description="remasking: the most tokens a row may re-mask in one block")
    eos_confidence: Fraction | None = Field(None, description="EOS-aware stopping: after an EOS committed with this "
                                            "confidence, the row's later masks become EOS and leave the computation")
    nfe_budget: Count | None = Field(None, description="forward passes per row; from the last one on, each step "
                                     "reveals the rest of its block (sub-block) at once")

    @model_validator(mode="after")
    def _policy_implied(self):
        """tau given without a policy selects threshold, u and tau top_u_or_threshold (`implied_policy`); the policy
        stays unset (not given), so a later override or replace implies it again from what is given then."""
        if "policy" not in self.model_fields_set:
            self.__dict__["policy"] = implied_policy(self.model_fields_set)
        return self

    @model_validator(mode="after")
    def _cache_needs_blocks(self):
        if self.cache is not None and self.block_size is None:
            raise _invalid(f"cache {self.cache} (Fast-dLLM) needs a block_size: the cache is refreshed at each block")
        return self

    def in_effect(self, spec=None) -> dict[str, Any]:
        """policy and the options it reads, block_size (a block-causal model's own when unset), kv_cache on
        block-causal models, cache on full-canvas models without a carry decoded in blocks, reset_carry_per_block on
        full-canvas carry models decoded in blocks; without a `spec`, whatever could apply."""
        block_causal = getattr(spec, "attention", None) == "block_causal"
        carry = getattr(spec, "carry", None)  # None: unknown
        used = {"policy", *POLICY_USES[self.policy], "block_size"}
        used |= {k for k in DECODER_RULES if getattr(self, k) is not None  # a rule in effect where set
                 and (k != "refresh_every" or spec is None or block_causal)}
        if self.remask_threshold is not None:
            used.add("edit_budget")
        if spec is None or block_causal:
            used.add("kv_cache")
        if self.block_size is not None and not block_causal:
            used |= {"cache"} if not carry else set()
            used |= {"reset_carry_per_block"} if carry or spec is None else set()
        values = {k: v for k, v in self.model_dump(mode="json").items() if k in used}
        if block_causal and self.block_size is None:
            values["block_size"] = spec.block_size
        return values


class SimplexOptions(SamplingOptions):
    """The simplex-diffusion sampler (TESS 2 §3.1, §3.4; `dlm.sampling.simplex`)."""

    family: ClassVar[str] = "simplex"
    inference_steps: Count = Field(100, description="reverse diffusion steps, spaced over the training timesteps "
                                   "(TESS 2 §5.1)")
    top_p: Fraction | None = Field(None, description="top-p projection of each step's logits instead of the argmax "
                                   "(TESS 2 Eq. 5), e.g. 0.99; unset: argmax")
    early_stop_patience: Count | None = Field(None, description="stop a row once its output (tokens through the "
                                              "first EOS) is unchanged for this many consecutive steps; unset: run "
                                              "every step")
    reward_model: Directory | None = Field(None, description="reward model directory for reward guidance (TESS 2 "
                                           "§3.4); it must share the diffusion model's tokenizer")
    guidance_scale: Number = Field(0.0, description="eta: reward-guidance step size, logits += eta * grad R at each "
                                   "step (TESS 2 Eq. 8); 0 = no guidance")
    guidance_steps: Count = Field(1, description="gradient-ascent steps on the reward per diffusion step")
    guidance_temperature: Positive = Field(1.0, description="temperature of the softmax that turns logits into the "
                                           "reward model's soft inputs (TESS 2 Eq. 6)")

    @model_validator(mode="after")
    def _guidance_needs_a_reward_model(self):
        if self.guidance_scale != 0 and self.reward_model is None:
            raise _invalid(f"guidance_scale {self.guidance_scale} needs a reward_model to guide with")
        return self

    def in_effect(self, spec=None) -> dict[str, Any]:
        """Every option, except the reward guidance's (reward_model, guidance_steps, guidance_temperature) while
        guidance_scale is 0."""
        off = GUIDANCE if self.guidance_scale == 0 else ()
        return {k: v for k, v in self.model_dump(mode="json").items() if k not in off}


GUIDANCE = ("reward_model", "guidance_steps", "guidance_temperature")  # read only with a guidance_scale


class AutoregressiveOptions(SamplingOptions):
    """The AR baseline's sampler takes no options: greedy or temperature sampling with a KV cache."""

    family: ClassVar[str] = "autoregressive"


OPTIONS: dict[str, type[SamplingOptions]] = {cls.family: cls for cls in (MaskedOptions, SimplexOptions,
                                                                          AutoregressiveOptions)}
# Short names (the papers' symbols and the flags the docs use) → option fields: CLI aliases and sweep keys.
ALIASES = {"sampler": "policy", "u": "reveal_count", "tau": "confidence_threshold", "steps": "inference_steps",
           "early_stop": "early_stop_patience", "eta": "guidance_scale"}
OWNER = {name: family for family, cls in OPTIONS.items() for name in cls.model_fields}  # field → its family


class SamplingSettings(
        create_model(  # type: ignore[misc]  # a base built from every family's fields, which mypy cannot read
            "_EveryFamily", __config__=ConfigDict(extra="forbid"),
            **{name: (f.annotation, f) for cls in OPTIONS.values() for name, f in cls.model_fields.items()})):
    """Every family's options in one flat set, for what serves models of several families (the recipe's eval
    section, `dlm eval runs/mdm runs/ar --tau 0.9`): each model takes its own family's share."""

    @model_validator(mode="after")
    def _each_family(self):
        for family in OPTIONS:  # cross-field checks (a cache needs a block_size, guidance a reward model)
            try:
                self.sampling_options(family)
            except OptionsError as err:
                raise _invalid(str(err)) from None
        return self

    def sampling_options(self, family: str) -> SamplingOptions:
        """The options of a `family` model: its fields that were set here, the family's defaults for the rest (a
        policy option set without a policy selects its policy; nothing is refused: a recipe's values are defaults)."""
        cls = options_class(family)
        return _validate(cls, {k: getattr(self, k) for k in cls.model_fields if k in self.model_fields_set}, None)


def options_class(family: str) -> type[SamplingOptions]:
    if family not in OPTIONS:
        raise OptionsError(f"no sampler for model family {family!r} (samplers: {', '.join(OPTIONS)})")
    return OPTIONS[family]


def option_name(key: str) -> str:
    """The option field a key names: a field name or a short name in ALIASES ('tau' → 'confidence_threshold')."""
    name = ALIASES.get(key, key)
    if name not in OWNER:
        known = sorted([*OWNER, *ALIASES])
        close = difflib.get_close_matches(key, known, n=1)
        raise OptionsError(f"unknown sampling option {key!r}" + (f" (did you mean {close[0]}?)" if close else "")
                           + f"; options: {', '.join(OWNER)}")
    return name


def parse_options(family: str, values: Mapping[str, Any] | None = None, *, strict: bool = True,
                  names: Mapping[str, str] | None = None) -> SamplingOptions:
    """A `family` model's options from plain values a user gave (None = the default), by the module's policy rule. A
    key that no family takes is an error; a key of another family's sampler is an error when `strict`, else left out
    (`ignored` says why). `names` maps a field to how the user wrote it (e.g. "--tau"), for the messages."""
    cls = options_class(family)
    given = _known({k: v for k, v in (values or {}).items() if v is not None})
    foreign = [k for k in given if k not in cls.model_fields]
    if foreign and strict:
        raise OptionsError("; ".join(f"{_label(k, names)}{k} is a {OWNER[k]}-sampler option; {family} models do not "
                                     "take it" for k in foreign))
    own = {k: v for k, v in given.items() if k not in foreign}
    refuse_unused(own, names)
    return _validate(cls, own, names)


def parse_settings(values: Mapping[str, Any] | None = None, *,
                   names: Mapping[str, str] | None = None) -> SamplingSettings:
    """Every family's options from one set of plain values a user gave (None = the default): each value is checked by
    the family that takes it, and by the module's policy rule; a key no family takes is an error."""
    given = _known({k: v for k, v in (values or {}).items() if v is not None})
    refuse_unused(given, names)
    return _validate(SamplingSettings, given, names)


def resolve_options(family: str, options=None, *, strict: bool = True) -> SamplingOptions:
    """The options a `family` model samples with, from None (its defaults), its own options, SamplingSettings (its
    share) or plain values. Another family's options are an error when `strict`, else give the defaults."""
    cls = options_class(family)
    if options is None:
        return cls()
    if isinstance(options, SamplingSettings):
        return options.sampling_options(family)
    if isinstance(options, SamplingOptions):
        if isinstance(options, cls):
            return options
        if strict:
            raise OptionsError(f"{type(options).__name__} are for {options.family} models; this is a {family} model")
        return cls()
    if isinstance(options, Mapping):
        return parse_options(family, options, strict=strict)
    raise TypeError(f"sampling options must be SamplingOptions, SamplingSettings or a mapping, not {type(options)}")


def ignored(family: str, options, spec=None, effective: SamplingOptions | None = None) -> list[str]:
    """The settings given in `options` that a `family` model does not use, e.g. ['confidence_threshold (masked
    sampler)']: the note to print when one set of settings serves models of several families. With the model's
    `spec`, also its own family's given settings not in effect on it (`in_effect` of `effective`, the options it
    samples with; default: those of `options`), e.g. ['kv_cache (not read with these settings on a bidirectional
    model)']."""
    if isinstance(options, (SamplingSettings, SamplingOptions)):
        given = [k for k in OWNER if k in options.model_fields_set]
    elif isinstance(options, Mapping):
        given = [k for k in OWNER if options.get(k) is not None]
    else:
        given = []
    own = options_class(family).model_fields
    notes = [f"{k} ({OWNER[k]} sampler)" for k in given if k not in own]
    if spec is not None and any(k in own for k in given):
        used = (effective or resolve_options(family, options, strict=False)).in_effect(spec)
        model = f"{getattr(spec, 'attention', '')} model" + (" with a carry" if getattr(spec, "carry", False) else "")
        notes += [f"{k} (not read with these settings on a {model})" for k in given if k in own and k not in used]
    return notes


def _known(values: dict) -> dict:
    """`values`, once every key is checked to be an option field (a short name is not one: the key is the field)."""
    for key in values:
        if key not in OWNER:
            option_name(key)  # an unknown key: raises, with a suggestion
            raise OptionsError(f"{key!r} is a short name; the option is {ALIASES[key]!r}")
    return values


def _label(field: str, names: Mapping[str, str] | None) -> str:
    return f"{names[field]}: " if names and field in names else ""


def _validate(cls, values: dict, names: Mapping[str, str] | None):
    """`cls(**values)`, every error turned into one OptionsError line that names the field (or the user's flag), the
    value and what it must be: '--tau 1.5: confidence_threshold must be a number in (0, 1]'."""
    try:
        return cls.model_validate(values)
    except ValidationError as err:
        raise OptionsError(_describe(err, names)) from None


def _describe(err: ValidationError, names: Mapping[str, str] | None) -> str:
    lines = []
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else None
        msg = e["msg"].removeprefix("Value error, ")
        if field is None:
            lines.append(msg)
        elif names and field in names:
            lines.append(f"{names[field]} {e['input']}: {field} {msg}")
        else:
            lines.append(f"{field} {msg}, got {e['input']!r}")
    return "; ".join(lines)
