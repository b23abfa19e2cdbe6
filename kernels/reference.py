"""Plain-torch reference implementations: the CPU path and the oracle for kernel tests.

Layouts (shared with the Triton kernels):
  q            [num_tokens, num_q_heads, head_dim]
  k_cache      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache alike)
  block_table  [num_reqs, max_blocks_per_req] int32
  seq_lens     [num_reqs] int32 on the device: KV length after this step's tokens
  query_start_loc        [num_reqs + 1] int32 on the device
  query_start_loc_cpu    [num_reqs + 1] int32 on the CPU (known at schedule time)
  slot_mapping [num_tokens] int64, block_id * block_size + offset; -1 = skip

No function here reads exact sequence lengths on the CPU: loops run over the
CPU query starts and buffers are sized by ``max_seq_len_upper_bound``; the
device ``seq_lens`` only enter masks.

An FP8 KV cache (``torch.float8_e4m3fn``) stores ``clamp(x / scale, -448, 448)`` in e4m3
(computed in float32) with per-tensor ``k_scale`` / ``v_scale`` and is read back as
``k_fp8.float() * k_scale``; any other cache dtype ignores the scales.
"""

from __future__ import annotations

import torch

KV_FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def kv_to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: ``clamp(x / scale, -448, 448)`` rounded to
    e4m3 (float32 math) for an FP8 cache, else ``x.to(dtype)``."""
    if dtype == KV_FP8_DTYPE:
        # a device tensor divisor: CUDA multiplies by the reciprocal of a Python scalar one
        x = x.float()
        return (x / x.new_full((), scale)).clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def kv_from_cache(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache entries in float32: ``x.float() * scale`` for FP8, else ``x.float()``."""
    return x.float() * scale if x.dtype == KV_FP8_DTYPE else x.float()


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as uint8 (indexing and index_put of float8 tensors is not on every
    device), else the cache itself."""
    return cache.view(torch.uint8) if cache.dtype == KV_FP8_DTYPE else cache


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter this step's K/V into the paged cache; slots < 0 (padding) are skipped.
    An FP8 cache stores them quantized with ``k_scale`` / ``v_scale``."""
    nb, bs, h, d = k_cache.shape
    valid = slot_mapping >= 0
    # Boolean selection is fine here: this reference runs on the CPU and as a test
    # oracle, never inside a GPU step (the Triton kernel skips -1 slots itself).
    idx = slot_mapping[valid]
    _bytes(k_cache).view(nb * bs, h, d)[idx] = _bytes(kv_to_cache(key[valid], k_cache.dtype, k_scale))
    _bytes(v_cache).view(nb * bs, h, d)[idx] = _bytes(kv_to_cache(value[valid], v_cache.dtype, v_scale))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    max_seq_len_upper_bound: int,
    scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its paged KV.

    Query token i of request r sits at position ``seq_lens[r] - q_len[r] + i`` and
    attends keys ``0..position``. Computed in float32 (an FP8 cache dequantized as
    ``k.float() * k_scale``, ``v.float() * v_scale``).
    """
    num_tokens, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty_like(q)
    starts = query_start_loc_cpu.tolist()  # CPU tensor: no device sync
    nblk = min((max_seq_len_upper_bound + bs - 1) // bs, block_table.shape[1])  # (as the kernel's kv_cap)
    kv_pos = torch.arange(nblk * bs, device=q.device)
    for r in range(len(starts) - 1):
        s, e = starts[r], starts[r + 1]
        if e == s:
            continue
        blocks = block_table[r, :nblk].long().clamp(min=0)
        if k_cache.dtype == KV_FP8_DTYPE:
            k = kv_from_cache(_bytes(k_cache)[blocks].view(k_cache.dtype).reshape(nblk * bs, hkv, d), k_scale)
            v = kv_from_cache(_bytes(v_cache)[blocks].view(v_cache.dtype).reshape(nblk * bs, hkv, d), v_scale)
        else:
            k = k_cache[blocks].reshape(nblk * bs, hkv, d).float()
            v = v_cache[blocks].reshape(nblk * bs, hkv, d).float()
        k = k.repeat_interleave(group, dim=1)  # [L, hq, d]
        v = v.repeat_interleave(group, dim=1)
        qr = q[s:e].float()  # [n, hq, d]
        q_pos = seq_lens[r] - (e - s) + torch.arange(e - s, device=q.device)  # device
        scores = torch.einsum("nhd,lhd->hnl", qr, k) * scale
        mask = kv_pos[None, :] <= q_pos[:, None]  # [n, L]
        scores = scores.masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", probs, v).to(q.dtype)
    return out


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm with optional fused residual add: returns (normed, new_residual).

    With a residual, ``new_residual = x + residual`` and the norm is applied to it
    (the pre-norm decoder pattern). Accumulates in float32.
    """
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    out = (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight
    return out.to(x.dtype), residual


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (rotate-half) RoPE. q [T, Hq, D], k [T, Hk, D];
    cos_sin_cache [max_pos, D] = cat(cos[:, :D/2], sin[:, :D/2])."""
    d = q.shape[-1]
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, : d // 2].unsqueeze(1), cs[:, d // 2 :].unsqueeze(1)

    def rot(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rot(q), rot(k)


def silu_and_mul_reference(x: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for a fused gate|up output ``[..., 2I]``; with
    ``pairs``, ``silu(x[..., 0::2]) * x[..., 1::2]`` (the row-interleaved layout)."""
    if pairs:
        return torch.nn.functional.silu(x[..., 0::2]) * x[..., 1::2]
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]


def rope_and_write_kv_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Optional per-head q/k RMSNorm, then rotary, then the KV write; returns rotated q.

    q ``[T, Hq, D]``, k/v ``[T, Hk, D]``. Exactly the unfused sequence the fused
    kernel (``kernels.rope_kv``) replaces (an FP8 cache: the rotated k, in q's dtype,
    quantized with ``k_scale``, v with ``v_scale``)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    if q_norm_weight is not None:
        q = rms_norm_reference(q.reshape(-1, d), q_norm_weight, eps)[0].view(t, hq, d)
    if k_norm_weight is not None:
        k = rms_norm_reference(k.reshape(-1, d), k_norm_weight, eps)[0].view(t, hk, d)
    q, k = rotary_embedding_reference(positions, q, k, cos_sin_cache)
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


def skinny_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    act: str | None = None,
    out_dtype: torch.dtype | None = None,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``act(linear(rms_norm(x [+ residual])))``, unfused: returns ``(y, new_residual)``.

    Without ``norm_weight`` it is ``linear`` (+ act); ``new_residual`` is
    ``x + residual`` when a residual is given, else None. ``weight_scale [N]``: ``weight``
    is FP8 with per-row scales, the product (weight-only: ``x`` not quantized) in float32,
    scaled (+ bias), rounded to ``x``'s dtype."""
    new_res = None
    if norm_weight is not None:
        x, new_res = rms_norm_reference(x, norm_weight, eps, residual)
    if weight_scale is not None:
        y = (x.float() @ weight.float().T) * weight_scale.float()[None, :]
        y = (y + bias.float() if bias is not None else y).to(x.dtype)
    else:
        y = torch.nn.functional.linear(x, weight, bias)
    if act in ("silu_and_mul", "silu_and_mul_pairs"):
        y = silu_and_mul_reference(y, pairs=act == "silu_and_mul_pairs")
    elif act is not None:
        raise ValueError(f"unknown activation {act!r}")
    return (y.to(out_dtype) if out_dtype is not None else y), new_res


def ngram_drafts_reference(hist: torch.Tensor, known: torch.Tensor, k: int, n_min: int, n_max: int) -> torch.Tensor:
    """Prompt lookup: continue the latest earlier occurrence of the row's last ``n`` tokens
    (longest ``n`` first). ``hist`` [R, W] token ids (positions >= ``known`` are ignored);
    returns [R, k]. A row without a match proposes its last token repeated (it will most
    likely be rejected, which costs nothing but the verify slots already scheduled)."""
    R, W = hist.shape
    dev = hist.device
    known = known.long()
    last = hist.gather(1, (known - 1).clamp(min=0)[:, None])
    drafts = last.expand(R, k).clone()
    found = torch.zeros(R, dtype=torch.bool, device=dev)
    for n in range(n_max, n_min - 1, -1):
        if n >= W:
            continue
        idx = (known[:, None] - n + torch.arange(n, device=dev)[None, :]).clamp(min=0)
        suffix = hist.gather(1, idx)  # [R, n]
        windows = hist.unfold(1, n, 1)  # [R, W - n + 1, n]
        match = (windows == suffix[:, None, :]).all(dim=-1)
        starts = torch.arange(windows.shape[1], device=dev)[None, :]
        match &= starts + n < known[:, None]  # a continuation exists and it is not the suffix itself
        best = torch.where(match, starts, -1).amax(dim=1)
        take = (best >= 0) & ~found
        cont = best.clamp(min=0)[:, None] + n + torch.arange(k, device=dev)[None, :]
        cont = torch.minimum(cont, (known - 1)[:, None]).clamp(min=0)
        drafts = torch.where(take[:, None], hist.gather(1, cont), drafts)
        found |= take
    return drafts


# ------------------------------------------------------------- sampling noise
_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash on int64 tensors holding values in [0, 2^32).

    The multipliers stay below 2^31 so products fit in int64 without overflow.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 16)
    return x


def noise_row_key(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit hash key (int64 [rows]) of its (seed, position)."""
    lo = seeds & _MASK32
    hi = (seeds >> 32) & _MASK32
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    return _mix32(key ^ (positions.long() & _MASK32))


def uniform_noise64(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """U in (0, 1), float64 [rows, vocab], a pure function of (seed, position, token id):
    ``(k + 0.5) / 2^24`` for a 24-bit hash ``k``, exact in float64 (never 0 or 1)."""
    key = noise_row_key(seeds, positions)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = _mix32(key[:, None] ^ ids[None, :])
    x = _mix32(x ^ (key[:, None] >> 7))
    return ((x >> 8).double() + 0.5) / float(1 << 24)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``uniform_noise64`` rounded to float32 (may round up to 1.0 for the top hash values)."""
    return uniform_noise64(seeds, positions, vocab).float()


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """E = -log U ~ Exp(1), taken in float64 from the exact U, then rounded to float32.

    Strictly positive: a float32 U can round to 1.0, and ``-log 1.0`` is a signed zero
    whose sign decides between a score of +inf and -inf (GPU code negating as ``0 - x``
    and torch disagreed on exactly that). Near U = 1, where the winners are, the float64
    log also keeps E's relative error at float32 rounding."""
    return (-torch.log(uniform_noise64(seeds, positions, vocab))).float()


def exponential_race_reference(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One draw per row from (unnormalised) ``probs`` keyed by (seed, position): argmax p / E
    with E = -log U; ties go to the lowest token id."""
    return (probs / exponential_noise(seeds, positions, probs.shape[-1])).argmax(dim=-1)


def sample_logits_reference(
    logits: torch.Tensor,
    divisor: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    greedy: torch.Tensor,
    option_rows: torch.Tensor | None = None,
    commit: torch.Tensor | None = None,
) -> torch.Tensor:
    """``greedy`` where ``temperature`` is 0, else the seeded draw from ``softmax(logits /
    divisor)`` (``kernels.sample_logits``; ``option_rows`` and ``commit``: as there, the
    options read from option-table word rows and the tokens written into the token table)."""
    if commit is not None and option_rows is None:
        raise ValueError("commit needs option_rows (the rows of the token table to write)")
    if option_rows is not None:
        rows = option_rows[: logits.shape[0]]
        divisor, temperature = (w[rows].to(torch.int32).view(torch.float32) for w in (divisor, temperature))
        seeds = seeds[rows]
    drawn = exponential_race_reference((logits / divisor[:, None]).softmax(dim=-1), seeds, positions)
    out = torch.where(temperature > 0, drawn, greedy)
    if commit is not None:
        commit[option_rows[: logits.shape[0]], positions] = out
    return out


def prepare_inputs_reference(
    starts, rows, qsl, n_tokens: int, q_lens, capacity, token_ids, block_table, block_size: int
):
    """A step's device-derived inputs. Request ``r``'s tokens are ``qsl[r] .. qsl[r + 1] - 1``
    (``qsl``: the query starts, [R + 1]; ``n_tokens``: ``qsl[R]`` as a host int); token
    ``t`` of them sits at ``t - qsl[r]`` within its window, which starts at position
    ``starts[r]`` (device); its input id comes from ``token_ids[rows[r]]``, its KV slot from
    ``block_table[r]`` (-1 at or past ``capacity[r]``: never written). A request may have
    no tokens. Returns positions, input_ids, seq_lens (int32), slot_mapping,
    query_start_loc (int32)."""
    n_blk = block_table.shape[1]
    starts = starts.long()
    # (output_size: no device read of the total)
    token_req = torch.repeat_interleave(
        torch.arange(q_lens.shape[0], device=q_lens.device), q_lens, output_size=n_tokens
    )
    offsets = torch.arange(n_tokens, device=q_lens.device) - qsl.long()[token_req]
    positions = starts[token_req] + offsets
    input_ids = token_ids[rows[token_req], positions.clamp(max=token_ids.shape[1] - 1)]
    seq_lens = (starts + q_lens).int()
    page = (positions // block_size).clamp(max=n_blk - 1)
    blk = block_table[token_req, page].long()
    slot_mapping = torch.where(positions < capacity[token_req], blk * block_size + positions % block_size, -1)
    qsl = torch.zeros(q_lens.shape[0] + 1, dtype=torch.int32, device=q_lens.device)
    qsl[1:] = q_lens.cumsum(0).int()
    return positions, input_ids, seq_lens, slot_mapping, qsl


# XOR-ed into a request seed to give each random stream of speculative decoding its own key
STREAM_ACCEPT = 0x5EC0_0001
STREAM_RECOVER = 0x5EC0_0002
STREAM_DRAFT = 0x5EC0_0003


def verify_slots_reference(
    logits, spec_idx, input_ids, draft_idx, num_drafts, temperature, seeds, positions,
    draft_probs=None, draft_rows=None, probs: bool = False, bonus_idx=None,
):  # fmt: skip
    """``kernels.spec_verify.verify_slots_triton`` in torch: rejection sampling of every draft
    slot (Leviathan et al. 2023). Returns ``(accept int8 [R, K], recovered int64 [R, K],
    bonus int64 [R] or None)``."""
    R, K = spec_idx.shape
    bonus = None
    if bonus_idx is not None:  # the ordinary sampler's draw at the row's sampled position
        xb = logits[bonus_idx].float()
        pb = (xb / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]).softmax(dim=-1)
        drawn = exponential_race_reference(pb, seeds, positions)
        bonus = torch.where(temperature > 0, drawn, xb.argmax(dim=-1))
    x = logits[spec_idx.reshape(-1)].float()  # [R * K, V]
    d = input_ids[draft_idx.reshape(-1)][:, None]
    t = temperature.repeat_interleave(K)
    greedy = x.argmax(dim=-1)
    if probs:
        p = x / x.sum(dim=-1, keepdim=True)
    else:
        p = (x / torch.where(t > 0, t, torch.ones_like(t))[:, None]).softmax(dim=-1)
    p_d = p.gather(1, d)[:, 0]
    if draft_probs is None:  # a point mass on the draft
        q_d, residual = torch.ones_like(p_d), p.scatter(1, d, 0.0)
    else:
        q = draft_probs[draft_rows, :K].reshape(R * K, -1)
        q_d, residual = q.gather(1, d)[:, 0], (p - q).clamp_min(0.0)
    # if p == q the residual is empty, but then rejection has probability 0: fall back to p
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    seeds = seeds.repeat_interleave(K)
    pos = ((positions - num_drafts)[:, None] + torch.arange(K, device=x.device)[None, :]).reshape(-1)
    accept = uniform_noise(seeds ^ STREAM_ACCEPT, pos, 1)[:, 0] * q_d < p_d
    recovered = torch.where(accept, 0, exponential_race_reference(residual, seeds ^ STREAM_RECOVER, pos))
    accept = torch.where(t > 0, accept, greedy == d[:, 0])
    recovered = torch.where(t > 0, recovered, greedy).reshape(R, K)
    valid = torch.arange(K, device=x.device)[None, :] < num_drafts[:, None]
    return (accept.reshape(R, K) & valid).to(torch.int8), torch.where(valid, recovered, 0), bonus


def accept_commit_reference(
    accept, recovered, input_ids, draft_idx, num_drafts, bonus, positions, rows, token_table, num_computed,
    output_counts=None,
):  # fmt: skip
    """``kernels.spec_verify.accept_commit_triton`` in torch: each row keeps its leading
    accepted drafts, then its recovered token (or the bonus token if every draft passed);
    the tokens go into ``token_table[rows]`` from the row's first new position (none past
    the last column), ``num_computed[rows]`` advances, ``output_counts`` counts them.
    Returns ``(tokens [R, K + 1], num_accepted [R], known [R])``."""
    R, K = accept.shape
    dev = accept.device
    slot = torch.arange(K + 1, device=dev)[None, :]
    ok = (accept != 0) & (slot[:, :K] < num_drafts[:, None])
    n_acc = ok.long().cumprod(dim=1).sum(dim=1)
    tokens = torch.cat([input_ids[draft_idx], bonus[:, None]], dim=1)
    fallback = torch.cat([recovered, bonus[:, None]], dim=1)
    last = torch.where(n_acc < num_drafts, fallback.gather(1, n_acc[:, None])[:, 0], bonus)
    tokens = torch.where(slot == n_acc[:, None], last[:, None], tokens)
    first = positions.long() - num_drafts
    pos = first[:, None] + slot
    keep = pos < token_table.shape[1]
    rows2 = rows.long()[:, None].expand(-1, K + 1)
    token_table[rows2[keep], pos[keep]] = tokens[keep]
    num_computed[rows] = (first + n_acc).to(num_computed.dtype)
    if output_counts is not None:
        emitted = (slot <= n_acc[:, None]).to(output_counts.dtype)
        output_counts.index_put_((rows2, tokens), emitted, accumulate=True)
    return tokens, n_acc, first + n_acc + 1


def write_column(table, rows, cols, tokens) -> None:
    """``table[rows, cols] = tokens`` (``rows`` distinct), except where ``cols`` is past the
    table's last column. No data-dependent shape (no host sync on a GPU): such a row writes
    its last column's own value back."""
    last = table.shape[1] - 1
    keep = cols <= last
    cols = torch.where(keep, cols, last)
    table[rows, cols] = torch.where(keep, tokens, table[rows, cols])


def draft_sample_reference(logits, temperature, seeds, positions, draft_probs, rows, slot: int, table, known):
    """``kernels.draft_sample.draft_sample_triton`` in torch: the draft's argmax (every row
    greedy if ``draft_probs`` is None), else for rows with temperature > 0 a seeded draw
    from ``softmax(logits / T)``, whose distribution goes to ``draft_probs[rows, slot]``;
    the token goes to ``table[rows, known + slot]``."""
    x = logits.float()
    tok = x.argmax(dim=-1)
    if draft_probs is not None:
        hot = temperature > 0
        p = (x / torch.where(hot, temperature, torch.ones_like(temperature))[:, None]).softmax(dim=-1)
        draft_probs[rows[hot], slot] = p[hot]  # (only sampled rows write: a padded row may repeat a row)
        tok = torch.where(hot, exponential_race_reference(p, seeds ^ STREAM_DRAFT, positions), tok)
    write_column(table, rows, known.long() + slot, tok)
    return tok


def draft_step_inputs_reference(tokens, pos, block_table, capacity, block_size: int, max_position: int, out):
    """``kernels.draft_sample.draft_step_inputs_triton`` in torch."""
    positions, input_ids, seq_lens, slots = out
    page = (pos // block_size).clamp(max=block_table.shape[1] - 1)
    blk = block_table.gather(1, page[:, None])[:, 0].long()
    positions.copy_(pos)
    input_ids.copy_(tokens)
    seq_lens.copy_(pos + 1)
    slots.copy_(torch.where(pos < capacity, blk * block_size + pos % block_size, -1))
    pos.copy_((pos + 1).clamp(max=max_position))
