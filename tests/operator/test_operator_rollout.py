from __future__ import annotations

import copy

from modeldeployments import model_deployment, served

from meridian.operator.children import build_children
from meridian.operator.rollout import contains, plan_changes
from meridian.operator.spec import parse_spec

UID = "uid-1"


def fleet_of(spec):
    return parse_spec("chat", "serving", model_deployment(spec)["spec"])


def owned(objs):
    for obj in objs:
        obj["owners"] = [UID]
    return objs


def cluster_for(spec, **served_kwargs):
    """What the watches would show once every child of `spec` exists and has settled."""
    built = build_children(fleet_of(spec))
    return owned([served(c, **served_kwargs) for cs in built.values() for c in cs])


def plan(spec, observed):
    fleet = fleet_of(spec)
    return plan_changes(fleet, UID, build_children(fleet), observed)


def applied(result):
    return [(c["kind"], c["metadata"]["name"]) for c in result.apply]


def test_a_new_deployment_creates_every_child_config_first(spec):
    result = plan(spec, [])
    assert len(result.apply) == 9
    assert applied(result)[:3] == [
        ("ConfigMap", "chat-us-east-engine"),
        ("Service", "chat-us-east"),
        ("Deployment", "chat-us-east"),
    ]
    assert not result.delete and not result.waiting


def test_nothing_to_do_when_the_cluster_matches_the_spec(spec):
    result = plan(spec, cluster_for(spec))
    assert result.apply == () and result.delete == () and result.waiting == ()


def test_a_deleted_child_is_recreated(spec):
    observed = [
        c for c in cluster_for(spec) if c["name"] != "chat-eu-west" or c["kind"] != "Service"
    ]
    assert applied(plan(spec, observed)) == [("Service", "chat-eu-west")]


def test_an_edited_child_is_put_back(spec):
    observed = cluster_for(spec)
    deployment = next(
        c for c in observed if c["name"] == "chat-ap-south" and c["kind"] == "Deployment"
    )
    deployment["spec"]["replicas"] = 7
    deployment["spec"]["template"]["spec"]["nodeSelector"]["topology.kubernetes.io/region"] = "x"
    assert applied(plan(spec, observed)) == [("Deployment", "chat-ap-south")]


def test_fields_the_operator_does_not_set_are_left_alone(spec):
    observed = cluster_for(spec)
    for child in observed:
        child["labels"]["team"] = "search"
        child["annotations"]["note"] = "hand-added"
    assert plan(spec, observed).apply == ()


def test_scaling_applies_to_every_region_at_once(spec):
    observed = cluster_for(spec)
    for region in spec["regions"]:
        region["replicas"] += 1
    assert applied(plan(spec, observed)) == [
        ("Deployment", "chat-us-east"),
        ("Deployment", "chat-eu-west"),
        ("Deployment", "chat-ap-south"),
    ]


def test_a_template_change_rolls_out_one_region_at_a_time(spec):
    old = copy.deepcopy(spec)
    spec["image"] = "meridian:0.2.0"
    result = plan(spec, cluster_for(old))
    assert applied(result) == [("Deployment", "chat-us-east")]
    assert result.waiting == ("eu-west", "ap-south")

    # us-east has the new template but its pods are not all ready yet: the others keep waiting.
    mid = cluster_for(old)
    rolling = [c for c in cluster_for(spec, ready=1) if c["region"] == "us-east"]
    mid = [c for c in mid if c["region"] != "us-east"] + rolling
    result = plan(spec, mid)
    assert result.apply == () and result.waiting == ("eu-west", "ap-south")

    # us-east is Ready on the new template: eu-west goes next, ap-south still waits.
    done = [c for c in cluster_for(old) if c["region"] != "us-east"]
    done += [c for c in cluster_for(spec) if c["region"] == "us-east"]
    result = plan(spec, done)
    assert applied(result) == [("Deployment", "chat-eu-west")]
    assert result.waiting == ("ap-south",)


def test_an_engine_change_moves_its_configmap_in_the_same_wave(spec):
    old = copy.deepcopy(spec)
    spec["engine"] = {"maxNumSeqs": 64}
    result = plan(spec, cluster_for(old))
    assert applied(result) == [("ConfigMap", "chat-us-east-engine"), ("Deployment", "chat-us-east")]


def test_parallel_strategy_changes_every_region_at_once(spec):
    old = copy.deepcopy(spec)
    spec["image"] = "meridian:0.2.0"
    spec["rollout"] = old["rollout"] = {"regionStrategy": "Parallel"}
    result = plan(spec, cluster_for(old))
    assert len(result.apply) == 3 and result.waiting == ()


def test_an_unready_region_holds_back_the_regions_after_it(spec):
    old = copy.deepcopy(spec)
    observed = [c for c in cluster_for(old) if c["region"] != "us-east"]
    observed += [c for c in cluster_for(old, ready=0) if c["region"] == "us-east"]
    spec["image"] = "meridian:0.2.0"
    result = plan(spec, observed)
    assert applied(result) == [("Deployment", "chat-us-east")]
    assert result.waiting == ("eu-west", "ap-south")


def test_removing_a_region_deletes_exactly_its_children(spec):
    observed = cluster_for(spec)
    del spec["regions"][1]
    result = plan(spec, observed)
    assert result.apply == ()
    assert sorted((c["kind"], c["name"]) for c in result.delete) == [
        ("ConfigMap", "chat-eu-west-engine"),
        ("Deployment", "chat-eu-west"),
        ("Service", "chat-eu-west"),
    ]


def test_children_of_another_owner_are_never_deleted(spec):
    observed = cluster_for(spec)
    for child in observed:
        child["owners"] = ["uid-of-an-earlier-chat"]
    spec["regions"] = spec["regions"][:1]
    assert plan(spec, observed).delete == ()


def test_fewer_pipeline_replicas_delete_the_extra_groups(spec):
    spec["parallelism"] = {"pipeline": 2}
    observed = cluster_for(spec)
    spec["regions"][0]["replicas"] = 1
    deleted = sorted((c["kind"], c["name"]) for c in plan(spec, observed).delete)
    assert deleted == [("Service", "chat-us-east-g1"), ("StatefulSet", "chat-us-east-g1")]


def test_a_child_being_deleted_is_left_to_finish(spec):
    observed = cluster_for(spec)
    observed[0]["deleting"] = True
    assert plan(spec, observed).apply == ()


def test_contains_treats_server_defaults_and_equal_quantities_as_no_change():
    assert contains({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": 2}})
    assert contains({"cpu": "500m"}, {"cpu": "0.5"})
    assert contains({"memory": "2Gi"}, {"memory": "2048Mi"})
    assert contains({"x": [{"p": 1, "q": 2}]}, {"x": [{"p": 1}]})
    assert contains(None, {})
    assert not contains({"x": [1, 2]}, {"x": [1]})
    assert not contains({"cpu": "1"}, {"cpu": "2"})
    assert not contains({"a": {"b": 1}}, {"a": {"b": 2}})
