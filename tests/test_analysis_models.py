"""Every cache write of the reference models is found and covered, tiny and full widths.

Full-width models are traced on the meta device (no weights), with the row count dynamic.
The expected writes come from the model contract: every cache in ``cache_specs()`` is written
exactly once per step, by a covered write whose bytes per row times the group's block size is the
cache's bytes per block.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pcppass.analysis import find_state_writes
from pcppass.analysis.trace import capture_graph
from pcppass.cli.targets import load_target

#: writes per layer by op, per model (the families the brief requires in each model)
OPS_PER_LAYER = {
    "llama": {"pcppass::reshape_and_cache_flash": 2},
    "deepseek_v2": {"pcppass::concat_and_cache_mla": 1},
    "deepseek_v32": {"pcppass::fused_norm_rope": 2},
}

#: ops whose patterns declare the values stored per row, so the audit checks their bytes per row
CHECKED_OPS = {
    "llama": {"pcppass::reshape_and_cache_flash"},
    "deepseek_v4": {"pcppass::swa_qnorm_rope_kv_insert", "pcppass::compressor_save_state"},
}

CASES = [
    ("llama", "tiny", {}), ("llama", "full", {"kv_cache_dtype": "fp8"}),
    ("deepseek_v2", "tiny", {}), ("deepseek_v2", "full", {"kv_cache_dtype": "fp8_ds_mla"}),
    ("deepseek_v32", "tiny", {}), ("deepseek_v32", "full", {}),
    ("deepseek_v4", "tiny", {}), ("deepseek_v4", "full", {}),
]


@pytest.mark.parametrize("name,size,overrides", CASES, ids=[f"{n}-{s}" for n, s, _ in CASES])
def test_reference_model_writes_all_covered(name, size, overrides):
    device = "meta" if size == "full" else "cpu"
    model, inputs = load_target(name, size, device=device, **overrides)
    gm = capture_graph(model, inputs)
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt)
               for n in gm.graph.nodes if n.op == "placeholder"), "row count specialised"
    writes = find_state_writes(gm)
    assert [w.describe() for w in writes if not w.covered] == []

    specs = {s.name: s for s in model.cache_specs()}
    groups = {g.name: g for g in model.cache_groups()}
    written = Counter(w.state for w in writes)
    assert written == Counter({f"L['caches'][{n!r}]": 1 for n in specs})
    for w in writes:
        spec = specs[w.state.split("['caches'][")[1][1:-2]]
        assert w.bytes_per_row * groups[spec.group].block_size == spec.bytes_per_block(), w.describe()
        assert w.layout.block_size == groups[spec.group].block_size
        # the row the op writes (declared values, in the cache dtype) is the row the layout copies
        assert w.written_bytes_per_row in (None, w.bytes_per_row), w.describe()
    checked = {w.op for w in writes if w.written_bytes_per_row is not None}
    assert checked == CHECKED_OPS.get(name, set())

    if name in OPS_PER_LAYER:
        layers = model.config.num_layers if hasattr(model, "config") else len(model.layers)
        assert Counter(w.op for w in writes) == Counter(
            {op: n * layers for op, n in OPS_PER_LAYER[name].items()})
    else:
        ops = Counter(w.op for w in writes)
        assert set(ops) == {"pcppass::swa_qnorm_rope_kv_insert", "pcppass::compressor_save_state",
                            "pcppass::compressor_compress_store"}
        assert ops["pcppass::swa_qnorm_rope_kv_insert"] == len(model.layers)


def test_deepseek_full_width_row_bytes_match_the_brief():
    """656 B fp8_ds_mla rows and 132 B block-split indexer rows (DeepSeek sizes)."""
    model, inputs = load_target("deepseek_v32", "full", device="meta", kv_cache_dtype="fp8_ds_mla")
    writes = find_state_writes(capture_graph(model, inputs))
    by_arg = {w.arg: w for w in writes}
    assert by_arg["mla_kv_cache"].bytes_per_row == 656
    assert by_arg["indexer_k_cache"].bytes_per_row == 132
    assert by_arg["indexer_k_cache"].layout.kind == "block_split"
    bs = by_arg["indexer_k_cache"].layout.block_size
    assert by_arg["indexer_k_cache"].layout.segments == ((0, 128, 128), (bs * 128, 4, 4))
