import json
import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# helper modules whose asserts are the tests' checks: rewritten as in a test module
pytest.register_assert_rewrite(
    "tests.sim_worker", "tests.benchmark_results", "tests.serve_helpers", "tests.greedy_close"
)
pytest_plugins = ["tests.serve_helpers"]  # the serving tests' server fixtures


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """One real local Ray instance for the whole session."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_gpu():
    """A local Ray instance with the GPU, per GPU test module."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """Factory: a cached tiny checkpoint per (arch, options)."""
    from tests.checkpoints import write_checkpoint

    cache = {}

    def make(arch="llama", **kw):
        key = (arch, json.dumps(kw, sort_keys=True))
        if key not in cache:
            cache[key] = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, **kw)
        return cache[key]

    return make


# fixtures that shut the session's local Ray instance down to start a simulated cluster (and
# restore it after): anything joined to the local instance meanwhile would lose it
_RAY_RESTARTING_FIXTURES = {"three_nodes"}


def pytest_collection_modifyitems(config, items):
    """Run the tests on a simulated multi-node cluster first, whatever order the command line
    gives: the serving tests' session server joins the local Ray instance, which those
    fixtures restart. The sort is stable: every other test keeps its order."""
    items.sort(key=lambda item: 0 if _RAY_RESTARTING_FIXTURES & set(getattr(item, "fixturenames", ())) else 1)


def pytest_collection_finish(session):
    """Start the interpreted kernel tests' child pytest in the background now
    (``tests/interpreted.py``), so that it runs beside the rest of the session."""
    if not session.config.option.collectonly:
        from tests.interpreted import start_child

        start_child(session.items)
