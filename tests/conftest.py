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
def vllm_moe_dirs(tmp_path_factory):
    """Tiny random MoE models (Qwen3-MoE, Mixtral, DeepSeek-V2 with MoE everywhere): {name: dir}."""
    from vllm_cases import MOE_BUILDERS

    root = tmp_path_factory.mktemp("vllm_moe_models")
    return {name: build(root / name) for name, build in MOE_BUILDERS.items()}


@pytest.fixture(scope="session")
def vllm_hybrid_dirs(tmp_path_factory):
    """Tiny random hybrid models (recurrent-state layers beside attention): {name: dir}."""
    from vllm_cases import HYBRID_BUILDERS

    root = tmp_path_factory.mktemp("vllm_hybrid_models")
    return {name: build(root / name) for name, build in HYBRID_BUILDERS.items()}


@pytest.fixture(scope="session")
def vllm_references(vllm_model_dirs, vllm_moe_dirs, vllm_hybrid_dirs):
    """vLLM's own ``LLM.generate`` (its default compile; prefix caching off for the hybrids) on
    every model the job shards, then one ``LLM`` under pcppass's backend with an attention backend
    that stores K/V inside the attention op (``test_vllm_backends``), all in one process started
    at once in the background: a test that takes this fixture early overlaps them with its work."""
    from vllm_cases import HYBRID_ENGINE_ARGS, HYBRID_SHARDED, BackgroundReferences
    from vllm_sharding import KV_IN_FORWARD

    runs = {name: {"model_dir": str(path), "backend": "default"}
            for name, path in (*vllm_model_dirs.items(), *vllm_moe_dirs.items())}
    runs.update({name: {"model_dir": str(vllm_hybrid_dirs[name]), "backend": "default",
                        "engine_args": HYBRID_ENGINE_ARGS[name]} for name in HYBRID_SHARDED})
    # last: neither the backend override nor pcppass's backend is undone in that process
    runs[KV_IN_FORWARD] = {"model_dir": str(vllm_model_dirs["llama"]), "backend": "pcppass",
                           "register": [KV_IN_FORWARD]}
    references = BackgroundReferences(runs)
    yield references
    references.stop()


@pytest.fixture(scope="session")
def vllm_reference_tokens(vllm_references):
    """The tokens of :func:`vllm_references`' runs of vLLM's own ``LLM.generate``, by model."""
    return vllm_references.tokens()


@pytest.fixture(scope="session")
def vllm_all_dirs(vllm_model_dirs, vllm_moe_dirs, vllm_hybrid_dirs):
    return {name: str(path) for dirs in (vllm_model_dirs, vllm_moe_dirs, vllm_hybrid_dirs)
            for name, path in dirs.items()}


@pytest.fixture(scope="session")
def vllm_sharded_two(vllm_all_dirs, vllm_references):
    """Every P=2 case of the job (``vllm_sharding.TWO_RANKS``) in one launch: ``{key: [by rank]}``.
    Takes ``vllm_references`` so that vLLM's own runs go on beside these."""
    from vllm_sharding import TWO_RANKS, run_all

    return run_all(2, TWO_RANKS, vllm_all_dirs, layername=True)


@pytest.fixture(scope="session")
def vllm_sharded_four(vllm_all_dirs, vllm_references):
    """Every P=4 case of the job (``vllm_sharding.FOUR_RANKS``) in one launch, layer names as strings."""
    from vllm_sharding import FOUR_RANKS, run_all

    return run_all(4, FOUR_RANKS, vllm_all_dirs, layername=False)
