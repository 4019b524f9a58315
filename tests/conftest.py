"""Test collection and fixtures shared by test modules."""

import importlib.util

import pytest

# tests/test_vllm_*.py run in the vLLM job of .ci/run, whose own venv has vLLM installed (an
# install failure fails that job, and a run that collects no test fails too); an environment
# without vLLM does not collect them.
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_vllm_*.py"]


@pytest.fixture(scope="session", autouse=True)
def cpu_ranks_on_gloo():
    """Ranks that :func:`pcppass.engine.launch.launch` starts without a backend run gloo, also on a
    GPU host: the tests hand CPU tensors to their collectives, which NCCL (the default where CUDA
    is available) cannot carry. The GPU tests name ``backend="nccl"``."""
    import pcppass.engine.launch

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pcppass.engine.launch, "default_backend", lambda device=None: "gloo")
        yield


@pytest.fixture(scope="session")
def vllm_model_dirs(tmp_path_factory):
    """The vLLM job's tiny random models, built once per session: {name: directory}."""
    from vllm_cases import BUILDERS

    root = tmp_path_factory.mktemp("vllm_models")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="session")
def vllm_reference_tokens(vllm_model_dirs):
    """vLLM's own ``LLM.generate`` (its default compile) on the test prompts, both models at once."""
    from vllm_cases import finish_worker, start_worker

    procs = {name: start_worker("generate", path, backend="default") for name, path in vllm_model_dirs.items()}
    return {name: finish_worker(proc)["tokens"] for name, proc in procs.items()}


@pytest.fixture(scope="session")
def vllm_moe_dirs(tmp_path_factory):
    """Tiny random MoE models (Qwen3-MoE, Mixtral, DeepSeek-V2 with MoE everywhere): {name: dir}."""
    from vllm_cases import MOE_BUILDERS

    root = tmp_path_factory.mktemp("vllm_moe_models")
    return {name: build(root / name) for name, build in MOE_BUILDERS.items()}


@pytest.fixture(scope="session")
def vllm_moe_reference_tokens(vllm_moe_dirs):
    """vLLM's own ``LLM.generate`` on the MoE models (its default compile, its CPU MoE path)."""
    from vllm_cases import finish_worker, start_worker

    procs = {name: start_worker("generate", path, backend="default") for name, path in vllm_moe_dirs.items()}
    return {name: finish_worker(proc)["tokens"] for name, proc in procs.items()}


@pytest.fixture(scope="session")
def vllm_hybrid_dirs(tmp_path_factory):
    """Tiny random hybrid models (recurrent-state layers beside attention): {name: dir}."""
    from vllm_cases import HYBRID_BUILDERS

    root = tmp_path_factory.mktemp("vllm_hybrid_models")
    return {name: build(root / name) for name, build in HYBRID_BUILDERS.items()}


@pytest.fixture(scope="session")
def vllm_hybrid_references(vllm_hybrid_dirs):
    """vLLM's own ``LLM.generate`` (its default compile and engine, prefix caching off) on the
    hybrids the tests shard, started at once in the background: ``.tokens()`` waits for them, so
    a test that takes this fixture early overlaps them with its own work."""
    from vllm_cases import HYBRID_ENGINE_ARGS, HYBRID_SHARDED, BackgroundReferences, start_worker

    references = BackgroundReferences({
        name: start_worker("generate", vllm_hybrid_dirs[name], backend="default", engine_args=HYBRID_ENGINE_ARGS[name])
        for name in HYBRID_SHARDED})
    yield references
    references.stop()
