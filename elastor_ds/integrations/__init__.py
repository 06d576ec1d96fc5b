"""Adapters to training frameworks (DeepSpeed, Megatron-core): the only importers of those packages."""
