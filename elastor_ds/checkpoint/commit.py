"""The on-disk commit protocol: one atomic-commit type for every writer, ``latest``, retention.

Layout of a checkpoint root::

    root/
      latest                      # text: name of the newest committed step dir (moved last)
      step_000000100/             # committed: has manifest.json
        manifest.json
        data_00000.safetensors ...
        rank_state/rank_00000.json ...
      .tmp_step_000000200_<id>/   # a save in progress (never a checkpoint)

:class:`AtomicCommit` is the named concept (after Orbax's ``AtomicRenameTemporaryPath``): ``create``
a temporary directory, write into ``path``, then ``finalize`` (the result appears at once, whole)
or ``abort`` (the temporary directory is removed; nothing else changes). Two kinds:

* :class:`StepCommit`: a step of an elastor checkpoint root. ``finalize(manifest)``:
  1. write ``manifest.json`` into the temp dir (temp name, fsync, rename, fsync dir): from here on
     the temp dir is a complete checkpoint;
  2. move it to ``step_<step>``: a plain rename when the step is new; when the step already exists
     (a re-save), an atomic exchange of the two directories (``renameat2(RENAME_EXCHANGE)``), so
     ``step_<step>`` is always either the old or the new complete checkpoint; the old one then
     sits under the temp name and is removed. Without exchange support: ``latest`` first points at
     the complete temp dir, the old step moves aside, the new one moves in, and :func:`read_latest`
     maps a ``latest`` that names a vanished temp dir to its step dir. fsync the root;
  3. write ``latest`` atomically (temp, fsync, rename, fsync root) under a :class:`LatestPolicy`:
     ``ALWAYS`` (a training run: its newest save is the one to resume) or ``FORWARD`` (imports:
     never move ``latest`` to an older step than it names);
  4. retention (optional): delete the oldest committed dirs beyond ``keep``, never the new step,
     never the one ``latest`` names, never a step newer than the new one; and stale temp dirs of
     steps up to the newest committed one (never a newer save's temp dir in progress).
* :class:`DirCommit`: a whole directory (an export: consolidated, Megatron, DeepSpeed universal)
  written as ``.<name>.tmp-<id>`` next to the destination and renamed into place; the destination
  must be absent or empty.

``StepCommit(..., sync=False)`` (the node-local tmpfs backend, :mod:`.storage.tmpfs`) does the same
renames without any fsync: atomic, not durable.

A directory without ``manifest.json`` is never treated as a checkpoint. Every name read from a
checkpoint (``latest``, the manifest's files, chunks and rank state files) goes through
:func:`~elastor_ds.checkpoint.paths.safe_join`.
"""
from __future__ import annotations

import ctypes
import enum
import errno
import logging
import os
import re
import shlex
import shutil
import stat
import time
import uuid
from typing import Iterable, Optional

from ..errors import (CheckpointError, CheckpointNotFoundError, ConcurrentWriterError, CorruptCheckpointError,
                      IncompleteCheckpointError, UnreadableCheckpointError, UnsafeCheckpointError)
from .planning.manifest import INT64_MAX, MANIFEST_NAME, Manifest
from .paths import not_a_checkpoint, read_regular_text, safe_join
from .fileformat import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d{9,})$")
_DS_TAG_RE = re.compile(r"global_step[0-9]{1,19}")   # the tags DeepSpeed's save_checkpoint writes to `latest`
TMP_PREFIX = ".tmp_step_"
_TMP_RE = re.compile(r"^\.tmp_step_(\d{9,})_")
_IMPORT_TMP_RE = re.compile(r"^\.tmp_step_\d{9,}_import")   # an import's temp dir and its .stage beside it


class LatestPolicy(enum.Enum):
    """How a commit moves ``latest``."""
    ALWAYS = "always"     # to the new step (a training run resumes from its newest save)
    FORWARD = "forward"   # only when the new step is not older than the one ``latest`` names
    NEVER = "never"


MAX_MANIFEST_BYTES = 2 ** 30   # bounded read of an untrusted manifest (a 16,384-rank 70B manifest is ~64 MB)


def step_dirname(step: int) -> str:
    return f"step_{step:09d}"


def tmp_dirname(step: int, nonce: str) -> str:
    return f"{TMP_PREFIX}{step:09d}_{nonce}"


IMPORT_TAG = "import"   # an import's temp dir: .tmp_step_<N>_import<nonce>


def import_nonce() -> str:
    """The nonce of an import's temp dir: random, never the pid (in a container every run has the
    same pid, so one killed import's leftover blocked every later import of that step)."""
    return f"{IMPORT_TAG}{uuid.uuid4().hex[:12]}"


def step_of(name: str) -> Optional[int]:
    """The step of a ``step_N`` or ``.tmp_step_N_*`` directory name, else None."""
    m = _STEP_RE.match(name) or _TMP_RE.match(name)
    return int(m.group(1)) if m else None


def is_committed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_NAME))


def _check_readable(path: str) -> None:
    """A directory this process may not enter reads as "no manifest" to ``os.path.isfile``: say what
    it is instead, so nobody takes a good checkpoint for an uncommitted save."""
    try:
        os.stat(os.path.join(path, MANIFEST_NAME))
    except PermissionError:
        raise UnreadableCheckpointError(f"permission denied reading {path}: fix its permissions or run as a user "
                                        f"who may read it (the checkpoint in it is not known to be bad)") from None
    except OSError:
        pass


def list_committed(root: str) -> list[tuple[int, str]]:
    """(step, path) of committed checkpoints under ``root``, oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    for n in names:
        m = _STEP_RE.match(n)
        p = os.path.join(root, n)
        # a link named like a step is never one of this root's checkpoints (nor followed out of it):
        # `latest` refuses to name one, and without `latest` the newest step was taken through it
        if m and not os.path.islink(p) and is_committed(p):
            out.append((int(m.group(1)), p))
    return sorted(out)


def _latest_name(root: str) -> Optional[str]:
    try:
        name = read_regular_text(os.path.join(root, LATEST), 4096, nofollow=True).strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        _check_readable(root)
        raise UnreadableCheckpointError(f"permission denied reading {root}/{LATEST}: fix its permissions, or load "
                                        f"a step dir directly") from None
    except (OSError, UnicodeDecodeError) as e:
        raise IncompleteCheckpointError(f"{root}/{LATEST} is unreadable ({e}); load a step dir directly") from None
    return name or None


def read_latest(root: str) -> Optional[str]:
    """The step dir ``root/latest`` names (checked to stay inside ``root``), or None."""
    name = _latest_name(root)
    if name is None:
        return None
    if not (_STEP_RE.match(name) or _TMP_RE.match(name)):
        if _DS_TAG_RE.fullmatch(name):   # DeepSpeed's own save_checkpoint wrote this `latest`
            raise UnsafeCheckpointError(f"{root}/{LATEST} names {name!r}: {root} holds a DeepSpeed checkpoint (its "
                                        f"save_checkpoint), not an elastor one; convert it once with `elastor "
                                        f"convert {root} NEW --from deepspeed` and load NEW, or give elastor a "
                                        f"directory of its own")
        raise UnsafeCheckpointError(f"{root}/{LATEST} names {name[:120]!r}, not a step_<N> directory; refusing it "
                                    f"(corrupt or crafted pointer)")
    path = safe_join(root, name, what=f"{root}/{LATEST} entry")
    if _TMP_RE.match(name) and not os.path.exists(path):
        # a re-save without directory exchange crashed between its last rename and moving `latest`:
        # the complete new checkpoint is now the step dir
        path = os.path.join(root, step_dirname(step_of(name)))  # type: ignore[arg-type]
    return path


def check_latest_replaceable(root: str) -> Optional[str]:
    """The name ``root/latest`` holds (None: none, or unreadable); :class:`UnsafeCheckpointError`
    when elastor did not write it (DeepSpeed's ``save_checkpoint`` names its ``global_stepN`` tag
    there): a commit would replace a pointer someone else relies on."""
    try:
        name = _latest_name(root)
    except CheckpointError:
        return None   # unreadable: the save's own commit says why
    if name is None or _STEP_RE.match(name) or _TMP_RE.match(name):
        return name
    whose = ("DeepSpeed's save_checkpoint wrote it" if _DS_TAG_RE.fullmatch(name)
             else "not a step_<N> directory: elastor did not write it")
    raise UnsafeCheckpointError(
        f"{root}/{LATEST} names {name[:120]!r} ({whose}); an elastor save there would replace it. Give elastor a "
        f"directory of its own, or move that file away"
        + (f" (to resume from DeepSpeed's checkpoint, convert it once: `elastor convert {root} NEW --from deepspeed`)"
           if _DS_TAG_RE.fullmatch(name) else ""))


def resolve(path: str) -> str:
    """A committed step directory from ``path`` (a step dir, or a root with ``latest``)."""
    if not path:   # os.path.abspath("") would be the current directory
        raise CheckpointNotFoundError("the checkpoint path is empty; give a checkpoint root or a step dir")
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not os.path.isdir(path):
        raise not_a_checkpoint(path)
    _check_readable(path)
    if is_committed(path):
        return path
    try:
        latest = read_latest(path)
    except UnsafeCheckpointError:
        fmt = foreign_format(path)
        if fmt is None:
            raise
        raise CheckpointNotFoundError(f"{path} holds no elastor checkpoint{import_hint(path, fmt)}") from None
    if latest is not None:
        _check_readable(latest)
        if not is_committed(latest):
            raise IncompleteCheckpointError(f"{path}/latest points to {latest}, which has no {MANIFEST_NAME}: "
                                            f"it was never committed; use an older step dir or fallback")
        return latest
    committed = list_committed(path)
    if committed:
        log.warning("%s has no 'latest' pointer; using the newest committed checkpoint %s", path, committed[-1][1])
        return committed[-1][1]
    if _STEP_RE.match(os.path.basename(path)) or os.path.basename(path).startswith(TMP_PREFIX):
        raise IncompleteCheckpointError(f"{path} has no {MANIFEST_NAME}: the save never committed, so it is not a "
                                        f"checkpoint; load the previous step dir or the root")
    fmt = foreign_format(path)
    try:
        uncommitted = sorted(e for e in os.listdir(path) if _STEP_RE.match(e))
    except OSError:
        uncommitted = []
    shown = ", ".join(uncommitted[:3]) + (", ..." if len(uncommitted) > 3 else "")
    steps = (f"only step dirs that never committed ({shown}: no {MANIFEST_NAME} in them)" if uncommitted
             else "no step_* dirs")
    raise CheckpointNotFoundError(f"{path} holds no elastor checkpoint (no {MANIFEST_NAME}, no 'latest', {steps})"
                                  + (import_hint(path, fmt) if fmt else ""))


def foreign_format(path: str) -> Optional[str]:
    """The ``elastor convert --from`` format a directory that is not an elastor checkpoint looks
    like (from its entries' names only), or None."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return None
    if {"elastor_metadata.json", "model.safetensors"} <= names:
        return "consolidated"
    if "latest_universal" in names:
        return "deepspeed-universal"
    if "latest_checkpointed_iteration.txt" in names or any(n.startswith("iter_") for n in names) or \
            "metadata.json" in names and "common.pt" in names:
        return "megatron"
    if any(n.startswith("global_step") for n in names) or any(n.endswith("model_states.pt") for n in names):
        return "deepspeed"
    return None


def import_hint(path: str, fmt: str) -> str:
    return (f"; it looks like a {fmt} checkpoint: import it once with `elastor convert {path} DST --from {fmt}` "
            f"and load DST")


def check_manifest_paths(step_dir: str, man: Manifest) -> None:
    """Every name the manifest joins to ``step_dir`` resolves inside it (else UnsafeCheckpointError)."""
    for name in man.files:
        safe_join(step_dir, name, what="manifest file", allow_subdirs=True)  # rank_state/rank_N.json
    for t in man.tensors.values():
        for ch in t.chunks:
            if ch.file not in man.files:
                safe_join(step_dir, ch.file, what=f"chunk file of tensor {t.name!r}")
    for rank, name in man.rank_state_files.items():
        safe_join(step_dir, name, what=f"rank_state_files[{rank}]", allow_subdirs=True)


def read_manifest(step_dir: str) -> Manifest:
    p = os.path.join(step_dir, MANIFEST_NAME)
    try:
        text = read_regular_text(p, MAX_MANIFEST_BYTES, nofollow=True)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{step_dir} has no {MANIFEST_NAME}: it was never committed") from None
    except PermissionError:
        raise UnreadableCheckpointError(f"permission denied reading {p}: fix its permissions or run as a user who "
                                        f"may read it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise IncompleteCheckpointError(f"{p} is unreadable ({e})") from None
    man = Manifest.loads(text, where=p)
    named = step_of(os.path.basename(os.path.normpath(step_dir)))
    if named is not None and named != man.step:
        raise CorruptCheckpointError(f"{p} says step {man.step}, but its directory is named for step {named}: "
                                     f"renamed by hand or crafted; refusing it (rename the directory "
                                     f"{step_dirname(man.step)} if the manifest is right)")
    check_manifest_paths(step_dir, man)
    return man


# ---------------------------------------------------------------------------------- atomic commit
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two directory entries (Linux ``renameat2``); False where unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


_RENAME_NOREPLACE = 1


def _rename_noreplace(src: str, dst: str, root: str, step: int) -> None:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist (``renameat2(RENAME_NOREPLACE)``;
    where unsupported, a plain rename, which fails onto a non-empty directory as a committed step
    is); else :class:`DestinationNotEmptyError` (an import never replaces a step)."""
    from ..errors import DestinationNotEmptyError
    err = 0
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        fn = None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
    if fn is None or err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        if os.path.lexists(dst):
            err = errno.EEXIST
        else:
            try:
                os.rename(src, dst)
                return
            except OSError as e:
                err = e.errno or 0
    if err in (errno.EEXIST, errno.ENOTEMPTY):
        raise DestinationNotEmptyError(f"{root} already holds {step_dirname(step)} (committed meanwhile by another "
                                       f"import or save); an import never replaces a committed step: nothing was "
                                       f"committed, choose a new directory")
    raise OSError(err, os.strerror(err), src)


class AtomicCommit:
    """A write that appears whole or not at all: ``create`` -> write into ``path`` -> ``finalize``
    or ``abort``. As a context manager, an exception (or leaving without ``finalize``) aborts."""

    path: str
    finalized: bool = False
    aborted: bool = False

    def finalize(self, *args, **kwargs) -> str:  # pragma: no cover - interface
        raise NotImplementedError

    def abort(self) -> None:
        """Remove the temporary directory; touches nothing else. Idempotent."""
        if self.finalized or self.aborted:
            return
        self.aborted = True
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.finalized:
            self.abort()


class StepCommit(AtomicCommit):
    """One step of an elastor checkpoint root (protocol steps 1-4 in the module docstring)."""

    def __init__(self, root: str, step: int, tmp_dir: str, latest: LatestPolicy = LatestPolicy.ALWAYS,
                 sync: bool = True, check: bool = False):
        """``sync``: fsync the manifest, ``latest`` and the directories (durable storage); False on
        storage that does not outlive the node anyway (tmpfs: the renames are atomic all the same).
        ``check`` (imports): before the step is renamed into place, its manifest is parsed back as
        every reader parses it (:func:`read_manifest`), so a commit never produces a step its own
        readers refuse. Off for saves and memory snapshots (a full parse costs milliseconds every
        step; their manifests come from live tensors and a validated plan). An import also never
        replaces a step: the rename is ``RENAME_NOREPLACE``, so of two concurrent imports of one
        step the second fails (:class:`DestinationNotEmptyError`) instead of deleting the first's."""
        self.root, self.step, self.path, self.latest, self.sync = root, int(step), tmp_dir, latest, sync
        self.check = check
        self.replace = not check   # an import (check) never replaces a step, even one committed meanwhile

    def _write(self, path: str, text: str) -> None:
        atomic_write_text(path, text, sync=self.sync)

    def _sync_root(self) -> None:
        if self.sync:
            fsync_dir(self.root)

    @property
    def final_dir(self) -> str:
        return os.path.join(self.root, step_dirname(self.step))

    @classmethod
    def create(cls, root: str, step: int, nonce: Optional[str] = None,
               latest: LatestPolicy = LatestPolicy.ALWAYS, check: bool = False) -> "StepCommit":
        """Make ``root`` (if needed) and a fresh temp dir for ``step`` in it."""
        if not 0 <= int(step) <= INT64_MAX:
            raise CheckpointError(f"step {step} is not in 0..2**63-1 (what a manifest holds)")
        os.makedirs(root, exist_ok=True)
        tmp = os.path.join(root, tmp_dirname(step, nonce or f"{os.getpid()}_{uuid.uuid4().hex[:8]}"))
        os.makedirs(tmp)
        return cls(root, step, tmp, latest, check=check)

    @classmethod
    def adopt(cls, root: str, tmp_dir: str, step: int,
              latest: LatestPolicy = LatestPolicy.ALWAYS, sync: bool = True) -> "StepCommit":
        """Take over a temp dir created by someone else (every rank writes into it)."""
        return cls(root, step, tmp_dir, latest, sync)

    def finalize(self, manifest: Optional[Manifest] = None, keep: int = 0, retention: bool = False,
                 text: Optional[str] = None) -> str:
        """Commit; ``manifest`` None means the temp dir already holds its manifest; ``text``: the
        manifest already serialised (``manifest.dumps(...)``). Returns the step dir."""
        if self.finalized or self.aborted:
            raise CheckpointError(f"commit of {self.path} already {'finalized' if self.finalized else 'aborted'}")
        if manifest is not None:
            if manifest.step != self.step:
                raise CheckpointError(f"manifest step {manifest.step} != commit step {self.step}")
            self._write(os.path.join(self.path, MANIFEST_NAME), text if text is not None else manifest.dumps())
        elif not is_committed(self.path):
            raise IncompleteCheckpointError(f"{self.path} has no {MANIFEST_NAME} to commit")
        if self.check:
            try:
                read_manifest(self.path)
            except CheckpointError as e:
                raise CheckpointError(f"the step about to be committed under {self.root} would be refused by every "
                                      f"reader ({e}); nothing was committed") from None
        final = self.final_dir
        # never replace a `latest` someone else wrote (read once: it also decides whether to move it)
        cur = check_latest_replaceable(self.root) if self.latest is not LatestPolicy.NEVER else None
        try:
            st = os.lstat(final)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):   # a link or a file someone put there: never ours
            raise UnsafeCheckpointError(f"{final} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}, "
                                        f"not a step this engine wrote; nothing was replaced. Remove it, or save "
                                        f"under another root")
        if not self.replace:
            _rename_noreplace(self.path, final, self.root, self.step)
        elif st is None:
            os.rename(self.path, final)
        elif _exchange(self.path, final):
            self._sync_root()
            shutil.rmtree(self.path, ignore_errors=True)  # now the old step's content
        else:
            self._replace_without_exchange(final)
        self.finalized = True
        self._sync_root()
        if self._should_move_latest(cur):
            self._write(os.path.join(self.root, LATEST), os.path.basename(final) + "\n")
        if retention:
            apply_retention(self.root, keep, protect=final)
        return final

    def finalize_text(self, text: str) -> str:
        """:meth:`finalize` with the manifest given as its serialised text (no retention)."""
        if self.finalized or self.aborted:
            raise CheckpointError(f"commit of {self.path} already {'finalized' if self.finalized else 'aborted'}")
        self._write(os.path.join(self.path, MANIFEST_NAME), text)
        return self.finalize(None)

    def _replace_without_exchange(self, final: str) -> None:
        self._write(os.path.join(self.root, LATEST), os.path.basename(self.path) + "\n")
        aside = os.path.join(self.root, tmp_dirname(self.step, f"replaced{int(time.time() * 1e6)}"))
        os.rename(final, aside)
        os.rename(self.path, final)
        self._sync_root()
        self._write(os.path.join(self.root, LATEST), os.path.basename(final) + "\n")
        shutil.rmtree(aside, ignore_errors=True)

    def _should_move_latest(self, cur: Optional[str]) -> bool:
        """``cur``: the name ``latest`` held before this commit (read by :meth:`finalize`)."""
        if self.latest is LatestPolicy.ALWAYS:
            return True
        if self.latest is LatestPolicy.NEVER:
            return False
        cur_step = step_of(cur) if cur else None
        return cur_step is None or cur_step <= self.step


class DirCommit(AtomicCommit):
    """A whole directory written next to its destination and renamed into place."""

    def __init__(self, final: str, tmp_dir: str):
        self.final, self.path = final, tmp_dir

    @classmethod
    def create(cls, final: str, nonce: Optional[str] = None) -> "DirCommit":
        """Refuses a destination that exists and is not an empty directory (nothing is overwritten)."""
        final = os.path.abspath(final)
        check_empty_destination(final)
        if os.path.isdir(final) and os.path.ismount(final):
            from ..errors import DestinationNotEmptyError
            raise DestinationNotEmptyError(f"destination {final} is a mount point: the output is written beside its "
                                           f"destination, on the parent's file system, and renamed into place, which a "
                                           f"mount point cannot take; give a new folder inside it, e.g. {final}/export")
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp-{nonce or uuid.uuid4().hex[:12]}")
        try:   # private while written (and if the writer is killed): the final mode is given at finalize
            os.makedirs(tmp, mode=0o700, exist_ok=nonce is not None)
            os.chmod(tmp, 0o700)   # (an existing dir of a given nonce too)
        except OSError as e:   # name what the user asked for, not our temporary name beside it
            raise OSError(e.errno, f"cannot create {final}: {e.strerror or e} (in {parent})") from e
        return cls(final, tmp)

    def finalize(self) -> str:
        if self.finalized or self.aborted:
            raise CheckpointError(f"commit of {self.path} already {'finalized' if self.finalized else 'aborted'}")
        check_empty_destination(self.final)  # someone may have written there meanwhile
        if os.path.isdir(self.final):
            _take_over_mode(self.final, self.path)
            os.rmdir(self.final)  # empty (checked); fails rather than delete anything else
        else:   # the mode a plain mkdir gives it
            os.chmod(self.path, 0o777 & ~_umask())
        os.rename(self.path, self.final)
        self.finalized = True
        fsync_dir(os.path.dirname(self.final))
        return self.final


def _umask() -> int:
    """This process's umask, read without changing it (Linux ``/proc``); else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _take_over_mode(dst: str, tmp: str) -> None:
    """The user's empty destination directory is replaced by ``tmp``: give ``tmp`` its mode bits
    (a private 0700 directory stays private) and its group; where the group cannot be kept (not
    a member), the group's permission bits are dropped rather than granted to another group."""
    st = os.stat(dst, follow_symlinks=False)
    mode = st.st_mode & 0o7777
    if os.stat(tmp).st_gid != st.st_gid:
        try:
            os.chown(tmp, -1, st.st_gid)
        except OSError:
            mode &= ~(0o070 | 0o2000)
    os.chmod(tmp, mode)


def _is_checkpoint_dir(path: str) -> bool:
    """``path`` is a step directory, a root (``latest`` or committed steps) or an uncommitted save."""
    name = os.path.basename(path)
    if is_committed(path) or list_committed(path) or _STEP_RE.match(name) or name.startswith(TMP_PREFIX):
        return True
    try:
        latest = _latest_name(path)
    except CheckpointError:
        return False
    return latest is not None and bool(_STEP_RE.match(latest) or _TMP_RE.match(latest))


def step_dir_holding(path: str) -> Optional[str]:
    """The checkpoint step directory (committed, or a save in progress) that ``path`` is or lies
    in, else None: a root there would be deleted with that step by its own run's retention."""
    a = os.path.realpath(os.path.abspath(path))
    while True:
        name = os.path.basename(a)
        if _STEP_RE.match(name) or name.startswith(TMP_PREFIX) or is_committed(a):
            return a
        parent = os.path.dirname(a)
        if parent == a:
            return None
        a = parent


def check_outside_checkpoints(dst: str, src: Optional[str] = None) -> None:
    """A conversion's destination must not lie inside a checkpoint (its steps are renamed and
    deleted by commit and retention) nor inside the source, nor hold the source; else
    :class:`~elastor_ds.errors.ConfigError` naming the checkpoint."""
    from ..errors import ConfigError
    d = os.path.realpath(os.path.abspath(dst))
    if src is not None:
        s = os.path.realpath(os.path.abspath(src))
        if d == s or d.startswith(s.rstrip(os.sep) + os.sep) or s.startswith(d.rstrip(os.sep) + os.sep):
            raise ConfigError(f"destination {dst} and source {src} overlap (one holds the other); write the "
                              f"conversion to a directory outside the source")
    a = os.path.dirname(d)
    while True:
        if os.path.isdir(a) and _is_checkpoint_dir(a):
            raise ConfigError(f"destination {dst} lies inside the checkpoint {a}, whose steps are renamed and deleted "
                              f"by commits and retention; write the conversion to a directory outside any checkpoint")
        parent = os.path.dirname(a)
        if parent == a:
            return
        a = parent


def check_empty_destination(dst: str) -> None:
    """Raise :class:`DestinationNotEmptyError` unless ``dst`` is absent or an empty directory."""
    from ..errors import DestinationNotEmptyError
    if not os.path.lexists(dst):
        return
    if os.path.islink(dst):
        raise DestinationNotEmptyError(f"destination {dst} is a symbolic link (not followed); choose a new path or "
                                       f"the directory it points to")
    if not os.path.isdir(dst):
        raise DestinationNotEmptyError(f"destination {dst} exists and is not a directory; choose a new path")
    if os.listdir(dst):
        raise DestinationNotEmptyError(f"destination {dst} exists and is not empty; choose a new or empty directory "
                                       f"(nothing there is overwritten)")


# ---------------------------------------------------------------------------------- API kept for callers
def commit(root: str, tmp_dir: str, manifest: Manifest, keep: int, retention: bool = True,
           latest: LatestPolicy = LatestPolicy.ALWAYS, text: Optional[str] = None) -> str:
    """Commit ``tmp_dir`` (already holding every data file) as ``manifest.step``; see
    :meth:`StepCommit.finalize`. Returns the committed step directory."""
    return StepCommit.adopt(root, tmp_dir, manifest.step, latest).finalize(manifest, keep=keep, retention=retention,
                                                                            text=text)


def check_written(root: str, tmp_dir: str, step: int, names: "Iterable[str]") -> None:
    """Before a commit on shared storage: every file the ranks reported writing is in ``tmp_dir``
    (one listing per folder, no stat). A folder or file gone means something else deleted this
    save's temp dir while it was written, in practice a second job or engine saving into the same
    root (its retention removes temp dirs of steps it has committed); a rank that then wrote again
    would recreate the folder, so without this check a step could commit with files missing."""
    listed: dict[str, set] = {}
    for name in names:
        sub, base = os.path.split(name)
        if sub not in listed:
            try:
                listed[sub] = set(os.listdir(os.path.join(tmp_dir, sub)))
            except FileNotFoundError:
                listed[sub] = set()
        if base not in listed[sub]:
            raise vanished(root, tmp_dir, step, name)


def vanished(root: str, tmp_dir: str, step: int, name: str) -> ConcurrentWriterError:
    other = ("" if not os.path.isdir(tmp_dir) else
             " (or the ranks that wrote it see another folder under this path: the checkpoint dir must be storage "
             "every node shares)")
    where = (f"its temporary folder {tmp_dir} vanished" if name == "its temporary folder"
             else f"{name} vanished from {tmp_dir}")
    return ConcurrentWriterError(
        f"save of step {step}: {where} while the save was writing; another writer (a second "
        f"job or CheckpointEngine) is saving into {root} and removed this save's temporary folder{other}. Nothing "
        f"of this save was committed; give each job its own checkpoint directory")


def commit_text(root: str, tmp_dir: str, step: int, text: str, sync: bool = True) -> str:
    """Commit ``tmp_dir`` with an already serialised manifest ``text`` of ``step`` (memory snapshots:
    rank 0 renders it from a template, other nodes commit the same text); ``sync``: see
    :class:`StepCommit`. Returns the step dir."""
    try:
        return StepCommit.adopt(root, tmp_dir, step, sync=sync).finalize_text(text)
    except (FileNotFoundError, IncompleteCheckpointError):
        if os.path.isdir(tmp_dir) or not os.path.isdir(root):
            raise
        raise vanished(root, tmp_dir, step, "its temporary folder") from None


def apply_retention(root: str, keep: int, protect: str | None = None, recycle_dir: str | None = None,
                    recycle_names: Optional[set] = None, unusable: "frozenset[str] | set[str]" = frozenset()
                    ) -> list[str]:
    """Delete committed checkpoints beyond the newest ``keep`` (>= 1) and stale temp dirs; never
    ``protect``, never the step ``latest`` names, never one newer than ``protect``.
    ``recycle_dir`` (memory snapshots): the data files (``*.safetensors``) of a deleted committed
    step are moved there first, for the next save to write over (no longer part of any checkpoint).
    ``recycle_names``: the data files a rank of the current job will take (the others, e.g. of
    ranks gone after a shrink, are deleted instead, also from ``recycle_dir``: their memory).
    ``unusable``: step dirs a load of this process found corrupt and fell back past. They do not
    count among the ``keep`` newest, so a good older step is not deleted in favour of a bad one; one
    newer than the oldest step kept stays (for a look), an older one goes as any old step does."""
    keep = max(1, keep)
    removed = []
    left: list[tuple[str, str]] = []   # (path, why) of what retention leaves alone
    committed = list_committed(root)
    bad = {os.path.abspath(p) for p in unusable}
    limit = step_of(os.path.basename(protect)) if protect else None
    # the ``keep`` newest are counted up to the step just committed: steps above it are another
    # trajectory's (a run started over with load "none" in a used folder, or one that went back to
    # an older step), kept for a look, never counted; counted, they made retention delete this
    # run's own previous step, which then was missing as the fallback of its newest
    good = [(s, p) for s, p in committed if os.path.abspath(p) not in bad and (limit is None or s <= limit)]
    newest_good = {os.path.abspath(p) for _, p in good[-keep:]}
    oldest_kept = min((s for s, p in good[-keep:]), default=None)
    keep_paths = {os.path.abspath(p) for p in (protect,) if p}
    try:
        cur = read_latest(root)
    except CheckpointError:
        cur = None
    if cur:
        keep_paths.add(os.path.abspath(cur))
    for step, path in committed:
        ap = os.path.abspath(path)
        if ap in newest_good or ap in keep_paths or (limit is not None and step > limit):
            continue
        if ap in bad and oldest_kept is not None and step > oldest_kept:
            continue
        if os.path.islink(path):   # a link someone put there: never followed, never removed
            continue
        if recycle_dir is None:   # storage (a memory snapshot's folder is private to the job)
            why = _not_ours(path)
            if why:   # another user's, or files added to it: retention deletes only what saves made
                left.append((path, f"a committed step, but {why}"))
                continue
        if recycle_dir is not None:
            recycle_data_files(path, recycle_dir, recycle_names)
        if _remove_via_trash(root, path, step):
            removed.append(path)
    # temp dirs up to the step just committed are stale; a later save (another rank's writer may
    # be in it already) writes a newer one. Not the newest committed step: after a run went back
    # to an older step (a reload, load "none" into a used folder), steps of the trajectory it left
    # stay, and every save of the new one is below them
    newest = limit if limit is not None else max((s for s, _ in committed), default=-1)
    for n in os.listdir(root):
        p = os.path.join(root, n)
        tmp_step = step_of(n) if n.startswith(TMP_PREFIX) else None
        if tmp_step is None or os.path.abspath(p) in keep_paths:
            continue
        if tmp_step <= newest:
            why = _not_ours(p)
            if why:
                left.append((p, f"named like a save's temp dir, but {why}"))
                continue
            if _remove_via_trash(root, p, tmp_step):
                removed.append(p)
    if recycle_dir is not None and recycle_names is not None:
        try:
            spare = [n for n in os.listdir(recycle_dir) if n not in recycle_names]
        except OSError:
            spare = []
        for n in spare:
            try:
                os.unlink(os.path.join(recycle_dir, n))
            except OSError as e:
                log.debug("could not remove %s/%s: %s", recycle_dir, n, e)
    _say_left_alone(left)
    if removed:   # memory snapshots (recycle_dir) retire a step every iteration: not worth an INFO line each
        log.log(logging.DEBUG if recycle_dir is not None else logging.INFO, "retention removed %s",
                ", ".join(os.path.basename(p) for p in removed))
    return removed


def _remove_via_trash(root: str, path: str, step: int) -> bool:
    """Remove the directory ``path`` of ``root``: first renamed to a fresh temp name (atomic), then
    deleted there. A delete that walked ``path`` itself could go on emptying the directory after a
    concurrent save renamed it to its step (another engine committing into the same root: the
    step then stayed committed without its files, QA round 7); after the rename only one of the two
    renames wins, and the loser's commit fails. False when ``path`` was gone or could not be moved."""
    trash = os.path.join(root, tmp_dirname(step, f"gone{os.getpid()}_{uuid.uuid4().hex[:8]}"))
    try:
        os.rename(path, trash)
    except OSError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


_TEMP_ENTRY = re.compile(r"^(data_\d{5,}\.(safetensors|crc32)|manifest\.json(\.tmp\.\d+)?)$")
_STATE_ENTRY = re.compile(r"^rank_\d{5,}\.json$")
_left_alone: set = set()   # temp-dir-like entries retention already said it leaves (said once each)


def _say_left_alone(left: list[tuple[str, str]]) -> None:
    """One warning for the entries retention leaves alone that it has not named before (a few by
    name, then a count: a root sprayed with thousands of look-alike folders is one line)."""
    new = [(p, why) for p, why in left if p not in _left_alone]
    if not new:
        return
    if len(_left_alone) < 100_000:
        _left_alone.update(p for p, _ in new)
    named = "; ".join(f"{p}: {why}" for p, why in new[:3])
    more = f" (and {len(new) - 3} more such entries)" if len(new) > 3 else ""
    log.warning("retention leaves alone what no save of this user made: %s%s", named, more)


def _not_ours(path: str) -> str:
    """Why ``path`` (a ``step_*`` or ``.tmp_step_*`` folder) is not one a save of ours made, or ""
    when it is one: a real directory of this user holding only the files a save writes (data files,
    CRC tables, rank state files, the manifest and its temp names). Retention deletes nothing else."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return "it is not a directory"
        if st.st_uid != os.geteuid():
            return f"it belongs to uid {st.st_uid}"
        with os.scandir(path) as it:
            for e in it:
                if e.name == "rank_state" and e.is_dir(follow_symlinks=False):
                    with os.scandir(e.path) as inner:
                        bad = next((x.name for x in inner
                                    if not (_STATE_ENTRY.match(x.name) and x.is_file(follow_symlinks=False))), None)
                    if bad is not None:
                        return f"it holds rank_state/{bad[:80]!r}, which no save writes"
                elif not (_TEMP_ENTRY.match(e.name) and e.is_file(follow_symlinks=False)):
                    return f"it holds {e.name[:80]!r}, which no save writes"
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    return ""


def recycle_data_files(step_dir: str, dest: str, names_wanted: Optional[set] = None,
                       markers: tuple[str, ...] = (MANIFEST_NAME,)) -> None:
    """Move a doomed step dir's data files (``*.safetensors`` at its top level; only
    ``names_wanted`` when given) into ``dest`` (replacing older ones there), for a later write to
    reuse their pages. ``markers`` (the manifest; a peer copy's ``COMPLETE`` too) go first, so the
    step dir stops being a checkpoint before any data file leaves it. Never raises."""
    try:
        names = [n for n in os.listdir(step_dir) if n.endswith(".safetensors") and "/" not in n
                 and (names_wanted is None or n in names_wanted)]
        os.makedirs(dest, exist_ok=True)
        for marker in markers:
            try:
                os.unlink(os.path.join(step_dir, marker))
            except FileNotFoundError:
                pass
    except OSError as e:
        log.debug("not recycling %s: %s", step_dir, e)
        return
    for n in names:
        try:
            if not stat.S_ISREG(os.lstat(os.path.join(step_dir, n)).st_mode):   # a link is never recycled
                continue
            os.replace(os.path.join(step_dir, n), os.path.join(dest, n))
        except OSError as e:
            log.debug("not recycling %s/%s: %s", step_dir, n, e)


def check_import_destination(root: str, step: Optional[int] = None, force: bool = False) -> None:
    """May an import commit ``step`` under ``root``? Yes when ``root`` is absent or empty. A
    non-empty ``root`` needs ``force`` and must be an elastor checkpoint root without that step
    (an import adds a step; it never replaces one, never moves ``latest`` back, runs no retention).
    ``step`` None checks everything but the step."""
    from ..errors import DestinationNotEmptyError
    if os.path.islink(root):   # an import writes nothing through a link (it could lead anywhere)
        raise DestinationNotEmptyError(f"destination {root} is a symbolic link (to {os.readlink(root)!r}); an import "
                                       f"never writes through a link: give the directory's own path")
    if not os.path.lexists(root) or (os.path.isdir(root) and not os.listdir(root)):
        return
    if not os.path.isdir(root):
        raise DestinationNotEmptyError(f"destination {root} exists and is not a directory; choose a new path")
    entries = os.listdir(root)
    leftovers = sorted(n for n in entries if _IMPORT_TMP_RE.match(n))
    if leftovers and len(leftovers) == len(entries):   # nothing but what a killed import leaves
        shown = ", ".join(repr(n) for n in leftovers[:4]) + (", ..." if len(leftovers) > 4 else "")
        raise DestinationNotEmptyError(
            f"destination {root} holds only the leftovers of an interrupted import ({shown}: the temporary folders "
            f"of an import that was killed before it committed; nothing in them is a checkpoint). You may delete "
            f"them (rm -rf {shlex.quote(root.rstrip('/') or '/')}/{TMP_PREFIX}*) and rerun, or choose a new directory")
    if not force:
        raise DestinationNotEmptyError(f"destination {root} is not empty; choose a new directory, or pass --force to "
                                       f"add the imported step to this elastor checkpoint root (nothing is replaced "
                                       f"or deleted and 'latest' never moves to an older step)")
    if not list_committed(root) and _latest_name(root) is None:
        raise DestinationNotEmptyError(f"destination {root} is not empty and is not an elastor checkpoint root (no "
                                       f"step_* dirs, no 'latest'); refusing even with --force: choose a new directory")
    if step is not None and os.path.lexists(os.path.join(root, step_dirname(step))):
        raise DestinationNotEmptyError(f"destination {root} already holds {step_dirname(step)}; an import never "
                                       f"replaces a committed step: choose a new directory")
