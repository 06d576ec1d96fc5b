"""``--elastor-plan auto|on-change|FILE`` in the Megatron-LM hooks (training_hooks.configure and
integrations/megatron/autoplan.py) on an argparse Namespace like the one Megatron-LM's parse_args
hands ``validate_args``: no Megatron-LM checkout, no process group.

1. The model the planner prices is the one Megatron's flags build (written out by hand here).
2. ``auto`` on 4 and on 3 processes: a TP x PP x DP grid over exactly the launched world, applied as
   a plan file is (TP, PP, ``--pipeline-model-parallel-layout`` for uneven stages), in megatron-core's
   rank order; a small device memory (``ELASTOR_GPU_MEMORY_GB``) forces pipeline stages; TP/PP flags
   above 1 fix those sizes, and one that cannot fit is an error naming the flag.
3. ``on-change``: the flags on the first launched world, the planner's plan (replacing the flags)
   after it changed.
4. A heterogeneous plan file is refused with the fix; flags that contradict a plan file stay errors.
"""
from __future__ import annotations

import argparse
import json

import pytest

from elastor_ds.errors import ConfigError
from elastor_ds.integrations.megatron import autoplan
from elastor_ds.integrations.megatron import training_hooks as th
from elastor_ds.integrations.megatron.parallel import check_layout
from elastor_ds.layout import Layout
from elastor_ds.plan import ModelSpec

pytestmark = pytest.mark.unit

ENV = ("ELASTOR_PROCS_PER_NODE", "ELASTOR_INITIAL_WORLD_SIZE", "ELASTOR_GPU_MEMORY_GB", "LOCAL_WORLD_SIZE",
       "WORLD_SIZE")


def megatron_args(**kw) -> argparse.Namespace:
    """The fields of Megatron-LM's args (core_v0.16.1 names) the hooks read, as parse_args leaves them
    before validate_args (ffn_hidden_size still None, no padded_vocab_size yet)."""
    base = dict(elastor=True, elastor_keep=2, elastor_plan="auto", world_size=4, num_layers=4, hidden_size=64,
                num_attention_heads=4, group_query_attention=True, num_query_groups=2, ffn_hidden_size=None,
                swiglu=False, seq_length=32, max_position_embeddings=32, tokenizer_type="NullTokenizer",
                vocab_size=127, vocab_file=None, make_vocab_size_divisible_by=64,
                untie_embeddings_and_output_weights=False, bf16=False, fp16=False, use_distributed_optimizer=False,
                micro_batch_size=2, global_batch_size=8, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=1, pipeline_model_parallel_layout=None, context_parallel_size=1,
                expert_model_parallel_size=1, decoder_first_pipeline_num_layers=None,
                decoder_last_pipeline_num_layers=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.fixture
def world(monkeypatch):
    """Set the launcher's environment: ``world(n, per_node="4", initial=None, memory=None)``."""
    for k in ENV:
        monkeypatch.delenv(k, raising=False)

    def launch(n: int, per_node: str | None = None, initial: int | None = None, memory: float | None = None):
        for k in ENV:
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("WORLD_SIZE", str(n))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n))
        if per_node is not None:
            monkeypatch.setenv("ELASTOR_PROCS_PER_NODE", per_node)
        if initial is not None:
            monkeypatch.setenv("ELASTOR_INITIAL_WORLD_SIZE", str(initial))
        if memory is not None:
            monkeypatch.setenv("ELASTOR_GPU_MEMORY_GB", str(memory))
    return launch


def applied(a: argparse.Namespace) -> tuple[int, int, str | None]:
    return a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.pipeline_model_parallel_layout


def assert_runs_as_planned(a: argparse.Namespace, layout: Layout, world: int) -> None:
    """The layout covers exactly the world, megatron-core can run it as is, and the flags say it."""
    assert layout.world_size == world and a.elastor_plan_layout is layout
    grid = check_layout(layout)  # uniform, one TP, ranks in megatron-core's tp-cp-ep-dp-pp order
    tp, pp, layout_flag = applied(a)
    assert (grid.tp, grid.pp) == (tp, pp)
    sizes = [b - c for c, b in zip(grid.boundaries, grid.boundaries[1:])]
    if len(set(sizes)) > 1:
        assert layout_flag == "E" + "|".join("t" * n for n in sizes) + "L"
    else:
        assert layout_flag is None
    assert th.plan_layout(a) is layout  # check_parallel_state reads the chosen layout, no second planning


# ---------------------------------------------------------------- 1. the model from Megatron's flags
def test_the_model_is_the_one_the_flags_build():
    want = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128,
                     ffn_hidden_size=256, num_query_groups=2, dtype_bytes=4, gated_mlp=False, tied_embeddings=True,
                     vocab_divisible_by=64)
    assert autoplan.model_spec(megatron_args()) == want  # NullTokenizer: 127 + EOD; FFN 4 h
    swiglu = autoplan.model_spec(megatron_args(swiglu=True, bf16=True, group_query_attention=False, hidden_size=96,
                                               untie_embeddings_and_output_weights=True))
    # megatron's default FFN with --swiglu: int(4 h 2/3 / 64) * 64 = int(256 / 64) * 64 = 256
    assert (swiglu.ffn_hidden_size, swiglu.gated_mlp, swiglu.dtype_bytes, swiglu.num_query_groups,
            swiglu.tied_embeddings) == (256, True, 2, 4, False)
    with pytest.raises(ConfigError, match="needs the vocabulary size.*--vocab-size"):
        autoplan.model_spec(megatron_args(vocab_size=None, tokenizer_type="HuggingFaceTokenizer"))


def test_the_vocabulary_from_a_gpt2_vocab_file(tmp_path):
    vf = tmp_path / "vocab.json"
    vf.write_text(json.dumps({f"t{i}": i for i in range(300)}))
    a = megatron_args(vocab_size=None, tokenizer_type="GPT2BPETokenizer", vocab_file=str(vf))
    assert autoplan.model_spec(a).vocab_size == 300


# ---------------------------------------------------------------- 2. auto
def test_auto_on_four_and_three_processes(world):
    world(4)
    a4 = megatron_args(world_size=4)
    lay4 = th.configure(a4)
    assert_runs_as_planned(a4, lay4, 4)
    world(3)
    a3 = megatron_args(world_size=3)
    lay3 = th.configure(a3)
    assert_runs_as_planned(a3, lay3, 3)
    # 3 processes: TP 2 does not divide 3, DP 3 does not divide the 8 micro-batches (8 / 2): the one
    # grid is TP1 x PP3 x DP1, and 4 layers over 3 stages are uneven, so the layout flag is set
    assert applied(a3)[:2] == (1, 3) and lay3.dp == 1
    assert a3.pipeline_model_parallel_layout.count("|") == 2 and a3.pipeline_model_parallel_layout.count("t") == 4


def test_auto_reads_the_device_memory(world):
    # one layer of width 2046 (FFN 4 h): 12 h^2 + 2 h = 50.2M weights x (4 B fp32 weight + 4 B grad +
    # 8 B Adam moments; no distributed optimizer) = 0.75 GiB. A 6 GB device keeps (6 - 3 GiB overhead)
    # x 0.95 = 2.85 GiB, room for 3 layers: 8 layers need >= 3 stages, and PP must divide 8 processes
    # (3 heads: TP 1), so PP >= 4.
    big = dict(num_layers=8, hidden_size=2046, num_attention_heads=3, group_query_attention=False, seq_length=64,
               global_batch_size=16, micro_batch_size=1)
    world(8, per_node="4,4", memory=6)
    a = megatron_args(world_size=8, **big)
    assert_runs_as_planned(a, th.configure(a), 8)
    assert a.tensor_model_parallel_size == 1 and a.pipeline_model_parallel_size >= 4
    assert autoplan.launched_cluster(8).gpu_memory_gb == 6
    world(8, per_node="4,4")
    assert autoplan.launched_cluster(8).gpu_memory_gb == 80  # the planner's default without the variable


def test_auto_keeps_tp_groups_inside_a_node(world):
    # 6 processes as 3 + 3: TP-2 groups are ranks (0, 1), (2, 3), (4, 5), and (2, 3) spans the nodes;
    # as 2 + 2 + 2 they all fit (TP 2 fixed by the flag here)
    world(6, per_node="3,3")
    a = megatron_args(world_size=6, global_batch_size=12, micro_batch_size=1)
    lay = th.configure(a)
    assert_runs_as_planned(a, lay, 6)
    assert a.tensor_model_parallel_size == 1
    world(6, per_node="2,2,2")
    b = megatron_args(world_size=6, global_batch_size=12, micro_batch_size=1, tensor_model_parallel_size=2)
    lay = th.configure(b)
    assert_runs_as_planned(b, lay, 6)
    assert b.tensor_model_parallel_size == 2
    assert all(len({r // 2 for r in st.ranks}) == 1 for rep in lay.replicas for st in rep.stages)


def test_auto_honours_explicit_sizes_and_names_one_that_cannot_fit(world):
    world(4)
    a = megatron_args(world_size=4, tensor_model_parallel_size=2)
    th.configure(a)
    assert a.tensor_model_parallel_size == 2 and a.elastor_plan_layout.uniform_dims()[0] == 2
    b = megatron_args(world_size=4, pipeline_model_parallel_size=4)
    th.configure(b)
    assert applied(b)[:2] == (1, 4) and b.elastor_plan_layout.dp == 1
    world(3)
    with pytest.raises(ConfigError, match=r"--elastor-plan auto: no plan uses exactly the 3 launched processes.*"
                                          r"drop --tensor-model-parallel-size 2"):
        th.configure(megatron_args(world_size=3, tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match="needs --micro-batch-size and --global-batch-size"):
        th.configure(megatron_args(world_size=3, global_batch_size=None))
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-layout Ettt|tL was given"):
        th.configure(megatron_args(world_size=3, pipeline_model_parallel_layout="Ettt|tL"))


# ---------------------------------------------------------------- 3. on-change
def test_on_change_keeps_the_flags_on_the_first_world_and_replans_after(world):
    world(4, per_node="4", initial=4)
    a = megatron_args(elastor_plan="on-change", world_size=4, tensor_model_parallel_size=2,
                      pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tttL")
    assert th.configure(a) is None
    assert applied(a) == (2, 2, "Et|tttL") and getattr(a, "elastor_plan_layout", None) is None
    world(3, per_node="3", initial=4)  # a worker lost: the flags described 4 processes
    b = megatron_args(elastor_plan="on-change", world_size=3, tensor_model_parallel_size=2,
                      pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tttL")
    lay = th.configure(b)
    assert_runs_as_planned(b, lay, 3)
    assert applied(b)[:2] == (1, 3)
    world(3)  # outside `elastor run` there is no first world to compare with: the flags run
    c = megatron_args(elastor_plan="on-change", world_size=3)
    assert th.configure(c) is None and applied(c) == (1, 1, None)


# ---------------------------------------------------------------- 4. plan files
def _write(tmp_path, name: str, doc: dict) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return str(p)


def test_a_heterogeneous_plan_file_is_refused_with_the_fix(tmp_path, world):
    world(3)
    hetero = {"version": 1, "num_layers": 4, "replicas": [
        {"micro_batches": 2, "stages": [{"tp": 1, "layers": [0, 2], "ranks": [0]},
                                        {"tp": 1, "layers": [2, 4], "ranks": [1]}]},
        {"micro_batches": 2, "stages": [{"tp": 1, "layers": [0, 4], "ranks": [2]}]}]}
    with pytest.raises(ConfigError, match=r"Megatron-LM runs one TP x PP for every replica.*`elastor plan \.\.\. "
                                          r"--homogeneous --json > plan.json`, or use --elastor-plan auto"):
        th.configure(megatron_args(elastor_plan=_write(tmp_path, "h.json", hetero), world_size=3))
    uneven_mb = Layout.uniform(1, 1, 2, 4, micro_batches=[3, 1]).to_json()
    world(2)
    with pytest.raises(ConfigError, match=r"different micro-batch counts \[3, 1\].*--homogeneous"):
        th.configure(megatron_args(elastor_plan=_write(tmp_path, "m.json", uneven_mb), world_size=2))


def test_flags_that_contradict_a_plan_file_stay_errors(tmp_path, world):
    world(4)
    plan = _write(tmp_path, "p.json", Layout.uniform(2, 2, 1, 4, [0, 1, 4]).to_json())
    with pytest.raises(ConfigError, match="TP=2 but --tensor-model-parallel-size 4"):
        th.configure(megatron_args(elastor_plan=plan, tensor_model_parallel_size=4))
    with pytest.raises(ConfigError, match="PP=2 but --pipeline-model-parallel-size 4"):
        th.configure(megatron_args(elastor_plan=plan, pipeline_model_parallel_size=4))
    with pytest.raises(ConfigError, match="needs 4 processes"):
        th.configure(megatron_args(elastor_plan=plan, world_size=3))
    a = megatron_args(elastor_plan=plan)
    assert_runs_as_planned(a, th.configure(a), 4)
    assert applied(a) == (2, 2, "Et|tttL")


def test_the_flag_parses_every_form():
    p = th.add_arguments(argparse.ArgumentParser())
    for v in ("auto", "on-change", "plan.json"):
        assert p.parse_args(["--elastor", "--elastor-plan", v]).elastor_plan == v
