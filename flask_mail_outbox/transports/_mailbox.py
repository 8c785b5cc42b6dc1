"""The development inbox: delivered messages kept in the outbox's own database.

:class:`MailboxTransport` accepts every message and holds its envelope until
the core records the delivery: the core writes the envelope into
``outbox_mailbox`` in the transaction that marks the email ``sent``
(:mod:`flask_mail_outbox.core._mailbox`), so the inbox shows exactly what the
outbox says it delivered, on the outbox's own database and engine (no
second one), and this layer never touches the schema (the
transports sit below the core and do not import it). The dashboard's
Mailbox page lists it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from ._base import Envelope, Transport

#: The most envelopes held for the core at once; past it the oldest is dropped. The
#: core takes each one as it records the batch, so only a transport used without the
#: core (``send()`` called directly) ever gets near it.
MAX_HELD = 10_000


class MailboxTransport(Transport):
    """Accepts every message; the core keeps it in ``outbox_mailbox`` (development)."""

    def __init__(self) -> None:
        super().__init__()
        self._held: dict[int, Envelope] = {}
        self._lock = threading.Lock()

    def send(self, envelope: Envelope) -> Mapping[str, tuple[int, str]]:
        with self._lock:
            self._held.pop(envelope.email_id, None)
            self._held[envelope.email_id] = envelope
            while len(self._held) > MAX_HELD:
                del self._held[next(iter(self._held))]
        return {}

    def held(self, email_id: int) -> Envelope | None:
        """The envelope delivered for ``email_id`` and not yet forgotten, if any."""
        with self._lock:
            return self._held.get(email_id)

    def forget(self, email_ids: Iterable[int]) -> None:
        """Drop the envelopes of ``email_ids`` (recorded, or their outcome lost)."""
        with self._lock:
            for email_id in email_ids:
                self._held.pop(email_id, None)
