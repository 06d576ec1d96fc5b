"""Review 32 of the DeepSpeed integration: what an elastor save/resume lost or changed that
DeepSpeed's own ``save_checkpoint``/``load_checkpoint`` of the same engine keeps.

Oracles, independent of the code under test: DeepSpeed's own save/load of the same engine (its
optimizer state, buffers, scheduler, client state), the losses of an uninterrupted run, and values
computed by hand. Each world is one process (gloo, CPU) unless the bug needs more ranks.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("deepspeed")

from dist_utils import run_world  # noqa: E402


def _cfg(ck: str, load: str, zero: int = 0, mb: int = 4, gas: int = 1, dp: int = 1, opt: bool = True,
         sched: bool = True, **elastor_ckpt) -> dict:
    c: dict = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": gas,
               "train_batch_size": mb * gas * dp, "zero_optimization": {"stage": zero},
               "steps_per_print": 10 ** 9, "wall_clock_breakdown": False,
               "elastor": {"checkpoint": {"dir": ck, "load": load, "async": False, **elastor_ckpt}}}
    if opt:
        c["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}
    if sched:
        c["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                         "warmup_num_steps": 10}}
    return c


def _base_opt(engine):
    o = engine.optimizer
    return o.optimizer if hasattr(o, "single_partition_of_fp32_groups") else o


def _opt_state(engine) -> dict:
    """The base optimizer's state, by parameter index, cloned (comparable after the engine trains on)."""
    sd = _base_opt(engine).state_dict()
    return {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
            for k, v in sd["state"].items()}


def _assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for i in want:
        assert sorted(got[i]) == sorted(want[i]), i
        for k, v in want[i].items():
            g = got[i][k]
            if torch.is_tensor(v):
                assert torch.is_tensor(g) and g.shape == v.shape and torch.equal(g.float(), v.float()), (i, k, g, v)
            else:
                assert g == v, (i, k)


def _plain_steps(engine, n: int, seed: int) -> list[float]:
    """``n`` optimizer steps of a plain (non-pipeline) engine on a fixed batch stream."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n * engine.gradient_accumulation_steps()):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        out.append(float(loss))
    return out


# --- 1. ZeRO-0 and a one-element parameter ------------------------------------------------------

def _one_element_worker(rank: int, world: int, d: str) -> None:
    from elastor_ds import deepspeed as eds

    def build(load):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        one = model[2].bias                                   # one element: Linear(16, 1).bias
        assert one.numel() == 1
        rest = [p for p in model.parameters() if p is not one]
        # the one-element parameter first in its group: the group's step count is read from it
        groups = [{"params": rest}, {"params": [one], "weight_decay": 0.0}]
        e, _, _, _ = eds.initialize(model=model, model_parameters=groups,
                                    config=_cfg(os.path.join(d, "ck_" + os.path.basename(load)), load))
        return e

    a = build("none")
    _plain_steps(a, 3, 1)
    a.save_checkpoint(os.path.join(d, "native"))           # DeepSpeed's files and an elastor checkpoint
    a.elastor.finalize()
    b = build(os.path.join(d, "ck_none"))                   # elastor's resume
    c = build("none")
    c.load_checkpoint(os.path.join(d, "native"))            # DeepSpeed's resume: the oracle
    res = {"elastor": _opt_state(b), "deepspeed": _opt_state(c)}
    res["losses"] = {k: _plain_steps(e, 2, 2) for k, e in (("a", a), ("b", b), ("c", c))}
    for e in (b, c):
        e.elastor.finalize()
    torch.save(res, os.path.join(d, "res.pt"))


def test_one_element_parameter_keeps_its_adam_moments_under_zero0(tmp_path):
    """Before: per-element state was saved only for numel() > 1 and a group's ``step`` only when its
    first parameter had more than one element; Linear(16, 1).bias lost its moments and every load
    failed "optimizer.exp_avg.2.bias is not in checkpoint"."""
    run_world(_one_element_worker, 1, str(tmp_path), timeout_s=120)
    res = torch.load(str(tmp_path / "res.pt"))
    ds = res["deepspeed"]
    assert any(v["exp_avg"].shape == (1,) for v in ds.values())    # the oracle holds the bias's moments
    _assert_same_state(res["elastor"], ds)
    assert res["losses"]["b"] == res["losses"]["a"] == res["losses"]["c"]


# --- 2. LR scheduler state and client_state keep their types -------------------------------------

def _pipe(num_blocks: int = 1, hidden: int = 16, extra_layers=()):
    from elastor_ds import deepspeed as eds
    from elastor_ds.testing import toy_pipe as toy
    ls = toy.layers(num_blocks=num_blocks, hidden=hidden)
    ls = [ls[0], *extra_layers, *ls[1:]]
    return eds.PipelineModule(ls, num_stages=1, loss_fn=toy.loss_fn, boundaries=[0, len(ls)])


def _train(engine, n: int, mb: int = 4) -> list[float]:
    from elastor_ds.testing import toy_pipe as toy
    it = toy.batches(int(engine.global_steps), 0, 1, engine.gradient_accumulation_steps(), mb)
    return [float(engine.train_batch(it)) for _ in range(n)]


def _types_worker(rank: int, world: int, d: str) -> None:
    from elastor_ds import deepspeed as eds

    def build(load):
        m = _pipe()
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        sch = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[5], gamma=0.1)
        e, _, _, _ = eds.initialize(model=m, optimizer=opt, lr_scheduler=sch,
                                    config=_cfg(os.path.join(d, "ck_" + os.path.basename(load)), load,
                                                opt=False, sched=False))
        return e

    def lrs(e):
        out = []
        for _ in range(4):
            _train(e, 1)
            out.append(e.get_lr()[0])
        return out

    cs = {"best_loss_per_epoch": {0: 4.1, 1: 3.9}, "shape": (2, 3), "pairs": [(1, "a"), {(0, 1): None}],
          "epoch": 1, "best": float("inf")}
    a = build("none")
    _train(a, 3)
    a.save_checkpoint(os.path.join(d, "native"), client_state=cs)
    a.elastor.finalize()
    b = build(os.path.join(d, "ck_none"))
    c = build("none")
    _, ds_cs = c.load_checkpoint(os.path.join(d, "native"))
    res = {"client_saved": cs, "client_elastor": b.elastor_client_state(),
           "client_deepspeed": {k: ds_cs[k] for k in cs},
           "milestones": {k: (type(e.lr_scheduler.milestones).__name__, dict(e.lr_scheduler.milestones))
                          for k, e in (("elastor", b), ("deepspeed", c))},
           "lrs": {k: lrs(e) for k, e in (("a", a), ("b", b), ("c", c))}}
    for e in (b, c):
        e.elastor.finalize()
    torch.save(res, os.path.join(d, "res.pt"))


def test_scheduler_and_client_state_keep_their_types(tmp_path):
    """Before: both went through JSON as is: MultiStepLR's milestones {5: 1} came back {"5": 1} (the
    LR never dropped at step 5), client_state's {0: 4.1} came back {"0": 4.1} and (2, 3) [2, 3]."""
    run_world(_types_worker, 1, str(tmp_path), timeout_s=120)
    res = torch.load(str(tmp_path / "res.pt"), weights_only=False)
    assert res["client_deepspeed"] == res["client_saved"]        # the oracle keeps them
    got = res["client_elastor"]
    assert got == res["client_saved"]
    assert type(got["shape"]) is tuple and type(got["pairs"][0]) is tuple
    assert list(got["best_loss_per_epoch"]) == [0, 1] and list(got["pairs"][1]) == [(0, 1)]
    assert res["milestones"]["elastor"] == res["milestones"]["deepspeed"] == ("Counter", {5: 1})
    # hand-computed: 1e-2 until step 5, then 1e-3 (steps 4..7 after the resume at 3)
    assert res["lrs"]["a"] == pytest.approx([1e-2, 1e-3, 1e-3, 1e-3])
    assert res["lrs"]["b"] == res["lrs"]["a"] == res["lrs"]["c"]


def test_type_tags_round_trip_and_old_scheduler_state_still_loads():
    """The tagged JSON gives every type back; a scheduler state saved by the old encoding (string
    keys, lists) is still read, with its keys and tuples taken from the live scheduler's."""
    import collections

    from elastor_ds.checkpoint.state import from_jsonable, like, to_jsonable, typed_to_json

    def through_json(x):
        return from_jsonable(json.loads(json.dumps(to_jsonable(x))))

    obj = {"a": (1, (2.5, "x")), "b": {0: [1, 2], 1.5: None, True: "t", None: 1, (3, 4): {"k": ()}},
           "c": [float("inf"), ()], "d": {}}
    back = through_json(typed_to_json(obj))
    assert back == obj and type(back["a"]) is tuple and type(back["a"][1]) is tuple
    assert list(back["b"]) == [0, 1.5, True, None, (3, 4)] and type(back["b"][(3, 4)]["k"]) is tuple

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sch = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 4], gamma=0.5)
    for _ in range(3):
        opt.step()
        sch.step()
    old = through_json(sch.state_dict())         # what a checkpoint of the old encoding reads back
    assert old["milestones"] == {"2": 1, "4": 1}
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sch2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[3], gamma=0.5)   # other milestones now
    sch2.load_state_dict(like(old, sch2.state_dict()))
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]     # the optimizer's own state (0.5 after step 2)
    assert sch2.milestones == collections.Counter({2: 1, 4: 1})
    seen = []
    for _ in range(2):
        opt2.step()
        sch2.step()
        seen.append(opt2.param_groups[0]["lr"])
    assert seen == [0.25, 0.25]                  # by hand: halved again at step 4
    # a key of non-ASCII digits ('\u00b2'.isdigit() is True, int() refuses it) stays a string
    assert like({"5": 1, "\u00b2": 2}, {3: 1}) == {5: 1, "\u00b2": 2}


# --- 3. buffers: every persistent one (any dtype), no non-persistent one --------------------------

class _BN(torch.nn.Module):
    """Batch norm with a cumulative average (momentum None): its integer ``num_batches_tracked``
    weighs every update."""

    def __init__(self, h: int):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(h, momentum=None)

    def forward(self, x):
        s = x.shape
        return self.bn(x.reshape(-1, s[-1])).reshape(s)


class _Rope(torch.nn.Module):
    """A non-persistent buffer derived from the config (as HF Llama's rotary ``inv_freq``)."""

    def __init__(self, h: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, h, 2).float() / h)), persistent=False)

    def forward(self, x):
        f = torch.outer(torch.arange(x.shape[1]).float(), self.inv_freq)
        return x + torch.cat([f.sin(), f.cos()], -1)


def _buffers_worker(rank: int, world: int, d: str, old_writer: bool) -> None:
    from elastor_ds import deepspeed as eds
    from elastor_ds.integrations.deepspeed import state as st

    def build(load, base=10000.0):
        m = _pipe(extra_layers=[_Rope(16, base), _BN(16)])
        e, _, _, _ = eds.initialize(model=m, model_parameters=list(m.parameters()),
                                    config=_cfg(os.path.join(d, f"ck_{os.path.basename(load)}_{base}"), load))
        return e

    def module_state(e):
        return {k: v.clone() for k, v in e.module.state_dict().items()}

    a = build("none")
    _train(a, 3)
    if old_writer:   # what elastor_ds wrote before: floating buffers only, non-persistent ones too
        new = st.persistent_buffers
        st.persistent_buffers = lambda m: [(n, b) for n, b in m.named_buffers() if b.is_floating_point()]
    a.save_checkpoint(os.path.join(d, "native"))
    if old_writer:
        st.persistent_buffers = new
    a.elastor.finalize()
    ck = os.path.join(d, "ck_none_10000.0")
    res: dict = {"saved": module_state(a)}
    b, c = build(ck), build("none")
    c.load_checkpoint(os.path.join(d, "native"))
    res.update(elastor=module_state(b), deepspeed=module_state(c))
    b2, c2 = build(ck, 500000.0), build("none", 500000.0)   # resumed with another rope base
    c2.load_checkpoint(os.path.join(d, "native"))
    res["inv_freq"] = {k: e.module.get_buffer("1.inv_freq").clone() for k, e in (("elastor", b2), ("deepspeed", c2))}
    res["losses"] = {k: _train(e, 3) for k, e in (("a", a), ("b", b), ("c", c), ("b2", b2), ("c2", c2))}
    for e in (b, c, b2, c2):
        e.elastor.finalize()
    torch.save(res, os.path.join(d, "res.pt"))


def test_integer_buffers_saved_and_non_persistent_buffers_left_out(tmp_path):
    """Before: BatchNorm's num_batches_tracked (int64) was not saved (a resume restarted the
    cumulative average at 0) and a persistent=False buffer was saved and forced back on load
    (a resumed run with a new rope base kept the old inv_freq)."""
    run_world(_buffers_worker, 1, str(tmp_path), False, timeout_s=120)
    res = torch.load(str(tmp_path / "res.pt"))
    assert "2.bn.num_batches_tracked" in res["deepspeed"] and "1.inv_freq" not in res["deepspeed"]
    assert int(res["saved"]["2.bn.num_batches_tracked"]) == 3
    assert sorted(res["elastor"]) == sorted(res["deepspeed"])
    for k, v in res["deepspeed"].items():
        assert res["elastor"][k].dtype == v.dtype and torch.equal(res["elastor"][k], v), k
    want = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))      # the new config's
    assert torch.equal(res["inv_freq"]["deepspeed"], want) and torch.equal(res["inv_freq"]["elastor"], want)
    losses = res["losses"]
    assert losses["b"] == losses["a"] == losses["c"] and losses["b2"] == losses["c2"] != losses["a"]


def test_checkpoint_without_integer_buffers_still_loads(tmp_path):
    """A checkpoint written before integer buffers were saved (simulated by the old writer's
    choice of buffers) loads; the integer buffer keeps the module's value (a warning names it)."""
    run_world(_buffers_worker, 1, str(tmp_path), True, timeout_s=120)
    res = torch.load(str(tmp_path / "res.pt"))
    assert int(res["elastor"]["2.bn.num_batches_tracked"]) == 0
    for k, v in res["deepspeed"].items():
        if k != "2.bn.num_batches_tracked":
            assert torch.equal(res["elastor"][k], v), k
    assert torch.equal(res["inv_freq"]["elastor"], res["inv_freq"]["deepspeed"])


# --- 4. a plain engine with gradient accumulation saves at optimizer steps -------------------------

def _gas_worker(rank: int, world: int, d: str, gas: int) -> None:
    from elastor_ds import deepspeed as eds

    def build(ck, load, **kw):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        e, _, _, _ = eds.initialize(model=model, model_parameters=list(model.parameters()),
                                    config=_cfg(ck, load, gas=gas, sched=False, **kw))
        return e

    ck = os.path.join(d, "ck")
    a = build(ck, "none", interval_steps=2)
    losses = _plain_steps(a, 4, 1)                       # 4 optimizer steps, 4 * gas micro-batches
    a.elastor.finalize()
    committed = sorted(n for n in os.listdir(ck) if n.startswith("step_"))
    # resume from step 2: the micro-batches of steps 3 and 4 (the stream from its start, past steps 1-2)
    b = build(os.path.join(d, "ck_b"), os.path.join(ck, "step_000000002"))
    g = torch.Generator().manual_seed(1)
    for _ in range(2 * gas):
        torch.randn(4, 8, generator=g)
    resumed = []
    for _ in range(2 * gas):
        loss = b(torch.randn(4, 8, generator=g)).pow(2).mean()
        b.backward(loss)
        b.step()
        resumed.append(float(loss))
    b.elastor.finalize()
    with open(os.path.join(d, "res.json"), "w") as f:
        json.dump({"committed": committed, "losses": losses, "resumed": resumed, "start": 2}, f)


@pytest.mark.parametrize("gas", [2, 3])
def test_plain_engine_with_gradient_accumulation_saves_at_optimizer_steps(tmp_path, gas):
    """Before: step()'s hook asked is_gradient_accumulation_boundary() after DeepSpeed had advanced
    micro_steps, i.e. about the next micro-batch: with interval_steps 2 a save landed one
    micro-batch before step 3's optimizer step (mid-accumulation, named step 2) and step 4 was
    never saved."""
    run_world(_gas_worker, 1, str(tmp_path), gas, timeout_s=120)
    res = json.load(open(tmp_path / "res.json"))
    assert res["committed"] == ["step_000000002", "step_000000004"]     # interval_steps 2, 4 steps
    assert res["resumed"] == res["losses"][2 * gas:]


# --- 5. an unsupported optimizer wrapper is refused at initialize -----------------------------------

def _wrapper_worker(rank: int, world: int, d: str) -> None:
    from elastor_ds import deepspeed as eds
    from elastor_ds.errors import ConfigError

    def attempt(name, pipe, zero, extra, elastor=True):
        model = _pipe() if pipe else torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        c = _cfg(os.path.join(d, "ck_" + name), "none", zero=zero, sched=False, interval_steps=1)
        c.update(extra)
        if not elastor:
            del c["elastor"]
        try:
            e, _, _, _ = eds.initialize(model=model, model_parameters=list(model.parameters()), config=c)
        except ConfigError as err:
            return {"refused": str(err), "dir": os.path.exists(os.path.join(d, "ck_" + name))}
        out = {"accepted": type(e.optimizer).__name__}
        if e.elastor is not None:
            e.elastor.finalize()
        return out

    res = {"bf16_zero0": attempt("bf16_zero0", True, 0, {"bf16": {"enabled": True}}),
           "zero3": attempt("zero3", False, 3, {}),
           "bf16_zero0_no_ckpt": attempt("bf16_zero0_no_ckpt", True, 0, {"bf16": {"enabled": True}}, elastor=False),
           "bf16_zero1": attempt("bf16_zero1", True, 1, {"bf16": {"enabled": True}})}
    with open(os.path.join(d, "res.json"), "w") as f:
        json.dump(res, f)


def test_unsupported_optimizer_wrapper_refused_at_initialize(tmp_path):
    """Before: bf16 + ZeRO-0 (DeepSpeed's BF16_Optimizer) and ZeRO-3 were accepted by initialize and
    refused at the first periodic save, possibly hours later. Now initialize refuses them, naming a
    fix that fits the precision; without an elastor checkpoint nothing changes, and bf16 + ZeRO-1
    (the fix named) is accepted."""
    run_world(_wrapper_worker, 1, str(tmp_path), timeout_s=120)
    res = json.load(open(tmp_path / "res.json"))
    msg = res["bf16_zero0"].get("refused", "")
    assert "BF16_Optimizer" in msg and "bf16 + ZeRO-1 is supported" in msg and '"stage": 1' in msg, res
    assert not res["bf16_zero0"]["dir"]
    msg = res["zero3"].get("refused", "")
    assert "ZeRO stage 1 or 2" in msg and "fp32 + ZeRO-1 is supported" in msg, res
    assert res["bf16_zero0_no_ckpt"] == {"accepted": "BF16_Optimizer"}
    assert res["bf16_zero1"] == {"accepted": "DeepSpeedZeroOptimizer"}


# --- 6. initialize(args=...) leaves the caller's args alone ----------------------------------------

def _args_worker(rank: int, world: int, d: str) -> None:
    import argparse

    from elastor_ds import deepspeed as eds
    path = os.path.join(d, "ds.json")
    with open(path, "w") as f:
        json.dump(_cfg(os.path.join(d, "ck"), "none"), f)
    args = argparse.Namespace(deepspeed_config=path, local_rank=0)
    seen = []
    for positional in (False, True, False):
        m = _pipe()
        if positional:
            e = eds.initialize(args, m, model_parameters=list(m.parameters()))[0]
        else:
            e = eds.initialize(args=args, model=m, model_parameters=list(m.parameters()))[0]
        seen.append([args.deepspeed_config, e.elastor is not None, e.train_micro_batch_size_per_gpu()])
        e.elastor.finalize()
    with open(os.path.join(d, "res.json"), "w") as f:
        json.dump({"seen": seen, "path": path}, f)


def test_initialize_leaves_the_callers_args_alone(tmp_path):
    """Before: initialize set args.deepspeed_config = None (DeepSpeed refuses a config given twice),
    so a second initialize with the same args (an evaluation engine, a retry) had no config."""
    run_world(_args_worker, 1, str(tmp_path), timeout_s=120)
    res = json.load(open(tmp_path / "res.json"))
    assert res["seen"] == [[res["path"], True, 4]] * 3


# --- 7. fp16 + ZeRO: the dynamic loss scaler's state ------------------------------------------------

def _fp16_worker(rank: int, world: int, d: str) -> None:
    from deepspeed.accelerator import get_accelerator

    from elastor_ds import deepspeed as eds
    acc = get_accelerator()      # DeepSpeed's CPU accelerator refuses fp16; torch on CPU runs it
    acc.is_fp16_supported = lambda: True
    dtypes = acc.supported_dtypes
    acc.supported_dtypes = lambda: list(set(dtypes()) | {torch.float16})

    def build(load):
        m = _pipe(num_blocks=2)
        c = _cfg(os.path.join(d, "ck_" + os.path.basename(load)), load, zero=1, mb=2)
        # 2**20 overflows at first: steps are skipped, the scale halves (hysteresis 2), then training runs
        c["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 1000, "hysteresis": 2}
        e, _, _, _ = eds.initialize(model=m, model_parameters=list(m.parameters()), config=c)
        return e

    def scaler(e):
        ls = e.optimizer.loss_scaler
        return [float(ls.cur_scale), ls.cur_iter, ls.last_overflow_iter, ls.cur_hysteresis, int(e.skipped_steps)]

    a = build("none")
    _train(a, 12, mb=2)
    a.save_checkpoint(os.path.join(d, "native"))
    a.elastor.finalize()
    b = build(os.path.join(d, "ck_none"))
    c = build("none")
    c.load_checkpoint(os.path.join(d, "native"))
    res = {"scaler": {k: scaler(e) for k, e in (("a", a), ("b", b), ("c", c))}}
    res["losses"] = {k: _train(e, 3, mb=2) for k, e in (("a", a), ("b", b), ("c", c))}
    res["after"] = {k: scaler(e) for k, e in (("a", a), ("b", b), ("c", c))}
    for e in (b, c):
        e.elastor.finalize()
    with open(os.path.join(d, "res.json"), "w") as f:
        json.dump(res, f)


def test_fp16_dynamic_loss_scale_is_restored(tmp_path):
    """Before: the ZeRO optimizer's dynamic loss scaler was not saved: a resume started again at the
    initial scale 2**20 (iteration 0, no overflow seen), skipped steps DeepSpeed's own resume does
    not, and its losses left the uninterrupted run's."""
    run_world(_fp16_worker, 1, str(tmp_path), timeout_s=120)
    res = json.load(open(tmp_path / "res.json"))
    sc = res["scaler"]
    assert sc["a"][0] < 2 ** 20 and sc["a"][2] >= 0 and sc["a"][4] > 0    # the saver did overflow and skip
    assert sc["b"] == sc["c"] == sc["a"]
    assert res["losses"]["b"] == res["losses"]["c"] == res["losses"]["a"]
    assert res["after"]["b"] == res["after"]["c"] == res["after"]["a"]


# --- 8. per-stage param groups: each stage's hyper-parameters come back to it --------------------------

def _layer_groups(m, frozen: bool):
    """exp8: one group per pipeline layer, lr 1e-2 * 0.5**layer and weight decay 0.01 * layer;
    frozen (exp13): embedding frozen, groups [embedding + head (no decay), blocks (decay 0.1)]."""
    named = list(m.named_parameters())
    if frozen:
        return [{"params": [p for n, p in named if n.split(".")[0] in ("0", "3")], "weight_decay": 0.0},
                {"params": [p for n, p in named if n.split(".")[0] in ("1", "2")], "weight_decay": 0.1}]
    groups = []
    for i in range(4):
        ps = [p for n, p in named if n.split(".")[0] == str(i)]
        if ps:
            groups.append({"params": ps, "lr": 1e-2 * 0.5 ** i, "weight_decay": 0.01 * i})
    return groups


def _stage_groups_worker(rank: int, world: int, d: str, specs: list) -> None:
    import torch.distributed as dist

    def zero_of(e):
        return hasattr(e.optimizer, "single_partition_of_fp32_groups")

    from elastor_ds import deepspeed as eds
    from elastor_ds.testing import toy_pipe as toy
    for spec in specs:
        ls = toy.layers(num_blocks=2, hidden=16)
        if spec["frozen"]:
            for p in ls[0].parameters():
                p.requires_grad_(False)
        m = eds.PipelineModule(ls, num_stages=world, loss_fn=toy.loss_fn,
                               boundaries=[0, 2, 4] if world == 2 else [0, 4])
        c = _cfg(os.path.join(d, "ck_" + spec["name"]), spec["load"], zero=spec["zero"], mb=2, sched=False,
                 interval_steps=3)
        e, _, _, _ = eds.initialize(model=m, model_parameters=_layer_groups(m, spec["frozen"]), config=c)
        names = {id(p): n.split(".")[0] for n, p in m.named_parameters()}
        groups = _base_opt(e).param_groups
        # ZeRO's base optimizer holds flat partitions: its groups' module parameters are DeepSpeed's bit16_groups
        members = e.optimizer.bit16_groups if zero_of(e) else [g["params"] for g in groups]
        hyper = [[sorted({names[id(p)] for p in ps if id(p) in names}), g["lr"], g["weight_decay"]]
                 for ps, g in zip(members, groups)]
        hypers = [None] * world
        dist.all_gather_object(hypers, hyper)
        start = int(e.global_steps)
        it = toy.batches(start, 0, 1, 1, 2)
        losses = [float(e.train_batch(it)) for _ in range(spec["steps"])]
        e.elastor.finalize()
        if rank == 0:
            with open(os.path.join(d, spec["name"] + ".json"), "w") as f:
                json.dump({"start": start, "losses": losses, "hyper": hypers}, f)
        dist.barrier()


@pytest.mark.parametrize("zero", [0, 1])
def test_each_stage_gets_its_own_param_groups_back(tmp_path, zero):
    """Before: the manifest held rank 0's param groups and every stage restored them by index: a
    PP2 run with per-layer lr/weight decay resumed with stage 0's values on stage 1 (silently), and
    with a frozen-only group on stage 0, stage 1's group 0 got no step (KeyError 'step' in Adam).
    Now each group is found by its parameters' names, under PP2 as saved and under PP1."""
    d = str(tmp_path)
    step3 = lambda name: os.path.join(d, "ck_" + name, "step_000000003")   # noqa: E731
    # a group of frozen parameters only: DeepSpeed's ZeRO optimizer takes no empty group (ZeRO-0 only)
    sfx = ("", "_frozen") if zero == 0 else ("",)
    spec = lambda name, load, steps, s: dict(name=name + s, load=load, steps=steps, zero=zero,  # noqa: E731
                                             frozen=bool(s))
    run_world(_stage_groups_worker, 2, d, [spec("ref", "none", 6, s) for s in sfx], timeout_s=120)
    run_world(_stage_groups_worker, 2, d, [spec("pp2", step3("ref" + s), 3, s) for s in sfx], timeout_s=120)
    run_world(_stage_groups_worker, 1, d, [spec("pp1", step3("ref" + s), 3, s) for s in sfx], timeout_s=120)
    res = {n + s: json.load(open(os.path.join(d, n + s + ".json"))) for n in ("ref", "pp2", "pp1") for s in sfx}
    # by hand: layer i's group has lr 1e-2 * 0.5**i and weight decay 0.01 * i, on whichever stage holds it
    for name in ("ref", "pp2", "pp1"):
        for rank_groups in res[name]["hyper"]:
            for layers, lr, wd in rank_groups:
                (i,) = [int(x) for x in layers]
                assert (lr, wd) == pytest.approx((1e-2 * 0.5 ** i, 0.01 * i)), (name, rank_groups)
    for ref, got in ((f"ref{s}", f"{pp}{s}") for s in sfx for pp in ("pp2", "pp1")):
        assert res[got]["start"] == 3
        assert res[got]["losses"] == pytest.approx(res[ref]["losses"][3:], rel=1e-5, abs=1e-6), (got, res[got], res[ref])


def _unmatched_worker(rank: int, world: int, d: str) -> None:
    from elastor_ds import deepspeed as eds
    from elastor_ds.errors import TensorMismatchError
    from elastor_ds.testing import toy_pipe as toy
    m = eds.PipelineModule(toy.layers(num_blocks=2, hidden=16), num_stages=2, loss_fn=toy.loss_fn, boundaries=[0, 2, 4])
    e, _, _, _ = eds.initialize(model=m, model_parameters=_layer_groups(m, False),
                                config=_cfg(os.path.join(d, "ck"), "none", mb=2, sched=False))
    e.train_batch(toy.batches(0, 0, 1, 1, 2))
    # the groups a save commits: rank 0's and stage 1's (gathered by the writer)
    e.elastor.save()
    e.elastor.wait()
    from elastor_ds.checkpoint.commit import read_manifest, resolve
    saved = read_manifest(resolve(os.path.join(d, "ck"))).extra["optimizer"]
    # a checkpoint whose groups hold stage 0's parameters only (stage 1's trainable groups match none)
    only0 = [s for s in saved if all(n.split(".")[0] in ("0", "1") for n in s["params"])]
    out = {"saved": [s["params"][:1] for s in saved]}
    try:
        e.elastor.state._restore_groups(only0, "ck/step_x")
        out["raised"] = None
    except TensorMismatchError as err:
        out["raised"] = str(err)
    # a checkpoint of an older version: rank 0's groups without names, restored by index as before
    e.elastor.state._restore_groups([{k: v for k, v in s.items() if k != "params"} for s in only0], "old")
    out["old_format_lr"] = [g["lr"] for g in _base_opt(e).param_groups]
    e.elastor.finalize()
    with open(os.path.join(d, f"unmatched_{rank}.json"), "w") as f:
        json.dump(out, f)


def test_a_group_no_saved_group_holds_is_refused_on_every_rank(tmp_path):
    """Every stage's groups are saved (rank 0's manifest holds stage 1's too); a restore where a
    trainable group of stage 1 matches no saved group raises TensorMismatchError on both ranks
    (agreed: stage 0 alone is fine, and would otherwise go on and wait for stage 1)."""
    run_world(_unmatched_worker, 2, str(tmp_path), timeout_s=120)
    r0, r1 = (json.load(open(tmp_path / f"unmatched_{r}.json")) for r in (0, 1))
    assert sorted(n[0].split(".")[0] for n in r0["saved"]) == ["0", "1", "2", "3"]
    assert r0["raised"] and r0["raised"] == r1["raised"] and "rank 1's param group" in r0["raised"], (r0, r1)
    assert r0["old_format_lr"] == r1["old_format_lr"] == pytest.approx([1e-2, 5e-3])   # by index, as before


# --- elastor's first save into a folder of DeepSpeed's own checkpoints --------------------------

def _ds_folder_worker(rank: int, world: int, d: str) -> None:
    import deepspeed

    from elastor_ds import deepspeed as eds
    from elastor_ds.errors import ConfigError

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    cfg = _cfg(os.path.join(d, "ds"), "none")
    plain = {k: v for k, v in cfg.items() if k != "elastor"}
    a, _, _, _ = deepspeed.initialize(model=model(), model_parameters=None, config=plain)   # DeepSpeed alone
    _plain_steps(a, 2, 1)
    a.save_checkpoint(os.path.join(d, "ds"))
    out = {"latest_before": open(os.path.join(d, "ds", "latest")).read()}
    m = model()
    try:
        b, _, _, _ = eds.initialize(model=m, model_parameters=m.parameters(), config=cfg)
        out["raised"] = None
        _plain_steps(b, 1, 1)
        b.elastor.save()
        b.elastor.finalize()
    except ConfigError as e:
        out["raised"] = str(e)
    out["latest_after"] = open(os.path.join(d, "ds", "latest")).read()
    out["entries"] = sorted(os.listdir(os.path.join(d, "ds")))
    c, _, _, _ = deepspeed.initialize(model=model(), model_parameters=None, config=plain)
    path, _ = c.load_checkpoint(os.path.join(d, "ds"))   # DeepSpeed's own loader still finds its tag
    out["ds_loaded"] = path
    with open(os.path.join(d, "out.json"), "w") as f:
        json.dump(out, f)


def test_a_folder_of_deepspeeds_checkpoints_is_refused_as_elastors_dir_with_load_none(tmp_path):
    """Before: with ``"load": "none"``, elastor's first commit into a folder holding DeepSpeed's own
    checkpoints replaced DeepSpeed's ``latest`` (global_step2 -> step_000000002): DeepSpeed's
    ``load_checkpoint(dir)`` then failed. Now ``initialize`` refuses the folder, naming the file and
    the fix, and writes nothing there."""
    run_world(_ds_folder_worker, 1, str(tmp_path), timeout_s=120)
    out = json.load(open(tmp_path / "out.json"))
    assert out["latest_before"] == out["latest_after"] == "global_step2", out
    assert out["raised"] and "checkpoint.dir" in out["raised"] and "global_step2" in out["raised"] and \
        "elastor convert" in out["raised"], out
    assert out["entries"] == ["global_step2", "latest"], out
    assert out["ds_loaded"] and os.sep + "global_step2" + os.sep in out["ds_loaded"], out
