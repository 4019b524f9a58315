"""Full-width configs declare the production cache layouts (built on the meta device: no weights)."""

from __future__ import annotations

import pytest
import torch

from pcppass.models import MODEL_NAMES, build_model, model_config
from pcppass.models.deepseek_v2 import DeepseekV2Model
from pcppass.models.deepseek_v4 import DeepseekV4Model
from pcppass.models.deepseek_v32 import DeepseekV32Model
from pcppass.models.llama import LlamaModel


def _meta(model_cls, name, **overrides):
    with torch.device("meta"):
        return model_cls(model_config(name, "full", **overrides))


def _specs(model) -> dict:
    return {s.name: s for s in model.cache_specs()}


def test_full_llama_fp8_cache():
    specs = _specs(_meta(LlamaModel, "llama", kv_cache_dtype="fp8"))
    assert specs["layers.0.key"].block_shape == (64, 8, 128)
    assert specs["layers.1.value"].dtype == torch.float8_e4m3fn


def test_full_deepseek_v2_ds_mla_row_is_656_bytes():
    specs = _specs(_meta(DeepseekV2Model, "deepseek_v2", kv_cache_dtype="fp8_ds_mla"))
    assert specs["layers.0.kv"].block_shape == (64, 656) and specs["layers.0.kv"].dtype == torch.uint8
    specs = _specs(_meta(DeepseekV2Model, "deepseek_v2"))
    assert specs["layers.0.kv"].block_shape == (64, 576) and specs["layers.0.kv"].dtype == torch.bfloat16


def test_full_deepseek_v32_caches_and_groups():
    model = _meta(DeepseekV32Model, "deepseek_v32")
    specs = _specs(model)
    assert specs["layers.0.kv"].block_shape == (64, 656)
    assert specs["layers.0.indexer_k"].block_shape == (64 * 132,)  # block-split: 128 e4m3 + 1 fp32 per token
    assert {g.name for g in model.cache_groups()} == {"mla", "indexer"}


def test_full_deepseek_v4_caches_and_groups():
    model = _meta(DeepseekV4Model, "deepseek_v4")
    specs = _specs(model)
    assert specs["layers.0.swa_kv"].block_shape == (64, 512)
    assert specs["layers.0.compressor_state"].block_shape == (4, 2 * 2 * 512)  # C4: overlap, fp32
    assert specs["layers.0.indexer_state"].block_shape == (4, 2 * 2 * 128)
    assert specs["layers.0.indexer_k"].block_shape == (64 * 132,)
    assert specs["layers.1.compressor_state"].block_shape == (8, 2 * 512)  # C128: no overlap
    assert "layers.1.indexer_k" not in specs
    groups = {g.name: g for g in model.cache_groups()}
    assert (groups["swa"].addressing, groups["swa"].window) == ("ring", 128)
    assert (groups["c4_state"].addressing, groups["c4_state"].window) == ("ring", 8)
    assert (groups["c128_state"].addressing, groups["c128_state"].window) == ("ring", 128)
    assert (groups["c4"].addressing, groups["c4"].ratio) == ("compressed", 4)
    assert (groups["c128"].addressing, groups["c128"].ratio) == ("compressed", 128)
    assert all(s.group in groups for s in specs.values())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_cache_spec_names_a_declared_group(name):
    model = build_model(name, "tiny")
    groups = {g.name for g in model.cache_groups()}
    specs = model.cache_specs()
    assert len({s.name for s in specs}) == len(specs)
    assert all(s.group in groups for s in specs)


def test_unknown_option_is_rejected():
    with pytest.raises(TypeError, match="no option"):
        build_model("llama", kv_cache_typo="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_model("llama", kv_cache_dtype="fp4")
