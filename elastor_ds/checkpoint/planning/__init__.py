"""Pure checkpoint planning: what a checkpoint is and which bytes go where. No torch, no I/O.

- :mod:`.manifest`: the manifest document (format versions, schema validation, checksum, block CRC tables)
- :mod:`.save_plan`: deduplicated, balanced, tiled write plan from every rank's shard metadata
- :mod:`.load_plan`: the verified byte-range reads that fill a rank's requested regions

``tests/unit/test_layering.py`` imports each of these in a fresh interpreter and checks that neither
torch nor torch.distributed got imported, directly or indirectly.
"""
