"""Sequence-parallel attention processors for the families' transformers.

Legend: B batch, S tokens of this rank's shard, H heads, D head dim, C channels.

Each processor does what the diffusers processor it replaces does (projections, q/k norms, rotary
embedding, output projections, in the same order and dtype), with the attention itself from
``tilecast.kernels.attention.attention`` over the ranks' Ulysses and Ring groups and a key mask
from ``SequenceState.key_mask``: padded tokens of every split segment, and the model's own masks
(Qwen-Image's and HunyuanVideo's text masks, Z-Image's batch padding, ERNIE-Image's text padding),
get zero weight.
Cross-attention to replicated text (Wan, SANA) needs no exchange and runs locally. SANA's linear
self-attention is the one non-softmax case: an all-reduce of its key/value sums instead of the
kernels' exchange.

``install_processors`` picks the processor by the class of the one a layer has; a layer with any
other processor is refused (it would attend only to this rank's shard).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tilecast.kernels.attention import attention, resolve_backend
from tilecast.runtime.models.families.sequence_parallel import SequenceState

logger = logging.getLogger(__name__)


class _SequenceParallelProcessor:
    """Base: holds the shared state and the backend name."""

    layer_name = ""
    """The attention layer's module name in the transformer (set by ``install_processors``)."""

    def __init__(self, state: SequenceState, backend: str | None) -> None:
        self.state = state
        self.backend = backend

    def attend(self, q_BSHD, k_BSHD, v_BSHD, parts) -> torch.Tensor:
        """Sequence-parallel attention of the local shard; ``parts`` describe its segments (``key_mask``)."""
        mask_BS = self.state.key_mask(parts, q_BSHD.shape[0], q_BSHD.device)
        out_BSHD, _lse = attention(
            q_BSHD, k_BSHD, v_BSHD, backend=self.backend, parallel=self.state.parallel, key_mask=mask_BS
        )
        return out_BSHD

    def single_stream(self, attn, hidden_states, mask_BS, freqs, rotary):
        """Single-stream attention over the split tokens (Z-Image, ERNIE-Image): q/k/v projections,
        the q/k norms, ``rotary(x_BSHD, freqs)``, then ``attend`` with the per-token key mask
        ``mask_BS``; returns the attention output and the query dtype."""
        q_BSHD, k_BSHD, v_BSHD = (
            proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        if attn.norm_q is not None:
            q_BSHD = attn.norm_q(q_BSHD)
        if attn.norm_k is not None:
            k_BSHD = attn.norm_k(k_BSHD)
        if freqs is not None:
            q_BSHD, k_BSHD = rotary(q_BSHD, freqs), rotary(k_BSHD, freqs)
        return self.attend(q_BSHD, k_BSHD, v_BSHD, [(self.state.stream, mask_BS)]), q_BSHD.dtype


class FluxSequenceParallelProcessor(_SequenceParallelProcessor):
    """``FluxAttention`` (diffusers' ``FluxAttnProcessor``, tilecast's ``FluxDenseAttnProcessor``):
    joint ``[text, image]`` attention in the double-stream blocks, the same concatenation arriving
    as one stream in the single-stream blocks."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from tilecast.runtime.models.families.flux_fast import flux_output, flux_qkv  # imports diffusers' FLUX

        if attention_mask is not None:
            raise ValueError("FLUX's sequence-parallel attention takes no attention_mask")
        q_BSHD, k_BSHD, v_BSHD = flux_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("encoder_hidden_states", None), ("hidden_states", None)])
        return flux_output(attn, out_BSHD, encoder_hidden_states, dtype=q_BSHD.dtype)


class Flux2SequenceParallelProcessor(_SequenceParallelProcessor):
    """``Flux2AttnProcessor``: joint ``[text, image]`` attention of FLUX.2's double-stream blocks."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb
        from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

        if attention_mask is not None:
            raise ValueError("FLUX.2's sequence-parallel attention takes no attention_mask")
        if encoder_hidden_states is None:
            raise ValueError("FLUX.2's double-stream attention needs encoder_hidden_states (the text stream)")
        img_q, img_k, img_v, txt_q, txt_k, txt_v = (
            t.unflatten(-1, (-1, attn.head_dim))
            for t in _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        )
        q_BSHD = torch.cat([attn.norm_added_q(txt_q), attn.norm_q(img_q)], dim=1)
        k_BSHD = torch.cat([attn.norm_added_k(txt_k), attn.norm_k(img_k)], dim=1)
        v_BSHD = torch.cat([txt_v, img_v], dim=1)
        if image_rotary_emb is not None:
            q_BSHD = apply_rotary_emb(q_BSHD, image_rotary_emb, sequence_dim=1)
            k_BSHD = apply_rotary_emb(k_BSHD, image_rotary_emb, sequence_dim=1)
        out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("encoder_hidden_states", None), ("hidden_states", None)])
        out_BSC = out_BSHD.flatten(2, 3).to(q_BSHD.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[1](attn.to_out[0](out_BSC[:, seq_txt:].contiguous()))  # projection, dropout
        return img_out, attn.to_add_out(out_BSC[:, :seq_txt].contiguous())


class Flux2SingleSequenceParallelProcessor(_SequenceParallelProcessor):
    """``Flux2ParallelSelfAttnProcessor``: FLUX.2's single-stream blocks, attention over the
    ``[text, image]`` concatenation (one stream here) fused with the MLP's projections."""

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise ValueError("FLUX.2's sequence-parallel attention takes no attention_mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = projected.split([3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor], dim=-1)
        q_BSHD, k_BSHD, v_BSHD = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        q_BSHD, k_BSHD = attn.norm_q(q_BSHD), attn.norm_k(k_BSHD)
        if image_rotary_emb is not None:
            q_BSHD = apply_rotary_emb(q_BSHD, image_rotary_emb, sequence_dim=1)
            k_BSHD = apply_rotary_emb(k_BSHD, image_rotary_emb, sequence_dim=1)
        out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("encoder_hidden_states", None), ("hidden_states", None)])
        out_BSC = out_BSHD.flatten(2, 3).to(q_BSHD.dtype)
        return attn.to_out(torch.cat([out_BSC, attn.mlp_act_fn(mlp)], dim=-1))


class QwenImageSequenceParallelProcessor(_SequenceParallelProcessor):
    """``QwenDoubleStreamAttnProcessor2_0``: joint ``[text, image]`` attention, text keys masked by
    ``encoder_hidden_states_mask`` (split with the text by the plan) as well as by padding."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        encoder_hidden_states_mask=None,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        if encoder_hidden_states is None:
            raise ValueError("Qwen-Image's attention needs encoder_hidden_states (the text stream)")
        if attention_mask is not None:
            raise ValueError("Qwen-Image's attention takes encoder_hidden_states_mask, not attention_mask")
        head_dim = attn.inner_dim // attn.heads
        img_q, img_k, img_v = (
            proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        txt_q, txt_k, txt_v = (
            proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
            img_k = apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
            txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
            txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)
        q_BSHD = torch.cat([txt_q, img_q], dim=1)
        out_BSHD = self.attend(
            q_BSHD,
            torch.cat([txt_k, img_k], dim=1),
            torch.cat([txt_v, img_v], dim=1),
            [("encoder_hidden_states", encoder_hidden_states_mask), ("hidden_states", None)],
        )
        out_BSC = out_BSHD.flatten(2, 3).to(q_BSHD.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        img_out = attn.to_out[0](out_BSC[:, seq_txt:].contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        return img_out, attn.to_add_out(out_BSC[:, :seq_txt].contiguous())


class WanSequenceParallelProcessor(_SequenceParallelProcessor):
    """``WanAttnProcessor``: self-attention over the split video tokens; cross-attention (to the
    replicated text, and to the image context of I2V checkpoints) runs locally on this rank's queries."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections

        if attention_mask is not None:
            raise ValueError("Wan's sequence-parallel attention takes no attention_mask")
        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            image_context_length = encoder_hidden_states.shape[1] - 512  # diffusers: the text context is 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        q_BSHD, k_BSHD, v_BSHD = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            q_BSHD, k_BSHD = _wan_rotary(q_BSHD, *rotary_emb), _wan_rotary(k_BSHD, *rotary_emb)

        extra_BSC = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            out_img, _lse = attention(q_BSHD, key_img, value_img.unflatten(2, (attn.heads, -1)), backend=self.backend)
            extra_BSC = out_img.flatten(2, 3).type_as(query)

        if encoder_hidden_states is None:  # self-attention: across the ranks
            out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("hidden_states", None)])
        else:  # cross-attention to the full text, here
            out_BSHD, _lse = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend)
        out_BSC = out_BSHD.flatten(2, 3).type_as(query)
        if extra_BSC is not None:
            out_BSC = out_BSC + extra_BSC
        return attn.to_out[1](attn.to_out[0](out_BSC))


def _wan_rotary(x_BSHD: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's interleaved rotary embedding (``WanAttnProcessor``'s ``apply_rotary_emb``)."""
    x1, x2 = x_BSHD.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x_BSHD)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x_BSHD)


class ZImageSequenceParallelProcessor(_SequenceParallelProcessor):
    """``ZSingleStreamAttnProcessor``: single-stream attention over the split tokens of the current
    region (noise refiner, context refiner, main layers; the plan's stream input ``x``), keys masked
    by the model's batch-padding mask (split by the plan) and by padding."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(f"Z-Image's attention mask should be (batch, tokens), got {tuple(attention_mask.shape)}")
        out_BSHD, dtype = self.single_stream(attn, hidden_states, attention_mask, freqs_cis, _z_image_rotary)
        output = attn.to_out[0](out_BSHD.flatten(2, 3).to(dtype))
        if len(attn.to_out) > 1:  # dropout
            output = attn.to_out[1](output)
        return output


def _z_image_rotary(x_BSHD: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's complex rotary embedding (``ZSingleStreamAttnProcessor``'s ``apply_rotary_emb``)."""
    with torch.amp.autocast("cuda", enabled=False):
        x = torch.view_as_complex(x_BSHD.float().reshape(*x_BSHD.shape[:-1], -1, 2))
        return torch.view_as_real(x * freqs_cis.unsqueeze(2)).flatten(3).type_as(x_BSHD)


class SanaLinearSequenceParallelProcessor(_SequenceParallelProcessor):
    """``SanaLinearAttnProcessor2_0``: SANA's linear (ReLU-kernel) self-attention over the split
    image tokens. Every query reads the same sums over all keys, ``[V; 1]^T ReLU(K)`` per head
    (``(D+1) x D``): each rank sums its own keys (padded ones zeroed), one all-reduce over the
    Ulysses and Ring groups completes them, and each rank applies them to its own queries. No
    softmax, so neither Ulysses' head exchange nor Ring's merge: the degrees only size the group."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        import torch.distributed as dist
        import torch.nn.functional as F

        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("SANA's sequence-parallel linear attention is self-attention without a mask")
        original_dtype = hidden_states.dtype
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        q_BHDS = F.relu(query.transpose(1, 2).unflatten(1, (attn.heads, -1))).float()
        k_BHSD = F.relu(key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)).float()
        v_BHDS = value.transpose(1, 2).unflatten(1, (attn.heads, -1)).float()
        valid_S = self.state.valid(self.state.stream, hidden_states.device)
        if valid_S is not None:  # padded tokens add nothing to the sums
            k_BHSD = k_BHSD * valid_S[:, None].to(k_BHSD.dtype)
        v_BHDS = F.pad(v_BHDS, (0, 0, 0, 1), mode="constant", value=1.0)  # the ones row sums ReLU(K): the normaliser
        sums_BHED = torch.matmul(v_BHDS, k_BHSD)
        for group in (self.state.parallel.ulysses_group, self.state.parallel.ring_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sums_BHED, group=group)
        out_BHES = torch.matmul(sums_BHED, q_BHDS)
        out_BHDS = out_BHES[:, :, :-1] / (out_BHES[:, :, -1:] + 1e-15)
        output = attn.to_out[0](out_BHDS.flatten(1, 2).transpose(1, 2).to(original_dtype))
        output = attn.to_out[1](output)
        if original_dtype == torch.float16:
            output = output.clip(-65504, 65504)
        return output


class SanaCrossSequenceParallelProcessor(_SequenceParallelProcessor):
    """``SanaAttnProcessor2_0``: SANA's cross-attention from this rank's image tokens to the full,
    replicated text (no exchange), the text's padding masked as the model's bias masks it."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        if encoder_hidden_states is None:
            raise ValueError("SANA's cross-attention needs encoder_hidden_states (the text)")
        query = attn.to_q(hidden_states)
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        q_BSHD, k_BSHD, v_BSHD = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        mask_BS = None
        if attention_mask is not None:  # the model's additive bias: 0 keeps a text token, -10000 drops it
            bias_BS = attention_mask.reshape(q_BSHD.shape[0], -1)
            mask_BS = bias_BS if bias_BS.dtype == torch.bool else bias_BS > -1.0
        out_BSHD, _lse = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend, key_mask=mask_BS)
        output = attn.to_out[0](out_BSHD.flatten(2, 3).to(query.dtype))
        output = attn.to_out[1](output)
        return output / attn.rescale_output_factor


class ErnieImageSequenceParallelProcessor(_SequenceParallelProcessor):
    """``ErnieImageSingleStreamAttnProcessor``: single-stream attention over the split ``[image, text]``
    tokens (the plan's stream input ``x``), keys masked by the model's text-padding mask (split by
    the plan) and by padding."""

    def __call__(self, attn, hidden_states, attention_mask=None, freqs_cis=None):
        if attention_mask is not None:  # (B, 1, 1, S) as the model builds it, or (B, S)
            attention_mask = attention_mask.reshape(attention_mask.shape[0], attention_mask.shape[-1])
        out_BSHD, dtype = self.single_stream(attn, hidden_states, attention_mask, freqs_cis, _ernie_rotary)
        return attn.to_out[0](out_BSHD.flatten(2, 3).to(dtype))


def _ernie_rotary(x_BSHD: torch.Tensor, freqs_B_S_1_R: torch.Tensor) -> torch.Tensor:
    """ERNIE-Image's rotary embedding on the first ``R`` channels (``ErnieImageSingleStreamAttnProcessor``:
    non-interleaved rotate-half, angles ``[t0, t0, t1, t1, ...]``)."""
    rot = freqs_B_S_1_R.shape[-1]
    x, x_pass = x_BSHD[..., :rot], x_BSHD[..., rot:]
    cos, sin = torch.cos(freqs_B_S_1_R).to(x.dtype), torch.sin(freqs_B_S_1_R).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass), dim=-1)


class LTX2SequenceParallelProcessor(_SequenceParallelProcessor):
    """``LTX2AudioVideoAttnProcessor`` / ``LTX2PerturbedAttnProcessor``: the six attention layers of
    an LTX-2 audio-video block, under diffusers' plan (video tokens and the video text split over the
    ranks, the audio and its text whole on every rank). By the layer it serves (``layer_name``):

    - ``attn1`` video self-attention and ``attn2`` video-to-text cross-attention: across the ranks
      (queries and keys both split; the text keys masked by the model's mask and by padding);
    - ``audio_attn1``, ``audio_attn2`` (audio self / audio-to-text) and ``audio_to_video_attn``
      (video queries, audio keys): the keys are whole here, so locally;
    - ``video_to_audio_attn`` (whole audio queries, split video keys): each rank attends to its own
      video keys (padding masked), then the ranks' partial results are merged by their
      log-sum-exps (one all-gather per group), which is the softmax over all the keys.

    Video rotary tables the plan leaves whole (the "split" layout's ``(B, H, S, D)``, and the
    cross-modal tables) are cut to the rank's tokens here. STG's perturbed blocks (LTX-2.3) keep
    diffusers' rule: a perturbed sample takes the value projection in place of attention.
    """

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ):
        from diffusers.models.transformers.transformer_ltx2 import (
            apply_interleaved_rotary_emb,
            apply_split_rotary_emb,
        )

        role = self.layer_name.rpartition(".")[2]
        if role not in _LTX2_ROLES:
            raise ValueError(f"LTX-2 attention layer {self.layer_name!r} is not one tilecast can run sequence-parallel")
        query_video, key_video = _LTX2_ROLES[role]
        if attention_mask is not None and role not in ("attn2", "audio_attn2"):
            raise ValueError(f"LTX-2's sequence-parallel {role} takes no attention mask")
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(context)
        if all_perturbed is None:
            all_perturbed = bool(torch.all(perturbation_mask == 0)) if perturbation_mask is not None else False
        if all_perturbed:
            out_BSC = value
        else:
            query, key = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(context))
            if query_rotary_emb is not None:
                rotate = apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb
                key_rotary_emb = query_rotary_emb if key_rotary_emb is None else key_rotary_emb
                query = rotate(query, self._local_rope(query_rotary_emb) if query_video else query_rotary_emb)
                key = rotate(key, self._local_rope(key_rotary_emb) if key_video else key_rotary_emb)
            q_BSHD, k_BSHD, v_BSHD = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
            text_mask_BS = None
            if attention_mask is not None:  # the model's additive bias: 0 keeps a text token, -10000 drops it
                text_mask_BS = attention_mask.reshape(q_BSHD.shape[0], -1) > -1.0
            if role == "attn1":
                out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("hidden_states", None)])
            elif role == "attn2":
                out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("encoder_hidden_states", text_mask_BS)])
            elif role == "video_to_audio_attn":
                out_BSHD = self._attend_split_keys(q_BSHD, k_BSHD, v_BSHD)
            else:
                out_BSHD, _lse = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend, key_mask=text_mask_BS)
            out_BSC = out_BSHD.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                out_BSC = torch.lerp(value, out_BSC, perturbation_mask)
        if gate_logits is not None:  # per-head gates, 1 when the logits are 0
            gates_BSH1 = (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)
            out_BSC = (out_BSC.unflatten(2, (attn.heads, -1)) * gates_BSH1).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out_BSC))

    def _local_rope(self, rope):
        """A video rotary table cut to this rank's tokens where it still covers them all."""
        cos = rope[0]
        dim = 2 if cos.dim() == 4 else 1  # "split": (B, H, S, D/2); "interleaved": (B, S, D)
        split = self.state.splits["hidden_states"]
        if cos.shape[dim] == split.local_len:
            return rope
        if cos.shape[dim] != split.true_len:
            raise ValueError(f"a video rotary table of {cos.shape[dim]} tokens for {split.true_len} video tokens")
        return tuple(self.state.split(f"{self.layer_name}.rope.{i}", t, dim) for i, t in enumerate(rope))

    def _attend_split_keys(self, q_BSHD, k_BSHD, v_BSHD) -> torch.Tensor:
        """Whole queries over keys split across the ranks: local partial attention, merged over the groups."""
        import torch.distributed as dist

        from tilecast.kernels.ring import merge_partials

        valid_S = self.state.valid("hidden_states", k_BSHD.device)
        mask_BS = None if valid_S is None else valid_S.expand(k_BSHD.shape[0], -1)
        out_BSHD, lse_BHS = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend, key_mask=mask_BS)
        out_BSHD, lse_BHS = out_BSHD.float(), lse_BHS.float()
        for group in (self.state.parallel.ulysses_group, self.state.parallel.ring_group):
            if group is None or dist.get_world_size(group) == 1:
                continue
            world = dist.get_world_size(group)
            outs = [torch.empty_like(out_BSHD) for _ in range(world)]
            lses = [torch.empty_like(lse_BHS) for _ in range(world)]
            dist.all_gather(outs, out_BSHD.contiguous(), group=group)
            dist.all_gather(lses, lse_BHS.contiguous(), group=group)
            merged, merged_lse = None, None
            for part, part_lse in zip(outs, lses):  # in rank order: the same sum on every rank
                merged, merged_lse = merge_partials(merged, merged_lse, part, part_lse)
            out_BSHD, lse_BHS = merged, merged_lse
        return out_BSHD.to(q_BSHD.dtype)


_LTX2_ROLES = {
    "attn1": (True, True),
    "attn2": (True, False),
    "audio_attn1": (False, False),
    "audio_attn2": (False, False),
    "audio_to_video_attn": (True, False),
    "video_to_audio_attn": (False, True),
}
"""An LTX-2 block's attention layers → (queries are video tokens, keys are video tokens)."""


class HeliosSequenceParallelProcessor(_SequenceParallelProcessor):
    """``HeliosAttnProcessor``: diffusers' Helios plan splits every attention call's input (the
    ``[history, current]`` tokens for self-attention, the current chunk's tokens for cross-attention)
    and gathers its output. Self-attention runs across the ranks; a history-amplified layer
    (``is_amplify_history``) scales the keys of the history tokens, found by their position in the
    whole sequence; cross-attention to the full text runs locally (unmasked, as diffusers runs it)."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        rotary_emb=None,
        original_context_length=None,
    ):
        from diffusers.models.transformers.transformer_helios import (
            _get_qkv_projections,
            apply_rotary_emb_transposed,
        )

        if attention_mask is not None:
            raise ValueError("Helios' sequence-parallel attention takes no attention_mask")
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        q_BSHD, k_BSHD, v_BSHD = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            q_BSHD = apply_rotary_emb_transposed(q_BSHD, rotary_emb)
            k_BSHD = apply_rotary_emb_transposed(k_BSHD, rotary_emb)
        if encoder_hidden_states is not None:  # cross-attention to the full text, here
            out_BSHD, _lse = attention(q_BSHD, k_BSHD, v_BSHD, backend=self.backend)
        else:
            if attn.is_amplify_history:
                k_BSHD = self._amplify_history(attn, k_BSHD, original_context_length)
            out_BSHD = self.attend(q_BSHD, k_BSHD, v_BSHD, [("hidden_states", None)])
        out_BSC = out_BSHD.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out_BSC))

    def _amplify_history(self, attn, k_BSHD: torch.Tensor, original_context_length: int) -> torch.Tensor:
        """The keys of this shard with the history tokens' scaled (``HeliosAttnProcessor``'s rule,
        history = the whole sequence's tokens before the last ``original_context_length``)."""
        split = self.state.splits["hidden_states"]
        history_len = split.true_len - original_context_length
        if history_len <= 0:
            return k_BSHD
        scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
        if attn.history_scale_mode == "per_head":
            scale = scale.view(1, 1, -1, 1)
        start = self.state.parallel.sp_rank * split.local_len
        history_S = torch.arange(start, start + split.local_len, device=k_BSHD.device) < history_len
        return torch.where(history_S[None, :, None, None], k_BSHD * scale, k_BSHD)


class HunyuanVideoSequenceParallelProcessor(_SequenceParallelProcessor):
    """``HunyuanVideoAttnProcessor2_0``: joint ``[video, text]`` attention of HunyuanVideo's dual-stream
    blocks (the text through its own projections) and single-stream blocks (one projection for
    both), over the split video and text tokens. The model's mask (``(B, 1, 1, video + text)``:
    the text's padding) is read for the text part and split as the text is."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None:
            raise ValueError("HunyuanVideo's sequence-parallel attention needs encoder_hidden_states (the text)")
        video_len = hidden_states.shape[1]
        if attn.add_q_proj is None:  # single-stream: one set of projections for [video, text]
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q_BSHD, k_BSHD, v_BSHD = (
            proj(hidden_states).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        if attn.norm_q is not None:
            q_BSHD = attn.norm_q(q_BSHD)
        if attn.norm_k is not None:
            k_BSHD = attn.norm_k(k_BSHD)
        if image_rotary_emb is not None:  # on the video tokens only
            q_BSHD = torch.cat(
                [apply_rotary_emb(q_BSHD[:, :video_len], image_rotary_emb, sequence_dim=1), q_BSHD[:, video_len:]],
                dim=1,
            )
            k_BSHD = torch.cat(
                [apply_rotary_emb(k_BSHD[:, :video_len], image_rotary_emb, sequence_dim=1), k_BSHD[:, video_len:]],
                dim=1,
            )
        if attn.add_q_proj is not None:  # dual-stream: the text's own projections
            text_q, text_k, text_v = (
                proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            )
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            q_BSHD, k_BSHD, v_BSHD = (
                torch.cat(pair, dim=1) for pair in ((q_BSHD, text_q), (k_BSHD, text_k), (v_BSHD, text_v))
            )
        text_mask_BS = None
        if attention_mask is not None:
            full_BN = attention_mask.reshape(attention_mask.shape[0], -1)
            video_true = self.state.splits["hidden_states"].true_len
            text_mask_BS = self.state.split("encoder_attention_mask", full_BN[:, video_true:], dim=1)
        out_BSHD = self.attend(
            q_BSHD, k_BSHD, v_BSHD, [("hidden_states", None), ("encoder_hidden_states", text_mask_BS)]
        )
        out_BSC = out_BSHD.flatten(2, 3).to(q_BSHD.dtype)
        video_out, text_out = out_BSC[:, :video_len], out_BSC[:, video_len:]
        if getattr(attn, "to_out", None) is not None:
            video_out = attn.to_out[1](attn.to_out[0](video_out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return video_out, text_out


class ReplicatedAttnProcessor(_SequenceParallelProcessor):
    """diffusers' ``AttnProcessor2_0`` unchanged, for a layer that runs before the plan splits any
    token (HunyuanVideo's token refiner, on the whole text on every rank; ``TextOnlyAttnProcessor``)."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask, **kwargs)


PROCESSORS: dict[str, type[_SequenceParallelProcessor]] = {
    "ErnieImageSingleStreamAttnProcessor": ErnieImageSequenceParallelProcessor,
    "FluxAttnProcessor": FluxSequenceParallelProcessor,
    "FluxDenseAttnProcessor": FluxSequenceParallelProcessor,
    "Flux2AttnProcessor": Flux2SequenceParallelProcessor,
    "Flux2ParallelSelfAttnProcessor": Flux2SingleSequenceParallelProcessor,
    "QwenDoubleStreamAttnProcessor2_0": QwenImageSequenceParallelProcessor,
    "WanAttnProcessor": WanSequenceParallelProcessor,
    "ZSingleStreamAttnProcessor": ZImageSequenceParallelProcessor,
    "SanaLinearAttnProcessor2_0": SanaLinearSequenceParallelProcessor,
    "SanaAttnProcessor2_0": SanaCrossSequenceParallelProcessor,
    "LTX2AudioVideoAttnProcessor": LTX2SequenceParallelProcessor,
    "LTX2PerturbedAttnProcessor": LTX2SequenceParallelProcessor,
    "HeliosAttnProcessor": HeliosSequenceParallelProcessor,
    "HunyuanVideoAttnProcessor2_0": HunyuanVideoSequenceParallelProcessor,
    "TextOnlyAttnProcessor": ReplicatedAttnProcessor,
}
"""Class name of the processor a layer has → the sequence-parallel processor that replaces it."""


def install_processors(transformer: nn.Module, state: SequenceState, backend: str | None) -> int:
    """Give every attention layer of ``transformer`` its sequence-parallel processor; returns how many.

    ``ValueError`` naming the layer when its processor has no sequence-parallel counterpart (or an
    unknown/unusable ``backend``), before anything is changed.
    """
    weight = next(transformer.parameters())
    resolve_backend(backend, weight.device, weight.dtype)
    layers = [
        (name, module)
        for name, module in transformer.named_modules()
        if hasattr(module, "set_processor") and hasattr(module, "processor")
    ]
    for name, module in layers:
        kind = type(module.processor).__name__
        if kind not in PROCESSORS:
            raise ValueError(
                f"attention layer {name} of {type(transformer).__name__} has processor {kind}, which tilecast "
                f"cannot run sequence-parallel (known: {', '.join(sorted(PROCESSORS))})"
            )
    if not layers:
        raise ValueError(f"{type(transformer).__name__} has no attention layers to run sequence-parallel")
    for name, module in layers:
        processor = PROCESSORS[type(module.processor).__name__](state, backend)
        processor.layer_name = name  # the processors that serve several layer kinds read it
        module.set_processor(processor)
    return len(layers)
