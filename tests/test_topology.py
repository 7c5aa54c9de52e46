"""Topology value, mesh groups on gloo ranks, and the deployment picker's rules."""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from datetime import timedelta
from pathlib import Path

import pytest

import tests.distributed  # noqa: F401 - puts ``tests`` on the path spawned ranks import from
from tilecast.runtime import picker
from tilecast.runtime.picker import Layout, Selection, auto_topology, resolve_deployment, validate_topology
from tilecast.runtime.topology import MESH_AXES, Topology, TopologyError, num_heads_from_checkpoint

# ---------------------------------------------------------------- Topology value


def test_valid_topology_describes_itself():
    topo = Topology(num_gpus=4, ulysses_degree=4, num_heads=28)
    assert topo.describe() == "TP 1, Ulysses 4, Ring 1"
    assert topo.sp_degree == 4 and topo.replica_size == 4
    assert topo.mesh_shape == (1, 1, 4, 1)
    assert Topology(num_gpus=8, ulysses_degree=2, dp_degree=4).describe() == "TP 1, Ulysses 2, Ring 1, DP 4"


def test_topology_is_frozen_and_kw_only():
    topo = Topology(num_gpus=2, ulysses_degree=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.num_gpus = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Topology(2, 1, 2)  # type: ignore[misc]


def test_every_violated_rule_is_listed_at_once():
    with pytest.raises(TopologyError) as info:
        Topology(num_gpus=8, tp_size=2, ulysses_degree=3, num_heads=28)
    assert isinstance(info.value, ValueError)
    errors = info.value.errors
    assert len(errors) == 2
    assert errors[0].startswith("GPU count must equal TP times Ulysses times Ring")
    assert "num_gpus=8" in errors[0] and "= 6" in errors[0]
    assert errors[1].startswith("TP times Ulysses must divide the 28 DiT heads")
    assert "TP 2 x Ulysses 3 = 6" in errors[1]
    assert str(errors[1]) in str(info.value)


def test_bad_degrees_are_named():
    errors = Topology.check(num_gpus=0, tp_size=0, ring_degree=-1, dp_degree=True)
    assert errors[0] == "num_gpus must be a positive integer, got 0."
    assert errors[1] == "Parallel degrees must be positive integers: tp_size=0, ring_degree=-1, dp_degree=True."


def test_dp_counts_in_the_gpu_product():
    assert Topology.check(num_gpus=8, ulysses_degree=4, dp_degree=2, num_heads=28) == []
    (error,) = Topology.check(num_gpus=8, ulysses_degree=2, dp_degree=2)
    assert error.startswith("GPU count must equal DP times TP times Ulysses times Ring")


def test_unknown_heads_skip_the_head_rule():
    assert Topology.check(num_gpus=6, ulysses_degree=6) == []
    assert Topology.check(num_gpus=6, ulysses_degree=6, num_heads=12) == []
    assert len(Topology.check(num_gpus=6, ulysses_degree=6, num_heads=28)) == 1


def test_world_size_is_degrees_times_data_parallel_replicas():
    assert Topology(num_gpus=16, ulysses_degree=4, ring_degree=2, num_heads=28).dp_degree == 2
    assert Topology(num_gpus=16, ulysses_degree=4, ring_degree=4, num_heads=28).dp_degree == 1
    assert Topology(num_gpus=4, ulysses_degree=2).describe() == "TP 1, Ulysses 2, Ring 1, DP 2"
    (error,) = Topology.check(num_gpus=4, ulysses_degree=3)
    assert error == (
        "GPU count must equal TP times Ulysses times Ring, or a multiple of it (the data-parallel replicas): "
        "num_gpus=4, but TP 1 x Ulysses 3 x Ring 1 = 3."
    )
    assert Topology.check(num_gpus=4, ulysses_degree=2, dp_degree=1)[0].startswith(
        "GPU count must equal TP times Ulysses times Ring: num_gpus=4"
    )


@pytest.mark.parametrize(
    "backend",
    [
        "sdpa_cudnn",
        "sdpa_flash",
        "sdpa_efficient",
        "sdpa_math",
        "chunked_math",
        "fa",
        "flash_attn",
        "torch_sdpa",
        "auto",
        None,
    ],
)
def test_ring_runs_on_every_backend_that_returns_lse(backend):
    # the rule, not this machine's kernels: sdpa_cudnn validates without a GPU
    assert Topology.check(num_gpus=2, ring_degree=2, attention_backend=backend) == []
    assert Topology(num_gpus=4, ulysses_degree=2, ring_degree=2, attention_backend=backend).ring_degree == 2


def test_ring_refuses_a_backend_without_lse_and_unknown_names():
    from tilecast.kernels import capabilities

    capabilities.declare(capabilities.BackendTraits(name="test_no_lse", devices=frozenset({"cpu"}), returns_lse=False))
    try:
        assert Topology.check(num_gpus=2, ulysses_degree=2, attention_backend="test_no_lse") == []
        (error,) = Topology.check(num_gpus=2, ring_degree=2, attention_backend="test_no_lse")
        assert error.startswith("Ring 2: Ring attention merges partial results by their log-sum-exp")
        assert "test_no_lse" in error
    finally:
        capabilities._TRAITS.pop("test_no_lse")
    (error,) = Topology.check(num_gpus=1, attention_backend="flash")
    assert error.startswith("unknown attention backend 'flash'; valid names: ")


def test_capabilities_describe_the_registered_kernels():
    from tilecast.kernels import backends, capabilities

    assert capabilities.backend_names() == backends.backend_names()
    for name, backend in backends._REGISTRY.items():
        assert capabilities.traits(name) == backend.traits
    assert set(capabilities.candidates("auto")) | set(capabilities.candidates("torch_sdpa")) <= set(backends._REGISTRY)


def test_model_rules_heads_and_ff_width():
    from tilecast.runtime.topology import model_errors

    assert model_errors(tp_size=2, ulysses_degree=2, num_heads=12, ff_dim=384) == []
    assert model_errors(tp_size=5, num_heads=10, ff_dim=384) == [
        "TP must divide the DiT's feed-forward width: ff_dim=384, but TP 5."
    ]
    assert len(Topology.check(num_gpus=8, tp_size=8, num_heads=12, ff_dim=384)) == 1


def test_fsdp_needs_two_ranks():
    (error,) = Topology.check(num_gpus=1, fsdp=True)
    assert error.startswith("FSDP requires multiple GPUs.".rstrip("."))
    assert Topology.check(num_gpus=2, ulysses_degree=2, fsdp=True) == []


def test_tiny_k6sr_limits_match_its_config():
    from tilecast.runtime.models.k6sr.tiny import TRANSFORMER_CONFIG
    from tilecast.runtime.topology import TINY_K6SR_LIMITS, model_limits

    config = TRANSFORMER_CONFIG
    assert TINY_K6SR_LIMITS.num_heads == config["model_dim"] // sum(config["axes_dims"])
    assert TINY_K6SR_LIMITS.ff_dim == config["ff_dim"]
    assert model_limits("tiny/k6sr") == TINY_K6SR_LIMITS


def test_same_mistake_same_message_before_launch_and_on_the_ranks():
    from types import SimpleNamespace

    from tilecast.runtime.models.k6sr import dit_parallel
    from tilecast.runtime.rank import build_groups
    from tilecast.runtime.topology import TopologyError

    expected = Topology.check(num_gpus=4, ulysses_degree=3)
    config = SimpleNamespace(tp_size=1, ulysses_degree=3, ring_degree=1, attention_backend=None)
    ranks = SimpleNamespace(distributed=True, world_size=4)
    with pytest.raises(TopologyError) as info:
        build_groups(config, ranks)  # raises before any collective
    assert info.value.errors == expected

    transformer = SimpleNamespace(config=SimpleNamespace(model_dim=192, axes_dims=(4, 6, 6), ff_dim=384))
    with pytest.raises(TopologyError) as info:
        dit_parallel._check_divisible(transformer, 1, 8)
    assert info.value.errors == Topology.check(num_gpus=8, ulysses_degree=8, num_heads=12, ff_dim=384)


def test_auto_topology_value():
    assert Topology.auto(8).describe() == "TP 1, Ulysses 4, Ring 2"
    assert Topology.auto(6, num_heads=12).describe() == "TP 1, Ulysses 6, Ring 1"
    with pytest.raises(TopologyError):
        Topology.auto(6, num_heads=28)  # the picker's own layout for 6 GPUs breaks the head rule


@pytest.mark.parametrize(
    ("topo", "expected"),
    [
        (
            Topology(num_gpus=4, ring_degree=2, ulysses_degree=2),
            {
                "dp": [[0], [1], [2], [3]],
                "ring": [[0, 2], [1, 3]],
                "ulysses": [[0, 1], [2, 3]],
                "tp": [[0], [1], [2], [3]],
                "sp": [[0, 1, 2, 3]],
                "decode": [[0, 1, 2, 3]],
            },
        ),
        (
            Topology(num_gpus=4, tp_size=2, ulysses_degree=2),
            {
                "dp": [[0], [1], [2], [3]],
                "ring": [[0], [1], [2], [3]],
                "ulysses": [[0, 2], [1, 3]],
                "tp": [[0, 1], [2, 3]],
                "sp": [[0, 2], [1, 3]],
                "decode": [[0, 1, 2, 3]],
            },
        ),
        (
            Topology(num_gpus=4, ulysses_degree=2, dp_degree=2),
            {
                "dp": [[0, 2], [1, 3]],
                "ring": [[0], [1], [2], [3]],
                "ulysses": [[0, 1], [2, 3]],
                "tp": [[0], [1], [2], [3]],
                "sp": [[0, 1], [2, 3]],
                "decode": [[0, 1], [2, 3]],
            },
        ),
    ],
    ids=["ring2-ulysses2", "tp2-ulysses2", "dp2-ulysses2"],
)
def test_axis_ranks(topo, expected):
    assert {axis: topo.axis_ranks(axis) for axis in expected} == expected


def test_unknown_axis_is_a_value_error():
    with pytest.raises(ValueError, match="unknown mesh axis 'cp'"):
        Topology(num_gpus=1).axis_ranks("cp")


# ---------------------------------------------------------------- heads from a checkpoint


def _write_transformer_config(root: Path, config: dict) -> Path:
    (root / "transformer").mkdir(parents=True)
    (root / "transformer" / "config.json").write_text(json.dumps(config))
    return root


def test_heads_from_kandinsky6_sr_config(tmp_path):
    path = _write_transformer_config(
        tmp_path / "k6", {"_class_name": "Kandinsky6SRTransformer3DModel", "model_dim": 1792, "axes_dims": [16, 24, 24]}
    )
    assert num_heads_from_checkpoint(path) == 28
    defaults = _write_transformer_config(tmp_path / "k6d", {"_class_name": "Kandinsky6SRTransformer3DModel"})
    assert num_heads_from_checkpoint(defaults) == 28  # diffusers' defaults


def test_heads_from_num_attention_heads(tmp_path):
    path = _write_transformer_config(
        tmp_path / "flux", {"_class_name": "FluxTransformer2DModel", "num_attention_heads": 24}
    )
    assert num_heads_from_checkpoint(str(path)) == 24


def test_heads_of_builtin_models():
    assert num_heads_from_checkpoint("tiny/k6sr") == 12
    assert num_heads_from_checkpoint("test/allreduce") is None  # unknown: head rule skipped
    assert num_heads_from_checkpoint("tiny/not-yet-built") is None


def test_heads_unreadable_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="neither 'tiny/k6sr' nor an existing directory"):
        num_heads_from_checkpoint(tmp_path / "missing")
    with pytest.raises(ValueError, match="pass --num-heads"):
        num_heads_from_checkpoint(tmp_path)
    odd = _write_transformer_config(tmp_path / "odd", {"_class_name": "Mystery"})
    with pytest.raises(ValueError, match="Mystery"):
        num_heads_from_checkpoint(odd)


# ---------------------------------------------------------------- mesh on 4 gloo ranks

MESH_CASES = {
    "ring2-ulysses2": dict(num_gpus=4, ring_degree=2, ulysses_degree=2),
    "tp2-ulysses2": dict(num_gpus=4, tp_size=2, ulysses_degree=2),
    "dp2-ulysses2": dict(num_gpus=4, ulysses_degree=2, dp_degree=2),
}
GROUP_AXES = MESH_AXES + ("sp", "decode")


def _mesh_worker(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    try:
        report = {}
        for name, kwargs in MESH_CASES.items():
            topo = Topology(**kwargs)
            mesh = topo.build_mesh("cpu")
            groups = topo.groups(mesh)
            again = topo.groups(mesh)  # idempotent: same groups, no new collectives needed
            members = {axis: dist.get_process_group_ranks(groups.group(axis)) for axis in GROUP_AXES}
            same = all(dist.get_process_group_ranks(again.group(a)) == members[a] for a in GROUP_AXES)
            # the groups carry collectives: the sum of ranks over each axis group
            sums = {}
            for axis in GROUP_AXES:
                t = torch.tensor([float(rank)])
                dist.all_reduce(t, group=groups.group(axis))
                sums[axis] = t.item()
            report[name] = {"members": members, "same": same, "sums": sums, "coordinate": groups.coordinate}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # nobody tears down while a peer's last transfer is in flight
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_build_mesh_groups_on_four_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    world_size = 4
    ctx = mp.start_processes(
        # A file rendezvous in this test's own directory: no port to pick (and lose) at all.
        _mesh_worker,
        args=(world_size, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    try:
        deadline = time.monotonic() + 50
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "gloo ranks did not finish in 50 s"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()
            proc.join(5)

    for rank in range(world_size):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, kwargs in MESH_CASES.items():
            topo = Topology(**kwargs)
            got = report[name]
            assert got["same"], name
            for axis in GROUP_AXES:
                (expected,) = [g for g in topo.axis_ranks(axis) if rank in g]
                assert got["members"][axis] == expected, (name, rank, axis)
                assert got["sums"][axis] == sum(expected), (name, rank, axis)
            assert list(got["coordinate"]) == list(MESH_AXES)
    # spot-check the brief's two layouts explicitly
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["ring2-ulysses2"]["members"]["ulysses"] == [0, 1]
    assert r0["ring2-ulysses2"]["members"]["ring"] == [0, 2]
    assert r0["ring2-ulysses2"]["members"]["decode"] == [0, 1, 2, 3]
    assert r0["tp2-ulysses2"]["members"]["tp"] == [0, 1]
    assert r0["tp2-ulysses2"]["members"]["ulysses"] == [0, 2]
    assert r0["dp2-ulysses2"]["members"]["decode"] == [0, 1]
    assert r0["dp2-ulysses2"]["members"]["dp"] == [0, 2]


def test_build_mesh_needs_matching_world():
    with pytest.raises(ValueError, match="torch.distributed initialized"):
        Topology(num_gpus=2, ulysses_degree=2).build_mesh("cpu")


# ---------------------------------------------------------------- picker: auto layout

# The picker's autoTopology for 1..8 GPUs, and whether its validateTopology accepts it (28 heads).
PICKER_AUTO = {
    1: ((1, 1, 1), True),
    2: ((1, 2, 1), True),
    3: ((1, 3, 1), False),
    4: ((1, 4, 1), True),
    5: ((1, 5, 1), False),
    6: ((1, 6, 1), False),
    7: ((1, 7, 1), True),
    8: ((1, 4, 2), True),
}


@pytest.mark.parametrize("num_gpus", sorted(PICKER_AUTO))
def test_auto_topology_reproduces_the_picker(num_gpus):
    (tp, ulysses, ring), valid = PICKER_AUTO[num_gpus]
    layout = auto_topology(num_gpus)
    assert (layout.tp_size, layout.ulysses_degree, layout.ring_degree) == (tp, ulysses, ring)
    deployment = resolve_deployment(Selection(gpus_per_node=num_gpus))
    assert deployment.valid is valid
    if not valid:
        assert deployment.errors == ["TP times Ulysses must divide the 28 DiT heads."]
        assert deployment.suggestion is not None
        assert deployment.suggestion.product == num_gpus
        assert 28 % (deployment.suggestion.tp_size * deployment.suggestion.ulysses_degree) == 0


def test_auto_topology_generalizes_for_other_head_counts():
    assert auto_topology(8, num_heads=12) == Layout(ulysses_degree=4, ring_degree=2)
    assert auto_topology(6, num_heads=12) == Layout(ulysses_degree=6)
    assert auto_topology(5, num_heads=12) == Layout(ulysses_degree=1, ring_degree=5)
    assert auto_topology(16, num_heads=28) == Layout(ulysses_degree=4, ring_degree=4)
    assert picker.suggest_topology(6, ring_allowed=False) is None
    assert picker.suggest_topology(6) == Layout(ulysses_degree=2, ring_degree=3)


def test_manual_layout_is_used_as_given():
    s = Selection(topology_mode="manual", gpus_per_node=4, tp_size=2, ulysses_degree=2, ring_degree=1)
    assert resolve_deployment(s).topology == Layout(tp_size=2, ulysses_degree=2)


# ---------------------------------------------------------------- picker: validateTopology


def _errors(layout=(1, 4, 1), *, num_heads=28, **selection):
    tp, ulysses, ring = layout
    return validate_topology(
        Selection(**selection), Layout(tp_size=tp, ulysses_degree=ulysses, ring_degree=ring), num_heads=num_heads
    )


def test_default_selection_is_valid():
    assert _errors() == []


def test_rule_positive_integer_degrees():
    # the picker also evaluates 28 % 0 (NaN, an error) and the product
    assert _errors((1, 0, 1)) == [
        "Parallel degrees must be positive integers.",
        "GPU count must equal TP times Ulysses times Ring.",
        "TP times Ulysses must divide the 28 DiT heads.",
    ]
    assert _errors((-1, -4, 1)) == ["Parallel degrees must be positive integers."]


def test_rule_one_node():
    assert _errors(nodes=2) == ["This picker covers one node."]


def test_rule_gpu_count_is_the_product():
    assert _errors((1, 2, 1)) == ["GPU count must equal TP times Ulysses times Ring."]


def test_rule_heads():
    assert _errors((1, 3, 1), gpus_per_node=3) == ["TP times Ulysses must divide the 28 DiT heads."]
    assert _errors((2, 2, 2), gpus_per_node=8) == []
    assert _errors((1, 8, 1), gpus_per_node=8) == ["TP times Ulysses must divide the 28 DiT heads."]
    assert _errors((1, 8, 1), gpus_per_node=8, num_heads=24) == []
    assert _errors((1, 3, 1), gpus_per_node=3, num_heads=12) == []
    assert _errors((1, 8, 1), gpus_per_node=8, num_heads=12) == ["TP times Ulysses must divide the 12 DiT heads."]
    assert _errors((1, 3, 1), gpus_per_node=3, num_heads=None) == []


def test_rule_fsdp_needs_two_gpus():
    assert _errors((1, 1, 1), gpus_per_node=1, placement="fsdp") == ["FSDP requires multiple GPUs."]
    assert _errors((1, 2, 1), gpus_per_node=2, placement="fsdp") == []


def test_rule_sdpa_has_no_ring():
    assert _errors((1, 2, 2), attention="torch_sdpa") == ["SDPA does not support Ring rotation."]
    # on RTX the platform default is SDPA, so Ring is rejected whatever the backend says
    assert _errors((1, 2, 2), hw="rtxpro6000") == ["SDPA does not support Ring rotation."]
    assert _errors((1, 2, 2), hw="gb300", attention="fa") == []


def test_rule_no_fa_on_sm120():
    for hw in ("rtxpro6000", "rtx5090"):
        assert _errors(hw=hw, attention="fa") == ["FA resolves to SDPA on this SM120 platform; select SDPA instead."]
    assert _errors((1, 2, 2), hw="rtx5090", attention="fa") == [
        "SDPA does not support Ring rotation.",
        "FA resolves to SDPA on this SM120 platform; select SDPA instead.",
    ]


def test_rule_gpu_range_is_ours():
    assert _errors((1, 4, 4), gpus_per_node=16) == ["This picker covers 1 to 8 GPUs per node."]


def test_all_errors_at_once_in_picker_order():
    errors = _errors((1, 3, 2), nodes=2, gpus_per_node=1, hw="rtx5090", attention="fa", placement="fsdp")
    assert errors == [
        "This picker covers one node.",
        "GPU count must equal TP times Ulysses times Ring.",
        "TP times Ulysses must divide the 28 DiT heads.",
        "FSDP requires multiple GPUs.",
        "SDPA does not support Ring rotation.",
        "FA resolves to SDPA on this SM120 platform; select SDPA instead.",
    ]


def test_recipe_findings_are_warnings_with_the_pickers_words():
    findings = picker.recipe_findings(
        num_gpus=2, ring_degree=2, num_heads=12, attention_backend="sdpa_cudnn", hardware="h200", decode="serial"
    )
    assert findings[0] == picker.RECIPE_PREFIX + picker.ERR_SDPA_RING
    assert picker.WARN_SCOPE in findings and picker.WARN_EXTRAPOLATED_HW in findings
    multi = picker.recipe_findings(num_gpus=16, ulysses_degree=4, ring_degree=4, nodes=2, num_heads=28, hardware="h200")
    assert [f for f in multi if f.startswith(picker.RECIPE_PREFIX)] == [picker.RECIPE_PREFIX + picker.ERR_NODES]
    assert picker.recipe_findings(num_gpus=4, ulysses_degree=4, num_heads=28, hardware="gb300", decode="tiles") == [
        picker.WARN_SCOPE,
        picker.WARN_UNVERIFIED,
        picker.WARN_TILES,
    ]


def test_picker_attention_names():
    assert [picker.picker_attention(n) for n in (None, "auto", "platform", "fa", "flash_attn")] == [
        "platform",
        "platform",
        "platform",
        "fa",
        "fa",
    ]
    assert {picker.picker_attention(n) for n in ("sdpa_cudnn", "sdpa_math", "chunked_math", "torch_sdpa")} == {
        "torch_sdpa"
    }


def test_detect_hardware():
    assert picker.detect_hardware("NVIDIA H100 80GB HBM3") == "h100"
    assert picker.detect_hardware("NVIDIA H200") == "h200"
    assert picker.detect_hardware("NVIDIA B200") == "b200"
    assert picker.detect_hardware("NVIDIA GB300") == "gb300"
    assert picker.detect_hardware("NVIDIA RTX PRO 6000 Blackwell Server Edition") == "rtxpro6000"
    assert picker.detect_hardware("NVIDIA GeForce RTX 5090") == "rtx5090"
    assert picker.detect_hardware("NVIDIA GB200") is None
    assert picker.detect_hardware("NVIDIA A100-SXM4-80GB") is None
    assert picker.detect_hardware(None) is None


# ---------------------------------------------------------------- picker: selection fields


def test_selection_defaults_are_the_pickers():
    s = Selection()
    assert (s.hw, s.nodes, s.gpus_per_node, s.topology_mode) == ("gb300", 1, 4, "auto")
    assert (s.attention, s.decode, s.placement, s.offload_components) == ("platform", "tiles", "resident", "all")
    assert (s.prefetch, s.resident_layers, s.scale, s.tile_batch) == (1, 0, "2", "1")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("hw", "a100", "hw='a100'"),
        ("attention", "flash", "attention='flash'"),
        ("decode", "fast", "decode='fast'"),
        ("placement", "disk", "placement='disk'"),
        ("offload_components", "text_encoder", "offload_components='text_encoder'"),
        ("offload_components", "transformer vae latent_upscaler", "offload_components="),
        ("scale", "3", "scale='3'"),
        ("tile_batch", 4, "tile_batch='4'"),
        ("prefetch", 5, "prefetch=5 must be an integer from 1 to 4"),
        ("resident_layers", 9, "resident_layers=9 must be an integer from 0 to 8"),
        ("topology_mode", "magic", "topology_mode='magic'"),
    ],
)
def test_selection_rejects_unknown_choices(field, value, match):
    with pytest.raises(ValueError, match=match):
        Selection(**{field: value})


def test_selection_normalizes_components_and_numbers():
    s = Selection(placement="offload", offload_components="vae, transformer", scale=2.25, tile_batch=2)
    assert (s.offload_components, s.scale, s.tile_batch) == ("transformer vae", "2.25", "2")
    assert s.streaming_dit
    assert not Selection(placement="offload", offload_components="vae latent_upscaler").streaming_dit
    assert not Selection(placement="component", offload_components="all").streaming_dit


# ---------------------------------------------------------------- picker: resolveDeployment

W = picker


def _resolve(**selection) -> picker.Deployment:
    layout = selection.pop("layout", None)
    num_heads = selection.pop("num_heads", 28)
    if layout is not None:
        tp, ulysses, ring = layout
        selection.update(topology_mode="manual", tp_size=tp, ulysses_degree=ulysses, ring_degree=ring)
        selection.setdefault("gpus_per_node", tp * ulysses * ring)
    return resolve_deployment(Selection(**selection), num_heads=num_heads)


def test_default_deployment():
    d = _resolve()
    assert d.attention == "fa" and d.summary == "TP 1, Ulysses 4, Ring 1"
    assert d.warnings == [W.WARN_SCOPE, W.WARN_UNVERIFIED, W.WARN_TILES]
    assert d.verification == {"serve": "unverified", "request": "unverified"}
    assert d.resolved_settings() == {
        "attention": "FlashAttention",
        "prefetch": "1 layer",
        "resident_layers": "0 layers",
    }


def test_platform_attention_resolution():
    assert _resolve(hw="h100").attention == "fa"
    assert _resolve(hw="rtxpro6000", gpus_per_node=2).attention == "torch_sdpa"
    assert _resolve(hw="rtx5090", gpus_per_node=1).attention == "torch_sdpa"
    assert _resolve(hw="h100", attention="torch_sdpa").attention == "torch_sdpa"


@pytest.mark.parametrize(
    "selection",
    [
        dict(hw="gb300", layout=(2, 2, 1), decode="tiles"),
        dict(hw="gb300", layout=(2, 2, 1), decode="serial", attention="fa"),
        dict(hw="gb300", layout=(1, 1, 2), placement="offload", decode="tiles"),
        dict(hw="rtxpro6000", layout=(1, 1, 1), decode="serial"),
        dict(hw="rtxpro6000", layout=(1, 2, 1), decode="tiles", attention="torch_sdpa"),
    ],
)
def test_served_recipes_are_verified(selection):
    d = _resolve(**selection)
    assert d.served and d.verification == {"serve": "verified", "request": "unverified"}
    assert W.WARN_UNVERIFIED not in d.warnings


@pytest.mark.parametrize(
    "selection",
    [
        dict(hw="gb300", layout=(1, 4, 1)),  # the default offline recipe is not HTTP-verified
        dict(hw="gb300", layout=(2, 2, 1), decode="spatial"),
        dict(hw="gb300", layout=(2, 2, 1), placement="offload"),
        dict(hw="gb300", layout=(2, 2, 1), attention="torch_sdpa"),
        dict(hw="gb300", layout=(1, 1, 2), placement="offload", prefetch=2),
        dict(hw="gb300", layout=(1, 1, 2), placement="offload", resident_layers=1),
        dict(hw="gb300", layout=(1, 1, 2), placement="offload", offload_components="transformer"),
        dict(hw="gb300", layout=(1, 1, 2), placement="component"),
        dict(hw="b200", layout=(2, 2, 1)),
        dict(hw="rtxpro6000", layout=(1, 1, 1), decode="tiles"),
        dict(hw="rtxpro6000", layout=(1, 2, 1), decode="serial"),
        dict(hw="rtxpro6000", layout=(1, 2, 1), decode="tiles", placement="offload"),
        dict(hw="rtxpro6000", layout=(2, 1, 1), decode="tiles"),
    ],
)
def test_other_recipes_are_unverified(selection):
    d = _resolve(**selection)
    assert not d.served and d.verification["serve"] == "unverified"
    assert d.warnings[:2] == [W.WARN_SCOPE, W.WARN_UNVERIFIED]


def test_errors_make_verification_error_even_for_a_served_layout():
    d = _resolve(hw="gb300", layout=(2, 2, 1), gpus_per_node=8)
    assert d.errors == ["GPU count must equal TP times Ulysses times Ring."]
    assert not d.served and d.verification == {"serve": "error", "request": "error"}
    with pytest.raises(ValueError, match="GPU count must equal"):
        d.serve_argv("/m")


@pytest.mark.parametrize(
    ("selection", "warning", "present"),
    [
        (dict(hw="h100"), W.WARN_EXTRAPOLATED_HW, True),
        (dict(hw="b200"), W.WARN_EXTRAPOLATED_HW, True),
        (dict(hw="rtx5090", gpus_per_node=1), W.WARN_EXTRAPOLATED_HW, True),
        (dict(hw="gb300"), W.WARN_EXTRAPOLATED_HW, False),
        (dict(hw="rtxpro6000", gpus_per_node=2), W.WARN_EXTRAPOLATED_HW, False),
        (dict(hw="gb300", attention="torch_sdpa"), W.WARN_BACKEND_OVERRIDE, True),
        (dict(hw="rtxpro6000", gpus_per_node=2, attention="fa"), W.WARN_BACKEND_OVERRIDE, True),
        (dict(hw="gb300", attention="fa"), W.WARN_BACKEND_OVERRIDE, False),
        (dict(hw="rtxpro6000", gpus_per_node=2, attention="torch_sdpa"), W.WARN_BACKEND_OVERRIDE, False),
        (dict(hw="rtx5090", gpus_per_node=1), W.WARN_RTX5090, True),
        (dict(hw="rtxpro6000", gpus_per_node=1), W.WARN_RTX5090, False),
        (dict(gpus_per_node=5), W.WARN_MANY_GPUS, True),
        (dict(gpus_per_node=8), W.WARN_MANY_GPUS, True),
        (dict(gpus_per_node=4), W.WARN_MANY_GPUS, False),
        (dict(hw="rtxpro6000", gpus_per_node=4), W.WARN_RTXPRO_GPUS, True),
        (dict(hw="rtxpro6000", gpus_per_node=2), W.WARN_RTXPRO_GPUS, False),
        (dict(hw="gb300", gpus_per_node=4), W.WARN_RTXPRO_GPUS, False),
        (dict(placement="component"), W.WARN_OFFLOAD, True),
        (dict(placement="offload"), W.WARN_OFFLOAD, True),
        (dict(placement="fsdp"), W.WARN_OFFLOAD, False),
        (dict(placement="resident"), W.WARN_OFFLOAD, False),
        (dict(decode="spatial"), W.WARN_SPATIAL, True),
        (dict(decode="tiles"), W.WARN_SPATIAL, False),
        (dict(decode="tiles"), W.WARN_TILES, True),
        (dict(decode="serial"), W.WARN_TILES, False),
        (dict(layout=(2, 2, 1)), W.WARN_TP_RING, True),
        (dict(layout=(1, 2, 2)), W.WARN_TP_RING, True),
        (dict(gpus_per_node=8), W.WARN_TP_RING, True),  # auto: Ulysses4 x Ring2
        (dict(layout=(1, 4, 1)), W.WARN_TP_RING, False),
        (dict(tile_batch="2"), W.WARN_TILE_BATCH, True),
        (dict(tile_batch="1"), W.WARN_TILE_BATCH, False),
        (dict(gpus_per_node=1, decode="tiles"), W.WARN_ONE_GPU, True),
        (dict(gpus_per_node=1, decode="spatial"), W.WARN_ONE_GPU, True),
        (dict(gpus_per_node=1, decode="serial"), W.WARN_ONE_GPU, False),
        (dict(gpus_per_node=2, decode="tiles"), W.WARN_ONE_GPU, False),
    ],
)
def test_each_warning(selection, warning, present):
    d = _resolve(**selection)
    assert (warning in d.warnings) is present
    assert d.warnings[0] == W.WARN_SCOPE


def test_warnings_keep_the_pickers_order():
    d = _resolve(hw="rtx5090", gpus_per_node=8, attention="fa", placement="offload", decode="spatial", tile_batch="2")
    assert d.warnings == [
        W.WARN_SCOPE,
        W.WARN_UNVERIFIED,
        W.WARN_EXTRAPOLATED_HW,
        W.WARN_BACKEND_OVERRIDE,
        W.WARN_RTX5090,
        W.WARN_MANY_GPUS,
        W.WARN_OFFLOAD,
        W.WARN_SPATIAL,
        W.WARN_TP_RING,
        W.WARN_TILE_BATCH,
    ]
    d = _resolve(hw="rtxpro6000", gpus_per_node=1, decode="tiles")
    assert d.warnings == [W.WARN_SCOPE, W.WARN_UNVERIFIED, W.WARN_TILES, W.WARN_ONE_GPU]
    d = _resolve(hw="rtxpro6000", gpus_per_node=4, layout=(2, 2, 1), decode="tiles")
    assert d.warnings == [W.WARN_SCOPE, W.WARN_UNVERIFIED, W.WARN_RTXPRO_GPUS, W.WARN_TILES, W.WARN_TP_RING]


def test_warning_texts_are_the_pickers():
    reference = Path(__file__).resolve().parents[2] / "shared" / "reference" / "kandinsky6-sr.md"
    if not reference.is_file():
        pytest.skip("reference page not available")
    text = reference.read_text()
    for name in dir(W):
        if name.startswith(("WARN_", "ERR_")) and name != "ERR_GPU_RANGE":
            message = getattr(W, name).format(num_heads=28)
            assert f'"{message}"' in text, name


@pytest.mark.parametrize(
    ("selection", "note", "present"),
    [
        (dict(attention="torch_sdpa"), W.NOTE_SDPA_SOFT, True),
        (dict(hw="rtxpro6000", gpus_per_node=2, attention="torch_sdpa"), W.NOTE_SDPA_SOFT, False),
        (dict(placement="component"), W.NOTE_COMPONENT, True),
        (dict(placement="fsdp"), W.NOTE_FSDP, True),
        (dict(placement="offload", offload_components="vae"), W.NOTE_PARTIAL_OFFLOAD, True),
        (dict(placement="offload"), W.NOTE_PARTIAL_OFFLOAD, False),
        (dict(placement="offload", prefetch=2), W.NOTE_PREFETCH, True),
        (dict(placement="offload", resident_layers=3), W.NOTE_RESIDENT, True),
        (dict(decode="tiles"), W.NOTE_TILES, True),
        (dict(decode="spatial"), W.NOTE_SPATIAL, True),
        (dict(tile_batch="2"), W.NOTE_TILE_BATCH, True),
    ],
)
def test_each_note(selection, note, present):
    assert (note in _resolve(**selection).notes) is present


def test_ignored_settings_are_noted():
    notes = _resolve(placement="resident", offload_components="vae", prefetch=3, resident_layers=2).notes
    assert "offload components 'vae' are ignored: placement is 'resident'." in notes
    assert any(n.startswith("DiT prefetch 3 is ignored") for n in notes)
    assert any(n.startswith("DiT resident layers 2 is ignored") for n in notes)
    assert (
        "--dit-offload-prefetch-size"
        not in _resolve(placement="offload", offload_components="vae", prefetch=3).serve_flags()
    )


# ---------------------------------------------------------------- picker: serve command


def test_serve_flags_default():
    d = _resolve()
    assert d.serve_argv("/m") == [
        "tilecast",
        "serve",
        "--model-path",
        "/m",
        "--num-gpus",
        "4",
        "--tp-size",
        "1",
        "--ulysses-degree",
        "4",
        "--ring-degree",
        "1",
        "--attention-backend",
        "fa",
        "--vae-config.use-parallel-tiling",
        "true",
        "--vae-config.use-parallel-decode",
        "false",
    ]


def test_serve_flags_decode_modes():
    assert _resolve(decode="serial").serve_flags()[-4:] == shlex.split(
        "--vae-config.use-parallel-tiling false --vae-config.use-parallel-decode false"
    )
    assert _resolve(decode="spatial").serve_flags()[-6:] == shlex.split(
        "--vae-config.use-parallel-tiling false --vae-config.use-parallel-decode true"
        " --vae-config.parallel-decode-mode spatial_shard"
    )


def test_serve_flags_placement():
    def tail(**kw):
        flags = _resolve(**kw).serve_flags()
        return flags[flags.index("false") + 1 :]  # after the decode flags (tiles: "... decode false")

    assert tail() == []
    assert tail(placement="component", offload_components="vae latent_upscaler") == [
        "--cpu-offload-components",
        "vae latent_upscaler",
    ]
    assert tail(placement="offload") == ["--layerwise-offload-components", "all"]
    assert tail(placement="offload", prefetch=3, resident_layers=2) == [
        "--layerwise-offload-components",
        "all",
        "--dit-offload-prefetch-size",
        "3",
        "--dit-layerwise-resident-layers",
        "2",
    ]
    assert tail(placement="offload", offload_components="transformer", prefetch=2) == [
        "--layerwise-offload-components",
        "transformer",
        "--dit-offload-prefetch-size",
        "2",
    ]
    assert tail(placement="component", prefetch=2) == ["--cpu-offload-components", "all"]
    assert tail(placement="fsdp") == ["--use-fsdp-inference", "true"]


def test_serve_command_has_no_sglang_only_flags():
    command = _resolve(hw="rtx5090", gpus_per_node=1, placement="offload", decode="serial").serve_command("/m k6")
    assert command.startswith("tilecast serve --model-path '/m k6' --num-gpus 1 ")
    assert "--attention-backend torch_sdpa" in command
    for flag in ("--performance-mode", "--warmup-mode", "--host", "--port"):
        assert flag not in command
