"""The writer: one rank's files of a save (data, block-CRC table, rank state) and the manifest.

Runs in the engine's background thread. The data file is a standard safetensors file streamed
from the staging buffer (:func:`.storage.write_stream`: one CRC pass gives cumulative block CRCs,
chunk and file CRCs while ``fsync`` flushes); the table file holds the block CRCs; rank 0 builds
the manifest from every rank's result (:func:`build_manifest`) and commits it.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Optional, Sequence

from ..layout.region import Region
from .planning.manifest import BLOCK_SIZE, BlockTable, Chunk, FileEntry, Manifest, TensorEntry, crc_table_name
from .planning.save_plan import SavePlan, WriteItem
from .crc import crc32
from .storage import EntrySpec, build_header, write_all, write_crc_table, write_stream


def chunk_key(name: str, region: Region) -> str:
    """The safetensors key of a chunk: tensor name and the chunk's offsets."""
    return f"{name}#{','.join(str(o) for o in region.offsets)}"


def write_rank_files(rank: int, items: Sequence[WriteItem], views: Sequence[Any], tmp_dir: str,
                     rank_state: Optional[Mapping[str, Any]], fsync: bool = True,
                     recycle_dir: Optional[str] = None) -> dict:
    """Write this rank's data file (``views``: each item's bytes, in file order), its block-CRC
    table and its state file into ``tmp_dir``, all fsynced; return what the manifest needs (plain
    data, sent to rank 0). ``recycle_dir``: a data file of this name left there by retention
    (:func:`~.commit.apply_retention`) is moved in and written over (its pages are reused)."""
    os.makedirs(tmp_dir, exist_ok=True)
    fname = f"data_{rank:05d}.safetensors"
    reused = False
    if recycle_dir is not None:
        try:
            os.rename(os.path.join(recycle_dir, fname), os.path.join(tmp_dir, fname))
            reused = True
        except OSError:   # none there (the first saves) or gone: a new file
            pass
    entries = [EntrySpec(chunk_key(it.name, it.region), it.dtype, it.region.sizes, it.nbytes) for it in items]
    header, rel = build_header(entries, {"format": "elastor", "writer_rank": str(rank)})
    crcs: list[int] = []
    blocks: list[list[int]] = []
    size, crc = write_stream(os.path.join(tmp_dir, fname), header, views, fsync=fsync, chunk_crcs=crcs,
                             block_crcs=blocks, block_size=BLOCK_SIZE, overwrite=reused)
    tname = crc_table_name(fname)
    tsize, tcrc, starts = write_crc_table(os.path.join(tmp_dir, tname), blocks, fsync=fsync)
    chunks = [(it.name, chunk_key(it.name, it.region), it.region.to_json(), len(header) + off, it.nbytes, c,
               (BLOCK_SIZE, tname, first)) for it, off, c, first in zip(items, rel, crcs, starts)]
    files = {fname: (size, crc), tname: (tsize, tcrc)}
    state_name = None
    if rank_state is not None:
        state_name = f"rank_state/rank_{rank:05d}.json"
        sp = os.path.join(tmp_dir, state_name)
        os.makedirs(os.path.dirname(sp), exist_ok=True)
        data = json.dumps(rank_state, separators=(",", ":")).encode()
        fd = os.open(sp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, memoryview(data))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        files[state_name] = (len(data), crc32(data))   # of the bytes written, not read back
    return {"rank": rank, "data": fname, "chunks": chunks, "files": files, "state": state_name}


def build_manifest(step: int, plan: SavePlan, results: Sequence[dict], extra: Any, model: Any, layout: Any) -> Manifest:
    """The manifest of a save from every rank's :func:`write_rank_files` result (rank 0)."""
    chunks: dict[str, list[Chunk]] = {n: [] for n in plan.tensors}
    files: dict[str, FileEntry] = {}
    states: dict[int, str] = {}
    for res in results:
        for name, key, reg, off, length, crc, (bsize, table, first) in res["chunks"]:
            chunks[name].append(Chunk(res["data"], key, Region.from_json(reg), off, length, crc,
                                      BlockTable(bsize, table, first)))
        for fname, (size, crc) in res["files"].items():
            files[fname] = FileEntry(fname, size, crc, res["rank"])
        if res["state"]:
            states[res["rank"]] = res["state"]
    tensors = {n: TensorEntry(n, shape, dtype, tuple(sorted(chunks[n], key=lambda c: c.region.offsets)))
               for n, (shape, dtype) in plan.tensors.items()}
    return Manifest(step=step, tensors=tensors, files=files, layout=layout, model=model, extra=extra,
                    rank_state_files=states, world_size=len(results), created_unix=time.time())
