from __future__ import annotations

from modeldeployments import model_deployment, served

from meridian.operator.children import build_children
from meridian.operator.spec import parse_spec
from meridian.operator.status import (
    compute_status,
    invalid_spec_status,
    observe_pod,
    region_status,
    status_events,
)

NOW, LATER = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"
UNSCHEDULABLE = (
    "0/12 nodes are available: 4 Insufficient nvidia.com/gpu, 8 node(s) didn't match "
    "Pod's node affinity/selector."
)


def fleet_of(spec):
    return parse_spec("chat", "serving", model_deployment(spec)["spec"])


def observed(spec, ready_by_region=None):
    ready_by_region = ready_by_region or {}
    built = build_children(fleet_of(spec))
    return [
        served(child, ready=ready_by_region.get(region))
        for region, children in built.items()
        for child in children
    ]


def pod(region, *, ready=True, unschedulable=None, waiting=None):
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": unschedulable,
            }
        )
    statuses = [{"name": "worker", "state": {"waiting": waiting}}] if waiting else []
    return observe_pod(
        {
            "metadata": {"name": f"p-{region}", "labels": {"serving.meridian.dev/region": region}},
            "status": {"conditions": conditions, "containerStatuses": statuses},
        }
    )


def statuses(spec, children, pods=(), **kwargs):
    fleet = fleet_of(spec)
    return [region_status(fleet, region, children, pods, **kwargs) for region in fleet.regions]


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_regions_ready_makes_the_deployment_ready(spec):
    regions = statuses(spec, observed(spec))
    assert [r["phase"] for r in regions] == ["Ready"] * 3
    status = compute_status(fleet_of(spec), 4, regions, {}, NOW)
    assert conditions(status) == {
        "Ready": ("True", "AllRegionsReady"),
        "Progressing": ("False", "Converged"),
        "Degraded": ("False", "AsExpected"),
    }
    assert (status["replicas"], status["readyReplicas"]) == (5, 5)
    assert status["regionNames"] == "us-east,eu-west,ap-south"
    assert status["observedGeneration"] == 4
    assert all(c["observedGeneration"] == 4 for c in status["conditions"])


def test_unready_workers_mean_progressing(spec):
    regions = statuses(spec, observed(spec, {"eu-west": 1}))
    assert [r["phase"] for r in regions] == ["Ready", "Progressing", "Ready"]
    assert regions[1]["readyReplicas"] == 1
    status = compute_status(fleet_of(spec), 1, regions, {}, NOW)
    assert conditions(status)["Ready"] == ("False", "RegionsNotReady")
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert "region eu-west Progressing: 1/2 replicas ready" in status["conditions"][0]["message"]


def test_a_region_without_workers_yet_is_pending(spec):
    children = [c for c in observed(spec) if c["region"] != "ap-south"]
    assert statuses(spec, children)[2]["phase"] == "Pending"


def test_unschedulable_pods_degrade_only_their_region_and_say_why(spec):
    pods = [
        pod("us-east"),
        pod("eu-west", ready=False, unschedulable=UNSCHEDULABLE),
        pod("eu-west"),
    ]
    regions = statuses(spec, observed(spec, {"eu-west": 1}), pods)
    assert [r["phase"] for r in regions] == ["Ready", "Degraded", "Ready"]
    assert regions[1]["message"] == f"1 of 2 worker pods cannot be scheduled: {UNSCHEDULABLE}"
    status = compute_status(fleet_of(spec), 1, regions, {}, NOW)
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True"
    assert degraded["message"].startswith("region eu-west Degraded: 1 of 2 worker pods cannot")


def test_crashing_workers_degrade_their_region(spec):
    waiting = {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}
    regions = statuses(
        spec, observed(spec, {"ap-south": 0}), [pod("ap-south", ready=False, waiting=waiting)]
    )
    assert regions[2]["phase"] == "Degraded"
    assert "CrashLoopBackOff: back-off 5m0s" in regions[2]["message"]


def test_waiting_and_changing_regions_are_not_ready(spec):
    fleet = fleet_of(spec)
    children = observed(spec)
    waiting = region_status(fleet, fleet.regions[1], children, [], waiting=True)
    changing = region_status(fleet, fleet.regions[0], children, [], changing=True)
    assert (waiting["phase"], changing["phase"]) == ("Waiting", "Progressing")


def test_pipeline_replicas_count_only_when_every_stage_is_ready(spec):
    spec["parallelism"] = {"pipeline": 2}
    fleet = fleet_of(spec)
    children = observed(spec, {"us-east": 1})  # each group has 1 of its 2 pods ready
    us_east = region_status(fleet, fleet.regions[0], children, [])
    eu_west = region_status(fleet, fleet.regions[1], children, [])
    assert (us_east["readyReplicas"], us_east["phase"]) == (0, "Progressing")
    assert (eu_west["readyReplicas"], eu_west["phase"]) == (2, "Ready")


def test_transition_times_move_only_when_a_condition_flips(spec):
    ready = compute_status(fleet_of(spec), 1, statuses(spec, observed(spec)), {}, NOW)
    again = compute_status(fleet_of(spec), 2, statuses(spec, observed(spec)), ready, LATER)
    assert [c["lastTransitionTime"] for c in again["conditions"]] == [NOW] * 3
    worse = compute_status(
        fleet_of(spec), 2, statuses(spec, observed(spec, {"us-east": 0})), ready, LATER
    )
    times = {c["type"]: c["lastTransitionTime"] for c in worse["conditions"]}
    assert times == {"Ready": LATER, "Progressing": LATER, "Degraded": NOW}


def test_an_invalid_spec_is_degraded_and_keeps_the_last_region_report(spec):
    good = compute_status(fleet_of(spec), 1, statuses(spec, observed(spec)), {}, NOW)
    bad = invalid_spec_status(
        2, "region us-east: engine.extraArgs must not contain --port", good, LATER
    )
    assert conditions(bad) == {
        "Ready": ("False", "InvalidSpec"),
        "Progressing": ("False", "InvalidSpec"),
        "Degraded": ("True", "InvalidSpec"),
    }
    assert bad["regions"] == good["regions"] and bad["observedGeneration"] == 2
    events = status_events(good, bad)
    assert (
        "Warning",
        "InvalidSpec",
        "region us-east: engine.extraArgs must not contain --port",
    ) in events


def test_events_tell_region_transitions_once(spec):
    progressing = compute_status(
        fleet_of(spec), 1, statuses(spec, observed(spec, {"eu-west": 0})), {}, NOW
    )
    ready = compute_status(fleet_of(spec), 1, statuses(spec, observed(spec)), progressing, LATER)
    events = status_events(progressing, ready)
    assert ("Normal", "RegionReady", "region eu-west: 2/2 replicas ready") in events
    assert ("Normal", "Ready", "5/5 replicas ready in us-east, eu-west, ap-south") in events
    assert len([e for e in events if e[1] == "RegionReady"]) == 1
    assert status_events(ready, ready) == []
