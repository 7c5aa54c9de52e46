"""Offline tokenizers for the built-in tiny checkpoints: the real transformers classes, tiny vocabularies.

Nothing is downloaded. Each builder constructs the tokenizer class a diffusers pipeline expects
(``CLIPTokenizer``, ``T5TokenizerFast``, ``Qwen2Tokenizer``, a byte-level ``PreTrainedTokenizerFast``
for ERNIE-Image's Mistral encoder) directly from an in-memory
character-level vocabulary, so the class keeps its own normaliser, pre-tokeniser and
post-processor, and ``save_pretrained`` writes files that ``from_pretrained(local_dir)`` reads
back offline. The vocabularies are fixed lists (printable ASCII), so the files are byte-identical
on every build.

Vocabulary sizes (the tiny text encoders' ``vocab_size`` must cover them): ``CLIP_VOCAB_SIZE``,
``T5_VOCAB_SIZE``, ``QWEN_VOCAB_SIZE``, ``ERNIE_VOCAB_SIZE``.
"""

from __future__ import annotations

import logging
import string

logger = logging.getLogger(__name__)

_CHARS = [c for c in string.printable if c not in string.whitespace]
"""The 94 visible ASCII characters; words are split on whitespace by every tokenizer below."""

# ---- CLIP (BPE, lower-cased, ``</w>`` marks the end of a word) -----------------------------
_CLIP_SPECIAL = ["<|startoftext|>", "<|endoftext|>"]
_CLIP_VOCAB = {tok: i for i, tok in enumerate(_CHARS + [c + "</w>" for c in _CHARS] + _CLIP_SPECIAL)}
CLIP_VOCAB_SIZE = len(_CLIP_VOCAB)

# ---- T5 / UMT5 (Unigram over SentencePiece-style pieces) -----------------------------------
_T5_SPECIAL = ["<pad>", "</s>", "<unk>"]
_T5_PIECES = ["\u2581"] + _CHARS + ["\u2581" + c for c in _CHARS]
T5_VOCAB_SIZE = len(_T5_SPECIAL) + len(_T5_PIECES)

# ---- Qwen2 / Qwen3 (byte-level BPE) --------------------------------------------------------
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
"""Special tokens of the Qwen chat format (the pipelines' prompt templates use them)."""
QWEN_VOCAB_SIZE = 256 + len(QWEN_SPECIAL)

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
"""A Qwen-style chat template (the Z-Image pipeline formats prompts with ``apply_chat_template``)."""

# ---- Mistral (Tekken: byte-level BPE), as ERNIE-Image's text encoder reads it ----------------
ERNIE_SPECIAL = ["<unk>", "<s>", "</s>"]
"""Mistral's first control tokens, with their ids 0, 1, 2."""
ERNIE_VOCAB_SIZE = len(ERNIE_SPECIAL) + 256


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table, in byte order (the symbols a byte-level BPE sees)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def clip_tokenizer(*, model_max_length: int = 77):
    """A ``CLIPTokenizer`` over single characters (FLUX's first text encoder)."""
    from transformers import CLIPTokenizer

    return CLIPTokenizer(vocab=dict(_CLIP_VOCAB), merges=[], model_max_length=model_max_length)


def t5_tokenizer(*, model_max_length: int = 512):
    """A ``T5TokenizerFast`` over single characters (FLUX's T5 and Wan's UMT5), without sentinel ids."""
    from transformers import T5TokenizerFast

    vocab = [(tok, 0.0) for tok in _T5_SPECIAL] + [(piece, -1.0) for piece in _T5_PIECES]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def qwen_tokenizer(*, model_max_length: int = 4096, padding_side: str = "right"):
    """A ``Qwen2Tokenizer`` with one token per byte plus the chat special tokens (Qwen-Image, Z-Image)."""
    from transformers import Qwen2Tokenizer

    vocab = {sym: i for i, sym in enumerate(_byte_alphabet())}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=model_max_length,
        padding_side=padding_side,
        additional_special_tokens=QWEN_SPECIAL[1:],
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def ernie_tokenizer(*, model_max_length: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Mistral's ``<unk>``/``<s>``/``</s>`` that
    prepends ``<s>`` to every text (``add_special_tokens``), as ERNIE-Image's Mistral tokenizer does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(ERNIE_SPECIAL + _byte_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(ERNIE_SPECIAL)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )
