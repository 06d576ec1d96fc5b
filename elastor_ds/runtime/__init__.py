"""Framework-neutral heterogeneous runtime pieces: group derivation from a layout, split all-reduce
plans, ZeRO-1 shares over the holders of each block and cross-width p2p pairing (pure); the
collectives that execute them live in :mod:`elastor_ds.runtime.hetero_comm`, the DeepSpeed adapter in
:mod:`elastor_ds.integrations.deepspeed.hetero`."""
from .groups import (Cell, ShardPart, creation_order, layout_held, needs_hetero, reduce_groups, replica_groups,
                     replica_of, split_reduce_bytes, split_reduce_plan, stage_groups, uniform_dp_bytes, zero_partition,
                     zero_state_numel)
from .p2p import recv_source, send_targets

__all__ = ["Cell", "ShardPart", "creation_order", "layout_held", "needs_hetero", "reduce_groups", "replica_groups",
           "replica_of", "split_reduce_bytes", "split_reduce_plan", "stage_groups", "uniform_dp_bytes",
           "zero_partition", "zero_state_numel", "recv_source", "send_targets"]
