"""DisaggEngine on Ray, without a cluster: how resources become Ray's actor options, and what is refused
before Ray is touched. The cluster tests are tests/test_disagg_ray.py (heavy)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from asyncpage.disagg import DisaggEngine
from asyncpage.disagg.actors import actor_options
from asyncpage.errors import InvalidRequestError


def test_custom_resources_place_an_actor_with_one_cpu_unless_told() -> None:
    assert actor_options("prefill", {"node_a": 1}) == {"num_cpus": 1, "resources": {"node_a": 1}}
    assert actor_options("decode", {"CPU": 2, "GPU": 1, "node_b": 0.5}) == \
        {"num_cpus": 2, "num_gpus": 1, "resources": {"node_b": 0.5}}
    assert actor_options("decode", None) == {"num_cpus": 1, "resources": {}}


@pytest.mark.parametrize("resources", [{"node_a": -1}, {"node_a": "1"}, {"node_a": True}, ["node_a"],
                                       {"node_a": float("nan")}, {"GPU": float("inf")}])
def test_a_resource_that_is_not_an_amount_is_refused_naming_the_field(resources: object) -> None:
    with pytest.raises(InvalidRequestError, match=r"^prefill_resources:"):
        actor_options("prefill", resources)  # type: ignore[arg-type]


@pytest.mark.parametrize("local", [{"kv_host": "127.0.0.1"}, {"prefill_cpus": [0]}, {"decode_cpus": [1]}])
def test_process_only_options_are_refused_with_ray_placement(local: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError, match="not for Ray actors"):
        DisaggEngine.from_pretrained(None, prefill_resources={"node_a": 1}, **local)  # type: ignore[arg-type]
