"""The offline API, vLLM-compatible: ``LLM(model=DIR, **options).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from cluster.engine import EngineCore
from cluster.outputs import RequestOutput
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams


class LLM:
    """Runs an engine in the calling process (workers in Ray actors)."""

    def __init__(self, model: str | None = None, **options: Any):
        self.config = EngineConfig.from_options(model=model, **options)
        self.engine = EngineCore(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        # Validate everything before anything runs: one bad prompt fails the call, cleanly.
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, p, sp in zip(ids, prompts, params):
                self.engine.add_request(rid, p, sp)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
                self.engine.release(rid)
            raise
        pending = set(ids)
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True)
        results: dict[str, RequestOutput] = {}
        try:
            while pending:
                deltas = self.engine.step()
                if not deltas and not self.engine.has_unfinished():
                    break
                for d in deltas:
                    if d.finish_reason and d.request_id in pending:
                        out = self.engine.output(d.request_id)
                        if out.finished:
                            results[d.request_id] = out
                            pending.discard(d.request_id)
                            self.engine.release(d.request_id)
                            if bar:
                                bar.update(1)
        finally:
            if bar:
                bar.close()
        if self.engine.dead:
            from cluster.executor import EngineDeadError

            raise EngineDeadError(f"the engine failed during generate(): {self.engine.dead}")
        if pending:
            raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished")
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
