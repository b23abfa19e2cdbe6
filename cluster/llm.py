"""The offline API, vLLM-compatible: ``LLM(model=DIR_OR_GGUF, **options).generate(prompts, params)``
and ``.chat(messages, params)``; ``LLM()`` serves the embedded default (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import itertools
import os
from typing import Any, Sequence

import msgspec

from cluster.engine import EngineCore
from cluster.generation_config import GenerationDefaults, load_generation_defaults
from cluster.model_source import default_model_path
from cluster.outputs import RequestOutput
from metadata.config import EngineConfig
from metadata.sampling_params import SamplingParams


class LLM:
    """Runs an engine in the calling process (workers in Ray actors)."""

    def __init__(self, model: str | os.PathLike | None = None, **options: Any):
        if isinstance(model, os.PathLike):  # (a pathlib.Path, as users of transformers pass)
            model = os.fspath(model)
        self.config = EngineConfig.from_options(model=model, **options)
        self.data_parallel = None  # replica actors when data_parallel_size > 1 (cluster.dp_offline)
        if self.config.parallel.data_parallel_size > 1:
            from cluster.dp_offline import OfflineDataParallel

            self.engine = None
            self.data_parallel = OfflineDataParallel(self.config)
        else:
            self.engine = EngineCore(self.config)
        self._ids = itertools.count()
        self._generation: GenerationDefaults | None = None

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request runs with when no sampling params are given: the engine's defaults,
        those the model's ``generation_config.json`` names in their place (as in vLLM;
        ``generation_config='vllm'``: the engine's own)."""
        if self._generation is None:
            if self.engine is not None:
                self._generation = self.engine.generation
            else:
                path = self.config.model.model or default_model_path()
                self._generation = load_generation_defaults(self.config, path)
        return self._generation.params()

    def get_tokenizer(self):
        if self.data_parallel is not None:
            return self.data_parallel.tokenizer
        return self.engine.tokenizer

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` messages) or a list of them,
        each rendered with the tokenizer's chat template (or ``chat_template``) and generated
        as ``generate`` does; one output per conversation."""
        if not messages:
            raise ValueError("chat() needs at least one message")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template=")
        prompts = []
        for conv in convs:
            if not conv or not all(isinstance(m, dict) for m in conv):
                raise ValueError("each conversation must be a non-empty list of message dicts")
            text = tok.apply_chat_template(
                list(conv),
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            # the template writes the special tokens itself (as vLLM: no BOS added again)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """``priority``: one scheduling priority a prompt (lower first; the engine must run with
        ``scheduling_policy='priority'``), as vLLM takes it."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
            params = [msgspec.structs.replace(sp, priority=p) for sp, p in zip(params, priority)]
        if self.data_parallel is not None:
            return self.data_parallel.generate(prompts, params, use_tqdm)
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
        tokens_in = tokens_out = 0
        try:
            while pending:
                deltas = self.engine.step()
                if not deltas and not self.engine.has_unfinished():
                    break
                tokens_out += sum(len(d.token_ids) for d in deltas)
                for d in deltas:
                    if d.finish_reason and d.request_id in pending:
                        out = self.engine.output(d.request_id)
                        if out.finished:
                            results[d.request_id] = out
                            pending.discard(d.request_id)
                            self.engine.release(d.request_id)
                            if bar:
                                tokens_in += len(out.prompt_token_ids)
                                _show_speed(bar, tokens_in, tokens_out)
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
        if self.data_parallel is not None:
            self.data_parallel.shutdown()
        if self.engine is not None:
            self.engine.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _show_speed(bar, tokens_in: int, tokens_out: int) -> None:
    """vLLM's offline progress postfix: prompt and output tokens per second so far."""
    elapsed = bar.format_dict.get("elapsed") or 0.0
    if elapsed > 0:
        bar.set_postfix_str(
            f"est. speed input: {tokens_in / elapsed:.2f} toks/s, output: {tokens_out / elapsed:.2f} toks/s",
            refresh=False,
        )
