"""Tokenizers: any HF tokenizer, or a small byte-level BPE trained offline for the built-in data.

Every dlm tokenizer has EOS, PAD and a dedicated mask token, and a chat template that renders plain role labels
(`user: ...` / `assistant: ...`, PUMBA §B.4).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import cast

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

from dlm.errors import DlmError
from dlm.modeling.formats import Format
from dlm.modeling.resolve import CONFIG_FILE, ResolvedModel, resolve_model
from dlm.modeling.spec import ModelSpec

EOS, PAD, MASK = "<|eos|>", "<|pad|>", "<|mask|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json")

# Plain role labels, no BOS (PUMBA §B.4): "user: {prompt}\nassistant: " — the response follows, then EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] != 'assistant' %}{{ '\\n' }}{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 1024,
                        cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """Train (or load from cache) a byte-level BPE on `texts`; deterministic for the same texts and size."""
    key = hashlib.sha256(("\x00".join(texts) + f"|{vocab_size}").encode()).hexdigest()[:16]
    cached = Path(cache_dir) / f"bpe-{vocab_size}-{key}" if cache_dir else None
    if cached is not None and (cached / "tokenizer.json").is_file():
        return load_tokenizer(cached)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, MASK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, mask_token=MASK, chat_template=CHAT_TEMPLATE
    )
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=cached.name + ".tmp-", dir=cached.parent))
        wrapped.save_pretrained(tmp)
        try:
            tmp.rename(cached)
        except OSError:  # another process cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return wrapped


def load_tokenizer(source: str | Path | ResolvedModel) -> PreTrainedTokenizerBase:
    """Any HF tokenizer (a model directory, resolved or not, a tokenizer directory or a cached name), completed with
    PAD, a mask token and the role-label template where it lacks them; a LLaDA / Dream release's as `dlm convert`
    writes it (stock class, its own mask token). New special tokens grow the vocabulary: call
    `resize_for(tokenizer, model)` after."""
    return ensure_special_tokens(model_tokenizer(source))


def model_tokenizer(source: str | Path | ResolvedModel) -> PreTrainedTokenizerBase:
    """The tokenizer as saved, nothing added: a model directory's (through its config.json already read), a
    release's as `dlm convert` writes it, or any other HF tokenizer path or name."""
    if not isinstance(source, ResolvedModel):
        if not (Path(source) / CONFIG_FILE).is_file():  # a tokenizer directory or a cached name, not a model
            return AutoTokenizer.from_pretrained(str(source))
        source = resolve_model(source)
    if source.release is not None:
        assert source.spec is not None  # resolve_model gives every release the spec its format implies
        with tempfile.TemporaryDirectory() as tmp:
            write_release_tokenizer(source.path, Path(tmp), source.release, source.spec)
            tok = AutoTokenizer.from_pretrained(tmp)
        tok.name_or_path = str(source.path)
        return tok
    try:
        config = source.hf_config()  # so that transformers does not read config.json again
    except DlmError:  # an architecture transformers does not know: it finds the tokenizer class by itself
        config = None
    return AutoTokenizer.from_pretrained(str(source.path), config=config)


def write_release_tokenizer(src: Path, dst: Path, fmt: Format, spec: ModelSpec) -> str:
    """A release's tokenizer saved in `dst` loadable with no remote code: a remote tokenizer class becomes the
    format's stock class, auto_map goes, the mask token (and PAD/EOS when unset) are set from the spec's ids; the chat
    template and special tokens are carried over. Returns the mask token."""
    with tempfile.TemporaryDirectory() as stage:
        found = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        if "tokenizer_config.json" not in found and "tokenizer.json" not in found:
            raise DlmError(f"{src}: no tokenizer files (tokenizer_config.json, tokenizer.json)")
        for f in found:
            shutil.copy2(src / f, Path(stage) / f)
        path = src / "tokenizer_config.json"
        try:
            tok_config = json.loads(path.read_text()) if path.is_file() else {}
        except json.JSONDecodeError as err:
            raise DlmError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None
        tok_config.pop("auto_map", None)
        if tokenizer_class_from_name(tok_config.get("tokenizer_class") or "") is None:
            tok_config["tokenizer_class"] = fmt.tokenizer_class
        (Path(stage) / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
        tok = AutoTokenizer.from_pretrained(stage)
        for role in ("mask", "eos", "pad"):
            wanted = getattr(spec, f"{role}_token_id")
            token = tok.convert_ids_to_tokens(wanted) if wanted is not None and wanted < len(tok) else None
            if token is None:
                if role != "mask":
                    continue
                raise DlmError(f"{src}: the tokenizer ({len(tok)} tokens) has no token with the mask id {wanted}")
            if role == "mask" or getattr(tok, f"{role}_token") is None:
                setattr(tok, f"{role}_token", token)
        tok.save_pretrained(dst)
        return tok.mask_token


def ensure_special_tokens(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tok.eos_token is None:
        tok.add_special_tokens({"eos_token": EOS})
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token  # LLaDA-style: padding is EOS (PUMBA §B.4.1)
    if tok.mask_token is None:
        tok.add_special_tokens({"mask_token": MASK})
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    return tok


def render_prompt(tok: PreTrainedTokenizerBase, prompt: str) -> str:
    """The text the model sees before its response, through the tokenizer's chat template."""
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return cast(str, text)  # tokenize=False returns the rendered string; the stub types every return mode at once


def encode_pair(tok: PreTrainedTokenizerBase, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Token ids of the rendered prompt and of the response (without EOS)."""
    p = tok(render_prompt(tok, prompt), add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"]
    return p, r


def corpus_texts(records: Iterable[dict]) -> list[str]:
    return [f"user: {r['prompt']}\nassistant: {r['response']}" for r in records]
