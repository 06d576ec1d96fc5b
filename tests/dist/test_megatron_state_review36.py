"""Review 36 of ``save_gpt`` / ``load_gpt`` (megatron-core library API), on 2 gloo ranks (TP2, so the
vocabulary has padding rows: 120 true rows padded to 128, rows 56..63 of rank 1's half):

* megatron-core's own ``ChainedOptimizer`` (its ``state`` is a ``ProxyDict`` without ``get``; was an
  untyped AttributeError on every rank) over two torch Adams saves, and loads into another chain split
  elsewhere: every weight, moment and the step bit-identical to the ranks' own tensors at save time,
  padding rows zero. An optimizer elastor cannot read is a ConfigError naming its type and the fix.
* a ``load_gpt`` that fails leaves the caller's model and optimizer bit-identical to clones taken before
  it: a checkpoint with a flipped byte (fails while reading, after other tensors were written) and one
  without the optimizer state asked for (fails before reading). Was: the padding rows zeroed and zero
  Adam state created before the engine failed, and the read-into weights left as a mix.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("megatron.core")

from dist_utils import run_world  # noqa: E402

STEP = 3
VOCAB, PADDED, TP = 120, 128, 2          # tiny_gpt_config: vocab 120, divisible by 8 * TP -> 128
VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


def _setup(seed: int):
    import torch

    from elastor_ds.testing import megatron_cpu
    megatron_cpu.apply()
    from elastor_ds.integrations.megatron import initialize_from_layout
    from elastor_ds.integrations.megatron.model import build_gpt
    from elastor_ds.layout import Layout
    from elastor_ds.testing.megatron_gpt import tiny_gpt_config

    cfg = tiny_gpt_config(num_layers=2)
    assert cfg.vocab_size == VOCAB
    layout = Layout.uniform(TP, 1, 1, cfg.num_layers)
    grid = initialize_from_layout(layout)
    torch.manual_seed(seed)
    model = build_gpt(cfg, grid, parallel_output=False)
    return cfg, layout, model


def _chain(model, split: int):
    """megatron-core's ChainedOptimizer over two torch Adams (parameters [:split] and [split:])."""
    import torch
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    ps = list(model.parameters())
    return ChainedOptimizer([torch.optim.Adam(ps[:split], lr=1e-2), torch.optim.Adam(ps[split:], lr=1e-2)])


def _step(model, opts) -> None:
    import torch

    g = torch.Generator().manual_seed(11)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    for o in opts:
        o.step()


def _engine(root: str, name: str = "ckpt"):
    from elastor_ds.checkpoint.engine import CheckpointEngine
    from elastor_ds.comm import TorchComm

    return CheckpointEngine(os.path.join(root, name), TorchComm.create(60))


def _snapshot(model, state_of) -> dict:
    """Clones of every parameter and its optimizer state (``state_of(p)``: a dict, or None)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        st = state_of(p) or {}
        for k, v in st.items():
            out[f"{k}/{name}"] = v.clone() if hasattr(v, "clone") else v
    return out


def _save_chained(rank: int, world: int, root: str) -> None:
    """Step STEP with a ChainedOptimizer, and a per-rank oracle: the rank's own tensors at save time."""
    import torch

    from elastor_ds.integrations.megatron import save_gpt

    cfg, layout, model = _setup(0)
    chain = _chain(model, 3)
    _step(model, chain.chained_optimizers)
    assert not hasattr(chain.state, "get")   # the object the old code called .get on
    eng = _engine(root)
    save_gpt(eng, STEP, model, cfg, layout, chain)
    eng.finalize()
    state_of = lambda p: next(o.state[p] for o in chain.chained_optimizers if p in o.state)  # noqa: E731
    torch.save(_snapshot(model, state_of), os.path.join(root, f"oracle_{rank}.pt"))


def _save_plain(rank: int, world: int, root: str) -> None:
    """Step STEP with one torch Adam (``ckpt``); step 5 of the weights alone (``weights_only``)."""
    import torch

    from elastor_ds.integrations.megatron import save_gpt

    cfg, layout, model = _setup(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _step(model, [opt])
    for name, args in (("ckpt", (STEP, model, cfg, layout, opt)), ("weights_only", (5, model, cfg, layout))):
        eng = _engine(root, name)
        save_gpt(eng, *args)
        eng.finalize()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mcore36_chained"))
    run_world(_save_chained, 2, root, timeout_s=180)
    return root


@pytest.fixture(scope="module")
def saved_plain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mcore36_plain"))
    run_world(_save_plain, 2, root, timeout_s=180)
    return root


def _padding_rows(name: str, rank: int) -> range:
    """Local rows of ``name`` on TP rank ``rank`` that are vocabulary padding (hand-computed)."""
    if name not in VOCAB_NAMES:
        return range(0)
    per = PADDED // TP
    return range(max(0, VOCAB - rank * per), per)


def _load_chained(rank: int, world: int, root: str) -> None:
    import torch

    from elastor_ds.integrations.megatron import load_gpt

    cfg, layout, model = _setup(100 + rank)
    chain = _chain(model, 5)                  # split elsewhere than at save time
    res = load_gpt(_engine(root), None, model, cfg, layout, chain)
    assert res.step == STEP
    oracle = torch.load(os.path.join(root, f"oracle_{rank}.pt"))
    checked = 0
    for name, p in model.named_parameters():
        st = next(o.state[p] for o in chain.chained_optimizers if p in o.state)
        for key, t in (("", p.detach()), ("exp_avg/", st["exp_avg"]), ("exp_avg_sq/", st["exp_avg_sq"])):
            want = oracle[key + name].clone()
            pad = _padding_rows(name, rank)
            if len(pad):
                assert want[pad.start:].abs().sum() > 0, "the oracle's padding rows were nonzero at save time"
                want[pad.start:] = 0
            assert torch.equal(t, want), f"rank {rank}: {key}{name} differs from the rank's tensor at save time"
            checked += 1
        assert float(st["step"]) == float(oracle["step/" + name]) == 1.0
    assert checked == 3 * len(list(model.parameters())) > 0
    assert any(len(_padding_rows(n, rank)) for n, _ in model.named_parameters()) == (rank == 1)


def test_chained_optimizer_saves_and_loads_into_another_chain(saved):
    run_world(_load_chained, 2, saved, timeout_s=180)


class MyChain:
    """A user's own chain of optimizers, state as megatron's ProxyDict, no ``chained_optimizers``."""

    def __init__(self, opts):
        from megatron.core.optimizer.optimizer import ProxyDict

        self.opts = opts
        self.param_groups = [g for o in opts for g in o.param_groups]
        self.state = ProxyDict([o.state for o in opts])


def _refused(rank: int, world: int, root: str) -> None:
    import torch

    from elastor_ds.errors import ConfigError
    from elastor_ds.integrations.megatron import load_gpt, save_gpt

    cfg, layout, model = _setup(7)
    ps = list(model.parameters())
    opt = MyChain([torch.optim.Adam(ps[:2]), torch.optim.Adam(ps[2:])])
    before = _snapshot(model, lambda p: None)
    eng = _engine(root, "refused")
    for fn, args in ((save_gpt, (eng, 1, model, cfg, layout, opt)), (load_gpt, (_engine(root), None, model, cfg,
                                                                                 layout, opt))):
        with pytest.raises(ConfigError, match=r"failed on 2 of 2 ranks: .*optimizer "
                                              r"test_megatron_state_review36\.MyChain has no param_groups list and "
                                              r"state mapping \(state is ProxyDict\).*ChainedOptimizer"):
            fn(*args)
    after = _snapshot(model, lambda p: None)
    assert all(torch.equal(before[k], after[k]) for k in before)
    eng.finalize()
    assert not any(n.startswith("step_") for n in os.listdir(os.path.join(root, "refused")))


def test_optimizer_without_a_state_mapping_is_a_config_error_naming_it(tmp_path):
    run_world(_refused, 2, str(tmp_path), timeout_s=180)


# ---------------------------------------------------------------- a failed load changes nothing
def _flip_embedding_bytes(ckpt: str) -> None:
    """Flip one byte of rows 0 and VOCAB-1 of the embedding (one in each TP rank's half), found from
    the manifest's chunk boxes."""
    step_dir = os.path.join(ckpt, open(os.path.join(ckpt, "latest")).read().strip())
    man = json.load(open(os.path.join(step_dir, "manifest.json")))
    t = man["tensors"]["embedding.word_embeddings.weight"]
    assert t["dtype"] == "float32"
    flipped = 0
    for row in (0, VOCAB - 1):
        for ch in t["chunks"]:
            (r0, c0), (nr, nc) = ch["region"]
            if r0 <= row < r0 + nr:
                with open(os.path.join(step_dir, ch["file"]), "r+b") as f:
                    at = ch["offset"] + ((row - r0) * nc + nc // 2) * 4 + 1
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0x10]))
                flipped += 1
                break
    assert flipped == 2


def _failed_load(rank: int, world: int, root: str, case: str, opt_state: str, restore: bool) -> None:
    import torch

    from elastor_ds.errors import CorruptCheckpointError, TensorMismatchError
    from elastor_ds.integrations.megatron import load_gpt

    cfg, layout, model = _setup(200 + rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if opt_state == "stepped":
        _step(model, [opt])
    state_of = lambda p: opt.state.get(p)  # noqa: E731
    before = _snapshot(model, state_of)
    if rank == 1:   # the padding rows are nonzero before: zeroing them would show
        assert all(before[n][_padding_rows(n, rank).start:].abs().sum() > 0 for n in VOCAB_NAMES)
    if case == "corrupt":
        err, ckpt = CorruptCheckpointError, "corrupt"
    else:   # a checkpoint of the weights alone, loaded with an optimizer (strict): fails before any read
        err, ckpt = TensorMismatchError, "weights_only"
    with pytest.raises(err):
        load_gpt(_engine(root, ckpt), None, model, cfg, layout, opt, restore_on_failure=restore)
    after = _snapshot(model, state_of)
    assert sorted(after) == sorted(before), f"rank {rank}: the optimizer state's keys changed"
    changed = [k for k in before if not (torch.equal(before[k], after[k]) if torch.is_tensor(before[k])
                                         else before[k] == after[k])]
    if restore or case == "mismatch":
        assert changed == [], f"rank {rank}: a failed load_gpt changed {changed[:6]}"
    else:
        # without the host copy the bytes the engine read stay (documented); nothing else changes: no
        # padding row zeroed, no state created (the assertions above)
        assert changed, "the corrupt load failed before writing anything: this case tests nothing"
        for n in VOCAB_NAMES:
            pad = _padding_rows(n, rank)
            if n in before and len(pad):
                assert torch.equal(after[n][pad.start:], before[n][pad.start:]), f"{n}: padding rows touched"


@pytest.mark.parametrize("case,opt_state,restore", [
    ("corrupt", "fresh", True), ("corrupt", "stepped", True), ("mismatch", "fresh", True),
    ("corrupt", "stepped", False)], ids=["corrupt-fresh", "corrupt-stepped", "mismatch-fresh", "corrupt-no-restore"])
def test_failed_load_leaves_model_and_optimizer_as_they_were(saved_plain, tmp_path, case, opt_state, restore):
    root = str(tmp_path)
    if case == "corrupt":
        shutil.copytree(os.path.join(saved_plain, "ckpt"), os.path.join(root, "corrupt"))
        _flip_embedding_bytes(os.path.join(root, "corrupt"))
    else:
        shutil.copytree(os.path.join(saved_plain, "weights_only"), os.path.join(root, "weights_only"))
    run_world(_failed_load, 2, root, case, opt_state, restore, timeout_s=180)
