"""Refusals are logged with their reason and client, rate-limited, and counted by reason."""

from __future__ import annotations

import logging

import pytest

from gateway import metrics
from gateway.refusals import Refusals, reason_label


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def count(api: str, status: str, reason: str) -> float:
    value = metrics.REFUSED_REQUESTS.labels(api=api, status=status, reason=reason)._value.get()
    return float(value)


def test_each_refusal_is_logged_until_the_burst_then_summed_up(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    refusals = Refusals(clock, window_s=10, burst=3)
    before = count("http", "400", "temperature")
    with caplog.at_level(logging.WARNING, logger="gateway.refusals"):
        for i in range(7):
            refusals.record("http", "400", "temperature", "10.0.0.9:5555",
                            f"temperature must be >= 0, got -{i}")
            clock.now += 1
        lines = [r.getMessage() for r in caplog.records]
        # The burst, then one line when the rest start to be left out (a flood that stops
        # there still shows); the other three are counted, not logged.
        assert len(lines) == 4
        assert lines[0] == ("refused http request from 10.0.0.9:5555: 400 temperature: "
                            "temperature must be >= 0, got -0")
        assert lines[3] == ("more refused requests than 3 in 10 s: the next are counted "
                            "(pagewire_gateway_refused_requests_total) but not logged for 7.0 s")
        clock.now += 10  # the next window starts with a line for what was left out
        refusals.record("grpc", "INVALID_ARGUMENT", "n", "ipv4:127.0.0.1:1", "n must be ...")
        lines = [r.getMessage() for r in caplog.records]
    assert lines[4] == "4 more refused requests were not logged (at most 3 per 10 s)"
    assert lines[5].startswith("refused grpc request from ipv4:127.0.0.1:1: INVALID_ARGUMENT n")
    # Every refusal is counted, logged or not.
    assert count("http", "400", "temperature") - before == 7


def test_client_text_is_cut_and_kept_on_one_line(caplog: pytest.LogCaptureFixture) -> None:
    refusals = Refusals(Clock())
    with caplog.at_level(logging.WARNING, logger="gateway.refusals"):
        refusals.record("http", "404", "no_endpoint", "c",
                        "no endpoint /a\rforged line\n\x1b[31mred\x85 " + "x" * 1000)
    message = caplog.records[0].getMessage()
    assert "/a\\x0dforged line\\x0a\\x1b[31mred\\x85 x" in message
    assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in message)
    assert len(message) < 400 and message.endswith("…")


@pytest.mark.parametrize(("reason", "label"), [
    ("temperature", "temperature"),
    ("messages[3].role", "messages"),
    ("stream_options", "stream_options"),
    ("Not A Label!", "other"),
    ("x" * 60, "other"),
])
def test_reason_labels_are_short_words(reason: str, label: str) -> None:
    assert reason_label(reason) == label
