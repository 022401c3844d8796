"""The operator's Tinker rate card (TINKER_RATE_CARD): read from the environment, checked, and the prices each
usage event gets from it (a model's own rate, else the default's; cached prefill at prefill's unless priced apart;
checkpoint operations and unpriced usage left null)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from services.api.routers.tinker.billing import BYTE_SECONDS_PER_GB_HOUR, event
from services.api.settings import ApiSettings, TinkerRateCard
from shared.stores.tinker_usage import UsageCount

CARD = {"default": {"training": 0.5, "sampling_prefill": 0.2, "sampling_sample": 1.0, "storage_gb_month": 0.05},
        "models": {"big": {"training": 2.0, "sampling_prefill_cached": 0.02}}}
CALLER = SimpleNamespace(owner="o", principal=SimpleNamespace(name="k"))


def priced(kind: str, count: int, model: str | None = "big", card: dict = CARD) -> dict:
    e = event(UsageCount(0, kind, "s", model, count), CALLER, {}, TinkerRateCard.model_validate(card))
    return {k: v for k, v in e.items() if "usd" in k}


def test_the_rate_card_is_read_from_the_environment_and_checked(monkeypatch):
    import json

    monkeypatch.setenv("TINKER_RATE_CARD", json.dumps(CARD))
    card = ApiSettings().tinker_rate_card
    assert card.rate("big", "training") == 2.0 and card.rate("small", "training") == 0.5
    assert card.rate("big", "sampling_sample") == 1.0  # unset for the model: the default's
    monkeypatch.setenv("TINKER_RATE_CARD", '{"default": {"training": -1}}')
    with pytest.raises(ValidationError, match="training"):
        ApiSettings()
    monkeypatch.setenv("TINKER_RATE_CARD", '{"default": {"trainig": 1}}')
    with pytest.raises(ValidationError, match="trainig"):
        ApiSettings()


def test_each_usage_event_is_priced_by_its_base_models_rate():
    assert priced("training", 500) == {"effective_rate_usd_per_million_tokens": 2.0,
                                       "estimated_cost_usd": pytest.approx(0.001)}
    assert priced("training", 500, model="small")["estimated_cost_usd"] == pytest.approx(0.00025)
    assert priced("sampling_prefill_cached", 10**6)["estimated_cost_usd"] == pytest.approx(0.02)
    assert priced("sampling_prefill_cached", 10**6, model="small")["estimated_cost_usd"] == pytest.approx(0.2)
    assert priced("checkpoint", 3) == {}  # checkpoint operations are not priced
    gb_month = 720 * BYTE_SECONDS_PER_GB_HOUR  # one gigabyte held for a month
    assert priced("storage", gb_month) == {"effective_rate_usd_per_gigabyte_month": 0.05,
                                           "estimated_cost_usd": pytest.approx(0.05)}
    assert priced("training", 500, card={}) == {}  # no rate card: no costs
