"""Offline tokenizers for the built-in tiny checkpoints: the real transformers classes, tiny vocabularies.

Nothing is downloaded. Each builder constructs the tokenizer class a diffusers pipeline expects
(``CLIPTokenizer``, ``T5TokenizerFast``, ``Qwen2Tokenizer``, ``GemmaTokenizer``, byte-level
``PreTrainedTokenizerFast``s for the Mistral encoders of FLUX.2-dev and ERNIE-Image, GLM-Image's
byte-level BPE, a Llama 3-style byte-level BPE for HunyuanVideo) directly from an in-memory
character-level vocabulary, so the class keeps its own normaliser, pre-tokeniser and
post-processor, and ``save_pretrained`` writes files that ``from_pretrained(local_dir)`` reads
back offline. The vocabularies are fixed lists (printable ASCII), so the files are byte-identical
on every build.

Vocabulary sizes (the tiny text encoders' ``vocab_size`` must cover them): ``CLIP_VOCAB_SIZE``,
``T5_VOCAB_SIZE``, ``QWEN_VOCAB_SIZE``, ``GEMMA_VOCAB_SIZE``, ``MISTRAL_VOCAB_SIZE``,
``ERNIE_VOCAB_SIZE``, ``glm_image_vocab_size(codebook_size)``, ``llama3_vocab_size(words)``. (ByT5, GLM-Image's glyph tokenizer,
needs no vocabulary: ``transformers.ByT5Tokenizer()`` is built offline as it is.)
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
QWEN_VISION_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2-VL's vision tokens (``qwen_tokenizer(vision=True)``): an image's span in the prompt and its
placeholder, which ``Qwen2VLProcessor`` expands to one token per merged patch."""
QWEN_VL_VOCAB_SIZE = QWEN_VOCAB_SIZE + len(QWEN_VISION_SPECIAL)
"""Vocabulary of ``qwen_tokenizer(vision=True)``: the vision tokens follow the chat ones (ids
``QWEN_VOCAB_SIZE``.., so every other id is what ``qwen_tokenizer()`` gives)."""

# ---- Gemma / Gemma 2 (BPE with byte fallback, spaces as ``\u2581``, ``<bos>`` first) --------------
_GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
_GEMMA_PIECES = ["\u2581", "\n"] + _CHARS
GEMMA_VOCAB_SIZE = len(_GEMMA_SPECIAL) + len(_GEMMA_PIECES)

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


# ---- GLM-Image's autoregressive model (byte-level BPE; image codebook ids first) ----------
GLM_IMAGE_SPECIAL = ["<|endoftext|>", "<sop>", "<eop>", "<|image|>"]
"""Padding, the grid-shape brackets (``<sop>H W<eop>``) and the source-image placeholder."""

GLM_IMAGE_CHAT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m.content is string -%}{{ m.content }}{%- else -%}"
    "{%- for item in m.content -%}"
    "{%- if item.type == 'image' -%}{{ bos_token }}<|image|>{{ eos_token }}"
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
"""GLM-Image's prompt format: the text as is, a source image as ``<image start><|image|><image end>``
(``GlmImageProcessor`` then appends the target grids and the image-start token)."""


def glm_image_vocab_size(codebook_size: int) -> int:
    """Size of ``glm_image_tokenizer(codebook_size)``'s vocabulary."""
    return codebook_size + 2 + len(GLM_IMAGE_SPECIAL) + 256


# ---- Mistral Small 3.x (Tekken: byte-level BPE) --------------------------------------------
MISTRAL_SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "<pad>",
]
"""Control tokens of Mistral Small 3.x's chat format and of its image placeholders (ids 0..10 here)."""
MISTRAL_VOCAB_SIZE = len(MISTRAL_SPECIAL) + 256

MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set ns = namespace(text='') %}"
    "{% if message['content'] is string %}{% set ns.text = message['content'] %}"
    "{% else %}{% for block in message['content'] %}"
    "{% if block['type'] == 'text' %}{% set ns.text = ns.text + block['text'] %}"
    "{% elif block['type'] in ['image', 'image_url'] %}{% set ns.text = ns.text + '[IMG]' %}"
    "{% else %}{{ raise_exception('Only text and image blocks are supported in message content') }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + ns.text + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + ns.text + '[/INST]' }}"
    "{% else %}{{ ns.text + eos_token }}{% endif %}"
    "{% endfor %}"
)
"""Mistral Small 3.x's chat format (system prompt, ``[INST]`` turns; content as a string or as a
list of text / image blocks, the form FLUX.2's pipeline sends)."""


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


def qwen_tokenizer(*, model_max_length: int = 4096, padding_side: str = "right", vision: bool = False):
    """A ``Qwen2Tokenizer`` with one token per byte plus the chat special tokens (Qwen-Image, Z-Image);
    ``vision=True`` appends Qwen2-VL's vision tokens (``QWEN_VISION_SPECIAL``: the image-editing
    families' ``Qwen2VLProcessor``). Without it the tokenizer is exactly the one the text-only
    checkpoints were built with."""
    from transformers import Qwen2Tokenizer

    vocab = {sym: i for i, sym in enumerate(_byte_alphabet())}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        model_max_length=model_max_length,
        padding_side=padding_side,
        additional_special_tokens=QWEN_SPECIAL[1:] + (QWEN_VISION_SPECIAL if vision else []),
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    return tokenizer


def glm_image_tokenizer(*, codebook_size: int):
    """GLM-Image's processor tokenizer, laid out as the released one: ids ``0..codebook_size-1`` are
    the image tokens ``<|dit_token_N|>``, the next two the image start (``bos_token``) and end
    (``eos_token``), then the special tokens and one token per byte. Left padding, the processor's
    named tokens (``image_token``, ``grid_bos_token``, ``grid_eos_token``) and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    image_tokens = [f"<|dit_token_{i}|>" for i in range(codebook_size + 2)]
    vocab = {tok: i for i, tok in enumerate(image_tokens + GLM_IMAGE_SPECIAL + _byte_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    pad, grid_bos, grid_eos, image = GLM_IMAGE_SPECIAL
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=image_tokens[codebook_size],
        eos_token=image_tokens[codebook_size + 1],
        pad_token=pad,
        padding_side="left",
        extra_special_tokens={"image_token": image, "grid_bos_token": grid_bos, "grid_eos_token": grid_eos},
    )
    tokenizer.chat_template = GLM_IMAGE_CHAT_TEMPLATE
    return tokenizer


def gemma_tokenizer(*, model_max_length: int = 8192):
    """A ``GemmaTokenizer`` over single characters, spaces and newlines (SANA's Gemma 2 text encoder).

    As Gemma's own tokenizer: ``<bos>`` starts every encoding (SANA counts it when it sizes the text
    window after its complex human instruction), ``<pad>`` is id 0, right padding (SANA's pipeline
    sets it too). Other characters fall back to bytes, which this vocabulary maps to ``<unk>``."""
    from transformers import GemmaTokenizer

    vocab = {tok: i for i, tok in enumerate(_GEMMA_SPECIAL + _GEMMA_PIECES)}
    return GemmaTokenizer(
        vocab=vocab, merges=[], model_max_length=model_max_length, padding_side="right", add_bos_token=True
    )


def mistral_tokenizer(*, model_max_length: int = 4096):
    """A byte-level ``PreTrainedTokenizerFast`` with Mistral's control tokens and chat template (FLUX.2-dev's
    Mistral Small 3.x encoder). The released checkpoint ships it inside a ``PixtralProcessor``; FLUX.2's
    text path reads only the tokenizer and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(MISTRAL_SPECIAL + _byte_alphabet())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(MISTRAL_SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
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


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
"""Llama 3's control tokens that chat-formatted prompts use (ids 0..4 here)."""


LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
"""Llama 3's pre-tokenizer pattern (words with their leading space, digits in threes, punctuation runs)."""


def _llama3_pre_tokenizer():
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def llama3_words(text: str) -> list[str]:
    """The byte-level pieces Llama 3's pre-tokenizer cuts ``text`` into (control tokens left out), in
    order of first appearance: the whole words ``llama3_tokenizer`` may keep as single tokens."""
    import re

    words: list[str] = []
    pre = _llama3_pre_tokenizer()
    for part in re.split("|".join(re.escape(token) for token in LLAMA3_SPECIAL), text):
        for piece, _span in pre.pre_tokenize_str(part):
            if piece not in words:
                words.append(piece)
    return words


def llama3_vocab_size(words: list[str]) -> int:
    """Size of ``llama3_tokenizer(words=words)``'s vocabulary."""
    return len(dict.fromkeys(LLAMA3_SPECIAL + _byte_alphabet() + list(words)))


def llama3_tokenizer(*, words: list[str] = (), model_max_length: int = 4096):
    """A Llama 3-style ``PreTrainedTokenizerFast``: Llama 3's split pattern and byte-level alphabet, its
    control tokens, ``<|begin_of_text|>`` first, right padding with ``<|end_of_text|>``. ``words``
    (byte-level pieces, ``llama3_words``) are whole tokens, as Llama 3's merges make the common English
    words (``ignore_merges``: a piece in the vocabulary is taken whole); any other piece falls back to
    one token per byte. HunyuanVideo's pipeline crops its prompt template's first 95 tokens: with the
    template's words whole, the template tokenizes to exactly that many, as with Llama 3's own tokenizer."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(dict.fromkeys(LLAMA3_SPECIAL + _byte_alphabet() + list(words)))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    backend.pre_tokenizer = _llama3_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(LLAMA3_SPECIAL)
    bos = LLAMA3_SPECIAL[0]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=LLAMA3_SPECIAL[1],
        pad_token=LLAMA3_SPECIAL[1],
        padding_side="right",
        model_max_length=model_max_length,
    )
