"""The docs stay true (README.md, docs/*.md, bench/README.md).

* every relative link resolves: the file exists and a ``#anchor`` names one of its headings;
* every ``elastor`` command written in a code block or code span names a real subcommand, and each
  of its flags exists in that subcommand's parser (the parser ``elastor --help`` prints, built in
  process by :func:`elastor_ds.cli.build_parser`);
* every flag of every subcommand is documented: in a flag table under a heading that names the
  subcommand, and every alias somewhere in the docs;
* every config key of the DeepSpeed ``"elastor"`` section named in a key table exists in the schema
  and every schema key has a row; every JSON block parses, and those holding an ``"elastor"``
  section, a plan document or a profile are accepted by the code that reads them;
* every repository path and ``elastor_ds.*`` module named in code exists;
* the checkpoint reader printed in docs/checkpoint-format.md reads a checkpoint written by the
  engine, bit for bit, and rejects a flipped byte.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

# the repository root (this file may sit in a tier folder under tests/)
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


# ------------------------------------------------------------------ markdown helpers
def split_markdown(text: str) -> tuple[list[tuple[str, str]], list[str]]:
    """(code blocks as (info string, body), prose lines outside code blocks)."""
    blocks, prose, cur, info, fence = [], [], None, "", ""
    for line in text.splitlines():
        m = FENCE.match(line)
        if cur is None and m:
            cur, info, fence = [], m.group(3).strip(), m.group(2)
        elif cur is not None and m and m.group(2).startswith(fence[0]) and len(m.group(2)) >= len(fence) \
                and not m.group(3).strip():
            blocks.append((info, "\n".join(cur)))
            cur = None
        elif cur is not None:
            cur.append(line)
        else:
            prose.append(line)
    assert cur is None, "unclosed code fence"
    return blocks, prose


def code_spans(line: str) -> list[str]:
    return re.findall(r"`([^`]+)`", line)


def first_cell(row: str) -> str:
    """The first cell of a table row (``\\|`` is a pipe inside a cell, not a separator)."""
    return re.split(r"(?<!\\)\|", row)[1]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, markup dropped, lower case, punctuation
    removed (letters, digits, '_', '-' and spaces kept), spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(prose: list[str]) -> list[tuple[int, str]]:
    out = []
    for line in prose:
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            out.append((len(m.group(1)), m.group(2)))
    return out


def anchors(path: Path) -> set[str]:
    _, prose = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for _, h in headings(prose):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def doc_texts() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in DOC_FILES if p.exists()}


# ------------------------------------------------------------------ links
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_relative_links_resolve():
    bad = []
    for path, text in doc_texts().items():
        _, prose = split_markdown(text)
        # inline code is not a link: drop code spans before looking for links
        body = "\n".join(re.sub(r"`[^`]*`", "", line) for line in prose)
        for target in LINK.findall(body):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                bad.append(f"{where}: {file_part} does not exist")
                continue
            if ROOT not in dest.parents and dest != ROOT:
                bad.append(f"{where}: points outside the repository")
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)


def test_the_readme_stays_short_and_its_picture_small():
    assert (ROOT / "README.md").stat().st_size <= 12 * 1024
    png = ROOT / "docs" / "img" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size <= 200 * 1024


# ------------------------------------------------------------------ the CLI
def subparsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from elastor_ds.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(sub.choices)


def option_map(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in parser._actions for s in a.option_strings}


SHELL_STOP = {"&&", "||", ";", "|", ">", ">>", "2>&1", "<", "#"}


def logical_lines(block: str) -> list[str]:
    """Lines of a shell block with backslash continuations joined."""
    out, cur = [], ""
    for line in block.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def commands_in(text: str) -> list[str]:
    """Every ``elastor ...`` command written in code: the text from ``elastor`` to the end of its
    logical line (code blocks) or code span."""
    blocks, prose = split_markdown(text)
    pieces = [line for _, body in blocks for line in logical_lines(body)]
    pieces += [span for line in prose for span in code_spans(line)]
    out = []
    for piece in pieces:
        # a command starts a line (after a prompt) or follows a shell operator; "an elastor
        # checkpoint" in the middle of a sentence is not one
        for m in re.finditer(r"(?:^\s*(?:\$\s+)?|(?:&&|\|\||;|\||\$\()\s*)(elastor)(?=\s+[-a-z])", piece):
            out.append(piece[m.start(1):])
    return out


def tokens(cmd: str) -> list[str]:
    try:
        toks = shlex.split(cmd, comments=True)
    except ValueError:
        toks = cmd.split()
    out = []
    for t in toks:
        if t in SHELL_STOP or t.startswith(("#", ">")):
            break
        t = t.strip("[]")
        if t.startswith("--") and "|" in t and all(p.startswith("--") for p in t.split("|")):
            out.extend(t.split("|"))
        elif t:
            out.append(t)
    return out


def check_command(cmd: str, top: argparse.ArgumentParser, subs: dict) -> list[str]:
    """Problems with one written command (empty if the parser knows every flag it names)."""
    toks = tokens(cmd)[1:]
    top_opts = option_map(top)
    while toks and toks[0].startswith("-"):
        if toks[0] not in top_opts:
            return [f"`{cmd}`: elastor has no option {toks[0]}"]
        toks = toks[1:]
    if not toks:
        return []
    name = toks[0]
    if name not in subs:
        # prose such as `elastor checkpoint` in a code span is not a command; a command line is
        return [f"`{cmd}`: no subcommand {name!r} (have {sorted(subs)})"] if re.fullmatch(r"[a-z]+", name) else []
    opts = option_map(subs[name])
    problems = []
    i = 1
    while i < len(toks):
        t = toks[i]
        if t.startswith("--"):
            flag = t.split("=", 1)[0]
            act = opts.get(flag)
            if act is None:
                problems.append(f"`{cmd}`: elastor {name} has no flag {flag}")
            elif act.nargs != 0 and "=" not in t:
                i += 1   # its value
        elif t.startswith("-") and len(t) > 1 and not t[1].isdigit():
            if t not in opts:
                problems.append(f"`{cmd}`: elastor {name} has no option {t}")
        elif name == "run" and not t.startswith(("<", "...")):
            break        # the script: everything after it is the script's
        i += 1
    return problems


def test_every_elastor_command_in_the_docs_parses():
    top, subs = subparsers()
    found, bad = 0, []
    for path, text in doc_texts().items():
        for cmd in commands_in(text):
            found += 1
            bad += [f"{path.relative_to(ROOT)}: {p}" for p in check_command(cmd, top, subs)]
    assert not bad, "\n".join(bad)
    assert found >= 20   # the check must have seen the docs' commands


def flag_tables() -> dict[str, set[str]]:
    """Flags listed in the first cell of table rows under a heading naming ``elastor <sub>``."""
    _, subs = subparsers()
    names = "|".join(map(re.escape, subs))
    found: dict[str, set[str]] = {s: set() for s in subs}
    for path, text in doc_texts().items():
        _, prose = split_markdown(text)
        stack: list[tuple[int, str | None]] = []
        for line in prose:
            m = re.match(r"^(#{1,6})\s+(.*)$", line)
            if m:
                level = len(m.group(1))
                stack = [e for e in stack if e[0] < level]
                sm = re.search(rf"`elastor ({names})`", m.group(2))
                stack.append((level, sm.group(1) if sm else None))
                continue
            ctx = next((s for _, s in reversed(stack) if s), None)
            if ctx and line.startswith("|"):
                first = first_cell(line)
                for span in code_spans(first):
                    found[ctx] |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", span))
    return found


def test_documented_flags_exist_and_every_flag_is_documented():
    top, subs = subparsers()
    tables = flag_tables()
    all_text = "\n".join(doc_texts().values())
    bad = []
    for name, parser in subs.items():
        opts = option_map(parser)
        for flag in sorted(tables[name]):
            if flag not in opts:
                bad.append(f"a table documents `elastor {name} {flag}`, which does not exist")
        for act in parser._actions:
            if not act.option_strings or "-h" in act.option_strings:
                continue
            if not set(act.option_strings) & tables[name]:
                bad.append(f"elastor {name} {'/'.join(act.option_strings)}: no row in a flag table under a "
                           f"heading naming `elastor {name}`")
            for s in act.option_strings:
                if not re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", all_text):
                    bad.append(f"elastor {name} {s}: not mentioned anywhere in the docs")
    for act in top._actions:
        for s in act.option_strings:
            if s not in ("-h", "--help") and not re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", all_text):
                bad.append(f"elastor {s}: not mentioned anywhere in the docs")
    for name in subs:
        if not re.search(rf"`elastor {name}`", all_text):
            bad.append(f"elastor {name}: no section names it")
    assert not bad, "\n".join(bad)


def test_every_environment_variable_is_documented():
    """Every ``ELASTOR_*`` name appears in docs/elastic.md. elastic/protocol.py owns the names (no
    other module spells one: tests/unit/test_protocol.py), so its list is the list to document."""
    from elastor_ds.elastic.protocol import ENV_NAMES
    text = (ROOT / "docs" / "elastic.md").read_text(encoding="utf-8")
    missing = [n for n in ENV_NAMES if not re.search(rf"\b{n}\b", text)]
    assert len(ENV_NAMES) >= 20 and not missing, f"not in docs/elastic.md: {missing}"


def test_every_event_kind_and_failure_cause_is_documented():
    from elastor_ds.elastic.events import EventKind
    from elastor_ds.elastic.policy import Cause
    text = (ROOT / "docs" / "elastic.md").read_text(encoding="utf-8")
    _, prose = split_markdown(text)
    rows = {code_spans(first_cell(line))[0] for line in prose
            if line.startswith("|") and code_spans(first_cell(line))}
    missing = [k.value for k in EventKind if k.value not in rows]
    assert not missing, f"event kinds without a row in docs/elastic.md's events table: {missing}"
    causes = [c.value for c in Cause if not re.search(rf"\b{c.value}\b", text)]
    assert not causes, f"failure causes not named in docs/elastic.md: {causes}"


def test_example_trainer_flags_in_the_docs_exist():
    """Flags given to ``examples/megatron_gpt/pretrain_gpt.py`` in the docs' commands are the
    trainer's (its ``--help``, run once in a subprocess)."""
    import subprocess
    import sys
    trainer = "examples/megatron_gpt/pretrain_gpt.py"
    out = subprocess.run([sys.executable, str(ROOT / trainer), "--help"], capture_output=True, text=True,
                         timeout=300, cwd=str(ROOT), env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", out.stdout))
    bad, seen = [], 0
    for path, text in doc_texts().items():
        blocks, prose = split_markdown(text)
        pieces = [line for _, body in blocks for line in logical_lines(body)]
        pieces += [span for line in prose for span in code_spans(line)]
        for piece in pieces:
            i = piece.find(trainer)
            if i < 0:
                continue
            seen += 1
            for t in tokens(piece[i + len(trainer):]):
                flag = t.split("=", 1)[0]
                if flag.startswith("--") and flag not in known:
                    bad.append(f"{path.relative_to(ROOT)}: {trainer} has no flag {flag}")
    assert seen >= 3 and not bad, "\n".join(bad) or f"only {seen} trainer commands found"


# ------------------------------------------------------------------ config keys, JSON documents
def schema_keys() -> dict[str, set[str]]:
    from elastor_ds.integrations.deepspeed import config as c
    from elastor_ds.checkpoint import settings as s
    return {"": set(c._TOP_KEYS), "checkpoint": set(s._CKPT_KEYS), "memory_snapshot": set(s._MEM_KEYS)}


def test_config_keys_in_the_docs_are_in_the_schema_and_all_documented():
    keys = schema_keys()
    rows = set()
    for text in doc_texts().values():
        _, prose = split_markdown(text)
        for line in prose:
            if not line.startswith("|"):
                continue
            spans = code_spans(first_cell(line))
            if len(spans) == 1 and re.fullmatch(r"(plan|model|profile|checkpoint|memory_snapshot)(\.[a-z_]+)?",
                                                spans[0]):
                rows.add(spans[0])
    bad = []
    for key in sorted(rows):
        section, _, sub = key.rpartition(".") if "." in key else ("", "", key)
        if section not in keys or sub not in keys[section]:
            bad.append(f"`{key}` is documented but the \"elastor\" config schema has no such key")
    want = {k for k in keys[""] if k not in ("checkpoint", "memory_snapshot")}
    want |= {f"{s}.{k}" for s in ("checkpoint", "memory_snapshot") for k in keys[s]}
    bad += [f"config key `{k}` has no row in a docs table" for k in sorted(want - rows)]
    assert not bad, "\n".join(bad)


def json_blocks():
    for path, text in doc_texts().items():
        blocks, _ = split_markdown(text)
        for info, body in blocks:
            if info.split()[:1] == ["json"]:
                yield path, body


def test_json_blocks_parse_and_are_accepted_by_their_readers():
    from elastor_ds.integrations.deepspeed.config import parse_elastor_section
    from elastor_ds.layout import Layout
    from elastor_ds.plan.cost import Profile
    seen = {"elastor": 0, "replicas": 0, "layer_time_s": 0}
    for path, body in json_blocks():
        try:
            doc = json.loads(body)
        except json.JSONDecodeError:
            doc = json.loads("{" + body + "}")   # a fragment: "key": {...}
        assert isinstance(doc, dict), f"{path}: JSON block is not an object"
        if "elastor" in doc:
            parse_elastor_section(doc["elastor"])
            seen["elastor"] += 1
        if "replicas" in doc:
            Layout.from_json(doc)
            seen["replicas"] += 1
        if "layer_time_s" in doc:
            Profile.from_dict(doc)
            seen["layer_time_s"] += 1
    assert seen["elastor"] >= 2 and seen["replicas"] >= 1 and seen["layer_time_s"] >= 1, seen


# ------------------------------------------------------------------ paths and modules named in code
TOP_DIRS = ("scripts", "bench", "examples", "patches", "tests", "elastor_ds", "docs")
PKG_DIRS = ("checkpoint", "comm", "elastic", "plan", "layout", "runtime", "integrations", "data", "testing")


def code_text(text: str) -> list[str]:
    blocks, prose = split_markdown(text)
    return [body for _, body in blocks] + [s for line in prose for s in code_spans(line)]


def test_paths_and_modules_named_in_code_exist():
    bad = []
    for path, text in doc_texts().items():
        rel = path.relative_to(ROOT)
        for piece in code_text(text):
            piece = re.sub(r"(^|[\s(`'\"=])\./", r"\1", piece, flags=re.M)   # ./scripts/x.sh -> scripts/x.sh
            for m in re.finditer(r"(?<![\w./<-])((?:%s)/[\w./-]*[\w/])" % "|".join(TOP_DIRS + PKG_DIRS), piece):
                p = m.group(1)
                if "*" in p or "<" in p:
                    continue
                top = p.split("/")[0]
                base = ROOT if top in TOP_DIRS else ROOT / "elastor_ds"
                if not (base / p).exists():
                    bad.append(f"{rel}: {p} does not exist")
                elif p.startswith("scripts/") and p.endswith(".sh") and not os.access(base / p, os.X_OK):
                    bad.append(f"{rel}: {p} is not executable")
            for m in re.finditer(r"(?<![\w.])elastor_ds(?:\.\w+)+", piece):
                parts = m.group(0).split(".")
                i = 1
                while i < len(parts) and ((ROOT / Path(*parts[:i + 1])).is_dir()
                                          or (ROOT / Path(*parts[:i + 1])).with_suffix(".py").is_file()):
                    i += 1
                mod_file = ROOT / Path(*parts[:i])
                mod_file = mod_file / "__init__.py" if mod_file.is_dir() else mod_file.with_suffix(".py")
                if i == 1 and parts[1] != "deepspeed":
                    bad.append(f"{rel}: {m.group(0)}: no module elastor_ds.{parts[1]}")
                elif i < len(parts) and mod_file.is_file():
                    src = mod_file.read_text(encoding="utf-8")
                    if not re.search(rf"(def|class)\s+{parts[i]}\b|^{parts[i]}\s*[:=]|\b{parts[i]}\b.*import|"
                                     rf"import.*\b{parts[i]}\b", src, re.M):
                        bad.append(f"{rel}: {m.group(0)}: {parts[i]} is not defined in {mod_file.relative_to(ROOT)}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the documented reader
def doc_reader() -> dict:
    text = (ROOT / "docs" / "checkpoint-format.md").read_text(encoding="utf-8")
    blocks, _ = split_markdown(text)
    code = next(body for info, body in blocks if info == "python" and "def read_tensor" in body)
    ns: dict = {}
    exec(compile(code, "docs/checkpoint-format.md", "exec"), ns)  # noqa: S102 - our own documentation
    return ns


def test_the_documented_reader_reads_an_engine_checkpoint(tmp_path):
    import numpy as np
    import torch

    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.checkpoint.shards import TensorShard, full_shard
    from elastor_ds.layout.region import Region

    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 2048, generator=g)                  # 2 MiB: stored as column tiles
    b = torch.randn(300, generator=g).to(torch.bfloat16)
    steps = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    f8 = torch.randn(40, generator=g).to(torch.float8_e4m3fn)   # a documented dtype the reader once lacked
    eng = CheckpointEngine(str(tmp_path))
    # two row halves from one process: two writers' worth of chunks
    eng.save(5, [TensorShard("w", (256, 2048), Region((0, 0), (128, 2048)), w[:128]),
                 TensorShard("w", (256, 2048), Region((128, 0), (128, 2048)), w[128:]),
                 full_shard("b", b), full_shard("optimizer.step.w", steps), full_shard("f8", f8),
                 full_shard("empty", torch.zeros(0, 3))])
    eng.wait()
    r = doc_reader()
    step_dir = r["resolve"](str(tmp_path))
    assert os.path.basename(step_dir) == "step_000000005"
    man = r["read_manifest"](step_dir)
    assert len(man["tensors"]["w"]["chunks"]) > 2            # the reader assembled several boxes
    assert np.array_equal(r["read_tensor"](step_dir, "w", man), w.numpy())
    assert np.array_equal(r["read_tensor"](step_dir, "b", man), b.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(r["read_tensor"](step_dir, "optimizer.step.w", man), steps.numpy())
    assert np.array_equal(r["read_tensor"](step_dir, "f8", man), f8.view(torch.uint8).numpy())
    assert r["read_tensor"](step_dir, "empty", man).shape == (0, 3)
    # `latest` naming a temp dir that was renamed into place (commit step 3, without exchange)
    (tmp_path / "latest").write_text(".tmp_step_000000005_1234_0\n")
    assert r["resolve"](str(tmp_path)) == step_dir
    # a flipped byte inside a chunk of w fails its block CRC
    c = man["tensors"]["w"]["chunks"][1]
    p = os.path.join(step_dir, c["file"])
    with open(p, "r+b") as f:
        f.seek(c["offset"] + c["length"] // 2)
        x = f.read(1)
        f.seek(c["offset"] + c["length"] // 2)
        f.write(bytes([x[0] ^ 0x10]))
    with pytest.raises(ValueError, match="fails its CRC"):
        r["read_tensor"](step_dir, "w", man)
