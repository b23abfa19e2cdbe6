"""Device dispatch: Triton kernels on CUDA, the torch references elsewhere.

Every choice between kernels is made here (and, for GEMMs that also do the next RMSNorm, in
``kernels.fused_norm_ops``; for speculative decoding, in ``kernels.spec_ops``), from CPU
facts (shapes, dtypes, the batch size) and the installed ``kernels.settings.KernelSettings``;
the leaf kernels take the tuning entries they need as arguments and never reach back here.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.settings import KernelSettings, current

# Decode-sized batches (M <= this) of 16-bit weights use the Triton skinny GEMM with its
# fused RMSNorm prologue / SiLU*mul epilogue; larger ones cuBLAS plus separate kernels.
# A module attribute so a benchmark can compare both paths (0 disables the skinny path).
SKINNY_MAX_M = 16


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def write_kv(key, value, k_cache, v_cache, slot_mapping, *, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """This step's K/V into the paged cache; an FP8 cache (``float8_e4m3fn``) stores them
    quantized with the per-tensor ``k_scale`` / ``v_scale`` (Python floats; ignored otherwise)."""
    if _use_triton(key):
        from kernels.kv_write import write_kv_triton

        return write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return reference.write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)


def paged_attention(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    query_start_loc,
    query_start_loc_cpu,
    max_query_len: int,
    max_seq_len_upper_bound: int,
    scale: float,
    eager: bool = False,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """``eager``: the pass runs outside any CUDA graph (see ``AttentionMetadata.eager``).
    ``k_scale`` / ``v_scale``: an FP8 cache's per-tensor scales (Python floats), applied
    inside the attention kernel; ignored with any other cache dtype."""
    if _use_triton(q):
        from kernels.paged_attention import paged_attention_triton

        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            max_query_len,
            max_seq_len_upper_bound,
            scale,
            eager=eager,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return reference.paged_attention_reference(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        query_start_loc_cpu,
        max_seq_len_upper_bound,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )


# Largest (padded) decode batch whose attention launch also does the rope prologue: one
# launch a layer fewer wins at b1-b8, but from b32 the prologue's registers cost occupancy
# where attention is bandwidth-bound (docs/decisions.md).
ROPE_IN_ATTENTION_MAX_TOKENS = 8
# ... and the most keys the launch may stream (tokens x the length bound, CPU ints): the
# same occupancy cost at long contexts. Every win is at most 8 x 1,024 (b8 under the 1,024
# bucket, b1 at 4k), every loss above (b32 x 1,024).
ROPE_IN_ATTENTION_MAX_TOKEN_KEYS = 8 * 1024


def rope_in_attention_applies(num_tokens: int, max_query_len: int, bound: int) -> bool:
    """Whether a CUDA decode pass of these CPU sizes runs rope + KV write inside the
    attention launch (``rope_and_attention``): the ``rope_in_attention`` option (default on),
    one query token a request, at most ``ROPE_IN_ATTENTION_MAX_TOKENS`` tokens and at most
    ``ROPE_IN_ATTENTION_MAX_TOKEN_KEYS`` tokens x length bound (one launch a layer fewer)."""
    return (
        max_query_len == 1
        and num_tokens <= ROPE_IN_ATTENTION_MAX_TOKENS
        and num_tokens * bound <= ROPE_IN_ATTENTION_MAX_TOKEN_KEYS
        and current().rope_in_attention
    )


def rope_and_attention(
    positions,
    q,
    k,
    v,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    block_table,
    seq_lens,
    query_start_loc,
    query_start_loc_cpu,
    max_query_len: int,
    max_seq_len_upper_bound: int,
    scale: float,
    q_norm_weight=None,
    k_norm_weight=None,
    eps: float = 1e-6,
    eager: bool = False,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """``paged_attention(rope_and_write_kv(...))`` on the raw q/k/v of a QKV projection.
    On CUDA with one query token a request (``max_query_len == 1``, a CPU int), a small
    batch and few keys (tokens x ``max_seq_len_upper_bound``) it is one launch
    (``kernels.paged_attention`` with ``rope=``); otherwise the two
    ops. ``k_scale`` / ``v_scale``: an FP8 cache's scales, for its writes and reads."""
    if _use_triton(q) and rope_in_attention_applies(q.shape[0], max_query_len, max_seq_len_upper_bound):
        from kernels.paged_attention import paged_attention_triton
        from kernels.rope_inline import DecodeRope

        rope = DecodeRope(
            positions, k, v, cos_sin_cache, slot_mapping, q_norm_weight, k_norm_weight, eps, k_scale, v_scale
        )
        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start_loc,
            1,
            max_seq_len_upper_bound,
            scale,
            rope=rope,
            eager=eager,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    q = rope_and_write_kv(
        positions,
        q,
        k,
        v,
        cos_sin_cache,
        k_cache,
        v_cache,
        slot_mapping,
        q_norm_weight,
        k_norm_weight,
        eps,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return paged_attention(
        q,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        query_start_loc,
        query_start_loc_cpu,
        max_query_len,
        max_seq_len_upper_bound,
        scale,
        eager=eager,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def rms_norm(x, weight, eps: float, residual=None):
    if _use_triton(x):
        from kernels.rms_norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps, residual)
    return reference.rms_norm_reference(x, weight, eps, residual)


def rotary_embedding(positions, q, k, cos_sin_cache):
    if _use_triton(q):
        from kernels.rotary import rotary_embedding_triton

        return rotary_embedding_triton(positions, q, k, cos_sin_cache)
    return reference.rotary_embedding_reference(positions, q, k, cos_sin_cache)


def silu_and_mul(x, pairs: bool = False):
    """``silu(gate) * up`` of a gate|up output: halves, or ``pairs`` (columns 2j, 2j + 1)."""
    if _use_triton(x):
        from kernels.activation import silu_and_mul_triton

        return silu_and_mul_triton(x, pairs=pairs)
    return reference.silu_and_mul_reference(x, pairs=pairs)


def rope_and_write_kv(
    positions,
    q,
    k,
    v,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    q_norm_weight=None,
    k_norm_weight=None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
):
    """[q/k RMSNorm] + rotary + KV write in one launch on CUDA; returns the rotated q.
    An FP8 cache stores the K/V quantized with ``k_scale`` / ``v_scale`` (ignored otherwise)."""
    args = (positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps)
    if _use_triton(q):
        from kernels.rope_kv import rope_and_write_kv_triton

        return rope_and_write_kv_triton(*args, k_scale=k_scale, v_scale=v_scale)
    return reference.rope_and_write_kv_reference(*args, k_scale=k_scale, v_scale=v_scale)


def skinny_config(x: torch.Tensor, weight: torch.Tensor, norm: bool, act: str | None, out_dtype):
    """The skinny-GEMM config for this call, or None for the unfused path."""
    if not (
        _use_triton(x)
        and x.dim() == 2
        and 0 < x.shape[0] <= SKINNY_MAX_M
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
    ):
        return None
    from kernels.skinny_gemm import kind_of, select_config

    kind = kind_of(norm, act, out_dtype == torch.float32)
    return select_config(x.shape[0], weight.shape[0], weight.shape[1], kind, current().skinny_table)


def linear(
    x,
    weight,
    bias=None,
    *,
    weight_scale=None,
    input_scale=None,
    residual=None,
    norm_weight=None,
    eps: float = 1e-6,
    act: str | None = None,
    out_dtype=None,
):
    """``act(norm(x [+ residual]) @ weight^T + bias)`` -> ``(y, new_residual)``.

    With ``weight_scale`` (float32 per output row) ``weight`` is FP8 (e4m3). Up to
    ``SKINNY_MAX_M`` rows, and on CUDA at 17-64 rows where the skinny table holds an FP8 entry
    for that batch class (``fp8_route``), it is weight-only: the 16-bit ``x`` (not quantized;
    ``input_scale`` is ignored) times the widened weight in one skinny-GEMM launch with the
    norm and activation fused (the reference on the CPU). Other batches: the normed ``x`` is
    quantized per row (or with the static per-tensor ``input_scale``) and multiplied by
    ``kernels.fp8_gemm`` (its reference on the CPU), the scales applied in its epilogue.

    Decode-sized 16-bit batches on CUDA: one Triton skinny-GEMM launch (at batch 1, the
    persistent GEMV of ``kernels.gemv`` where its config says ``"kernel": "gemv"``) with
    the norm and activation fused, where ``kernels.skinny_gemm.select_config`` (swept defaults,
    overridden per shape by ``kernels/skinny_tuning.json``) says it beats the unfused
    path. Otherwise the same math unfused: the RMSNorm kernel, then cuBLAS (or, at 2-256
    rows where ``kernels/tile_gemm_tuning.json`` has an entry, ``kernels.tile_gemm`` with the
    row-pair SiLU*mul in its epilogue), then the SiLU*mul kernel on CUDA; the references on
    the CPU (where this is exactly the previous unfused model code)."""
    if weight_scale is not None:
        return _fp8_linear(x, weight, weight_scale, input_scale, bias, residual, norm_weight, eps, act, out_dtype)
    cfg = skinny_config(x, weight, norm_weight is not None, act, out_dtype)
    # the tile table's 2-16-row class, where it has an entry, wins over the skinny config
    tile = tile_config(x, weight, bias) if cfg is not None and x.shape[0] > 1 else None
    if tile is not None:
        cfg = None
    if cfg is not None and cfg.get("kernel") == "gemv" and x.shape[0] == 1:
        from kernels.gemv import gemv_triton

        return gemv_triton(
            x,
            weight,
            bias,
            residual=residual,
            norm_weight=norm_weight,
            eps=eps,
            act=act,
            out_dtype=out_dtype,
            config=cfg,
        )
    if cfg is not None:
        from kernels.skinny_gemm import skinny_linear_triton

        return skinny_linear_triton(
            x,
            weight,
            bias,
            residual=residual,
            norm_weight=norm_weight,
            eps=eps,
            act=act,
            out_dtype=out_dtype,
            config=cfg,
        )
    if not _use_triton(x):
        return reference.skinny_linear_reference(
            x, weight, bias, residual=residual, norm_weight=norm_weight, eps=eps, act=act, out_dtype=out_dtype
        )
    new_res = None
    if norm_weight is not None:
        x, new_res = rms_norm(x, norm_weight, eps, residual)
    if tile is None:  # (the normed x has x's shape and dtype: a config found above stands)
        tile = tile_config(x, weight, bias)
    if tile is not None:  # mid-sized batches: kernels.tile_gemm where it beat cuBLAS
        from kernels.tile_gemm import tile_linear_triton

        fused = act == "silu_and_mul_pairs"  # in the GEMM's (or its split sum's) epilogue
        y = tile_linear_triton(
            x, weight, tile, out_dtype=out_dtype if act is None else None, act=act if fused else None
        )
        if fused:
            return (y.to(out_dtype) if out_dtype is not None else y), new_res
    else:
        y = torch.nn.functional.linear(x, weight, bias)
    return _activate(y, act, out_dtype), new_res


def _activate(y, act: str | None, out_dtype):
    """The unfused paths' epilogue: ``act`` (SiLU*mul of stacked halves or row pairs), then
    the cast to ``out_dtype``."""
    if act in ("silu_and_mul", "silu_and_mul_pairs"):
        y = silu_and_mul(y, pairs=act == "silu_and_mul_pairs")
    elif act is not None:
        raise ValueError(f"unknown activation {act!r}")
    return y.to(out_dtype) if out_dtype is not None else y


def _fp8_linear(x, weight, weight_scale, input_scale, bias, residual, norm_weight, eps, act, out_dtype):
    """``linear`` with an FP8 weight (``kernels.fp8_linear``), routed by ``fp8_route``: the
    weight-only skinny GEMM with the norm and activation fused, or norm kernel + weight-only
    GEMM + activation kernel, or norm, FP8 quantization of the input, FP8 GEMM, activation."""
    from kernels import fp8_linear

    path, cfg = fp8_route(x, weight, norm_weight is not None, act, out_dtype)
    if path == "fused":  # (on the CPU: its reference)
        kw = dict(residual=residual, norm_weight=norm_weight, eps=eps, act=act, out_dtype=out_dtype)
        return fp8_linear.weight_only_linear(x, weight, weight_scale, bias, cfg, **kw)
    new_res = None  # unfused, as the 16-bit path: norm kernel, GEMM, activation kernel
    if norm_weight is not None:
        x, new_res = rms_norm(x, norm_weight, eps, residual)
    if path == "unfused":
        y = fp8_linear.weight_only_linear(x, weight, weight_scale, bias, cfg)[0]
    else:
        y = fp8_linear.w8a8_linear(x, weight, weight_scale, input_scale, bias)
    return _activate(y, act, out_dtype), new_res


def fp8_route(x, weight, norm: bool, act, out_dtype) -> tuple[str, dict | None]:
    """How an FP8 ``linear`` of ``x [M, K]`` runs (CPU ints only): ``("fused", cfg)`` weight-only
    with the norm and activation fused, ``("unfused", cfg)`` norm kernel + weight-only plain
    GEMM + activation kernel, or ``("w8a8", None)``. Up to ``SKINNY_MAX_M`` rows (16, or fewer
    when set lower) always weight-only (``_fp8_skinny_config``; the reference on the CPU); the
    rest of 1-16 rows w8a8. 17-64 rows weight-only only
    where the table has an FP8 entry for the call's kind (or, unfused, for the plain GEMM):
    the tune found it faster than quantizing the activations; else (and on the CPU) w8a8."""
    from kernels.skinny_gemm import MAX_M, kind_of, m_class, select_config

    m = x.shape[0] if x.dim() == 2 else 0
    if not 0 < m <= MAX_M:
        return "w8a8", None
    if m_class(m) is not None:  # 1-16 rows: weight-only up to SKINNY_MAX_M (0 turns it off)
        if m > SKINNY_MAX_M:
            return "w8a8", None
        if not _use_triton(x):
            return "fused", None
        cfg = _fp8_skinny_config(x, weight, norm, act, out_dtype)
        return ("fused", cfg) if cfg is not None else ("unfused", _fp8_skinny_config(x, weight, False, None, None))
    if not _use_triton(x):
        return "w8a8", None
    table = current().skinny_table
    cfg = select_config(m, *weight.shape, kind_of(norm, act, out_dtype == torch.float32), table, fp8=True)
    if cfg is not None and cfg.get("kernel") != "gemv":
        return "fused", cfg
    if norm or act is not None:
        plain = select_config(m, *weight.shape, "plain", table, fp8=True)
        if plain is not None and plain.get("kernel") != "gemv":
            return "unfused", plain
    return "w8a8", None


def _fp8_skinny_config(x, weight, norm: bool, act, out_dtype) -> dict | None:
    """The skinny table's tiles for an FP8 weight of this shape (its FP8 entry, else its 16-bit
    one); the fallback tiles where it names the GEMV (no FP8 GEMV), or says "unfused" at one row
    or for a plain GEMM (no cuBLAS path for FP8); None where it says "unfused" for a fused call
    at more than one row (the caller runs the norm and activation kernels around a plain GEMM)."""
    from kernels.skinny_gemm import fallback_config, kind_of, select_config

    m = x.shape[0]
    kind = kind_of(norm, act, out_dtype == torch.float32)
    cfg = select_config(m, *weight.shape, kind, current().skinny_table, fp8=True)
    if cfg is None and m > 1 and (norm or act is not None):
        return None
    return fallback_config(m) if cfg is None or cfg.get("kernel") == "gemv" else cfg


def tile_ready(x, weight) -> bool:
    return (
        _use_triton(x)
        and x.dim() == 2
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def tile_config(x, weight, bias) -> dict | None:
    """The ``kernels.tile_gemm`` config for a mid-sized 16-bit batch on CUDA, or None."""
    if bias is not None or not tile_ready(x, weight):
        return None
    from kernels.tile_gemm import select_config

    return select_config(x.shape[0], weight.shape[0], weight.shape[1], "plain", current().tile_table)


def argmax(x):
    """``x.argmax(dim=-1)`` of a 2-D ``x``: a split Triton reduction on CUDA, torch elsewhere."""
    if _use_triton(x) and x.dim() == 2:
        from kernels.argmax import argmax_triton

        return argmax_triton(x)
    return x.argmax(dim=-1)


def exponential_race(probs, seeds, positions):
    """One seeded draw per row of ``probs`` (see ``kernels.sampling``)."""
    if _use_triton(probs):
        from kernels.sampling import exponential_race_triton

        return exponential_race_triton(probs, seeds, positions)
    return reference.exponential_race_reference(probs, seeds, positions)


def sample_logits(logits, divisor, temperature, seeds, positions, greedy, option_rows=None, commit=None):
    """Temperature sampling from the logits, greedy rows kept (``kernels.sample_logits``; the
    torch composition on the CPU and for vocabularies past the kernel's ``MAX_VOCAB``).
    ``option_rows``: the options are option-table word rows read at these device rows;
    ``commit``: the token table each row's token is also written into."""
    kw = dict(option_rows=option_rows, commit=commit)
    if _use_triton(logits):
        from kernels.sample_logits import MAX_VOCAB, sample_logits_triton

        if logits.shape[-1] <= MAX_VOCAB:
            return sample_logits_triton(logits, divisor, temperature, seeds, positions, greedy, **kw)
    return reference.sample_logits_reference(logits, divisor, temperature, seeds, positions, greedy, **kw)


def precompile_tile_gemm(uses, max_rows: int, max_logit_rows: int) -> int:
    """``kernels.tile_gemm.precompile`` of the installed tuning table (worker warm-up)."""
    from kernels.tile_gemm import precompile

    return precompile(uses, max_rows=max_rows, max_logit_rows=max_logit_rows, table=current().tile_table)


def build_kernel_settings(cfg) -> KernelSettings:
    """The ``KernelSettings`` of a ``metadata.config.KernelConfig``, its tuning tables loaded
    and checked now (a worker's start-up), not at the first launch that reads them."""
    from kernels.skinny_gemm import load_table as load_skinny
    from kernels.tile_gemm import load_table as load_tile

    return KernelSettings(
        pdl=cfg.pdl,
        pdl_max_tokens=cfg.pdl_max_tokens,
        rope_in_attention=cfg.rope_in_attention,
        norm_handoff=cfg.norm_handoff,
        skinny_table=load_skinny(cfg.skinny_tuning),
        tile_table=load_tile(cfg.tile_gemm_tuning) if cfg.tile_gemm else {},
    )
