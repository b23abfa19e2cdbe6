"""Driver-side speculative decoding: how many drafts a decode row carries.

The scheduler counts every draft as a future token (``num_placeholders``) and
as KV it will hold (``num_computed_tokens``): the optimistic outcome, an upper
bound. When the step's result arrives ``Scheduler.update_from_result`` subtracts the
rejected drafts again; their KV slots stay with the request and are overwritten by its next
tokens (block tables are positional), so nothing leaks.
"""

from __future__ import annotations

from cluster.request import Request
from metadata.config import EngineConfig


def speculation_eligible(req: Request) -> bool:
    """Penalties, logit bias, allowed / banned ids, constraints, min_tokens masking and logprobs
    are computed per sampled position by the plain sampler; requests that use them decode without
    drafts (same outputs, no speedup)."""
    o = req.options
    if o.num_logprobs >= 0 or o.logit_bias_ids or o.allowed_token_ids or o.banned_token_ids:
        return False
    if req.grammar is not None:
        return False
    if o.repetition_penalty != 1.0 or o.presence_penalty or o.frequency_penalty:
        return False
    return not (o.min_tokens > 0 and req.num_outputs_upper < o.min_tokens)


class DraftPlanner:
    def __init__(self, cfg: EngineConfig, max_model_len: int):
        sp = cfg.speculative
        self.enabled = sp.speculative_method != "off"
        self.k = sp.num_speculative_tokens
        self.host_ngram = sp.speculative_method == "ngram_host"
        self.n_min, self.n_max = sp.prompt_lookup_min, sp.prompt_lookup_max
        self.max_model_len = max_model_len
        # the draft model writes its own lookahead KV up to k - 1 positions past the row's bound
        self.kv_lookahead = self.k if sp.speculative_method == "draft_model" else 0

    def num_drafts(self, req: Request, budget: int) -> int:
        """Drafts for a decode row that samples this step (0: plain decoding)."""
        if not self.enabled or not speculation_eligible(req):
            return 0
        k = min(
            self.k,
            budget - 1,
            req.max_tokens - req.num_outputs_upper - 1,  # no drafts past max_tokens
            self.max_model_len - req.num_tokens_upper - 1,  # nor past max_model_len
        )
        if k > 0 and self.host_ngram:
            return len(self.host_drafts(req, k))
        return max(k, 0)

    def host_drafts(self, req: Request, k: int) -> list[int]:
        """Prompt lookup on the exact token list (synchronous scheduling only)."""
        if req.num_placeholders:
            return []  # tokens in flight: the exact list is not known yet
        return ngram_lookup(req.prompt_token_ids + req.output_token_ids, k, self.n_min, self.n_max)

    def alloc_tokens(self, req: Request, target: int) -> int:
        """KV positions to allocate for a row reaching ``target`` tokens (with draft lookahead)."""
        return min(target + self.kv_lookahead, self.max_model_len + 1) if self.kv_lookahead else target


def ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Continue the latest earlier occurrence of the last ``n`` tokens (longest ``n`` first)."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                cont = tokens[start + n : start + n + k]
                if cont:
                    return cont
    return []
