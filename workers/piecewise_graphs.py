"""Piecewise CUDA graphs for the steps the decode graphs do not cover.

Prefill, mixed prefill+decode and speculative steps with uneven draft counts have
per-step attention shapes (query lengths, split counts sized from upper bounds), so
they cannot replay one whole-model graph. Everything *between* two attention calls
depends only on the token count, though: the embedding and the first QKV projection,
each layer's o_proj + norm + MLP + the next layer's norm + QKV, the last MLP and the
final norm. Those ``num_layers + 1`` segments are captured once per token bucket and
replayed around eager attention launches.

Why it matters: an eager forward enqueues thousands of small kernels, more than the
device's launch queue holds (about 1,000 entries on a Hopper GPU), so a step launched
behind a busy device *waits for it* in the launch call. Piecewise, a step costs about
``num_layers + 1`` graph launches plus a few attention launches a layer.

Tokens past the real count are padding: every captured op is row-wise, so padded rows
only compute garbage that nothing reads; attention runs on the real rows only.
"""

from __future__ import annotations

import logging

import torch

from kernels import pdl

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts to capture: fine steps at small sizes (where padding costs the
    most relative to the work), coarser above."""
    sizes = [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    b = 3072
    while sizes[-1] < max_tokens:
        sizes.append(b)
        b = b + b // 2 if b < 8192 else b * 2
    out = [s for s in sizes if s < max_tokens]
    return out + [max_tokens]


class PiecewiseGraphs:
    """Replaces ``model(input_ids, positions, meta, kv_caches)`` for steps of up to
    ``max_tokens`` tokens: ``forward`` has the model's signature and result."""

    def __init__(self, model, max_tokens: int, device: torch.device, pool=None):
        self.model = model
        self.layers = list(model.layers)
        self.buckets = token_buckets(max_tokens)
        t = self.buckets[-1]
        attn = self.layers[0].self_attn
        qkv_width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
        hidden = model.arch.hidden_size
        dtype = model.norm.weight.dtype
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(t, qkv_width, dtype=dtype, device=device)
        self.residual = torch.zeros(t, hidden, dtype=dtype, device=device)
        self.attn_out = torch.zeros(t, attn.num_heads * attn.head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(t, hidden, dtype=dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = pool  # shared with the decode graphs: one step replays one kind at a time
        self.replays = 0

    # ------------------------------------------------------------- segments
    def _segment(self, i: int, t: int) -> None:
        """Segment ``i`` at ``t`` tokens: reads the static inputs, writes the static outputs."""
        layers = self.layers
        with pdl.step_tokens(t):
            if i == 0:
                h, residual = self.model.embed_tokens(self.input_ids[:t]), None
            else:
                nxt = layers[i] if i < len(layers) else None
                h, residual = layers[i - 1].post_attention(self.attn_out[:t], self.residual[:t], nxt)
            if i < len(layers):
                qkv, residual = layers[i].pre_attention(h, residual)
                self.qkv[:t].copy_(qkv)
                self.residual[:t].copy_(residual)
            else:
                out, _ = self.model.norm(h, residual)
                self.hidden[:t].copy_(out)

    @torch.inference_mode()
    def capture(self) -> None:
        n = len(self.layers) + 1
        for t in reversed(self.buckets):  # largest first: the pool is sized once
            for i in range(n):
                self._segment(i, t)  # warm-up: compiles this shape's kernels outside capture
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._segment(i, t)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(t, i)] = g
        torch.cuda.synchronize()
        logger.info(
            "captured %d piecewise CUDA graphs (%d segments x token buckets %s)", len(self.graphs), n, self.buckets
        )

    # ---------------------------------------------------------------- replay
    def fits(self, num_tokens: int) -> bool:
        return bool(self.graphs) and num_tokens <= self.buckets[-1]

    def forward(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        """The model's forward, piecewise: hidden states of the real tokens ``[T, H]``."""
        t_real = input_ids.shape[0]
        t = next(b for b in self.buckets if b >= t_real)
        self.input_ids[:t_real].copy_(input_ids)
        cos_sin = self.model.cos_sin
        graphs = self.graphs
        graphs[(t, 0)].replay()
        with pdl.step_tokens(t_real):
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                # attention writes straight into the next segment's static input (no copy)
                layer.self_attn.attend_core(self.qkv[:t_real], positions, meta, kv, cos_sin, out=self.attn_out[:t_real])
                graphs[(t, i + 1)].replay()
        self.replays += 1
        return self.hidden[:t_real]
