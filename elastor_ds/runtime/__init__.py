"""Framework-neutral heterogeneous runtime pieces: group derivation from a layout, split all-reduce
plans and cross-width p2p pairing (pure); the collectives that execute them live in
:mod:`elastor_ds.comm.hetero`, the DeepSpeed adapter in :mod:`elastor_ds.integrations.deepspeed.hetero`."""
from .groups import (Cell, creation_order, layout_held, needs_hetero, reduce_groups, replica_groups, replica_of, split_reduce_bytes,
                     split_reduce_plan, stage_groups, uniform_dp_bytes)
from .p2p import recv_source, send_targets

__all__ = ["Cell", "creation_order", "layout_held", "needs_hetero", "reduce_groups", "replica_groups", "replica_of",
           "split_reduce_bytes", "split_reduce_plan", "stage_groups", "uniform_dp_bytes", "recv_source",
           "send_targets"]
