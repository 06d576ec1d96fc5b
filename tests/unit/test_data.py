"""Data pipeline: layout-independent order, exact resume without re-tokenising, replica slices."""
from __future__ import annotations

import numpy as np
import pytest

from elastor_ds.data import CharTokenizer, PrefetchLoader, RecordDataset, replica_sample_indices, write_synthetic_corpus
from elastor_ds.errors import ConfigError, ElastorError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_synthetic_corpus(str(tmp_path_factory.mktemp("d") / "c.jsonl"), num_records=300, seed=3)


def test_replica_slices_partition_each_global_batch():
    mbs, m = 2, [5, 3]
    got = replica_sample_indices(4, m, mbs, 0) + replica_sample_indices(4, m, mbs, 1)
    assert got == list(range(4 * 16, 5 * 16))
    assert replica_sample_indices(0, [8], 2, 0) == list(range(16))


def test_resume_reproduces_samples_and_skips_tokenising(corpus):
    seq = 64
    with PrefetchLoader(corpus, seq, 7, (3, 1), 2, replica=0) as full:
        ref = [full.next() for _ in range(6)]
    with PrefetchLoader(corpus, seq, 7, (3, 1), 2, replica=0, start_iteration=4) as resumed:
        b4 = resumed.next()
        assert resumed.tokenised == 6  # only iteration 4's samples were tokenised, none of the 24 skipped
        b5 = resumed.next()
    assert np.array_equal(b4, ref[4]) and np.array_equal(b5, ref[5])
    # same global sample -> same tokens whatever the replica split (layout independence)
    ds = RecordDataset(corpus, seq, 7)
    one_replica = np.stack([ds.sample(i) for i in replica_sample_indices(4, [4], 2, 0)])
    assert np.array_equal(one_replica[:6], ref[4])


def test_epochs_reshuffle_and_bad_input(corpus, tmp_path):
    ds = RecordDataset(corpus, 32, 1)
    first = [ds.record_of(i) for i in range(len(ds))]
    second = [ds.record_of(len(ds) + i) for i in range(len(ds))]
    assert sorted(first) == list(range(len(ds))) and first != second
    tok = CharTokenizer()
    assert tok.decode(tok.encode("the cat.")) == "the cat."
    with pytest.raises(ConfigError, match="does not exist"):
        RecordDataset(str(tmp_path / "nope.txt"), 32)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        RecordDataset(str(bad), 8).text(1)


ORPHAN_PARENT = """
import os, signal, sys, time
from elastor_ds.data import PrefetchLoader
loader = PrefetchLoader(sys.argv[1], 32, 7, (3, 1), 2, replica=0, prefetch=2)
loader.next()                       # the worker runs and fills its queue

def sems(pid):                      # POSIX named semaphores a process has mapped (/dev/shm/sem.*)
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "/dev/shm/sem." in line}
print(loader._proc.pid, *sorted(sems(os.getpid()) | sems(loader._proc.pid)), flush=True)
time.sleep(0.5)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "killpg":         # as elastor run stops a worker: its whole process group
    os.killpg(0, signal.SIGKILL)
os._exit(0)                         # an agreed stop's exit: no close(), no daemon clean-up
"""


@pytest.mark.parametrize("how", ["kill", "killpg", "exit"])
def test_the_data_worker_does_not_outlive_its_trainer(corpus, how):
    """A trainer that dies (SIGKILL) or leaves through os._exit without closing its loader: its
    data worker, blocked on a full queue, exits within seconds instead of running forever, and no
    named semaphore the two processes had mapped is left in /dev/shm (multiprocessing's Queue and
    Event leaked 8 per trainer this way: thousands on a test machine)."""
    import os
    import subprocess
    import sys
    import time
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", ORPHAN_PARENT, corpus, how], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=root), start_new_session=True)
    assert p.returncode == (0 if how == "exit" else -9), p.stderr[-2000:]
    child, *mapped = p.stdout.split()
    child = int(child)

    def alive() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False
    t_end = time.time() + 10
    while alive() and time.time() < t_end:
        time.sleep(0.1)
    assert not alive(), f"data worker {child} still running 10 s after its trainer died"
    left = [path for path in mapped if os.path.exists(path)]
    assert not left, f"named semaphores left in /dev/shm after the trainer and its worker died: {left}"


# ---- review of the thirty-third session: hostile or malformed data files --------------------------

@pytest.mark.parametrize("line, words", [
    ("[1, 2, 3]", "it is a JSON list"),
    ("42", "it is a JSON int"),
    ('{"text": ' + "9" * 5000 + "}", "is not valid JSON"),          # int() refuses 5000 digits
    ('{"text": ' + "[" * 100000 + "]" * 100000 + "}", "is not valid JSON"),   # RecursionError
    ('{"content": "hello world"}', "its keys are ['content']"),      # trained on EOS alone before
    ('{"text": null}', "its 'text' is NoneType"),                   # trained on 'None' before
    ('{"text": {"a": 1}}', "its 'text' is dict"),
])
def test_a_jsonl_line_that_is_not_an_object_with_a_text_string_is_named(tmp_path, line, words):
    """They raised AttributeError/ValueError/RecursionError (a traceback through the data worker),
    or trained silently on 'None', "{'a': 1}" or an empty sample."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n' + line + "\n")
    ds = RecordDataset(str(f), 8)
    assert ds.text(0) == "ok"
    with pytest.raises(ConfigError, match="line 2") as e:
        ds.text(1)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_data_path_that_is_not_a_regular_file_is_named_for_what_it_is(tmp_path):
    """A directory, a FIFO or a device was reported as "does not exist"; a FIFO is not waited on."""
    import os
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, words in ((tmp_path, "is a directory"), (fifo, "is not a regular file"), ("/dev/zero", "not a regular")):
        with pytest.raises(ConfigError, match=words):
            RecordDataset(str(path), 8)
    real = tmp_path / "real.txt"
    real.write_text("a line\n")
    (tmp_path / "link.txt").symlink_to(real)   # a dataset folder of links: followed
    assert RecordDataset(str(tmp_path / "link.txt"), 8).text(0) == "a line"


def test_a_line_longer_than_the_record_bound_is_refused_while_indexing(tmp_path, monkeypatch):
    """A file without newlines (compressed, binary) was read whole for one sample (a 40 MiB line cost
    650 MiB of memory), and the index held the whole file in memory."""
    from elastor_ds.data import dataset as ds_mod
    monkeypatch.setattr(ds_mod, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(ds_mod, "_SCAN", 256)   # the bound is checked across scan pieces
    f = tmp_path / "d.txt"
    f.write_text("short\n" * 10 + "x" * 999 + "\n" + "short\n")
    ds = RecordDataset(str(f), 8)
    assert len(ds) == 12 and ds.text(10) == "x" * 999 and ds.text(11) == "short"
    f.write_text("short\n" * 10 + "x" * 1001 + "\nshort\n")
    with pytest.raises(ConfigError, match="line 11 is longer than"):
        RecordDataset(str(f), 8)
    f.write_text("short\n" + "y" * 5000)   # no final newline
    with pytest.raises(ConfigError, match="line 2 is longer than"):
        RecordDataset(str(f), 8)


def test_records_come_from_the_file_that_was_indexed(tmp_path):
    """Every sample reopened the path by name: a file replaced during the run was read at the old
    file's offsets (fragments of lines, silently)."""
    import os
    f = tmp_path / "d.txt"
    f.write_text("first record\nsecond record\n")
    ds = RecordDataset(str(f), 8)
    new = tmp_path / "new.txt"
    new.write_text("a much longer replacement line\nanother\n")
    os.replace(new, f)
    assert [ds.text(0), ds.text(1)] == ["first record", "second record"]


def test_a_bad_data_file_reaches_the_trainer_as_one_line(tmp_path):
    """The data worker sent its traceback, raised as ElastorError("data worker failed:\\n<traceback>")."""
    f = tmp_path / "d.jsonl"
    f.write_text("[1, 2]\n" * 40)
    with PrefetchLoader(str(f), 16, 7, (2,), 2, replica=0) as loader:
        with pytest.raises(ConfigError, match=r"line \d+: a JSONL record is an object with a 'text' string") as e:
            loader.next(timeout=60)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)


def test_the_first_batch_waits_while_the_worker_indexes(corpus):
    """The first batch had the same 120 s as every other, while the worker indexes the whole file
    before it (a large corpus failed with "data worker produced nothing in 120s"): it waits as long
    as the worker lives; later batches keep the bound. Here the bound is shorter than the worker's
    start-up (a spawned interpreter)."""
    with PrefetchLoader(corpus, 16, 7, (2,), 2, replica=0, prefetch=1) as loader:
        first = loader.next(timeout=0.001)
        assert first.shape == (4, 17)
        assert loader.next().shape == (4, 17)


def test_a_worker_that_dies_before_its_first_batch_is_said_at_once(tmp_path):
    """The first batch's unbounded wait ends when the worker is gone."""
    import time
    f = tmp_path / "d.txt"
    f.write_text("a line\n" * 10)
    loader = PrefetchLoader(str(f), 16, 7, (2,), 2, replica=0)
    loader._proc.kill()
    t0 = time.monotonic()
    with pytest.raises(ElastorError, match="data worker exited"):
        loader.next()
    assert time.monotonic() - t0 < 10
    loader.close()


@pytest.mark.parametrize("name", ["d.jsonl.gz", "d.txt.bz2", "d.jsonl.zst"])
def test_a_compressed_data_file_is_refused_not_trained_on(tmp_path, name):
    """A ``.jsonl.gz`` was read as plain text (the format follows the name): training on compressed
    bytes, silently."""
    import bz2
    import gzip
    raw = b'{"text": "hello"}\n' * 50
    data = {"gz": gzip.compress(raw), "bz2": bz2.compress(raw),
            "zst": b"\x28\xb5\x2f\xfd" + b"\x00" * 40}[name.rsplit(".", 1)[1]]
    f = tmp_path / name
    f.write_bytes(data)
    kind = {"gz": "gzip", "bz2": "bzip2", "zst": "zstd"}[name.rsplit(".", 1)[1]]
    with pytest.raises(ConfigError, match=f"is {kind}-compressed; decompress it first"):
        RecordDataset(str(f), 8)


def test_lines_of_only_whitespace_are_no_records(tmp_path, monkeypatch):
    """A blank line (a JSONL file's trailing one, the empty lines between paragraphs) was a record of
    its own: a sample of EOS and padding. Such lines are skipped now, also when a line crosses the
    pieces the index is read in (brute force against splitting the bytes by hand), and an error
    names the line's number in the file, not the record's."""
    import elastor_ds.data.dataset as dataset_mod
    rng = np.random.default_rng(7)
    pieces = [b"", b" ", b"\t \r", b"ab", b" x ", b"hello world", b"\x0b\x0c"]
    for trial in range(200):
        monkeypatch.setattr(dataset_mod, "_SCAN", int(rng.integers(1, 12)))
        data = b"\n".join(pieces[i] for i in rng.integers(0, len(pieces), int(rng.integers(1, 12))))
        data += b"\n" if trial % 2 else b""
        path = tmp_path / f"c{trial}.txt"
        path.write_bytes(data)
        lines = data.split(b"\n")
        want = [ln.decode().strip() for ln in lines if ln.strip(b" \t\r\n\x0b\x0c")]
        if not want:
            with pytest.raises(ConfigError, match="has no records"):
                RecordDataset(str(path), 16)
            continue
        ds = RecordDataset(str(path), 16)
        assert [ds.text(i) for i in range(len(ds))] == want, data
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n[1]\n\n')
    ds = RecordDataset(str(jl), 16)
    assert len(ds) == 3 and [ds.text(0), ds.text(1)] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"c\.jsonl: line 5: a JSONL record is an object"):
        ds.text(2)
