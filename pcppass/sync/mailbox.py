"""The layout of a peer-store mailbox, shared by the host code (:mod:`.peer`, :mod:`.row_kernels`)
and the Triton kernels (:mod:`.row_kernels_triton`), which must not import the host module that
loads them."""

#: bytes before a mailbox's data: one int64 epoch flag per rank (written by that rank)
MAILBOX_FLAGS = 256
