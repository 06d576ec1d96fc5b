"""The checkpoint engine alone, without training: save under one layout, load under another.

(The README's main job, a GPT trained through a lost worker and its return, is
``examples/megatron_gpt/elastic_demo.py``, which ``scripts/demo.sh`` runs.)

Phase ``save`` (e.g. 4 processes, TP2 x PP2 with Adam moments): every rank builds its shards of
a synthetic GPT state (vocab-parallel tied embedding, fused QKV with grouped query heads, gated
MLP, row-parallel projections), saves asynchronously through the checkpoint engine, and reports
its stall and time to durable. Phase ``load`` (e.g. 3 processes, a heterogeneous layout: replica 0
two TP1 stages with uneven layers, replica 1 one TP1 stage) loads the same checkpoint into the new
layout and checks every tensor bit-for-bit against the global tensors.

Run with torchrun, one process per rank of the layout::

    torchrun --nproc-per-node 4 -m elastor_ds.demo --phase save --ckpt /tmp/ck --layout tp=2,pp=2
    torchrun --nproc-per-node 3 -m elastor_ds.demo --phase load --ckpt /tmp/ck --layout plan.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys

import torch.distributed as dist

from .checkpoint.engine import CheckpointEngine
from .checkpoint.paths import printable
from .cli_types import positive_int
from .comm import TorchComm
from .errors import ElastorError
from .layout import Layout
from .testing.synthetic import GPTShape, check_rank_state, global_tensors, gpt_specs, optimizer_specs, rank_state

log = logging.getLogger("elastor.demo")


LAYOUT_FORMS = "tp=2,pp=2,dp=1[,boundaries=0:3:8], a plan JSON document, or a file holding one"
_LAYOUT_KEYS = ("tp", "pp", "dp", "boundaries")
# torchrun's environment: without it init_process_group fails with a traceback about RANK
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class UsageError(Exception):
    """A bad flag value or launch: one line on stderr, exit 2."""


def parse_layout(text: str, num_layers: int) -> Layout:
    """``--layout`` as a :class:`Layout`; :class:`UsageError` naming the value and the forms it takes."""
    try:
        return _parse_layout(text, num_layers)
    except (ElastorError, ValueError, OSError) as e:   # LayoutError, json's, int()'s, a file's
        raise UsageError(f"--layout {printable(text)[:200]}: {printable(e)}; give {LAYOUT_FORMS}") from None


def _parse_layout(text: str, num_layers: int) -> Layout:
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            return Layout.from_json(json.load(f), num_layers)
    if text.lstrip().startswith("{"):
        return Layout.from_json(json.loads(text), num_layers)
    parts: dict[str, str] = {}
    for p in text.split(","):
        key, eq, value = p.partition("=")
        if not eq or key.strip() not in _LAYOUT_KEYS or key.strip() in parts:
            raise ValueError(f"{p!r} is not one of {', '.join(k + '=...' for k in _LAYOUT_KEYS)} (each once)")
        parts[key.strip()] = value.strip()
    b = [int(x) for x in parts["boundaries"].split(":")] if "boundaries" in parts else None
    return Layout.uniform(int(parts.get("tp", 1)), int(parts.get("pp", 1)), int(parts.get("dp", 1)), num_layers, b)


def check_launch(nproc: int) -> None:
    """Started by torchrun (or another launcher that sets its environment), else :class:`UsageError`
    saying how to start it for a layout of ``nproc`` ranks."""
    missing = [k for k in _TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise UsageError(f"not started by torchrun ({', '.join(missing)} not set); run it as torchrun "
                         f"--nproc-per-node {nproc} -m elastor_ds.demo ... (one process per rank of the layout)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elastor_ds.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=["save", "load"], required=True)
    ap.add_argument("--ckpt", required=True, help="checkpoint root: written by --phase save, read by --phase load")
    ap.add_argument("--layout", required=True, help=LAYOUT_FORMS)
    ap.add_argument("--num-layers", type=positive_int, default=8)
    ap.add_argument("--hidden-size", type=positive_int, default=256, help="a multiple of 8 (8 heads)")
    ap.add_argument("--zero", action="store_true", help="ZeRO-1 partition the Adam moments across replicas")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    try:
        if args.hidden_size % 8:
            raise UsageError(f"--hidden-size {args.hidden_size}: give a multiple of 8 (the model has 8 heads)")
        layout = parse_layout(args.layout, args.num_layers)
        check_launch(layout.world_size)
    except UsageError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="[rank%(rank)s] %(message)s")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    old = logging.getLogRecordFactory()

    def factory(*a, **k):
        rec = old(*a, **k)
        rec.rank = rank
        return rec
    logging.setLogRecordFactory(factory)

    h = args.hidden_size
    shape = GPTShape(num_layers=args.num_layers, hidden=h, ffn=4 * h, heads=8, groups=4, vocab=1000, pad_multiple=128)
    if layout.world_size != world:
        log.error("layout %s needs %d processes but %d were launched; launch with --nproc-per-node %d",
                  layout.describe(), layout.world_size, world, layout.world_size)
        return 2
    specs = gpt_specs(shape)
    globs = global_tensors(specs + optimizer_specs(specs), args.seed)
    comm = TorchComm.create(120)
    eng = CheckpointEngine(args.ckpt, comm)
    if args.phase == "save":
        st = rank_state(layout, rank, specs, globs, args.zero and layout.dp > 1, fill=0.0)
        held = sum(s.tensor.numel() * s.tensor.element_size() for s in st.shards)
        stats = eng.save(100, st.shards, extra={"iteration": 100, "consumed_samples": 3200},
                         rank_state={"rank": rank}, model={"gpt": shape.__dict__},
                         layout=layout.to_json())
        done = eng.finalize()
        rows = comm.all_gather_object((held, stats.bytes_written, stats.stall_s, done.durable_s))
        if rank == 0:
            total_held = sum(r[0] for r in rows)
            total_written = sum(r[1] for r in rows)
            print(f"\nSAVE under {layout.describe()} on {world} processes -> {done.committed_dir}")
            print(f"{'rank':>4} {'held MiB':>9} {'wrote MiB':>9} {'stall ms':>9} {'durable ms':>10}")
            for r, (hb, wb, s, d) in enumerate(rows):
                print(f"{r:>4} {hb / 2**20:9.2f} {wb / 2**20:9.2f} {s * 1e3:9.1f} {d * 1e3:10.1f}")
            print(f"deduplication: ranks hold {total_held / 2**20:.1f} MiB, checkpoint stores "
                  f"{total_written / 2**20:.1f} MiB ({total_held / max(total_written, 1):.2f}x less)")
    else:
        dst = rank_state(layout, rank, specs, None, args.zero and layout.dp > 1)
        res = eng.load(None, dst.shards)
        errs = check_rank_state(layout, rank, specs, globs, dst)
        rows = comm.all_gather_object((len(errs), res.bytes_needed, res.bytes_read, res.seconds, errs[:2]))
        if rank == 0:
            print(f"\nLOAD of step {res.step} (saved under {Layout.from_json(res.manifest.layout).describe()} on "
                  f"{res.manifest.world_size} processes) into {layout.describe()} on {world} processes")
            print(f"{'rank':>4} {'needed MiB':>10} {'read MiB':>9} {'load ms':>8} {'mismatches':>10}")
            for r, (ne, nb, rb, s, _) in enumerate(rows):
                print(f"{r:>4} {nb / 2**20:10.2f} {rb / 2**20:9.2f} {s * 1e3:8.1f} {ne:>10}")
            bad = sum(r[0] for r in rows)
            print("every weight and Adam moment is bit-identical to the saved global tensors" if not bad else
                  f"MISMATCHES: {[r[4] for r in rows if r[4]]}")
            print(f"restored extra state: {res.extra}")
        if any(r[0] for r in rows):
            return 1
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
