"""The driver: scheduling, KV block management, the step loop, the offline and serving APIs."""

from metadata.sampling_params import SamplingParams


def __getattr__(name):
    if name == "LLM":
        from cluster.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
