"""The engine's output side: detokenize what a step added, find stop strings, build deltas.

It runs after ``Scheduler.update_from_result`` has applied the step's result (tokens
appended, EOS / stop-token / length finishes, blocks committed or freed) and, under
async scheduling, after the next plan has been sent: nothing here is on the path
from a result to the next plan. A stop string it finds finishes the request through
``Scheduler.finish_at_stop_string``; one more step may already be in flight for it,
whose tokens are dropped when they arrive.
"""

from __future__ import annotations

from cluster.detokenizer import IncrementalDetokenizer, TokenTexts, find_stop
from cluster.outputs import CompletionOutput, RequestMetrics, RequestOutput, StreamDelta
from cluster.request import Request
from cluster.scheduler import Scheduler, StepUpdate


class OutputProcessor:
    """Per-sequence detokenizers and the text side of finishing (stop strings, streaming)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.detok: dict[str, IncrementalDetokenizer] = {}
        # characters of text a sequence holds back while streaming: what could still turn out
        # to start one of its stop strings
        self._hold: dict[str, int] = {}
        # decodes shared by every sequence (per skip_special_tokens), made on first use
        self._texts: dict[bool, TokenTexts] = {}

    def add(self, req: Request) -> None:
        skip = req.params.skip_special_tokens
        texts = self._texts.get(bool(skip))
        if texts is None:
            texts = self._texts[bool(skip)] = TokenTexts(self.tokenizer, bool(skip))
        self.detok[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, skip, texts)
        self._hold[req.request_id] = max((len(s) - 1 for s in req.params.stop or ()), default=0)

    def release(self, req: Request) -> None:
        self.detok.pop(req.request_id, None)
        self._hold.pop(req.request_id, None)

    def process(self, update: StepUpdate, scheduler: Scheduler) -> list[StreamDelta]:
        """One delta per sequence that gained tokens. Tokens past a stop string are dropped
        from the request (``update.num_new_tokens`` is reduced by them)."""
        deltas = []
        for seq in update.sequences:
            req = seq.req
            params = req.params
            detok = self.detok[req.request_id]
            tokens, lps = seq.token_ids, seq.logprobs
            reason = stop_reason = None
            if not tokens:  # (finished on a token it dropped: a constraint's dead end)
                reason, stop_reason = seq.finish_reason, seq.stop_reason
            last = len(tokens) - 1
            stops = params.stop
            for i, tok in enumerate(tokens):
                if i == last:
                    reason, stop_reason = seq.finish_reason, seq.stop_reason
                if reason == "stop" and not params.include_stop_str_in_output:
                    new = detok.flush()  # a stop token (EOS or stop_token_ids) adds no text (as vLLM)
                else:
                    new = detok.add(tok, final=reason is not None)
                if stops and seq.start + i + 1 >= params.min_tokens:
                    # (the text a stop string could overlap: the new characters and a stop's length before)
                    lo = max(0, detok.length - len(new) - self._hold[req.request_id])  # (longest stop - 1)
                    hit = find_stop(detok.since(lo), len(new), stops)
                    if hit is not None:
                        pos, s = hit
                        pos += lo
                        detok.truncate(pos + len(s) if params.include_stop_str_in_output else pos)
                        reason, stop_reason = "stop", s
                        update.num_new_tokens -= scheduler.finish_at_stop_string(req, seq.start + i + 1, s)
                        if i < last:
                            tokens = tokens[: i + 1]
                            lps = lps[: i + 1] if lps else lps
                        break
            hold = 0 if reason is not None else self._hold[req.request_id]
            upto = max(req.emitted_chars, detok.length - hold)
            text = detok.since(req.emitted_chars)[: upto - req.emitted_chars]
            req.emitted_chars = upto
            delta = StreamDelta(req.parent_id, req.index, list(tokens), text, lps or None, reason, stop_reason)
            if seq.start == 0:  # (complete by the first token: the last prompt chunk's step sampled it)
                delta.prompt_logprobs = req.prompt_logprobs
            deltas.append(delta)
        return deltas

    def request_output(self, request_id: str, reqs: list[Request]) -> RequestOutput:
        """The whole output of a request group so far."""
        first = reqs[0]
        return RequestOutput(
            request_id=request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=r.index,
                    text=self.detok[r.request_id].text,
                    token_ids=list(r.output_token_ids),
                    cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                    logprobs=r.logprobs,
                    finish_reason=r.finish_reason,
                    stop_reason=r.stop_reason,
                )
                for r in reqs
            ],
            finished=all(r.finished for r in reqs),
            metrics=RequestMetrics(
                first.arrival, first.first_token_time, first.last_token_time, sum(r.num_preemptions for r in reqs)
            ),
            prompt_logprobs=first.prompt_logprobs,
        )
