"""Layout model (pure): regions, layouts, sharding rules, ZeRO partitions."""
from .layout import Layout, RankPosition, Replica, Stage, balanced_boundaries
from .region import Piece, Region, flat_range_to_regions
from .sharding import Holding, RuleKind, ShardRule, TensorSpec, holdings, local_pieces, rank_tensors
from .zero import FlatPiece, flat_partition_pieces, partition_bounds

__all__ = ["Layout", "RankPosition", "Replica", "Stage", "balanced_boundaries", "Piece", "Region",
           "flat_range_to_regions", "Holding", "RuleKind", "ShardRule", "TensorSpec", "holdings",
           "local_pieces", "rank_tensors", "FlatPiece", "flat_partition_pieces", "partition_bounds"]
