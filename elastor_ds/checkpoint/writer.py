"""The writer: one rank's files of a save (data, block-CRC table, rank state) and the manifest.

Runs in the engine's background thread. The data file is a standard safetensors file streamed
from the staging buffer (the storage backend's ``write_data_file``, :mod:`.storage`: one CRC pass
gives cumulative block CRCs, chunk and file CRCs while a durable backend's ``fsync`` flushes); the
table file holds the block CRCs; rank 0 builds the manifest from every rank's result
(:func:`build_manifest`) and commits it. Every byte goes through the storage backend: this module
lays files out, it never decides how they are written or synced.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from ..layout.region import Region
from .planning.manifest import BLOCK_SIZE, BlockTable, Chunk, FileEntry, Manifest, TensorEntry, crc_table_name
from .planning.save_plan import SavePlan, WriteItem
from .crc import crc32, crc32_combine
from .fileformat import DATA_ALIGN, EntrySpec, build_header, crc_table_bytes, cumulative_crcs

if TYPE_CHECKING:
    from .storage.base import StorageWriter


def chunk_key(name: str, region: Region) -> str:
    """The safetensors key of a chunk: tensor name and the chunk's offsets."""
    return f"{name}#{','.join(str(o) for o in region.offsets)}"


def data_file_name(rank: int) -> str:
    return f"data_{rank:05d}.safetensors"


def rank_header(rank: int, items: Sequence[WriteItem]) -> tuple[bytes, list[int]]:
    """The safetensors header of ``rank``'s data file for ``items`` and each item's offset in its
    data section (a pure function of the plan: rank 0 can compute every rank's)."""
    entries = [EntrySpec(chunk_key(it.name, it.region), it.dtype, it.region.sizes, it.nbytes) for it in items]
    return build_header(entries, {"format": "elastor", "writer_rank": str(rank)}, align=DATA_ALIGN)


def write_rank_files(rank: int, items: Sequence[WriteItem], views: Sequence[Any], tmp_dir: str,
                     rank_state: Optional[Mapping[str, Any]], storage: "StorageWriter",
                     block_size: int = BLOCK_SIZE, lean: bool = False) -> dict:
    """Write this rank's data file (``views``: each item's bytes, in file order), its block-CRC
    table and its state file into ``tmp_dir`` through ``storage`` (as durable as it is); return
    what the manifest needs (plain data, sent to rank 0); ``lean``: the chunk CRCs instead of the
    chunk list (for rank 0's :class:`ManifestTemplate`)."""
    fname = data_file_name(rank)
    header, rel = rank_header(rank, items)
    crcs: list[int] = []
    blocks: list[list[int]] = []
    size, crc = storage.write_data_file(os.path.join(tmp_dir, fname), header, views, chunk_crcs=crcs,
                                        block_crcs=blocks, block_size=block_size)
    return _finish_rank_files(rank, items, tmp_dir, fname, len(header), rel, crcs, blocks, size, crc, rank_state,
                              storage, block_size, lean)


def write_staged_rank_files(rank: int, items: Sequence[WriteItem], data: Any, spans: Sequence[tuple[int, int]],
                            path: str, header_len: int, header_crc: int, rank_state: Optional[Mapping[str, Any]],
                            storage: "StorageWriter", block_size: int = BLOCK_SIZE, lean: bool = False,
                            block_tables: Optional[Sequence[Sequence[int]]] = None) -> dict:
    """The same for a data file that is already in place (:mod:`.file_staging`: ``data`` is its
    mapped data section, filled by the snapshot): only the checksums, the table and the state
    file are left to do. Returns what :func:`write_rank_files` returns; ``lean``: the chunk CRCs
    instead of the chunk list (for rank 0's :class:`ManifestTemplate`). ``block_tables``: each
    span's cumulative block CRCs when the snapshot copy took them (:class:`~.staging.BlockCrcs`);
    otherwise they are computed here from ``data``."""
    mv = memoryview(data).cast("B")
    crcs: list[int] = []
    blocks: list[list[int]] = []
    crc = header_crc
    if block_tables is not None and len(block_tables) != len(spans):
        raise ValueError(f"{len(block_tables)} block-CRC tables for {len(spans)} chunks")
    for k, (pos, n) in enumerate(spans):
        if block_tables is not None:
            cum = block_tables[k]
        elif n <= block_size:   # a chunk of one block (most of a small model's): one CRC call, no loop
            cum = [crc32(mv[pos:pos + n])]
        else:
            cum = cumulative_crcs(mv[pos:pos + n], block_size)
        blocks.append(cum)
        crcs.append(cum[-1])
        crc = crc32_combine(crc, cum[-1], n)
    storage.seal_file(path)
    tmp_dir, fname = os.path.split(path)
    rel = [pos for pos, _ in spans]
    size = header_len + sum(n for _, n in spans)
    return _finish_rank_files(rank, items, tmp_dir, fname, header_len, rel, crcs, blocks, size, crc, rank_state,
                              storage, block_size, lean)


def _finish_rank_files(rank, items, tmp_dir, fname, header_len, rel, crcs, blocks, size, crc, rank_state,
                       storage: "StorageWriter", block_size, lean=False) -> dict:
    tname = crc_table_name(fname)
    table, starts = crc_table_bytes(blocks)
    storage.write_file(os.path.join(tmp_dir, tname), table)
    tsize, tcrc = len(table), crc32(table)
    chunks = None if lean else [
        (it.name, chunk_key(it.name, it.region), it.region.to_json(), header_len + off, it.nbytes, c,
         (block_size, tname, first)) for it, off, c, first in zip(items, rel, crcs, starts)]
    files = {fname: (size, crc), tname: (tsize, tcrc)}
    state_name = None
    if rank_state is not None:
        state_name = f"rank_state/rank_{rank:05d}.json"
        data = json.dumps(rank_state, separators=(",", ":")).encode()
        storage.write_file(os.path.join(tmp_dir, state_name), data)
        files[state_name] = (len(data), crc32(data))   # of the bytes written, not read back
    if lean:
        return {"rank": rank, "crcs": crcs, "files": files, "state": state_name}
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


class ManifestTemplate:
    """Rank 0's manifest of one save plan, rendered again for every save that reuses the plan.

    Saves reuse their plan (memory snapshots every step): everything in the manifest but the CRCs,
    the step and the JSON state is the same each time, and it is a pure function of the plan and the
    block size (:func:`rank_header` gives every rank's offsets). So ranks send only their CRCs
    (``write_staged_rank_files`` / ``write_rank_files`` with ``lean=True``) and rank 0 fills them
    into this document and serialises it once. The
    text equals what :func:`build_manifest` then ``Manifest.dumps(compact=True)`` give for the
    same results (``tests/dist/test_snapshot_fast_path.py`` checks it).
    """

    def __init__(self, plan: SavePlan, block_size: int):
        self.plan = plan
        self.block_size = block_size
        self.ranks: list[tuple[str, list[dict], int]] = []   # per rank: data file, chunk dicts, data file size
        per_tensor: dict[str, list[tuple[tuple[int, ...], dict]]] = {n: [] for n in plan.tensors}
        for r, items in enumerate(plan.items):
            header, rel = rank_header(r, items)
            fname = data_file_name(r)
            tname = crc_table_name(fname)
            first = 0
            cds = []
            for it, off in zip(items, rel):
                cd = {"file": fname, "key": chunk_key(it.name, it.region), "region": it.region.to_json(),
                      "offset": len(header) + off, "length": it.nbytes, "crc32": None,
                      "blocks": {"size": block_size, "table": tname, "index": first}}
                first += max(1, -(-it.nbytes // block_size))
                per_tensor[it.name].append((it.region.offsets, cd))
                cds.append(cd)
            self.ranks.append((fname, cds, len(header) + sum(it.nbytes for it in items)))
        tensors = {n: {"shape": list(shape), "dtype": dtype,
                       "chunks": [cd for _, cd in sorted(per_tensor[n], key=lambda t: t[0])]}
                   for n, (shape, dtype) in sorted(plan.tensors.items())}
        # the tensors section, serialised once: canonical text cut at every chunk's CRC (a unique
        # token per chunk), so a render only joins the pieces with the new CRCs
        self._token = f"elastor-{uuid.uuid4().hex}"
        order: dict[int, int] = {}   # chunk dict id -> its index in rank-major order
        for cds in (r[1] for r in self.ranks):
            for cd in cds:
                cd["crc32"] = f"{self._token}-{len(order)}"
                order[id(cd)] = len(order)
        text = json.dumps(tensors, sort_keys=True, separators=(",", ":"), allow_nan=False)
        parts = text.split(f'"{self._token}-')
        self._pieces = [parts[0]]
        self._slots: list[int] = []   # for each CRC hole in text order: its rank-major chunk index
        for part in parts[1:]:
            idx, rest = part.split('"', 1)
            self._slots.append(int(idx))
            self._pieces.append(rest)
        if len(self._slots) != len(order):
            raise AssertionError("manifest template: a chunk CRC token was not found exactly once")

    def render(self, step: int, results: Sequence[dict], extra: Any, model: Any, layout: Any) -> str:
        """The manifest text for ``results`` (every rank's lean result, in rank order)."""
        from ..errors import CheckpointError
        from .planning.manifest import FORMAT_NAME, FORMAT_VERSION
        if len(results) != len(self.ranks):
            raise CheckpointError(f"{len(results)} results for a plan of {len(self.ranks)} ranks")
        files: dict[str, dict] = {}
        states: dict[int, str] = {}
        crcs: list[str] = []
        for r, res in enumerate(results):
            fname, cds, size = self.ranks[r]
            got = res["crcs"]
            if res["rank"] != r or len(got) != len(cds) or res["files"].get(fname, (None,))[0] != size:
                raise CheckpointError(f"rank {r}'s snapshot result does not match the save plan (rank "
                                      f"{res['rank']}, {len(got)} chunks for {len(cds)}, data file size "
                                      f"{res['files'].get(fname, (None,))[0]} for {size})")
            crcs.extend(f'"{c:08x}"' for c in got)
            for name, (fsize, fcrc) in res["files"].items():
                files[name] = {"size": fsize, "crc32": f"{fcrc:08x}", "writer_rank": r}
            if res["state"]:
                states[r] = res["state"]
        body = [self._pieces[0]]
        for slot, piece in zip(self._slots, self._pieces[1:]):
            body.append(crcs[slot])
            body.append(piece)
        tensors_text = "".join(body)
        d = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "step": int(step),
             "world_size": len(results), "created_unix": time.time(), "layout": layout, "model": model,
             "extra": extra, "rank_state_files": {str(k): v for k, v in sorted(states.items())},
             "files": dict(sorted(files.items())), "tensors": self._token}
        # the canonical text of d (sorted keys, compact) with the tensors section spliced in: the
        # token is a string only this template made, so it occurs exactly once
        head = json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=False)
        mark = f'"tensors":"{self._token}"'
        if head.count(mark) != 1:
            raise CheckpointError("manifest template: the tensors marker is not unique in the document")
        text = head.replace(mark, '"tensors":' + tensors_text)
        return text[:-1] + ',"checksum":"sha256:' + hashlib.sha256(text.encode()).hexdigest() + '"}'
