#!/usr/bin/env python3
"""Score the bounce reader on a directory of real bounces with known answers.

Kept apart from the suite (and out of benchmarks/, whose scenarios use the public API
only: this reads the reader and the policy themselves): it reads samples from outside the repository (or
the project's own, tests/bounces/<mta>/), and prints

- recognized: the share of expected (sample, recipient) rows for which
  ``read_bounce`` gives an event naming that recipient, of the right event
  type (bounced, deferred, complained, unsubscribed, delivered), and, for a
  bounce, the right permanence (``bounce_kind``); a row expected to be no
  bounce at all (an auto-reply) counts when the reader finds no failure;
- hard/soft agreement: the share of rows where the outbox's verdict
  (:func:`flask_mail_outbox._policy.for_good` says ``"bounced"``: the
  address is suppressed for good) equals the expected one (sisimai's
  ``hardbounce``);
- reason agreement: our reason's sisimai counterpart
  (:data:`flask_mail_outbox._reasons.SISIMAI`) against sisimai's reason, or our
  reason against the one our own expectations name;
- the misses, by cause, with the samples.

Inputs (one of):

``--sisimai DIR --reference FILE``
    DIR holds sisimai's public samples (``set-of-emails/maildir/bsd``) and
    its test files (``t/*-lhost-*.t``, ``t/*-rhost-*.t``, ``t/89*-*.t``),
    as in a checkout of sisimai/p5-sisimai. The samples scored are those the
    test files give expectations for (status, reason, hardbounce per
    recipient) and that are in DIR. FILE is sisimai's own output on those
    samples, one JSON object ``{"<file name>": [{"recipient", "action",
    "reason", "hardbounce", "status", "feedbacktype"}, ...]}``: the test files
    do not name the recipients, this does. Neither is part of this
    repository.
``--own DIR``
    DIR holds ``<mta>/*.eml`` and ``<mta>/expected.json`` files
    (tests/bounces/ of this repository): ``{"<file name>": [{"recipient",
    "event_type", "bounce_kind", "hard", "reason"}, ...]}``.

Run: ``python scripts/bounce_corpus.py --own tests/bounces`` (from the repository
root), ``-v`` to list every miss.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flask_mail_outbox._bounces import NotMail, read_bounce
from flask_mail_outbox._policy import for_good
from flask_mail_outbox._reasons import SISIMAI


@dataclass
class Row:
    """One expected (sample, recipient): what the reader should find."""

    sample: str
    recipient: str | None
    event_type: str | None  # None: not a bounce (an auto-reply)
    bounce_kind: str | None
    hard: bool
    reason: str = ""  # sisimai's name
    source: str = ""


@dataclass
class Score:
    rows: int = 0
    recognized: int = 0
    agreed: int = 0
    reason_rows: int = 0
    reason_agreed: int = 0
    misses: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    disagreements: dict[str, list[str]] = field(
        default_factory=lambda: collections.defaultdict(list))
    reasons: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    #: Events naming an address no row expects (a sender, a Message-ID, a stray address).
    strays: list[str] = field(default_factory=list)


_ENTRY = re.compile(r"'(\d+)'\s*=>\s*\[((?:\s*\[[^\]]*\]\s*,?)+)\s*\]")
_ITEM = re.compile(r"\[\s*'([^']*)'\s*,\s*'([^']*)'\s*,\s*'([^']*)'\s*,\s*(\d)")
_ENGINE = re.compile(r"my \$enginename\s*=\s*'([^']+)'")


def sisimai_expectations(root: Path) -> dict[str, list[tuple[str, str, str, int]]]:
    """Per sample file name: the test files' (status, reply code, reason, hardbounce) list."""
    found: dict[str, list[tuple[str, str, str, int]]] = {}
    for test in sorted((root / "t").glob("*.t")):
        text = test.read_text("utf-8", "replace")
        engine = _ENGINE.search(text)
        if engine is None or "isexpected" not in text:
            continue
        name = engine.group(1).lower()
        if "-rhost-" in test.name:
            prefix = f"rhost-{name}"
        elif "-lhost-" in test.name:
            prefix = f"lhost-{name}"
        else:
            prefix = name  # arf, rfc3464, rfc3834
        for entry in _ENTRY.finditer(text):
            items = [(s, c, r, int(h)) for s, c, r, h in _ITEM.findall(entry.group(2))]
            if items:
                found[f"{prefix}-{int(entry.group(1)):02d}.eml"] = items
    return found


def sisimai_rows(root: Path, reference: Path) -> tuple[list[Row], Path]:
    """The rows of sisimai's public set: expectations from its tests, recipients from FILE."""
    samples = root / "set-of-emails" / "maildir" / "bsd"
    expected = sisimai_expectations(root)
    facts = json.loads(reference.read_text("utf-8"))
    rows = []
    for name, items in sorted(expected.items()):
        if not (samples / name).is_file():
            continue
        records = facts.get(name) or []
        for index, (status, _code, reason, hard) in enumerate(items):
            record = records[index] if index < len(records) else {}
            rows.append(_row(name, record, status, reason, hard))
    return rows, samples


#: ARF types that are no recipient's complaint (the reader's documented choice; sisimai
#: counts them as feedback): scored as "no event".
_NOT_COMPLAINTS = ("auth-failure", "not-spam")


def _row(name: str, record: dict[str, object], status: str, reason: str, hard: int) -> Row:
    recipient = str(record.get("recipient") or "") or None
    if recipient and recipient.endswith(".invalid"):
        recipient = None  # sisimai's placeholder for a report that names no recipient
    action = str(record.get("action") or "")
    kind: str | None = None
    if reason == "vacation":
        event_type: str | None = None
    elif record.get("feedbacktype") in _NOT_COMPLAINTS:
        event_type = None  # a DMARC failure report: the outbox reads no complaint in it
    elif reason == "feedback":
        event_type = ("unsubscribed" if record.get("feedbacktype") == "opt-out"
                      else "complained")
    elif reason == "delivered":
        event_type = "delivered"
    elif action == "delayed" and reason != "expired":
        # sisimai calls every expired message delayed; the MTA that gave up on one
        # says failed (a bounce, transient): only a warning while it still tries is deferred.
        event_type = "deferred"
    else:
        event_type = "bounced"
        # A message a server kept until it gave up says nothing lasting: transient.
        kind = "transient" if reason == "expired" or status.startswith("4") else "permanent"
    return Row(name, recipient, event_type, kind, bool(hard), reason, "sisimai")


def own_rows(root: Path) -> list[tuple[Row, Path]]:
    """The rows of the project's own samples (tests/bounces/<mta>/expected.json)."""
    rows = []
    for expected in sorted(root.glob("*/expected.json")):
        for name, items in json.loads(expected.read_text("utf-8")).items():
            for item in items:
                rows.append((Row(f"{expected.parent.name}/{name}", item.get("recipient"),
                                 item.get("event_type"), item.get("bounce_kind"),
                                 bool(item.get("hard")), item.get("reason", ""), "own"),
                             expected.parent / name))
    return rows


def score(rows: list[tuple[Row, Path]]) -> Score:
    result = Score()
    cache: dict[Path, list[object]] = {}
    for row, path in rows:
        if path not in cache:
            try:
                cache[path] = list(read_bounce(path.read_bytes()).events)
            except NotMail:
                cache[path] = []
        events = cache[path]
        result.rows += 1
        wanted = _plain(row.recipient)
        mine = [e for e in events if wanted in (_plain(getattr(e, "recipient", None)),
                                                _plain(_final(e)))]
        if row.event_type is None:
            ok = not any(getattr(e, "event_type", "") in ("bounced", "deferred", "complained")
                         for e in events)
            cause = "an auto-reply read as a bounce"
        else:
            ok = any(_right(row, e) for e in mine)
            cause = _cause(row, events, mine)
        if ok:
            result.recognized += 1
        else:
            result.misses[cause].append(row.sample)
        hard = any(for_good(e.event_type, e.bounce_kind, e.reason) == "bounced"  # type: ignore[attr-defined]
                   for e in mine)
        if hard == row.hard:
            result.agreed += 1
        else:
            ours = next((e.reason for e in mine), "-")  # type: ignore[attr-defined]
            result.disagreements[f"{'hard' if row.hard else 'soft'} for sisimai "
                                 f"({row.reason}), ours {ours}"].append(row.sample)
        if row.event_type == "bounced" and row.reason:
            result.reason_rows += 1
            ours_reason = next((e.reason for e in mine), None)  # type: ignore[attr-defined]
            names = {n.strip() for n in SISIMAI.get(ours_reason or "", "").split(",")} \
                if row.source == "sisimai" else {ours_reason}
            if row.reason in names:
                result.reason_agreed += 1
            else:
                result.reasons[f"{row.reason} -> ours {ours_reason}"].append(row.sample)
    wanted_by: dict[Path, set[str]] = collections.defaultdict(set)
    for row, path in rows:
        wanted_by[path].add(_plain(row.recipient))
    for path, events in cache.items():
        for event in events:
            names = {_plain(getattr(event, "recipient", None)), _plain(_final(event))}
            if getattr(event, "recipient", None) and not names & wanted_by[path]:
                result.strays.append(f"{path.name}: {getattr(event, 'recipient', '')}")
    return result


def _plain(address: str | None) -> str:
    """An address compared: lower case, a quoted local part unquoted."""
    return (address or "").replace('"', "").lower()


def _final(event: Any) -> str | None:
    """A DSN event's Final-Recipient address.

    The reader names a DSN recipient by its Original-Recipient (the address as
    sent: the one to suppress), sisimai by its Final-Recipient (after
    forwarding): both name the same recipient block.
    """
    payload = getattr(event, "payload", None) or {}
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            payload = {}
    value = payload.get("final_recipient") if isinstance(payload, dict) else None
    return value.partition(";")[2].strip() if isinstance(value, str) and ";" in value else value


def _right(row: Row, event: Any) -> bool:
    """Whether ``event`` is what ``row`` expects.

    A transient failure the reader calls a delay (``deferred``: the MTA still
    tries) counts as right: both say transient, neither suppresses. sisimai
    calls some delay warnings failed ("THIS IS A WARNING MESSAGE ONLY").
    """
    if event.event_type == row.event_type:
        return row.event_type != "bounced" or event.bounce_kind == row.bounce_kind
    return (row.event_type, row.bounce_kind, event.event_type) == (
        "bounced", "transient", "deferred")


def _cause(row: Row, events: list[object], mine: list[object]) -> str:
    if not events:
        return "not recognized at all"
    if not mine:
        return "wrong or no recipient"
    types = {e.event_type for e in mine}  # type: ignore[attr-defined]
    if row.event_type not in types:
        return f"wrong event type (want {row.event_type}, got {'/'.join(sorted(types))})"
    return f"wrong permanence (want {row.bounce_kind})"


def report(title: str, result: Score, verbose: bool) -> None:
    def pct(part: int, whole: int) -> str:
        return f"{part} of {whole} ({100 * part / whole:.1f} %)" if whole else "-"

    print(f"== {title}")
    print(f"recognized:          {pct(result.recognized, result.rows)}")
    print(f"hard/soft agreement: {pct(result.agreed, result.rows)}")
    print(f"reason agreement:    {pct(result.reason_agreed, result.reason_rows)} (bounces)")
    print(f"stray recipients:    {len(result.strays)} (events naming an address no row "
          "expects)" + (": " + ", ".join(result.strays[:None if verbose else 6])
                        if result.strays else ""))
    for heading, table in (("misses by cause", result.misses),
                           ("hard/soft disagreements", result.disagreements),
                           ("reason disagreements", result.reasons)):
        if not table:
            continue
        print(f"-- {heading}")
        for cause, samples in sorted(table.items(), key=lambda kv: -len(kv[1])):
            shown = samples if verbose else samples[:4]
            more = "" if len(shown) == len(samples) else ", ..."
            print(f"{len(samples):5d}  {cause}: {', '.join(shown)}{more}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sisimai", type=Path, help="a checkout of sisimai/p5-sisimai")
    parser.add_argument("--reference", type=Path, help="sisimai's output on its samples (JSON)")
    parser.add_argument("--own", type=Path, help="tests/bounces (its <mta>/expected.json)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every miss")
    args = parser.parse_args(argv)
    if not args.own and not args.sisimai:
        parser.error("give --sisimai DIR --reference FILE, or --own DIR, or both")
    if args.sisimai and not args.reference:
        parser.error("--sisimai needs --reference (sisimai's output naming the recipients)")
    logging.disable(logging.ERROR)
    if args.sisimai:
        rows, samples = sisimai_rows(args.sisimai, args.reference)
        result = score([(row, samples / row.sample) for row in rows])
        report(f"sisimai's public set: {len({r.sample for r in rows})} samples, "
               f"{len(rows)} recipients", result, args.verbose)
    if args.own:
        own = own_rows(args.own)
        report(f"our own samples: {len({r.sample for r, _ in own})} samples, {len(own)} "
               "recipients", score(own), args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
