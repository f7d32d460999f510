"""The driver's connection to a Ray cluster: a Ray Client session whose server failed to start (a transient
failure of Ray's proxy on a busy head node, seen in this suite) is asked for again; anything else fails at once.
Ray cannot be made to fail that way on demand, so a stand-in for the `ray` module plays the cluster here; the real
clusters are tests/cluster/test_ray.py's."""
from __future__ import annotations

import pytest

from batchjob.ray import submit
from batchjob.ray.submit import RayUnavailable, connect

STARTUP = ConnectionAbortedError("Initialization failure from server:\nTraceback ...\nRuntimeError: Starting Ray "
                                 "client server failed. See ray_client_server_23000.err for detailed logs.")


class Cluster:
    """`ray.init` failing with each of `errors` in turn, then connecting."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.inits, self.shutdowns = list(errors), 0, 0

    def init(self, **kwargs) -> None:
        self.inits += 1
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    waits = []
    monkeypatch.setattr(submit.time, "sleep", waits.append)
    return waits


def test_a_client_server_that_failed_to_start_is_asked_again_and_said(no_wait):
    ray, said = Cluster(STARTUP, STARTUP), []
    connect(ray, "ray://head:10001", said.append)
    assert ray.inits == 3 and ray.shutdowns == 2 and no_wait == [2, 4]
    assert len(said) == 2 and "attempt 1 of 3" in said[0] and "connecting again in 4 s" in said[1]


def test_it_gives_up_after_three_attempts_naming_the_cluster_and_the_error():
    ray = Cluster(STARTUP, STARTUP, STARTUP)
    with pytest.raises(RayUnavailable, match=r"Ray cluster ray://head:10001: ConnectionAbortedError: Initialization"):
        connect(ray, "ray://head:10001", lambda line: None)
    assert ray.inits == 3


@pytest.mark.parametrize("address, error", [
    ("ray://head:10001", ConnectionError("ray client connection timeout")),  # no cluster there: no retry
    ("head:6379", STARTUP),  # not through the Ray Client
    (None, RuntimeError("no resources")),
])
def test_other_failures_are_said_at_once(address, error, no_wait):
    ray = Cluster(error)
    with pytest.raises(RayUnavailable, match=type(error).__name__):
        connect(ray, address, lambda line: None)
    assert ray.inits == 1 and no_wait == []
