"""A session's trace: one complete event per request, on its model's or sampler's lane, from when the API took it
to when its result was written; pending requests drawn up to now, expired futures as instants."""

from __future__ import annotations

from services.api.routers.tinker.traces import chrome_trace


def start(request_id: str, name: str, target: str, t: float) -> dict:
    return {"request_id": request_id, "name": name, "target": target, "t": repr(t)}


def test_each_request_is_an_event_on_its_lane_with_its_state():
    traced = [(start("a", "forward_backward", "s:train:0", 10.0), {"result": {"type": "fb"}, "answered_at": 10.5}),
              (start("b", "sample", "s:sample:0", 10.2), {"result": {"error": "refused"}, "answered_at": 10.3}),
              (start("c", "optim_step", "s:train:0", 10.6), {"result": {"type": "try_again"}, "answered_at": None}),
              (start("d", "sample", "s:sample:0", 10.7), None)]
    trace = chrome_trace("s", traced, now=11.0)
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"], e["args"]["state"]) for e in events] == [
        ("forward_backward", 1, 10_000_000, 500_000, "finished"), ("sample", 2, 10_200_000, 100_000, "failed"),
        ("optim_step", 1, 10_600_000, 400_000, "pending"), ("sample", 2, 10_700_000, 0, "unknown")]
    assert [e["cat"] for e in events] == ["training", "sampling", "training", "sampling"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert lanes == {1: "s:train:0", 2: "s:sample:0"}
