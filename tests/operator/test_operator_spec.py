from __future__ import annotations

import pathlib
from decimal import Decimal

import pytest
import yaml
from modeldeployments import ROOT, SCHEMA, model_deployment

from meridian.operator.spec import Engine, InvalidSpec, Resources, parse_spec, quantity


def parse(spec, name="chat"):
    body = model_deployment(spec, name=name)
    return parse_spec(name, "serving", body["spec"])


def test_schema_defaults_match_what_the_operator_assumes(spec):
    fleet = parse(spec)
    region = fleet.regions[0]
    assert region.engine == Engine()
    assert region.resources == Resources(gpus=1, cpu="2", memory="8Gi")
    assert (fleet.tensor, fleet.pipeline) == (1, 1)
    assert (fleet.rollout.max_surge, fleet.rollout.max_unavailable) == (1, 0)
    assert fleet.rollout.sequential
    assert (fleet.model.format, fleet.model.quantization, fleet.model.dtype) == (
        "gguf",
        "none",
        "auto",
    )


def test_region_overrides_replace_only_the_fields_they_name(spec):
    spec["engine"] = {"maxNumSeqs": 128, "kvCacheMemory": "2Gi", "extraArgs": ["--seed=1"]}
    spec["regions"][2]["overrides"] = {
        "image": "meridian:0.2.0",
        "engine": {"maxNumSeqs": 32},
        "resources": {"gpus": 2, "gpuType": "NVIDIA-L4"},
    }
    us_east, _, ap_south = parse(spec).regions
    assert us_east.image == "meridian:0.1.0"
    assert us_east.engine.max_num_seqs == 128
    assert ap_south.image == "meridian:0.2.0"
    assert ap_south.engine.max_num_seqs == 32
    assert ap_south.engine.kv_cache_memory == "2Gi"
    assert ap_south.engine.extra_args == ("--seed=1",)
    assert ap_south.resources == Resources(gpus=2, gpu_type="NVIDIA-L4", cpu="2", memory="8Gi")


def test_a_min_max_region_starts_at_its_minimum(spec):
    spec["regions"][0] = {"name": "us-east", "minReplicas": 3, "maxReplicas": 8}
    assert parse(spec).regions[0].replicas == 3


@pytest.mark.parametrize("flag", ["--port=9000", "--model", "--max-num-seqs"])
def test_extra_args_may_not_repeat_flags_the_operator_sets(spec, flag):
    spec["regions"][1]["overrides"] = {"engine": {"extraArgs": [flag, "1"]}}
    with pytest.raises(
        InvalidSpec,
        match=rf"region eu-west: engine.extraArgs must not contain {flag.split('=')[0]}",
    ):
        parse(spec)


def test_a_region_with_fewer_gpus_than_tensor_ranks_is_refused(spec):
    spec["parallelism"] = {"tensor": 2}
    spec["resources"]["gpus"] = 2
    spec["regions"][2]["overrides"] = {"resources": {"gpus": 1}}
    with pytest.raises(
        InvalidSpec, match=r"region ap-south: resources\.gpus is 1 but parallelism\.tensor is 2"
    ):
        parse(spec)


def test_gpu_type_without_gpus_is_refused(spec):
    spec["resources"] = {"gpus": 0, "gpuType": "NVIDIA-L4"}
    with pytest.raises(InvalidSpec, match=r"gpuType is set but resources\.gpus is 0"):
        parse(spec)


def test_names_that_would_not_fit_kubernetes_limits_are_refused(spec):
    spec["parallelism"] = {"pipeline": 2}
    spec["regions"] = [{"name": "a" * 30, "replicas": 12}]
    with pytest.raises(
        InvalidSpec, match=r"StatefulSet name .* would be \d+ characters \(Kubernetes allows 52\)"
    ):
        parse(spec, name="b" * 20)


def test_every_problem_is_reported_at_once(spec):
    spec["regions"][0]["overrides"] = {"engine": {"extraArgs": ["--port", "1"]}}
    spec["regions"][1]["overrides"] = {"engine": {"extraArgs": ["--host", "::"]}}
    with pytest.raises(InvalidSpec) as error:
        parse(spec)
    assert "us-east" in str(error.value) and "eu-west" in str(error.value)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("500m", Decimal("0.5")),
        ("1.5G", 1_500_000_000),
        ("3", 3),
    ],
)
def test_quantities(text, value):
    assert quantity(text) == value


def test_a_malformed_quantity_says_what_is_expected():
    with pytest.raises(InvalidSpec, match="is not a quantity such as 4Gi"):
        quantity("4 GB")


@pytest.mark.parametrize(
    "path", sorted((ROOT / "manifests" / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_example_can_be_served(path: pathlib.Path):
    body = yaml.safe_load(path.read_text())
    fleet = parse_spec(body["metadata"]["name"], "default", model_deployment(body["spec"])["spec"])
    assert fleet.regions


def test_schema_requires_what_the_operator_reads():
    spec = SCHEMA["properties"]["spec"]
    assert set(spec["required"]) == {"model", "image", "regions"}
    assert spec["properties"]["model"]["required"] == ["name"]
    quantization = spec["properties"]["model"]["properties"]["quantization"]["enum"]
    assert quantization == ["none", "int8", "int4", "fp8"]
