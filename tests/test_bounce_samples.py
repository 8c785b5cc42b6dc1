"""Real bounces of three MTAs made here, each read and asserted: no MTA needed to run.

tests/bounces/<mta>/ holds what a private Exim 4.96, Postfix 3.7 and OpenSMTPD 6.8
mailed back (SOURCES.md says how) for the failures a sender meets: an unknown user,
an unknown host, a full mailbox, a message too big, relaying denied, a delay, and
a message given up in the queue. ``expected.json`` beside them says, per file, the
events the reader must give: recipient, event type, permanence, reason, whether the
policy suppresses the address for good (``for_good``), and the row its VERP
envelope sender names (tokens signed with ``fixture-secret-key``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flask_mail_outbox._bounces import read_bounce
from flask_mail_outbox._compose.verp import VerpAddresses
from flask_mail_outbox._policy import for_good

SAMPLES = Path(__file__).parent / "bounces"
MTAS = ("exim", "opensmtpd", "postfix")
VERP = VerpAddresses("bounces@outbox.test", ("fixture-secret-key",))

#: What each MTA's set covers (the file names say which failure each is).
CASES = {
    "exim": {"unknown-user-local", "unknown-user-5.1.1", "unknown-host", "mailbox-full-5.2.2",
             "message-too-big-5.3.4", "relay-denied-5.7.1", "delay-warning",
             "retry-timeout-exceeded"},
    "postfix": {"unknown-user-5.1.1", "unknown-host-5.4.4", "mailbox-full-5.2.2",
                "message-too-big-5.3.4", "relay-denied-5.7.1", "delay-warning-4.3.0",
                "queue-expired-4.3.0"},
    "opensmtpd": {"unknown-user-5.1.1", "unknown-host", "mailbox-full-5.2.2",
                  "message-too-big-5.3.4", "relay-denied-5.7.1", "delay-warning-4.3.0",
                  "queue-expired-4.4.7"},
}


def expected(mta: str) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = json.loads(
        (SAMPLES / mta / "expected.json").read_text(encoding="utf-8"))
    return found


def _params() -> list[Any]:
    return [pytest.param(mta, name, id=f"{mta}/{name}")
            for mta in MTAS for name in sorted(expected(mta))]


@pytest.mark.parametrize("mta", MTAS)
def test_every_file_has_its_expectations_and_every_case_is_there(mta: str) -> None:
    files = {path.name for path in (SAMPLES / mta).glob("*.eml")}
    assert files == set(expected(mta))
    assert {name.removesuffix(".eml") for name in files} == CASES[mta]
    sources = (SAMPLES / "SOURCES.md").read_text(encoding="utf-8")
    assert {name for name in files if f"`{mta}/{name}`" not in sources} == set()


@pytest.mark.parametrize(("mta", "name"), _params())
def test_each_real_bounce_is_read_as_expected(mta: str, name: str) -> None:
    report = read_bounce((SAMPLES / mta / name).read_bytes(), email_id_of=VERP.email_id_of)
    got = [{"recipient": e.recipient, "event_type": e.event_type, "bounce_kind": e.bounce_kind,
            "reason": e.reason,
            "hard": for_good(e.event_type, e.bounce_kind, e.reason) == "bounced",
            "email_id": e.email_id} for e in report.events]
    assert got == expected(mta)[name]


def test_the_set_says_each_failure_the_way_the_policy_needs() -> None:
    """Across the three MTAs: only a dead address is hard; a delay is a deferral; a
    message given up in the queue is a transient bounce."""
    for mta in MTAS:
        for name, events in expected(mta).items():
            (event,) = events
            dead = name.startswith(("unknown-user", "unknown-host"))
            assert event["hard"] is dead, (mta, name)
            if name.startswith("delay-warning"):
                assert (event["event_type"], event["bounce_kind"]) == ("deferred", None)
            elif name.startswith(("queue-expired", "retry-timeout")):
                assert (event["event_type"], event["bounce_kind"], event["reason"]) == (
                    "bounced", "transient", "expired"), (mta, name)
            else:
                assert (event["event_type"], event["bounce_kind"]) == (
                    "bounced", "permanent"), (mta, name)
