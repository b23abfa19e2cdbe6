"""Llama-family decoder (Llama, Qwen2, Qwen3) over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from kernels import fused_norm_ops, ops, pdl
from kernels.norm_handoff import Normed, PreNormed
from metadata.attention_metadata import AttentionMetadata
from workers.distributed import TPGroup
from workers.models.arch import ModelArch
from workers.models.layers import (
    MergedColumnLinear,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_rows,
)
from workers.pipeline import WHOLE_MODEL, PipelineStage

KVCache = tuple[torch.Tensor, torch.Tensor]


def local_kv_heads(arch: ModelArch, tp: TPGroup) -> tuple[int, int]:
    """(first kv head, count) this rank holds: sharded, or one replicated head when kv < tp."""
    if arch.num_kv_heads >= tp.size:
        if arch.num_kv_heads % tp.size:
            raise ValueError(
                f"num_key_value_heads {arch.num_kv_heads} is not divisible by tensor_parallel_size {tp.size}"
            )
        n = arch.num_kv_heads // tp.size
        return tp.rank * n, n
    if tp.size % arch.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp.size} must be a multiple of num_key_value_heads "
            f"{arch.num_kv_heads} to replicate KV heads"
        )
    return tp.rank * arch.num_kv_heads // tp.size, 1


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        d = arch.head_dim
        if arch.num_heads % tp.size:
            raise ValueError(f"num_attention_heads {arch.num_heads} is not divisible by tensor_parallel_size {tp.size}")
        self.num_heads = arch.num_heads // tp.size
        kv_first, self.num_kv_heads = local_kv_heads(arch, tp)
        self.head_dim = d
        self.scale = d**-0.5
        q_start, q_len = shard_rows(arch.num_heads * d, tp)
        kv_part = (kv_first * d, self.num_kv_heads * d)
        self.qkv_proj = MergedColumnLinear(arch.hidden_size, [(q_start, q_len), kv_part, kv_part], arch.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(arch.num_heads * d, arch.hidden_size, False, tp, dtype)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        # an FP8 KV cache's per-tensor scales (a checkpoint's ``k_scale``/``v_scale``; unused otherwise)
        self.k_scale = self.v_scale = 1.0

    def forward(self, h, positions, meta: AttentionMetadata, kv: KVCache, cos_sin):
        """Attention over an already normalised ``h``."""
        return self.attend(self.qkv_proj(h), positions, meta, kv, cos_sin)

    def attend(self, qkv, positions, meta: AttentionMetadata, kv: KVCache, cos_sin):
        """Everything after the QKV projection: [q/k norm] + rotary + KV write (one fused
        launch on CUDA, or part of the attention launch at decode), paged attention, the
        output projection."""
        return self.o_proj(self.attend_core(qkv, positions, meta, kv, cos_sin))

    def attend_core(self, qkv, positions, meta: AttentionMetadata, kv: KVCache, cos_sin):
        """``attend`` without the output projection: the attention output ``[T, Hq * D]``."""
        t = qkv.shape[0]
        nq, nk = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[:, :nq].view(t, self.num_heads, self.head_dim)
        k = qkv[:, nq : nq + nk].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, nq + nk :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv
        o = ops.rope_and_attention(
            positions,
            q,
            k,
            v,
            cos_sin,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.query_start_loc_cpu,
            meta.max_query_len,
            meta.max_seq_len_upper_bound,
            self.scale,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.q_norm.eps if self.q_norm is not None else 1e-6,
            eager=meta.eager,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return o.reshape(t, nq)


class MLP(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        part = shard_rows(arch.intermediate_size, tp)
        # gate|up as (gate j, up j) row pairs: the batch-1 GEMV then streams one contiguous
        # row set (faster than stacked rows and than the unfused path; docs/decisions.md)
        self.act = "silu_and_mul_pairs"
        self.gate_up_proj = MergedColumnLinear(arch.hidden_size, [part, part], arch.mlp_bias, dtype, interleave=True)
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, arch.mlp_bias, tp, dtype)
        self.inter = part[1]

    def forward(self, x):
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x), pairs=True))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(arch, tp, dtype)
        self.mlp = MLP(arch, tp, dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        # o_proj -> norm -> gate|up -> down as one block (no all-reduce between): the norm
        # handoffs of ``fused_norm_ops.mlp_block``
        self.whole_mlp_block = tp.size == 1 and not arch.mlp_bias

    def forward(self, h, residual, positions, meta, kv, cos_sin, next_layer=None):
        """Pre-norm block. Each RMSNorm (with the residual add) is fused into the projection
        that follows it, and SiLU*mul into gate|up; at decode sizes on CUDA that makes six
        launches a layer: norm+QKV, rope+KV write, attention, o_proj, norm+gate|up+act, down
        (five for decode batches of up to 8 tokens: rope+KV write run inside attention).
        At batch 1 (tp 1, CUDA) the producing GEMV may do a norm's elementwise part
        (``kernels.norm_handoff``): ``h`` may then arrive as a ``PreNormed`` with its residual
        already added, and with ``next_layer`` the output may leave as one. At mid-sized
        batches the down projection's split sum may do the next layer's whole norm: ``h``
        then arrives as a ``Normed``."""
        qkv, residual = self.pre_attention(h, residual)
        o = self.self_attn.attend_core(qkv, positions, meta, kv, cos_sin)
        return self.post_attention(o, residual, next_layer)

    def pre_attention(self, h, residual):
        """Input norm (with the residual add) + QKV projection -> ``(qkv, residual)``."""
        attn = self.self_attn
        if isinstance(h, PreNormed):
            return fused_norm_ops.linear_prenormed(h, attn.qkv_proj.weight, attn.qkv_proj.bias), residual
        if isinstance(h, Normed):  # the previous down's split sum did this norm
            return attn.qkv_proj(h.x), residual
        return attn.qkv_proj.norm_forward(h, residual, self.input_layernorm)

    def post_attention(self, o, residual, next_layer=None):
        """From the attention output ``o [T, Hq * D]``: o_proj, residual add + norm, MLP ->
        ``(h, residual)`` (``h`` possibly handed off to ``next_layer``'s norm)."""
        attn, mlp = self.self_attn, self.mlp
        if self.whole_mlp_block:  # tp 1: the norm handoffs (fused_norm_ops.mlp_block)
            ln = self.post_attention_layernorm
            nxt = None
            if next_layer is not None:
                nln = next_layer.input_layernorm
                nxt = (nln.weight, nln.eps, next_layer.self_attn.qkv_proj.weight)
            return fused_norm_ops.mlp_block(
                o,
                attn.o_proj.weight,
                residual,
                ln.weight,
                ln.eps,
                mlp.gate_up_proj.weight,
                mlp.down_proj.weight,
                act=mlp.act,
                handoff_to=nxt,
            )
        act, residual = mlp.gate_up_proj.norm_forward(
            attn.o_proj(o), residual, self.post_attention_layernorm, act=mlp.act
        )
        return mlp.down_proj(act), residual


class LlamaForCausalLM(nn.Module):
    """Checkpoint names follow Hugging Face (``model.layers.N.self_attn.q_proj.weight`` ...);
    the loader maps q/k/v and gate/up onto the fused projections.

    A pipeline ``stage`` holds only its layers (``layers[i]`` is layer ``stage.start + i``),
    the embedding on the first stage and the final norm and LM head on the last; with tied
    embeddings a last stage that does not embed loads the embedding into its own LM head."""

    def __init__(
        self, arch: ModelArch, tp: TPGroup, dtype: torch.dtype, max_positions: int, stage: PipelineStage = WHOLE_MODEL
    ):
        super().__init__()
        self.arch = arch
        self.stage = stage
        self.layer_ids = stage.layer_range(arch.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp, dtype) if stage.is_first else None
        )
        self.layers = nn.ModuleList(DecoderLayer(arch, tp, dtype) for _ in self.layer_ids)
        self.norm = self.lm_head = None
        if stage.is_last:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp, dtype)
        self.tie_embeddings()
        # the loader fills the rope table (``rope.cos_sin_cache``) once the model has its device:
        # computed here, under the loader's meta device, it would cost a second of torch imports
        self.register_buffer(
            "cos_sin", torch.empty(max_positions, arch.head_dim, dtype=torch.float32), persistent=False
        )

    def tie_embeddings(self) -> None:
        """With tied embeddings, the LM head shares the embedding's weight where the stage
        holds both (call again after ``to_empty``)."""
        if self.arch.tie_word_embeddings and self.embed_tokens is not None and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def stage_param_name(self, name: str) -> str | None:
        """A whole-model parameter name as this stage names it (layer indices local), or None
        for a parameter another pipeline stage holds."""
        if name.startswith("layers."):
            index, rest = name[len("layers.") :].split(".", 1)
            if not index.isdigit() or int(index) not in range(self.arch.num_layers):
                return name  # not a layer of this model: the loader reports it
            if int(index) not in self.layer_ids:
                return None
            return f"layers.{int(index) - self.layer_ids.start}.{rest}"
        if name.startswith("embed_tokens."):
            if self.embed_tokens is not None:
                return name
            if self.lm_head is not None and self.arch.tie_word_embeddings:
                return "lm_head." + name[len("embed_tokens.") :]
            return None
        if name.startswith(("norm.", "lm_head.")) and self.norm is None:
            return None
        return name

    def forward(
        self,
        input_ids,
        positions,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """The first stage embeds ``input_ids``; a later one continues from the previous
        stage's ``intermediate`` ``(hidden, residual)``. The last stage returns the normed
        hidden states, an earlier one ``(hidden, residual)`` for the next stage."""
        with pdl.step_tokens(input_ids.shape[0]):
            if intermediate is not None:
                h, residual = intermediate
            elif self.embed_tokens is None:
                raise ValueError(
                    f"pipeline stage {self.stage.index} needs the previous stage's hidden states (intermediate)"
                )
            else:
                h, residual = self.embed_tokens(input_ids), None
            nxt = list(self.layers[1:]) + [None]
            for layer, kv, next_layer in zip(self.layers, kv_caches, nxt):
                h, residual = layer(h, residual, positions, meta, kv, self.cos_sin, next_layer)
            if self.norm is None:
                return h, residual
            h, _ = self.norm(h, residual)
        return h

    def projections(self) -> list[nn.Module]:
        """Every decoder layer's projections (the FP8-quantizable weights)."""
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        return out

    def use_fp8(self) -> None:
        """After the projections became FP8: the fused 16-bit paths that read a projection's
        weight directly (the norm handoffs of ``fused_norm_ops.mlp_block``) are off."""
        for layer in self.layers:
            layer.whole_mlp_block = False

    def tile_gemm_uses(self) -> list[tuple[torch.Tensor, str]]:
        """Each projection weight with how ``ops`` may run it at a mid-sized batch (for
        ``kernels.tile_gemm.precompile``)."""
        uses = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj.weight_scale is not None:
                continue  # FP8: kernels.fp8_gemm, not the tile GEMM
            uses += [
                (attn.qkv_proj.weight, "plain"),
                (attn.o_proj.weight, "plain"),
                (mlp.gate_up_proj.weight, "act"),
                (mlp.down_proj.weight, "plain"),
            ]
            if layer.whole_mlp_block:
                uses += [(attn.o_proj.weight, "add_norm"), (mlp.down_proj.weight, "add_norm")]
        return uses + ([(self.lm_head.weight, "logits")] if self.lm_head is not None else [])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with pdl.step_tokens(hidden.shape[0]):
            return self.lm_head(hidden, out_dtype=torch.float32)
