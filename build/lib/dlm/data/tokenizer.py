"""Tokenizers: any HF tokenizer, or a small byte-level BPE trained offline for the built-in data.

Every dlm tokenizer has EOS, PAD and a dedicated mask token, and a chat template that renders plain role labels
(`user: ...` / `assistant: ...`, PUMBA §B.4).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS, PAD, MASK = "<|eos|>", "<|pad|>", "<|mask|>"

# Plain role labels, no BOS (PUMBA §B.4): "user: {prompt}\nassistant: " — the response follows, then EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}"
    "{% if message['role'] != 'assistant' %}{{ '\\n' }}{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 1024,
                        cache_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
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


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Any HF tokenizer (local path or cached name), completed with PAD, a mask token and the role-label template
    where it lacks them; a LLaDA / Dream checkpoint's tokenizer as `dlm convert` would write it (stock class, its own
    mask token). New special tokens grow the vocabulary: call `resize_for(tokenizer, model)` after."""
    from dlm.modeling.convert import foreign_tokenizer

    tok = foreign_tokenizer(name_or_path) if Path(name_or_path).is_dir() else None
    if tok is None:
        tok = AutoTokenizer.from_pretrained(str(name_or_path))
    ensure_special_tokens(tok)
    return tok


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
    return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)


def encode_pair(tok: PreTrainedTokenizerBase, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Token ids of the rendered prompt and of the response (without EOS)."""
    p = tok(render_prompt(tok, prompt), add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"]
    return p, r


def corpus_texts(records: Iterable[dict]) -> list[str]:
    return [f"user: {r['prompt']}\nassistant: {r['response']}" for r in records]
