"""Data files written with O_DIRECT (elastor_ds.checkpoint.direct_write): the same bytes and the same
CRC lists as the buffered writer, whatever the sizes (pieces straddled, column tiles with rows cut
by a bounce buffer, a tail that is not a multiple of 4 KiB), the safetensors library reads them,
and a file system that refuses O_DIRECT gets the buffered file. Real files under pytest's tmp_path
(a disk file system here; /dev/shm as well, which accepts O_DIRECT on Linux >= 6.6)."""
from __future__ import annotations

import errno
import os
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file

from elastor_ds.checkpoint import direct_write
from elastor_ds.checkpoint.direct_write import write_stream_direct
from elastor_ds.checkpoint.fileformat import EntrySpec, RowRuns, build_header, write_stream


def cases(rng: np.random.Generator):
    """(header, buffers) of a data file: whole buffers and column tiles of a row-major box."""
    box = rng.integers(0, 256, size=(37, 1000), dtype=np.uint8)   # 37 rows of 1,000 bytes
    flat = memoryview(box.reshape(-1))
    tile = RowRuns(flat, 300, 37, 450, 1000)                       # columns 300..750 of every row
    sizes = [1, 4095, 4096, 4097, 70_001, 0, 5 * 4096 + 3]
    bufs = [memoryview(rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()) for n in sizes]
    items = bufs[:3] + [tile] + bufs[3:] + [RowRuns(flat, 0, 37, 1000, 1000)]
    entries = [EntrySpec(f"t{i}", "uint8", (len(b),), len(b)) for i, b in enumerate(items)]
    header, _ = build_header(entries, {"format": "elastor"})
    return header, items, box


@pytest.mark.parametrize("piece", [4096, 3 * 4096, 1 << 20])
@pytest.mark.parametrize("folder", ["tmp", "shm"])
def test_same_bytes_and_crcs_as_the_buffered_writer(tmp_path, monkeypatch, piece, folder):
    monkeypatch.setattr(direct_write, "PIECE", piece)   # small bounce buffers: every straddle happens
    monkeypatch.setattr(direct_write, "_COPY", 5000)
    if folder == "shm":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        import tempfile
        base = tempfile.mkdtemp(dir="/dev/shm")
    else:
        base = str(tmp_path)
    try:
        if not takes_o_direct(base):
            pytest.skip(f"the file system of {base} refuses O_DIRECT: nothing to compare")
        header, items, box = cases(np.random.default_rng(piece))
        a, b = os.path.join(base, "direct.safetensors"), os.path.join(base, "buffered.safetensors")
        ca, ba, cb, bb = [], [], [], []
        got = write_stream_direct(a, header, items, chunk_crcs=ca, block_crcs=ba, block_size=4096)
        want = write_stream(b, header, items, chunk_crcs=cb, block_crcs=bb, block_size=4096)
        raw = open(a, "rb").read()
        assert raw == open(b, "rb").read()
        assert got == want and got == (len(raw), zlib.crc32(raw))   # hand check: the file's own CRC
        assert ca == cb and ba == bb
        # independent oracle: the safetensors library's reader
        t = load_file(a)
        assert bytes(t["t3"]) == box[:, 300:750].tobytes() and bytes(t["t8"]) == box.tobytes()
        assert direct_write._device_of(base) not in direct_write._unsupported
    finally:
        if folder == "shm":
            import shutil
            shutil.rmtree(base)


def test_a_file_system_that_refuses_o_direct_gets_the_buffered_file(tmp_path, monkeypatch):
    """EINVAL on the first O_DIRECT write (what XFS on odd sectors or some FUSE file systems answer):
    the file is written through the page cache from the start; the refusal is remembered."""
    if not takes_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT at open already")
    real_write, real_writev = os.write, os.writev
    calls = []

    def refusing(fd, data):   # noqa: ANN001
        if fcntl_flags(fd) & os.O_DIRECT:
            calls.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return (real_writev if isinstance(data, list) else real_write)(fd, data)
    monkeypatch.setattr(os, "write", refusing)
    monkeypatch.setattr(os, "writev", refusing)
    monkeypatch.setattr(direct_write, "_unsupported", set())
    header, items, _ = cases(np.random.default_rng(1))
    p, q = str(tmp_path / "a"), str(tmp_path / "b")
    got = write_stream_direct(p, header, items)
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "writev", real_writev)
    want = write_stream(q, header, items)
    assert calls and got == want and open(p, "rb").read() == open(q, "rb").read()
    assert direct_write._unsupported == {os.stat(tmp_path).st_dev}


def test_a_failing_disk_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    """ENOSPC after the first piece is written: raised, never hidden by the buffered path."""
    if not takes_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    real_write, real_writev = os.write, os.writev
    n = [0]

    def filling(fd, data):   # noqa: ANN001
        if fcntl_flags(fd) & os.O_DIRECT:
            n[0] += 1
            if n[0] > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        return (real_writev if isinstance(data, list) else real_write)(fd, data)
    monkeypatch.setattr(os, "write", filling)
    monkeypatch.setattr(os, "writev", filling)
    monkeypatch.setattr(direct_write, "PIECE", 4096)
    monkeypatch.setattr(direct_write, "_unsupported", set())
    header, items, _ = cases(np.random.default_rng(2))
    with pytest.raises(OSError) as ei:
        write_stream_direct(str(tmp_path / "a"), header, items)
    assert ei.value.errno == errno.ENOSPC and direct_write._unsupported == set()


def takes_o_direct(folder: str) -> bool:
    """Whether an aligned O_DIRECT write works in ``folder`` (a probe file, removed)."""
    import mmap
    p = os.path.join(folder, ".o_direct_probe")
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, 4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(p)


def fcntl_flags(fd: int) -> int:
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_GETFL)


@pytest.mark.parametrize("shift", [0, 8])
def test_a_page_aligned_staging_buffer_is_written_without_the_bounce_copy(tmp_path, monkeypatch, shift):
    """Items back to back in one page-aligned buffer (the staging buffer) behind a header padded to
    4 KiB: the file is the buffered writer's, and only the header and the bytes around the run's
    unaligned ends pass through the bounce buffers (counted at the copy). ``shift`` 8: the same
    items 8 bytes into the buffer can never be aligned with their file offsets, so every byte is
    copied -- and the file is still the same."""
    import mmap
    if not takes_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(direct_write, "DIRECT_CHUNK", 3 * 4096)   # several direct writes per run
    monkeypatch.setattr(direct_write, "MIN_DIRECT", 4096)
    rng = np.random.default_rng(7 + shift)
    sizes = [100_003, 7, 65_536, 4097, 1, 200_000]     # small and unaligned items inside the run
    staging = mmap.mmap(-1, sum(sizes) + shift + 4096)
    arr = np.frombuffer(staging, dtype=np.uint8)
    assert arr.__array_interface__["data"][0] % 4096 == 0
    arr[:] = rng.integers(0, 256, size=len(arr), dtype=np.uint8)
    base = memoryview(arr)
    items, pos = [], shift
    for n in sizes:
        items.append(base[pos:pos + n])
        pos += n
    entries = [EntrySpec(f"t{i}", "uint8", (n,), n) for i, n in enumerate(sizes)]
    header, _ = build_header(entries, {"format": "elastor"}, align=4096)
    assert len(header) % 4096 == 0
    copied = []
    real_copy = direct_write._Bounce._copy

    def counting(self, src):   # noqa: ANN001
        copied.append(len(src))
        return real_copy(self, src)
    monkeypatch.setattr(direct_write._Bounce, "_copy", counting)
    a, b = str(tmp_path / "direct"), str(tmp_path / "buffered")
    ca, ba, cb, bb = [], [], [], []
    got = write_stream_direct(a, header, items, chunk_crcs=ca, block_crcs=ba, block_size=4096)
    want = write_stream(b, header, items, chunk_crcs=cb, block_crcs=bb, block_size=4096)
    raw = open(a, "rb").read()
    assert raw == open(b, "rb").read() and got == want == (len(raw), zlib.crc32(raw))
    assert ca == cb and ba == bb
    t = load_file(a)
    assert [bytes(t[f"t{i}"]) for i in range(len(sizes))] == [bytes(m) for m in items]
    body = sum(sizes)
    if shift == 0:   # the header, then at most one partial page at the run's end
        assert sum(copied) - len(header) == body % 4096
    else:
        assert sum(copied) == len(header) + body


def test_the_staging_buffer_and_the_data_section_start_on_a_page():
    """What the copy-free path needs from the engine: a page-aligned staging buffer, and rank data
    files whose header is padded to 4 KiB (a legal safetensors header: spaces after the JSON)."""
    from elastor_ds.checkpoint.staging import StagingBuffer
    from elastor_ds.checkpoint.writer import rank_header
    from elastor_ds.checkpoint.planning.save_plan import WriteItem
    from elastor_ds.layout.region import Region
    for n in (1, 4095, 10 * 2**20 + 3):
        s = StagingBuffer(pin_memory=False)
        buf = s.ensure(n)
        assert buf.numel() == n and buf.data_ptr() % 4096 == 0
    items = [WriteItem(name="w", shard=0, region=Region((0, 0), (3, 5)), dtype="float32")]
    header, offs = rank_header(0, items)
    assert len(header) % 4096 == 0 and offs == [0]
    n = int.from_bytes(header[:8], "little")
    assert header[8:8 + n].rstrip(b" ").endswith(b"}") and set(header[8:8 + n][-10:]) == {ord(" ")}


def _vma_flags(addr: int) -> list[str]:
    """The kernel's ``VmFlags`` of the mapping that holds ``addr`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_advisable() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _thp_advisable(), reason="this kernel has no transparent huge pages to advise")
def test_bounce_and_staging_buffers_are_private_and_advised_huge_pages():
    """The buffers an O_DIRECT write comes from are private anonymous memory advised to use huge
    pages (``hg`` in the kernel's VmFlags) and not shared memory (``sh``): a shared anonymous map
    is shmem, which MADV_HUGEPAGE does not back with huge pages here, and O_DIRECT writes from
    4 KiB pages ran about 1.4x slower on the development VM."""
    import ctypes
    from elastor_ds.checkpoint.staging import StagingBuffer
    m = direct_write.private_buffer(direct_write.PIECE)
    flags = _vma_flags(ctypes.addressof(ctypes.c_char.from_buffer(m)))
    assert "hg" in flags and "sh" not in flags, flags
    s = StagingBuffer(pin_memory=False)
    buf = s.ensure(8 << 20)
    flags = _vma_flags(buf.data_ptr() + (4 << 20))
    assert "hg" in flags, flags


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stream_crcs_fed_in_pieces_of_any_size_equal_zlib_of_every_prefix(seed):
    """StreamCrcs (the CRCs the O_DIRECT writer takes of the bytes it copies, in file order): a
    header, chunks of odd sizes (empty ones, one shorter than a block, some straddling blocks),
    fed in random pieces that cut across chunk and block boundaries. Oracle: zlib.crc32 of every
    block-end prefix of each chunk, of each chunk, and of the whole file."""
    rng = np.random.default_rng(seed)
    block = 64
    header = rng.integers(0, 256, size=40, dtype=np.uint8).tobytes()
    lengths = [0, 1, 63, 64, 65, 0, 300, 128, 5]
    chunks = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in lengths]
    whole = header + b"".join(chunks)
    for blocks in (True, False):
        s = direct_write.StreamCrcs(len(header), lengths, block, blocks=blocks)
        p = 0
        while p < len(whole):
            n = int(rng.integers(1, 90))
            s.feed(memoryview(whole)[p:p + n])
            p += n
        assert s.finish() == zlib.crc32(whole)
        assert s.chunk_crcs == [zlib.crc32(c) for c in chunks]
        if blocks:
            want = [[zlib.crc32(c[:e]) for e in range(block, len(c), block)] + [zlib.crc32(c)] if len(c) % block
                    else [zlib.crc32(c[:e]) for e in range(block, len(c) + 1, block)] or [0] for c in chunks]
            assert [list(t) for t in s.tables] == want
    short = direct_write.StreamCrcs(len(header), lengths, block)
    short.feed(memoryview(whole)[:-1])
    with pytest.raises(ValueError, match="missing 1 bytes"):
        short.finish()
    with pytest.raises(ValueError, match="past the end"):
        short.feed(memoryview(b"ab"))


def test_full_bounce_buffers_waiting_for_the_disk_go_in_one_writev(tmp_path, monkeypatch):
    """The write helper's first writev is held until the copier waits for a free bounce buffer
    (every buffer full or being written): a writev then carries more than one buffer, and the
    file and its CRCs are still the buffered writer's."""
    import threading
    if not takes_o_direct(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(direct_write, "PIECE", 4096)
    monkeypatch.setattr(direct_write, "NBUF", 4)
    real_writev = os.writev
    sizes, gate = [], threading.Event()

    def slow_first(fd, views):   # noqa: ANN001
        if not sizes:
            gate.wait(5)         # released once the copier is blocked on a free buffer
        sizes.append(len(views))
        return real_writev(fd, views)
    monkeypatch.setattr(os, "writev", slow_first)
    real_get = direct_write.queue.Queue.get

    def get(self, *a, **k):   # noqa: ANN001
        if threading.current_thread() is threading.main_thread() and self.empty() and not sizes:
            gate.set()           # the copier waits for a free buffer: every buffer is full or being written
        return real_get(self, *a, **k)
    monkeypatch.setattr(direct_write.queue.Queue, "get", get)
    header, items, _ = cases(np.random.default_rng(11))
    a, b = str(tmp_path / "direct"), str(tmp_path / "buffered")
    ca, ba, cb, bb = [], [], [], []
    got = write_stream_direct(a, header, items, chunk_crcs=ca, block_crcs=ba, block_size=4096)
    monkeypatch.setattr(os, "writev", real_writev)
    monkeypatch.setattr(direct_write.queue.Queue, "get", real_get)
    want = write_stream(b, header, items, chunk_crcs=cb, block_crcs=bb, block_size=4096)
    assert open(a, "rb").read() == open(b, "rb").read() and got == want and ca == cb and ba == bb
    # whether the helper woke before or after the copier filled the other buffers, full buffers
    # waited while the first write was held, and one writev took them together
    assert max(sizes) > 1, sizes
