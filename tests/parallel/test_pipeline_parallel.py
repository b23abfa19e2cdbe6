"""Pipeline parallelism across simulated Ray nodes (``ray.cluster_utils.Cluster``, three
nodes of 2 CPUs each): stages land on distinct nodes and each TP group on one node (Ray's
state API); greedy tokens of PP=2, PP=2 x TP=2 and an uneven split under async scheduling
with the sync check in ``error`` mode equal one worker's, token for token; refused
combinations say which and why."""

from __future__ import annotations

import random

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from metadata.config import ConfigError, EngineConfig
from tests.checkpoints import hf_greedy
from workers.pipeline import stage_layers

MAX_NEW = 8
BLOCK = 8
COMMON = dict(
    block_size=BLOCK, max_model_len=128, max_num_batched_tokens=32, num_kv_blocks=64, worker_start_timeout_s=90.0
)


def _prompts() -> list[list[int]]:
    """A shared 2-block prefix (a prefix-cache hit for the later ones), a 45-token prompt
    (chunked prefill: steps that sample nothing), a one-token prompt."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 256) for _ in range(2 * BLOCK)]
    return [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (3, 9)] + [
        [rng.randrange(3, 256) for _ in range(n)] for n in (45, 1, 6)
    ]


PROMPTS = _prompts()
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def three_nodes():
    """A Ray cluster of three simulated nodes (the driver on the head), with the dashboard that
    serves Ray's state API (on a free port). A session-wide local Ray instance started by
    other tests is shut down first and restored afterwards."""
    import socket

    from ray.cluster_utils import Cluster

    was_local = ray.is_initialized()
    if was_local:
        ray.shutdown()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": True, "dashboard_port": port}
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if was_local:
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("llama", layers=4)


@pytest.fixture(scope="module")
def one_worker(three_nodes, model):
    return _run(model, PROMPTS)["tokens"]


def _run(model, prompts, rounds: int = 1, params=GREEDY, **options) -> dict:
    """Greedy tokens of ``rounds`` identical generate calls, with the workers' info, stats and
    nodes (from the state API), the prefix cache's stats and the last round's prompt logprobs."""
    llm = LLM(model=str(model), **COMMON, **options)
    try:
        tokens = None
        for _ in range(rounds):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            assert tokens is None or got == tokens  # a later round reads the cached prefixes
            tokens = got
        eng = llm.engine
        assert eng.dead is None, eng.dead
        ex = eng.executor
        stats = ray.get([w.stats.remote() for w in ex.workers], timeout=60)
        actor_nodes = _alive_worker_nodes(ray.get_runtime_context().gcs_address, {i["pid"] for i in ex.info})
        return {
            "tokens": tokens,
            "info": ex.info,
            "stats": stats,
            "actor_nodes": actor_nodes,
            "prefix": eng.scheduler.prefix_cache_stats(),
            "prompt_logprobs": [o.prompt_logprobs for o in outs],
        }
    finally:
        llm.shutdown()


def _alive_worker_nodes(address: str, pids: set[int]) -> dict[int, str]:
    """pid -> node id of each alive worker actor, as Ray's state API reports it."""
    from ray.util.state import list_actors

    actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    return {a.pid: a.node_id for a in actors if a.pid in pids and a.class_name.endswith("WorkerActor")}


def _by_stage(run: dict, tp: int) -> list[set[str]]:
    """Node ids of each stage's ranks, from the state API (ranks are stage * tp + tp_rank)."""
    nodes = [run["actor_nodes"][i["pid"]] for i in sorted(run["info"], key=lambda i: i["rank"])]
    assert len(nodes) == len(run["info"]), run
    return [set(nodes[s * tp : (s + 1) * tp]) for s in range(len(nodes) // tp)]


def test_pp2_stages_on_distinct_nodes_equal_one_worker(model, one_worker):
    run = _run(model, PROMPTS, pipeline_parallel_size=2)
    assert run["tokens"] == one_worker
    stages = _by_stage(run, tp=1)
    assert len(stages) == 2 and stages[0] != stages[1], stages  # one node per stage, distinct
    s0, s1 = run["stats"]
    assert (s0["pp_stage"], s0["pp_layers"], s1["pp_stage"], s1["pp_layers"]) == (0, [0, 2], 1, [2, 4])
    assert s0["num_layers"] == s1["num_layers"] == 2
    # every step's hidden states went 0 -> 1; every sampling step's tokens came back 1 -> 0
    assert s0["pp_sent_hidden"] == s1["pp_received_hidden"] > 0
    assert s1["pp_sent_tokens"] == s0["pp_received_tokens"] > 0
    assert s0["pp_received_hidden"] == s1["pp_sent_hidden"] == 0


def test_pp2_tp2_each_tp_group_on_one_node(model, one_worker):
    """Steps over 16 tokens also run as two overlapped micro-batches on every rank; prompt
    logprobs (the last stage's, gathered over its TP ranks) equal transformers'."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=2)
    run = _run(
        model, PROMPTS, params=params, pipeline_parallel_size=2, tensor_parallel_size=2, ubatch_token_threshold=16
    )
    assert run["tokens"] == one_worker
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for p, got in zip(PROMPTS, run["prompt_logprobs"]):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].log_softmax(-1)
        assert len(got) == len(p) and got[0] is None
        for i in range(1, len(p)):
            assert got[i][p[i]] == pytest.approx(float(ref[i - 1, p[i]]), abs=2e-4)
            assert set(ref[i - 1].topk(2).indices.tolist()) <= set(got[i])
    stages = _by_stage(run, tp=2)
    assert [len(s) for s in stages] == [1, 1], stages  # STRICT_PACK: a TP group shares a node
    assert stages[0] != stages[1], stages
    assert [s["pp_stage"] for s in run["stats"]] == [0, 0, 1, 1]
    assert all(s["tp_all_reduce"] == "gloo" for s in run["stats"])
    assert all(s["ubatched_steps"] > 0 for s in run["stats"]), run["stats"]


def test_uneven_split_async_sync_check_and_prefix_cache(model, one_worker):
    """Stage 0 runs 3 layers, stage 1 one; async scheduling keeps P + 2 plans queued; the sync
    check is armed in every step of every rank (a no-op for gloo on the CPU, but the same
    path); the second round hits the prefix cache the first filled."""
    run = _run(
        model,
        PROMPTS,
        rounds=2,
        pipeline_parallel_size=2,
        pipeline_layer_split=[3, 1],
        async_scheduling=True,
        sync_check="error",
    )
    assert run["tokens"] == one_worker
    assert [s["pp_layers"] for s in run["stats"]] == [[0, 3], [3, 4]]
    assert [s["num_layers"] for s in run["stats"]] == [3, 1]
    assert run["prefix"]["hits"] > 0, run["prefix"]


def test_tied_embeddings_last_stage_holds_its_own_head(three_nodes, ckpt_dir):
    """Qwen2 with tied embeddings, qkv bias, an odd vocabulary: stage 1 does not embed, so it
    loads the embedding into its own LM head; greedy tokens equal transformers'."""
    model = ckpt_dir("qwen2", layers=4, kv_heads=1, vocab_size=255, tie_word_embeddings=True)
    prompts = [[t % 255 for t in p[:12]] for p in PROMPTS[1:4]]
    run = _run(model, prompts, pipeline_parallel_size=2, pipeline_layer_split=[1, 3])
    assert run["tokens"] == hf_greedy(model, prompts, MAX_NEW)
    assert [s["num_layers"] for s in run["stats"]] == [1, 3]


def test_layer_split_must_fit_the_model(three_nodes, model):
    with pytest.raises(ConfigError, match=r"pipeline_layer_split \[2, 1\] .* model's 4 layers"):
        LLM(model=str(model), pipeline_parallel_size=2, pipeline_layer_split=[2, 1], **COMMON)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=5 exceeds the model's 4 layers"):
        LLM(model=str(model), pipeline_parallel_size=5, **COMMON)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(speculative_method="ngram"), "speculative_method='ngram' with pipeline_parallel_size=2 is not supported"),
        (dict(speculative_method="draft_model", speculative_model="/x"), "accepted count, which only the last stage"),
        (dict(pipeline_layer_split=[4]), r"pipeline_layer_split \[4\] has 1 entries; it needs one per pipeline stage"),
        (dict(pipeline_layer_split=[0, 4]), "every stage needs at least one layer"),
    ],
    ids=["ngram", "draft", "split-length", "split-empty-stage"],
)
def test_refused_combinations(options, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(pipeline_parallel_size=2, **options)


def test_stage_layers():
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert stage_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]  # earlier stages take the remainder
    assert stage_layers(4, 2, [1, 3]) == [(0, 1), (1, 4)]
    assert stage_layers(5, 1) == [(0, 5)]
