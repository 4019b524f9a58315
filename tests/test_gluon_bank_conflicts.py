"""The Gluon MLA kernels' shared-memory traffic of their dequant warps, counted without a GPU by
Triton's static bank-conflict model (``gl.bank_conflicts``, Triton >= 3.7): the codes read from the
raw slot and the float16 values stored into the ring (the MMAs' 128-byte swizzled tiles) take no
extra wavefront. The layout the kernels used before (16 codes per thread) is counted beside them,
so a conflict is seen when there is one."""

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from pcppass.engine.attention import gluon_kernels

pytestmark = pytest.mark.skipif(not hasattr(gl, "bank_conflicts"), reason="needs Triton's gl.bank_conflicts (>= 3.7)")

RING = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
PLAIN = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])


@gluon.jit
def _conflicts(OUT, CODES_L: gl.constexpr, RAW: gl.constexpr, RAW_WORDS: gl.constexpr, READ: gl.constexpr,
               STORE: gl.constexpr):
    """Compiles only if reading a tile's codes in ``CODES_L`` from ``RAW`` costs ``READ`` extra
    wavefronts per instruction and storing them converted into the float16 ring ``STORE``."""
    raw = gl.allocate_shared_memory(gl.int32, [64, RAW_WORDS], RAW)
    ring = gl.allocate_shared_memory(gl.float16, [64, 128], RING)
    words = gl.zeros([64, RAW_WORDS], gl.int32, CODES_L)
    halves = gluon_kernels._scaled_codes(gl.zeros([64, 32], gl.int32, CODES_L), gl.zeros([64, 1], gl.int32, CODES_L))
    gl.static_assert(gl.bank_conflicts(words.type, raw.type) == READ)
    gl.static_assert(gl.bank_conflicts(halves.type, ring.type) == STORE)


def compiles(codes_l, raw, raw_words: int, read: int, store: int, warps: int) -> bool:
    """Whether :func:`_conflicts` compiles for sm_90 with these counts (a failed ``static_assert``
    is a compilation error; any other error is raised)."""
    src = GluonASTSource(_conflicts, {"OUT": "*i32"},
                         {(1,): codes_l, (2,): raw, (3,): raw_words, (4,): read, (5,): store}, {})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    except Exception as err:
        if "static_assert" not in str(err) and "Static assertion" not in str(err):
            raise
        return False
    return True


@pytest.mark.parametrize("warps", [8, 4], ids=["dense (8 dequant warps)", "sparse (4)"])
def test_codes_are_read_and_stored_without_bank_conflicts(warps):
    codes_l = gluon_kernels.codes_layout(warps)
    # the dense kernel's raw slot (TMA boxes of one 128-dim chunk, 128-byte swizzle) and the
    # sparse kernel's (cp.async rows of 512 bytes)
    assert compiles(codes_l, gluon_kernels.RAW_CODES_SL.value, 32, 0, 0, warps)
    assert compiles(codes_l, PLAIN, 128, 0, 0, warps)


def test_the_former_layout_stores_two_way_conflicted():
    former = gl.BlockedLayout([1, 4], [4, 8], [8, 1], [1, 0])
    assert compiles(former, PLAIN, 128, 0, 1, 8)
    assert not compiles(former, PLAIN, 128, 0, 0, 8)
